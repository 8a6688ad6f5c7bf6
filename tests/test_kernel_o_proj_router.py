"""kernels/o_proj_router.py (the o-projection whose output tiles write the router's partial logits, one launch) against
kernels/fp8_linear.py's `fp8_linear` and the torch form `router_parts_torch`, under Triton's CPU interpreter in one
worker subprocess; `@pytest.mark.gpu` cases at one TP8 rank's shape (N = 3072, K = 512, E = 256).

Per case: y bit for bit the plain linear's under the same locks and settings (without locks: its one-split launch);
the partials against the torch form computed from that y, within PARTS_C * gamma_n * sum_n |term| a value (gamma_n =
n u / (1 - n u), u = 2^-24, n = the tile's block_n columns: two fp32 sums of the same n exactly rounded terms, each
within gamma_n sum |term| of the exact sum in any order, Higham Thm 3.1, so PARTS_C = 2); the partials' buffer filled
with NaN before the launch (every element written, or the case fails); the lock counters left zeroed. Negative
controls (a jit piece substituted from here): parts[., 1] from the unrounded product, and w_out left out; each must
fail the parts check.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from iquest.kernels import fp8_linear as fl, o_proj_router as opr
from iquest.kernels.testing import interpreted_tests, substitute, substituted

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PARTS_C = 2.0
U = 2.0 ** -24

BASE = dict(R=6, N=64, K=64, E=16, block=(32, 32), x="bf16", r="bf16", w_out="bf16", locks=True, block_n=32,
            block_e=16, r_stride=None, seed=0, control=None)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_bf16", R=1, E=8),
    case("6rows_bf16_two_chunks", E=40),
    case("8rows_fp32_r_fp32", R=8, x="fp32", r="fp32", w_out="fp32", N=128, E=12),
    case("6rows_fp16_strided_r", x="fp16", r="bf16", w_out="fp32", r_stride=96),
    case("one_split_no_locks", locks=False, N=96, E=16),
    case("n_80_ragged_tile", N=80, E=24, R=3),
    case("block_n_16_block_e_32", block_n=16, block_e=32, E=20),
]
CONTROLS = [case("control_unrounded", control="unrounded"), case("control_no_w_out", control="no_w_out")]
GPU_RANK = dict(N=3072, K=512, E=256, block=(128, 128), block_n=32, block_e=32)
GPU_CASES = [case("gpu_1row_rank", R=1, **GPU_RANK), case("gpu_6rows_rank", R=6, **GPU_RANK),
             case("gpu_6rows_rank_fp32_r", R=6, **dict(GPU_RANK, r="fp32")),
             case("gpu_6rows_rank_no_locks", R=6, locks=False, **GPU_RANK),
             case("gpu_6rows_rank_one_chunk", R=6, **dict(GPU_RANK, block_e=256))]


@triton.jit
def _branch_unrounded(total, wo, DT: tl.constexpr):
    """The partial from the fp32 sum, not from y as stored."""
    return total * wo[None, :]


@triton.jit
def _branch_no_w_out(total, wo, DT: tl.constexpr):
    """attn_out_norm's weight left out."""
    return total.to(DT).to(tl.float32)


CONTROL_PIECES = {"unrounded": _branch_unrounded, "no_w_out": _branch_no_w_out}


