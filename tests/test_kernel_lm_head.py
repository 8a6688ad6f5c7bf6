"""kernels/lm_head.py against the torch form it replaces, TorchOps.lm_head(hidden, head) = hidden.float() @
head.float().T (docs/model.md, "Numerics"), and against the float64 product of the same values. A head held bf16 (as the
published checkpoint stores it) gives the logits of the same head held fp32, bit for bit.

Tolerances, as data (TOLERANCES below, with their reasons), per logit, in units of sum_h |x_h w_vh|. An fp32 sum of
the H products in any order, with or without FMAs, is within g of the exact one: g = gamma_H = H u / (1 - H u), u =
2^-24, always (Higham, Thm 3.1), and g = 8 sqrt(H) u (when smaller) except with probability < 2 H e^-32 a logit,
rounding errors taken as independent (Higham and Mary's probabilistic bound, lambda = 8). So:
  exact  |kernel - float64| <= gamma_H
  torch  |kernel - torch| <= 2 g                (each within g of float64; kernels/device.logit_tolerance states the
                                                 guaranteed 2 gamma_H)
Neither bound stops TF32 products at a large H (their error, ~2^-11 a product with random signs, averages down), so
"exact" cases use data whose every product and partial sum is exact in fp32 (x = n 2^-4, n < 16; at most 12 weights of
16 significant bits a row): any correct order gives the float64 logits, and torch's, bit for bit, and TF32's 10-bit
operands do not. The measured ratios are printed with -s.

Under Triton's CPU interpreter, in one worker subprocess: 1, 3, 8 and 16 rows; V not a multiple of the tile (partial
last V tile); H = 3072 and small H with a K tail; bf16 and fp32 hidden; strided hidden, head and out rows; the out
buffer pre-filled with NaN; default settings (choose_block_v); both forms ("rows", the default, and "dot"). Negative
controls, a jit piece substituted from here (`kernels.testing.substituted`), one a form: TF32 products (operands
rounded to TF32 first, which the interpreter, ignoring input_precision, needs to show them), which must fail. `@pytest.mark.gpu`: every case, one TP8 rank's head
(V = 20000, H = 3072 fp32, R = 1, 6, 8), the control at that size, PDL and CUDA-graph replay bit-identical to a plain
launch.
"""

from __future__ import annotations

import sys

import pytest
import torch
import triton
import triton.language as tl

from iquest.fast.torch_ops import TorchOps
from iquest.kernels import lm_head as lm
from iquest.kernels.device import logit_tolerance
from iquest.kernels.testing import interpreted_tests, substituted

U = 2.0 ** -24
LAMBDA = 8.0  # the probabilistic bound's lambda: it fails with probability < 2 H exp(-LAMBDA^2 / 2) a logit
TOLERANCES = {  # name: (multiple of g sum|x w|, which g, why)
    "exact": (1.0, "always", "H fp32 products summed in any order (Higham, Thm 3.1)"),
    "torch": (2.0, "probable", "kernel and torch each within g sum|x w| of float64"),
}


# ---- negative control: a broken jit piece put into a copy of the kernel -----------------------------------
@triton.jit
def _to_tf32(v):
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x1000) & -0x2000).to(tl.float32, bitcast=True)  # 10 explicit significand bits


@triton.jit
def dot_tf32(acc, x, w):
    return tl.dot(_to_tf32(x), tl.trans(_to_tf32(w)), acc, input_precision="tf32")


@triton.jit
def row_products_tf32(acc, w, x):
    return acc + _to_tf32(w)[None, :, :] * _to_tf32(x)[:, None, :]


CONTROLS = {"tf32": {"_lm_head_kernel": {"_dot": dot_tf32}},
            "tf32_rows": {"_lm_head_rows_kernel": {"_row_products": row_products_tf32}}}

BASE = dict(R=8, V=100, H=100, x="bf16", w="fp32", data="randn", x_stride=1, w_stride=1, out_stride=0, alloc=False,
            broken=None, seed=0, settings=dict(block_v=32, block_k=32))


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


RANK = dict(V=20000, H=3072, w="bf16", settings={})  # one TP8 rank's head as the engine holds it, default settings

