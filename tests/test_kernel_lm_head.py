"""kernels/lm_head.py against the float64 product and the engine's fp32 product (x.float() @ W.float().T). The kernel
is off the product path until re-based to docs/model.md (its bf16-held head: kernels/lm_head.py); these tests hold it
to its own reference.

Tolerance, per logit: the kernel adds n = parts * H exact products (x split into `parts` bf16 pieces:
1 for bf16 x, 2 fp16, 3 fp32; fp16/fp32 W: H products rounded once, n = H + 1) in fp32 in some
order, so |error| <= n u sum_k |x_k w_k| with u = 2^-24 for round-to-nearest additions; the bound
is doubled (u = 2^-23) for tensor-core additions that truncate. The engine's cuBLAS product obeys the
same bound (checked), and |kernel - engine| is held to it too (not twice it: observed errors, kernel
and engine alike, are ~1e-3 of the bound, 1e-5 of it at H = 6144).

"exact" cases use integer-valued data whose every partial sum is exact in fp32 (x with 20, 11 or 8
significant bits for fp32, fp16, bf16; at most 12 weights of +-1/8 per row), so any correct order
gives the float64 result bit for bit: that catches a lost part of the fp32 split (~2^-17 of x), which
the worst-case bound does not (the drop-lo negative control lands at 0.25 of it).

Under Triton's CPU interpreter (one worker subprocess): 1, 3, 8 and 17 rows; V and H not multiples
of the tiles (partial V tile, K tail); bf16 / fp16 / fp32 x and W; strided x, W and out rows; the
norm applied by the wrapper; outputs pre-filled with NaN. Negative controls: a launcher that drops
the last K tile, and one that drops the third (lo) part of the fp32 split, must each fail its check
(and each counts that it ran). `@pytest.mark.gpu`: one TP8 rank's head at the retired shape (V = 20000, H = 6144,
R = 1, 6, 8), CUDA-graph replay and determinism (its timing was `iquest bench kernels`' until the kernel left the
product path). The interpreter runs every
case: together they cost it about a second.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import lm_head as lm
from iquest.kernels.testing import interpreted_tests

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARTS = {"bf16": 1, "fp16": 2, "fp32": 3}
U_ACC = 2.0 ** -23  # fp32 unit roundoff, doubled for truncating (tensor-core) additions

BASE = dict(R=8, V=100, H=100, x="bf16", w="bf16", block_v=32, block_k=32, x_stride=1, w_stride=1, out_stride=0,
            norm=False, data="randn", alloc=False, seed=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_bf16", R=1, seed=1),
    case("3rows_bf16", R=3, V=77, H=200, block_k=64, seed=2),
    case("8rows_bf16", seed=3),
    case("1row_fp32x", R=1, x="fp32", seed=4),
    case("3rows_fp32x", R=3, V=77, H=200, x="fp32", block_k=64, seed=5),
    case("8rows_fp32x", x="fp32", seed=6),
    case("8rows_fp16x", x="fp16", seed=7),
    case("fp32x_full_hidden", R=2, V=40, H=6144, x="fp32", block_v=16, block_k=128, seed=8),
    case("fp32w_bf16x", R=3, w="fp32", seed=9),
    case("fp16w_fp32x", R=3, w="fp16", x="fp32", seed=10),
    case("17rows_two_row_tiles", R=17, V=50, seed=11),
    case("even_k_no_tail", R=3, H=128, seed=12),
    case("strided_rows", R=3, V=70, H=90, x="fp32", x_stride=2, w_stride=3, out_stride=7, seed=13),
    case("auto_blocks_alloc", R=3, V=150, H=300, block_v=None, block_k=128, alloc=True, seed=14),
    case("norm_by_wrapper", R=3, norm=True, seed=15),
    case("norm_by_wrapper_fp32x", R=3, x="fp32", norm=True, seed=16),
    case("fp32x_bf16_values", R=3, x="fp32", data="bf16_values", seed=17),
    case("exact_fp32x", R=3, x="fp32", data="exact", seed=18),
    case("exact_fp16x", R=3, x="fp16", data="exact", seed=22),
    case("exact_bf16x", R=8, data="exact", seed=19),
]
NEG_DROP_K = case("neg_drop_last_k", R=3, seed=20)
NEG_DROP_LO = case("neg_drop_lo_part", R=3, x="fp32", data="exact", seed=21)

GPU = dict(V=20000, H=6144, block_v=None, block_k=128)  # one TP8 rank's LM head rows
GPU_CASES = [
    case("gpu_1row", R=1, **GPU, seed=31),
    case("gpu_6rows", R=6, **GPU, seed=32),
    case("gpu_8rows", R=8, **GPU, seed=33),
    case("gpu_8rows_fp32x_bf16_values", R=8, x="fp32", data="bf16_values", **GPU, seed=34),  # the engine's .float()
    case("gpu_8rows_fp32x", R=8, x="fp32", **GPU, seed=35),
    case("gpu_6rows_norm", R=6, norm=True, **GPU, seed=36),
    case("gpu_8rows_exact_fp32x", R=8, x="fp32", data="exact", **GPU, seed=37),
    case("gpu_8rows_fp32w", R=8, w="fp32", **GPU, seed=38),
]


def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, V, H = c["R"], c["V"], c["H"]
    xd, wd = DTYPES[c["x"]], DTYPES[c["w"]]
    if c["data"] == "exact":
        # x = n 2^-b with b-bit n (b = 20, 11, 8 for fp32, fp16, bf16 x); W: +-1/8 at <= 12 places per row,
        # so |any partial sum| < 12 * 2^20 quanta: every fp32 addition is exact in any order.
        bits = {"fp32": 20, "fp16": 11, "bf16": 8}[c["x"]]
        mag = torch.randint(2 ** (bits - 1), 2 ** bits, (R, H), generator=gen)
        sign = torch.randint(0, 2, (R, H), generator=gen) * 2 - 1
        x = (mag * sign).double() * 2.0 ** -bits
        w = torch.zeros(V, H, dtype=torch.float64)
        nz = torch.randint(0, H, (V, 12), generator=gen)  # repeats only leave fewer
        w.scatter_(1, nz, (torch.randint(0, 2, nz.shape, generator=gen) * 2 - 1).double() / 8)
    else:
        x = torch.randn(R, H, generator=gen) * 3
        w = torch.randn(V, H, generator=gen) * 0.02
        if c["data"] == "bf16_values":
            x = x.to(torch.bfloat16)
    x_wide = torch.zeros(R, H * c["x_stride"], dtype=xd)
    x_wide[:, :H] = x.to(xd)
    w_wide = torch.zeros(V, H * c["w_stride"], dtype=wd)
    w_wide[:, :H] = w.to(wd)
    t = dict(x=x_wide.to(device)[:, :H], w=w_wide.to(device)[:, :H])
    if c["norm"]:
        t["norm"] = (1 + 0.5 * torch.randn(H, generator=gen)).to(xd).to(device)
    return t


def run_case(c: dict, device: str) -> dict:
    t = build(c, device)
    x, w = t["x"], t["w"]
    R, V, H = c["R"], c["V"], c["H"]
    norm = (t["norm"], 1e-6) if c["norm"] else (None, None)
    out = None
    if not c["alloc"]:
        wide = torch.full((R, V + c["out_stride"]), float("nan"), dtype=torch.float32, device=device)
        out = wide[:, :V]
    got = lm.lm_head(x, w, *norm, out=out, block_v=c["block_v"], block_k=c["block_k"])
    engine = lm.lm_head_ref(x, w, *norm)  # fast/model.FastModel.logits' product
    xn = x
    if norm[0] is not None:
        from iquest.reference.layers import rms_norm

        xn = rms_norm(x, *norm)  # what the wrapper hands the kernel
    exact = xn.double() @ w.double().T
    scale = xn.double().abs() @ w.double().abs().T  # sum_k |x_k w_k|
    n_terms = (PARTS[c["x"]] * H) if c["w"] == "bf16" else H + 1
    tol = n_terms * U_ACC * scale

    def ratio(y: torch.Tensor, ref: torch.Tensor) -> float:  # max |y - ref| / bound (inf where it is 0 and they differ)
        err = (y.double() - ref.double()).abs()
        return torch.where(err == 0, 0.0, err / tol).nan_to_num(nan=float("inf")).max().item()

    r = {"is_out": out is None or got is out, "shape": list(got.shape), "dtype": str(got.dtype),
         "finite": bool(torch.isfinite(got).all()), "err_ratio": ratio(got, exact),
         "engine_err_ratio": ratio(engine, exact), "vs_engine_ratio": ratio(got, engine), "bound": n_terms * U_ACC,
         "exact_bits": bool((got.double() == exact).all())}
    if c["data"] == "bf16_values":  # the fp32 path on bf16-valued x: mid and lo are zero, same logits bit for bit
        same = lm.lm_head(x.to(torch.bfloat16), w, block_v=c["block_v"], block_k=c["block_k"])
        r["same_as_bf16"] = bool(torch.equal(same, got))
    return r


def _check(c: dict, r: dict) -> None:
    assert r["is_out"] and r["shape"] == [c["R"], c["V"]] and r["dtype"] == "torch.float32"
    assert r["finite"], "NaN or inf left in the output (a tile not stored?)"
    assert r["engine_err_ratio"] <= 1, f"the engine's fp32 product breaks the bound: {r['engine_err_ratio']:.2e}"
    assert r["err_ratio"] <= 1, f"{c['name']}: max |kernel - exact| / bound = {r['err_ratio']:.2e}"
    assert r["vs_engine_ratio"] <= 1, f"{c['name']}: max |kernel - engine| / bound = {r['vs_engine_ratio']:.2e}"
    if c["data"] == "exact":
        assert r["exact_bits"], f"{c['name']}: every partial sum is exact here, yet the logits differ from float64"
    if c["data"] == "bf16_values":
        assert r["same_as_bf16"], "fp32 x holding bf16 values must give the bf16 path's logits bit for bit"


def _summary(c: dict, r: dict) -> str:
    return (f"{c['name']}: err/bound {r['err_ratio']:.2e}, vs engine {r['vs_engine_ratio']:.2e} "
            f"(engine {r['engine_err_ratio']:.2e}), bound {r['bound']:.1e} of sum|x||w|")


# ---- interpreter tests ---------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check, _summary)


@pytest.mark.parametrize("name", ["neg_drop_last_k", "neg_drop_lo_part"])
def test_interpreted_negative_control(interpreted, name):
    """A broken launch must fail the very check the cases pass, and it must have run."""
    r = interpreted[name]
    assert "error" not in r, r.get("error")
    assert r["broken_calls"] == 1, "the broken launcher did not run"
    c = {"neg_drop_last_k": NEG_DROP_K, "neg_drop_lo_part": NEG_DROP_LO}[name]
    with pytest.raises(AssertionError):
        _check(c, r)
    if name == "neg_drop_last_k":
        assert r["err_ratio"] > 100, r["err_ratio"]
    else:
        assert not r["exact_bits"]


def _negative(c: dict, device: str) -> dict:
    """run_case with `_launch` replaced: drop the last K tile (H rounded down past it), or keep two parts of x."""
    original, calls = lm._launch, []

    def broken(x, weight, out, H, x_parts, block_v, block_k, *args):
        calls.append(1)
        if c is NEG_DROP_K:
            H -= H % block_k or block_k
        else:
            x_parts = min(x_parts, 2)
        return original(x, weight, out, H, x_parts, block_v, block_k, *args)

    lm._launch = broken
    try:
        r = run_case(c, device)
    finally:
        lm._launch = original
    return dict(r, broken_calls=len(calls))


def test_choose_block_v(monkeypatch):
    cpu = torch.device("cpu")  # 8 "SMs" off the GPU: 32 programs wanted
    assert lm.choose_block_v(20000, cpu) == 128 and lm.choose_block_v(100, cpu) == 16
    monkeypatch.setattr(lm, "_sm_count", lambda device: 132)  # an H200: 528 programs wanted
    assert [lm.choose_block_v(v, cpu) for v in (20000, 40000, 80000, 160000, 5000)] == [32, 64, 128, 128, 16]


def _args(**over):
    a = dict(x=torch.randn(3, 40), weight=torch.randn(50, 40).bfloat16())
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(x=torch.randn(40)), "2-D"),
    (dict(x=torch.randn(3, 41)), "hidden size 41"),
    (dict(x=torch.randn(0, 40)), "empty operand"),
    (dict(x=torch.randn(3, 40).int()), "x dtype"),
    (dict(weight=torch.randn(50, 40).double()), "weight dtype"),
    (dict(x=torch.randn(40, 3).T), "x must have unit stride"),
    (dict(weight=torch.randn(40, 50).bfloat16().T), "weight must have unit stride"),
    (dict(norm_weight=torch.ones(40)), "go together"),
    (dict(eps=1e-6), "go together"),
    (dict(norm_weight=torch.ones(41), eps=1e-6), "norm_weight must be"),
    (dict(norm_weight=torch.ones(40), eps=0.0), "eps"),
    (dict(norm_weight=torch.ones(40), eps=1), "eps"),
    (dict(out=torch.empty(3, 51)), "out must be"),
    (dict(out=torch.empty(3, 50, dtype=torch.bfloat16)), "out must be"),
    (dict(out=torch.empty(50, 3).T), "out must have unit stride"),
    (dict(block_v=24), "block_v"),
    (dict(block_k=8), "block_k"),
])
def test_rejects_bad_inputs(over, message):
    with pytest.raises(ValueError, match=f"lm_head: .*{message}"):
        lm.lm_head(**_args(**over))


# ---- GPU tests (one TP8 rank's LM head) ------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    _check(c, r)
    print(_summary(c, r))


@pytest.mark.gpu
@pytest.mark.parametrize("c", [NEG_DROP_K, NEG_DROP_LO], ids=["neg_drop_last_k", "neg_drop_lo_part"])
def test_gpu_negative_control(c):
    r = _negative(c, "cuda")
    assert r["broken_calls"] == 1
    with pytest.raises(AssertionError):
        _check(c, r)


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 8])
def test_gpu_graph_replay_deterministic(R):
    """Captured in a CUDA graph with a fixed `out`, replay gives the eager logits bit for bit, twice."""
    t = build(case("g", R=R, **GPU), "cuda")
    eager = lm.lm_head(t["x"], t["w"])
    out = torch.full_like(eager, float("nan"))
    lm.lm_head(t["x"], t["w"], out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lm.lm_head(t["x"], t["w"], out=out)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
    assert torch.equal(lm.lm_head(t["x"], t["w"]), eager)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [(c["name"], lambda c=c: _negative(c, "cpu")) for c in (NEG_DROP_K, NEG_DROP_LO)])