def _inputs(c: dict, device: str):
    gen = torch.Generator().manual_seed(c["seed"])
    R, N, K, E, (B0, B1) = c["R"], c["N"], c["K"], c["E"], c["block"]
    x = torch.randn(R, K, generator=gen).to(DTYPES[c["x"]])
    w = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (10 ** (torch.rand(-(-N // B0), -(-K // B1), generator=gen) * 2 - 1) / (64 * K ** 0.5)).float()
    wide = c["r_stride"] or N
    r = torch.randn(R, wide, generator=gen).to(DTYPES[c["r"]])[:, :N]
    router_w = (torch.randn(E, N, generator=gen) * 0.05).float()
    w_out = (1 + 0.3 * torch.randn(N, generator=gen)).to(DTYPES[c["w_out"]])
    return tuple(t.to(device) for t in (x, w, scale, r, router_w, w_out))


def _nan_parts(tiles, rows, experts, device):
    return torch.full((tiles, 2, rows, experts), float("nan"), dtype=torch.float32, device=device)


def run_case(c: dict, device: str) -> dict:
    x, w, scale, r, router_w, w_out = _inputs(c, device)
    R, N, block = c["R"], c["N"], c["block"]
    st = fl.LinearSettings(block_n=c["block_n"])
    pst = opr.PartsSettings(block_e=c["block_e"])
    lin_locks = torch.zeros(4096, dtype=torch.int32, device=device)
    if c["locks"]:
        want_y = fl.fp8_linear(x, w, scale, block, out_dtype=x.dtype, locks=lin_locks, settings=st)
    else:
        want_y = fl.fp8_linear(x, w, scale, block, out_dtype=x.dtype, settings=replace(st, split_k=1))
    locks = torch.zeros(opr.lock_count(R, N, st), dtype=torch.int32, device=device) if c["locks"] else None
    # a control's broken piece sits two calls down: the kernel's epilogue's own `_branch`
    broken = ({"_o_proj_router_kernel": {"_epilogue": substitute(opr._epilogue, _branch=CONTROL_PIECES[c["control"]])}}
              if c["control"] else {})
    saved = opr._parts_buffer
    opr._parts_buffer = _nan_parts
    try:
        with substituted(opr, broken):
            y, parts = opr.o_proj_router(x, w, scale, block, r, router_w, w_out, locks=locks, settings=st,
                                         parts_settings=pst)
    finally:
        opr._parts_buffer = saved
    want = opr.router_parts_torch(y, r, router_w, w_out, c["block_n"])
    # sum_n |term| per output, the bound's scale (float64 here: the test's own yardstick)
    terms = _abs_terms(y, r, router_w, w_out, c["block_n"])
    n = c["block_n"]
    bound = PARTS_C * (n * U / (1 - n * U)) * terms + 1e-30
    diff = (parts.double() - want.double()).abs()
    splits = fl.split_plan(N, c["K"], block, st, torch.device(device))[1] if c["locks"] else 1
    return {
        "splits": splits,
        "shape": list(parts.shape),
        "y_mismatch": int((y.float() != want_y.float()).sum()),
        "y_dtype": str(y.dtype),
        "nan": int(torch.isnan(parts).sum()),
        "over": [int((diff[:, j] > bound[:, j]).sum()) for j in range(2)],
        "worst": [float((diff[:, j] / bound[:, j]).max()) for j in range(2)],
        "locks_rearmed": locks is None or bool((locks == 0).all()),
    }


def _abs_terms(y, r, router_w, w_out, block_n):
    R, N = y.shape
    rw = router_w.double().abs()
    a = torch.stack((r.double().abs(), (y.float() * w_out.float()).double().abs()))  # the fp32 product, exact here
    out = []
    for n0 in range(0, N, block_n):
        cols = slice(n0, min(n0 + block_n, N))
        out.append(a[:, :, cols] @ rw[:, cols].T)
    return torch.stack(out)


def check(c: dict, r: dict) -> None:
    assert r["locks_rearmed"], "the split sum's counters were not left zeroed"
    T = triton.cdiv(c["N"], c["block_n"])
    assert r["shape"] == [T, 2, c["R"], c["E"]], r["shape"]
    assert r["y_dtype"] == str(DTYPES[c["x"]])
    assert r["y_mismatch"] == 0, f"y differs from fp8_linear's: {r['y_mismatch']} values"
    assert r["nan"] == 0, f"{r['nan']} partials not written"
    assert r["over"] == [0, 0], f"parts beyond the fp32 bound: {r['over']} (worst diff/bound {r['worst']})"


def summary(c: dict, r: dict) -> str:
    return f"{c['name']}: {r['splits']} split(s); worst diff/bound {r['worst']}"


interpreted, test_interpreted = interpreted_tests(__file__, CASES, check, summary)


def test_cases_cover_split_and_unsplit_sums():
    splits = {fl.split_plan(c["N"], c["K"], c["block"], fl.LinearSettings(block_n=c["block_n"]),
                            torch.device("cpu"))[1] if c["locks"] else 1 for c in CASES}
    assert 1 in splits and max(splits) > 1


@pytest.mark.parametrize("c", CONTROLS, ids=[c["name"] for c in CONTROLS])
def test_negative_control_fails_the_checks(interpreted, c):
    r = interpreted[c["name"]]
    assert "error" not in r, r.get("error")
    assert r["over"][0] == 0 and r["y_mismatch"] == 0  # only the piece substituted is wrong
    with pytest.raises(AssertionError, match="parts beyond"):
        check(c, r)


def test_torch_form_takes_e4m3_or_dequantized():
    from iquest.reference.fp8 import dequantize

    c = case("torch_form", R=3, N=80, E=5)
    x, w, scale, r, router_w, w_out = _inputs(c, "cpu")
    st = fl.LinearSettings(block_n=32)
    y, parts = opr.o_proj_router_torch(x, w, scale, c["block"], r, router_w, w_out, st)
    assert parts.shape == (3, 2, 3, 5) and parts.dtype == torch.float32 and y.dtype == x.dtype
    y2, parts2 = opr.o_proj_router_torch(x, dequantize(w, scale, c["block"], torch.float32), None, c["block"], r,
                                         router_w, w_out, st)
    assert torch.equal(y, y2) and torch.equal(parts, parts2)
    # the tiles' partials add up to the whole product
    whole = torch.stack((r.double(), y.double() * w_out.double())) @ router_w.double().T
    assert torch.allclose(parts.double().sum(0), whole, rtol=1e-5, atol=1e-6)


def test_settings_and_fits():
    assert opr.PartsSettings().block_e == 256 and opr.PartsSettings().prefetch is True
    for bad in (dict(block_e=8), dict(block_e=48), dict(block_e=True), dict(prefetch=1)):
        with pytest.raises(ValueError, match="PartsSettings: "):
            opr.PartsSettings(**bad)
    assert opr.fits(6, 256, 3072) and opr.fits(1, 1, 1)
    assert not opr.fits(0, 256, 3072) and not opr.fits(6, 0, 3072)
    assert not opr.fits(2 ** 20, 256, 3072)  # partials beyond int32 offsets
    assert opr.lock_count(6, 3072) == fl.lock_count(6, 3072) == 96


def test_bad_inputs_raise_before_launch():
    c = case("args", R=2)
    x, w, scale, r, router_w, w_out = _inputs(c, "cpu")
    blk = c["block"]

    def call(**kw):
        args = dict(x=x, w=w, scale=scale, block=blk, r=r, router_w=router_w, w_out=w_out)
        launch = {k: kw.pop(k) for k in ("locks", "settings", "parts_settings", "pdl") if k in kw}
        args.update(kw)
        return opr.o_proj_router(*args.values(), **launch)

    bad = [
        (dict(x=x[0]), "x and w must be 2-D"),
        (dict(x=x.to(torch.int32)), "x dtype"),
        (dict(w=w.float()), "float8_e4m3fn"),
        (dict(scale=scale[:, :1]), "scale must be fp32"),
        (dict(r=r[:1]), "r must be"),
        (dict(r=r.to(torch.int32)), "r dtype"),
        (dict(r=torch.randn(64, 2).bfloat16().T), "unit stride"),
        (dict(router_w=router_w.double()), "router_w must be contiguous fp32"),
        (dict(router_w=torch.randn(64, 16).T), "router_w must be contiguous fp32"),
        (dict(router_w=router_w[:, :32].contiguous()), "router_w must be"),
        (dict(w_out=w_out[:32]), "w_out must be"),
        (dict(w_out=w_out.to(torch.int32)), "w_out must be"),
        (dict(locks=torch.zeros(1, dtype=torch.int32)), "locks must be"),
        (dict(locks=torch.zeros(8, dtype=torch.int64)), "locks must be"),
        (dict(settings=object()), "settings must be a LinearSettings"),
        (dict(parts_settings=fl.LinearSettings()), "parts_settings must be a PartsSettings"),
        (dict(pdl=True), "programmatic dependent launch"),
    ]
    for kw, msg in bad:
        with pytest.raises(ValueError, match=f"o_proj_router: .*{msg}"):
            call(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES + CASES, ids=[c["name"] for c in GPU_CASES + CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    print(summary(c, r))
    check(c, r)


@pytest.mark.gpu
def test_gpu_chunk_width_moves_no_bit():
    """The default chunk (every expert at once) against chunks of 32 and 16 at a TP8 rank's shape: the same y and
    partials, bit for bit (a chunk only sets which experts' sums are formed together). Control: chunks of 32 with the
    w_out branch unrounded give other partials, so the comparison sees a change in one term."""
    c = case("gpu_chunks", R=6, **GPU_RANK)
    x, w, scale, r, router_w, w_out = _inputs(c, "cuda")
    st = fl.LinearSettings(block_n=c["block_n"])

    def run(block_e: int):
        locks = torch.zeros(opr.lock_count(6, c["N"], st), dtype=torch.int32, device="cuda")
        return opr.o_proj_router(x, w, scale, c["block"], r, router_w, w_out, locks=locks, settings=st,
                                 parts_settings=opr.PartsSettings(block_e=block_e))

    y0, parts0 = run(opr.PartsSettings().block_e)
    for block_e in (32, 16):
        y, parts = run(block_e)
        assert torch.equal(y, y0) and torch.equal(parts, parts0), block_e
    with substituted(opr, {"_o_proj_router_kernel": {"_epilogue": substitute(opr._epilogue,
                                                                             _branch=_branch_unrounded)}}):
        y, parts = run(32)
    assert torch.equal(y, y0) and not torch.equal(parts, parts0)


@pytest.mark.gpu
@pytest.mark.parametrize("c", CONTROLS, ids=[c["name"] for c in CONTROLS])
def test_gpu_control_fails(c):
    c = dict(c, **GPU_RANK)
    with pytest.raises(AssertionError, match="parts beyond"):
        check(c, run_case(c, "cuda"))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES + CONTROLS])