CASES = [
    case("1row_bf16", R=1, seed=1),
    case("1row_fp32", R=1, x="fp32", seed=2),
    case("3rows_V77_H200_fp32", R=3, V=77, H=200, x="fp32", settings=dict(block_v=32, block_k=64), seed=3),
    case("8rows_bf16", seed=4),
    case("8rows_fp32", x="fp32", seed=5),
    case("8rows_H3072_V1000_default_settings", V=1000, H=3072, settings={}, seed=6),
    case("8rows_H3072_fp32_alloc", V=50, H=3072, x="fp32", alloc=True, settings=dict(block_v=16, block_k=128),
         seed=7),
    case("16rows_one_row_tile", R=16, V=50, seed=8),
    case("even_k_no_tail", R=3, H=128, seed=9),
    case("strided_rows", R=3, V=70, H=90, x="fp32", x_stride=2, w_stride=3, out_stride=7, seed=10),
    case("exact_bf16", R=8, data="exact", seed=11),
    case("exact_fp32_H3072", R=8, V=300, H=3072, x="fp32", data="exact", settings=dict(block_v=64, block_k=128),
         seed=12),
    case("rows_tiles_K_tail", R=5, V=77, H=200, settings=dict(block_v=8, rows_block_k=16, rows_warps=2), seed=16),
    # the head held bf16, as stored
    case("head_bf16_8rows", w="bf16", seed=17),
    case("head_bf16_1row_H3072", R=1, V=50, H=3072, w="bf16", seed=18),
    case("head_bf16_exact", R=8, w="bf16", data="exact", seed=19),
    case("dot_head_bf16", R=6, w="bf16", settings=dict(form="dot", block_v=32, block_k=32), seed=22),
    # the "dot" form
    case("dot_1row_bf16", R=1, settings=dict(form="dot", block_v=32, block_k=32), seed=13),
    case("dot_8rows_H3072_V1000_default_settings", V=1000, H=3072, settings=dict(form="dot"), seed=14),
    case("dot_exact_bf16", R=8, data="exact", settings=dict(form="dot", block_v=32, block_k=32), seed=15),
    # negative controls, one a form: must fail the checks the cases above pass
    case("broken_tf32_products", R=8, data="exact", broken="tf32", settings=dict(form="dot", block_v=32, block_k=32),
         seed=20),
    case("broken_tf32_rows", R=8, data="exact", broken="tf32_rows", seed=21),
]

GPU_CASES = [
    case("gpu_1row_rank", R=1, **RANK, seed=31),
    case("gpu_6rows_rank", R=6, **RANK, seed=32),
    case("gpu_8rows_rank", R=8, **RANK, seed=33),
    case("gpu_8rows_rank_fp32", R=8, x="fp32", **RANK, seed=34),
    case("gpu_8rows_rank_head_fp32", R=8, **dict(RANK, w="fp32"), seed=42),
    case("gpu_8rows_rank_exact", R=8, data="exact", **RANK, seed=35),
    case("gpu_8rows_rank_block_k_64", R=8, **dict(RANK, settings=dict(block_k=64)), seed=36),
    case("gpu_8rows_rank_block_v_64", R=8, **dict(RANK, settings=dict(block_v=64)), seed=37),
    case("gpu_6rows_rank_dot", R=6, **dict(RANK, settings=dict(form="dot")), seed=38),
    case("gpu_1row_rank_dot", R=1, **dict(RANK, settings=dict(form="dot")), seed=39),
    # the controls on an fp32 head: a bf16 head's 8-bit weights are exact in TF32's 10 bits, so TF32 products would
    # leave its exact data exact and the control would show nothing (seen on an H100 at fd92958)
    case("gpu_broken_tf32_products", R=8, data="exact", broken="tf32",
         **dict(RANK, w="fp32", settings=dict(form="dot")), seed=40),
    case("gpu_broken_tf32_rows", R=8, data="exact", broken="tf32_rows", **dict(RANK, w="fp32"), seed=41),
]


def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, V, H = c["R"], c["V"], c["H"]
    if c["data"] == "exact":  # products of <= 20 bits, <= 12 a row: every partial sum exact in fp32
        x = (torch.randint(1, 16, (R, H), generator=gen) * (torch.randint(0, 2, (R, H), generator=gen) * 2 - 1)) / 16.0
        w = torch.zeros(V, H)
        nz = torch.randint(0, H, (V, 12), generator=gen)
        mag = torch.randint(2 ** 15, 2 ** 16, nz.shape, generator=gen) * (torch.randint(0, 2, nz.shape, generator=gen)
                                                                          * 2 - 1)
        w.scatter_(1, nz, mag.float() * 2.0 ** -16)
    else:  # post-norm rows (rms ~1), a head's scale
        x = torch.randn(R, H, generator=gen)
        w = torch.randn(V, H, generator=gen) * 0.02
    xd = torch.bfloat16 if c["x"] == "bf16" else torch.float32
    x_wide = torch.zeros(R, H * c["x_stride"], dtype=xd)
    x_wide[:, :H] = x.to(xd)
    w_wide = torch.zeros(V, H * c["w_stride"], dtype=torch.bfloat16 if c["w"] == "bf16" else torch.float32)
    w_wide[:, :H] = w  # a bf16 head rounds the exact data's 16-bit weights to 8: their partial sums stay exact
    return dict(x=x_wide.to(device)[:, :H], w=w_wide.to(device)[:, :H])


def run_head(t: dict, settings: lm.LMHeadSettings, out=None, broken: str | None = None, **kw) -> torch.Tensor:
    with substituted(lm, CONTROLS[broken] if broken else {}):
        return lm.lm_head(t["x"], t["w"], settings=settings, out=out, **kw)


def run_case(c: dict, device: str) -> dict:
    t = build(c, device)
    R, V, H = c["R"], c["V"], c["H"]
    out = None
    if not c["alloc"]:
        out = torch.full((R, V + c["out_stride"]), float("nan"), device=device)[:, :V]
    got = run_head(t, lm.LMHeadSettings(**c["settings"]), out, c["broken"])
    widened = got if c["w"] == "fp32" else run_head(dict(t, w=t["w"].float()), lm.LMHeadSettings(**c["settings"]),
                                                    None, c["broken"])
    torch_form = TorchOps().lm_head(t["x"], t["w"])
    x64, w64 = t["x"].double().cpu(), t["w"].double().cpu()  # a bf16 head's values are exact in fp32 and float64
    exact = x64 @ w64.T
    scale = x64.abs() @ w64.abs().T  # sum_h |x_h w_vh|
    g = {"always": H * U / (1 - H * U)}
    g["probable"] = min(g["always"], LAMBDA * H ** 0.5 * U)

    def bound(name):
        return TOLERANCES[name][0] * g[TOLERANCES[name][1]] * scale

    def ratio(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> float:
        err = (y.double().cpu() - ref.double().cpu()).abs()
        return float(torch.where(err == 0, 0.0, err / bound).nan_to_num(nan=float("inf")).max())

    return {"is_out": out is None or got is out, "shape": list(got.shape), "dtype": str(got.dtype),
            "finite": bool(torch.isfinite(got).all()),
            "exact_ratio": ratio(got, exact, bound("exact")),
            "torch_ratio": ratio(got, torch_form, bound("torch")),
            "torch_exact_ratio": ratio(torch_form, exact, bound("exact")),
            "tolerance_is_the_kernels": bool(torch.allclose(logit_tolerance(x64, w64),
                                                            2 * g["always"] * scale)),
            "exact_bits": bool((got.double().cpu() == exact).all()),
            "head_dtype": str(t["w"].dtype), "widened_bits": bool(torch.equal(got, widened)),
            "torch_bits": bool(torch.equal(got, torch_form))}


def check_values(c: dict, r: dict) -> None:
    assert r["is_out"] and r["shape"] == [c["R"], c["V"]] and r["dtype"] == "torch.float32"
    assert r["head_dtype"] == f"torch.{'bfloat16' if c['w'] == 'bf16' else 'float32'}"
    assert r["widened_bits"], f"{c['name']}: the head held {c['w']} and the same head held fp32 give other logits"
    assert r["finite"], "NaN or inf left in the output (a tile not stored?)"
    assert r["torch_exact_ratio"] <= 1, f"the torch form breaks the bound: {r['torch_exact_ratio']:.2e}"
    assert r["tolerance_is_the_kernels"]
    assert r["exact_ratio"] <= 1, f"{c['name']}: max |kernel - float64| / bound = {r['exact_ratio']:.2e}"
    assert r["torch_ratio"] <= 1, f"{c['name']}: max |kernel - torch| / bound = {r['torch_ratio']:.2e}"
    if c["data"] == "exact":
        assert r["exact_bits"] and r["torch_bits"], \
            f"{c['name']}: every partial sum is exact here, yet the logits differ from float64's or torch's"


def _check(c: dict, r: dict) -> None:
    if not c["broken"]:
        check_values(c, r)
        return
    assert not r["exact_bits"], "TF32 products left the exact data's logits exact"
    with pytest.raises(AssertionError):
        check_values(c, r)


def _summary(c: dict, r: dict) -> str:
    return (f"{c['name']}: of the bounds: vs float64 {r['exact_ratio']:.1e}, vs torch {r['torch_ratio']:.1e} "
            f"(torch vs float64 {r['torch_exact_ratio']:.1e}); bit-equal to torch: {r['torch_bits']}")


# ---- interpreter tests ----------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check, _summary)


def test_cases_cover_the_boundaries():
    plain = [c for c in CASES if not c["broken"]]
    assert {1, 8} <= {c["R"] for c in plain} and {3072} < {c["H"] for c in plain}
    assert {"bf16", "fp32"} == {c["x"] for c in plain} == {c["w"] for c in plain}
    assert {"rows", "dot"} == {c["settings"].get("form", "rows") for c in plain if c["w"] == "bf16"}
    assert any(c["V"] % c["settings"].get("block_v", 32) for c in plain)  # a partial last V tile
    assert {c["broken"] for c in CASES} == {None, *CONTROLS}
    assert all(c["w"] == "fp32" for c in CASES + GPU_CASES if c["broken"])  # TF32 rounds only wider weights


def test_choose_block_v(monkeypatch):
    cpu, s = torch.device("cpu"), lm.LMHeadSettings(form="dot")  # 8 "SMs" off the GPU: 32 programs wanted
    assert lm.choose_block_v(20000, s, cpu) == 64 and lm.choose_block_v(100, s, cpu) == 16
    monkeypatch.setattr(lm, "_sm_count", lambda device: 132)  # an H200: 528 programs wanted
    assert [lm.choose_block_v(v, s, cpu) for v in (20000, 40000, 80000, 5000)] == [32, 64, 64, 16]
    assert lm.choose_block_v(20000, lm.LMHeadSettings(), cpu) == lm.ROWS_BLOCK_V  # "rows": a fixed tile
    assert lm.choose_block_v(20000, lm.LMHeadSettings(block_v=64), cpu) == 64


def test_fits():
    assert lm.fits(1, 20000, 3072) and lm.fits(8, 20000, 3072) and lm.fits(16, 1, 1)
    assert not lm.fits(17, 20000, 3072) and not lm.fits(0, 20000, 3072)


def _args(**over):
    a = dict(hidden=torch.randn(3, 40).bfloat16(), head=torch.randn(50, 40))
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(hidden=torch.randn(40)), "2-D"),
    (dict(hidden=torch.randn(3, 41)), "H=41"),
    (dict(hidden=torch.randn(0, 40)), "block of 0 rows"),
    (dict(hidden=torch.randn(17, 40)), "block of 17 rows .* run the torch form"),
    (dict(hidden=torch.randn(3, 40).int()), "hidden torch.int32 must be"),
    (dict(head=torch.randn(50, 40).half()), "head torch.float16 must be bfloat16 or float32"),
    (dict(hidden=torch.randn(40, 3).T), "hidden must have unit stride"),
    (dict(head=torch.randn(40, 50).T), "head must have unit stride"),
    (dict(out=torch.empty(3, 51)), "out must be"),
    (dict(out=torch.empty(3, 50, dtype=torch.bfloat16)), "out must be"),
    (dict(out=torch.empty(50, 3).T), "out must have unit stride"),
    (dict(settings=lm.LMHeadSettings(block_v=24)), "block_v"),
    (dict(settings=lm.LMHeadSettings(form="dot", block_v=8)), "block_v"),
    (dict(settings=lm.LMHeadSettings(block_k=8)), "block_k"),
    (dict(settings=lm.LMHeadSettings(num_warps=3)), "num_warps"),
    (dict(settings=lm.LMHeadSettings(form="gemv")), "form"),
    (dict(settings=lm.LMHeadSettings(rows_block_k=24)), "rows_block_k"),
    (dict(settings=lm.LMHeadSettings(rows_warps=3)), "rows_warps"),
])
def test_rejects_bad_inputs(over, message):
    with pytest.raises(ValueError, match=f"lm_head: .*{message}"):
        lm.lm_head(**_args(**over))


def test_settings_are_frozen():
    with pytest.raises(AttributeError):
        lm.LMHeadSettings().block_k = 64


# ---- GPU tests (one TP8 rank's head) ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the torch form's fp32 matmul, as the engine runs it
    try:
        r = run_case(c, "cuda")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    _check(c, r)
    print(_summary(c, r))


@pytest.mark.gpu
@pytest.mark.parametrize("R", [1, 8])
def test_gpu_pdl_and_graph_replay_bit_identical(R):
    """Captured in a CUDA graph with PDL and a fixed `out`, replay gives a plain launch's logits bit for bit, twice."""
    t = build(case("g", R=R, **RANK), "cuda")
    s = lm.LMHeadSettings()
    plain = run_head(t, s)
    out = torch.full_like(plain, float("nan"))
    run_head(t, s, out, pdl=True)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_head(t, s, out, pdl=True)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)
    assert torch.equal(run_head(t, s), plain)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES])
