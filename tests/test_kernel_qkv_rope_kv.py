"""kernels/qkv_rope_kv.py (the q/k/v projection ending in the per-head prologue, one launch) against the unfused pair
it replaces: kernels/fp8_linear.py's `fp8_linear` then kernels/qk_rope_kv.py's `qk_rope_kv` on the projection's
views, under Triton's CPU interpreter in one worker subprocess; `@pytest.mark.gpu` cases at one TP8 rank's shape.

Per case, from the same caches (random values, so an unwritten slot shows): the rotated q, the projection's k and v
columns, the cache's written slots and slot_pos. On the interpreter every one is bit for bit the pair's (the same
products in the same order, and numpy's sums); on the GPU at bf16 the projection and V are, and q and K agree within
the bf16 rounding of a norm whose squares are summed in another layout (GPU_TOL); at fp32 all agree to a few fp32 ulps
(GPU_F32_TOL). The trash slot is left out (several padding
rows write it in no defined order). Negative control (a jit piece substituted from here): the rotation pairing each dim
with itself instead of its NeoX partner, which must fail.
"""

from __future__ import annotations

import sys

import pytest
import torch
import triton
import triton.language as tl

from iquest.kernels import fp8_linear as fl, qk_rope_kv as qk, qkv_rope_kv as qrk
from iquest.kernels.testing import interpreted_tests, substitute, substituted
from iquest.reference.layers import rope_cos_sin

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# GPU: the unfused pair's norm sums a head's squares over one warp, this kernel over the tile's layout: a 1/rms may
# differ by a few fp32 ulps, which moves a bf16 rounding only near a midpoint (tests/test_kernel_qk_rope_kv.py's TOL).
GPU_TOL = dict(max_rel=2.0 ** -6, mismatch=1e-3)
# GPU, fp32 activations (IEEE fp32 dots): the fused projection's products are summed in another order than the plain
# linear's (one head a tile against 32-column tiles), so its columns differ from the pair's in the last fp32 bits
# (measured at 72c654b: v 109 of 384 values, max_rel 9.8e-8; q 353 of 4,608, 9.4e-8): a few ulps, far below a wrong
# column, scale or rotation (order 1). The engine runs bf16 on the GPU, where the projection and V are bit for bit.
GPU_F32_TOL = dict(max_rel=2.0 ** -20)

BASE = dict(R=6, HQ=6, HKV=1, D=128, H=256, rot=32, theta=1e6, slots=96, start=40, dead=(), dtype="bf16",
            block=(128, 128), locks=True, seed=0, control=None)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


MINI = dict(HQ=4, HKV=2, D=32, H=64, rot=8, block=(32, 32), slots=20, start=17)
CASES = [
    case("1row_bf16", R=1),
    case("6rows_padding_bf16", dead=(4, 5)),
    case("6rows_fp32", dtype="fp32"),
    case("ring_wrap_bf16", start=92, dead=(5,), theta=1e4),
    case("no_rope_bf16", rot=None),
    case("one_split_no_locks_bf16", locks=False, dead=(5,)),
    case("mini_gqa_bf16", **MINI, dead=(2,)),
    case("mini_gqa_fp32_one_split", **MINI, dtype="fp32", locks=False),
    case("prefill_40rows_two_tiles_bf16", R=40, **dict(MINI, slots=4096, start=0), dead=(38, 39)),
]
CONTROLS = [case("control_partner_self", control="partner_self")]
GPU_RANK = dict(H=3072, slots=4160, start=4157)
GPU_CASES = [
    case("gpu_6rows_rank", **GPU_RANK, dead=(5,)),
    case("gpu_1row_rank", R=1, **GPU_RANK),
    case("gpu_no_rope_rank", rot=None, **GPU_RANK),
    case("gpu_prefill_64rows", R=64, **dict(GPU_RANK, slots=196608, start=1000), dead=(63,)),
]


@triton.jit
def _partner_raw(x, ROT: tl.constexpr):
    """Each dim its own partner (rotate_half forgotten): the rotation reads the dim itself."""
    return x, tl.where(x < ROT // 2, -1.0, 1.0), x < ROT


def _controls() -> dict:
    heads = substitute(qk.head_rows, _pairs=_partner_raw)
    broken = {"_prologue": substitute(qrk._prologue, head_rows=heads)}
    return {"partner_self": {"_qkv_rope_kv_kernel": broken}}


def _weights(c: dict, gen: torch.Generator, device: str):
    N = (c["HQ"] + 2 * c["HKV"]) * c["D"]
    H, (B0, B1) = c["H"], c["block"]
    w = (torch.randn(N, H, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (10 ** (torch.rand(-(-N // B0), -(-H // B1), generator=gen) * 2 - 1) / (64 * H ** 0.5)).float()
    return w.to(device), scale.to(device)


def run_case(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, HQ, HKV, D, S, dt = c["R"], c["HQ"], c["HKV"], c["D"], c["slots"], DTYPES[c["dtype"]]
    x = torch.randn(R, c["H"], generator=gen).to(dt).to(device)
    w, scale = _weights(c, gen, device)
    qw, kw = ((1 + 0.3 * torch.randn(D, generator=gen)).to(dt).to(device) for _ in range(2))
    positions = torch.arange(c["start"], c["start"] + R, device=device)
    live = torch.ones(R, dtype=torch.bool)
    live[list(c["dead"])] = False
    live = live.to(device)
    cos = sin = None
    if c["rot"] is not None:
        cos, sin = (t.to(device) for t in rope_cos_sin(positions.cpu(), c["rot"], c["theta"], torch.float32))
    caches = [torch.randn(S + 1, HKV, D, generator=gen).to(dt).to(device) for _ in range(2)]
    slot_pos = torch.randint(-1, 1000, (S + 1,), generator=gen).to(device)
    mine = [t.clone() for t in (*caches, slot_pos)]
    pair = [t.clone() for t in (*caches, slot_pos)]
    N = (HQ + 2 * HKV) * D

    # the unfused pair, as the engine ran it: the projection (split as fp8_linear splits it), then the prologue
    lin_locks = torch.zeros(4096, dtype=torch.int32, device=device)
    y = fl.fp8_linear(x, w, scale, c["block"], out_dtype=dt, locks=lin_locks if c["locks"] else None)
    q, k, v = (y[:, a:b].view(R, -1, D) for a, b in ((0, HQ * D), (HQ * D, (HQ + HKV) * D), ((HQ + HKV) * D, N)))
    want_q = qk.qk_rope_kv(q, k, v, qw, kw, 1e-6, cos, sin, positions, live, *pair)
    locks = torch.zeros(qrk.lock_count(R, D, N), dtype=torch.int32, device=device) if c["locks"] else None
    with substituted(qrk, _controls().get(c["control"], {})):
        got_q = qrk.qkv_rope_kv(x, w, scale, c["block"], HQ, HKV, qw, kw, 1e-6, cos, sin, positions, live, *mine,
                                locks=locks)
    got_y = got_q.reshape(R, -1).as_strided((R, N), (got_q.stride(0), 1))  # the projection the q view sits in
    real = torch.zeros(S + 1, dtype=torch.bool, device=device)
    real[positions[live] % S] = True  # the live rows' slots (the trash slot left out)
    out = {"locks_rearmed": locks is None or bool((locks == 0).all()), "splits": _splits(c, N)}
    for name, got, want in (("q", got_q, want_q), ("k_cols", got_y[:, HQ * D:(HQ + HKV) * D], k.reshape(R, -1)),
                            ("v_cols", got_y[:, (HQ + HKV) * D:], v.reshape(R, -1)),
                            ("cache_k", mine[0][real], pair[0][real]), ("cache_v", mine[1][real], pair[1][real]),
                            ("slot_pos", mine[2][:S], pair[2][:S]),
                            ("untouched_k", mine[0][:S][~real[:S]], caches[0][:S][~real[:S]])):
        g, t = got.float().cpu(), want.float().cpu()
        live_rows = live.cpu() if name in ("q", "k_cols", "v_cols") else None
        if live_rows is not None:
            g, t = g[live_rows], t[live_rows]
        out[name] = {"mismatch": int((g != t).sum()), "n": g.numel(),
                     "max_rel": float((g - t).abs().max() / t.abs().max().clamp(min=1e-30)) if g.numel() else 0.0}
    return out


def _splits(c: dict, N: int) -> int:
    if not c["locks"]:
        return 1
    return fl.split_plan(N, c["H"], c["block"], fl.LinearSettings(), torch.device("cpu"))[1]


def check(c: dict, r: dict, tol: dict | None = None) -> None:
    assert r["locks_rearmed"], "the split sum's counters were not left zeroed"
    for name in ("slot_pos", "untouched_k"):
        assert r[name]["mismatch"] == 0, f"{name} differs from the unfused pair's: {r[name]}"
    if tol is not None and c["dtype"] == "fp32":
        for name in ("v_cols", "k_cols", "cache_v", "q", "cache_k"):
            assert r[name]["max_rel"] <= GPU_F32_TOL["max_rel"], f"{name}: {r[name]} beyond {GPU_F32_TOL}"
        return
    for name in ("v_cols", "k_cols", "cache_v"):
        assert r[name]["mismatch"] == 0, f"{name} differs from the unfused pair's: {r[name]}"
    for name in ("q", "cache_k"):
        if tol is None:
            assert r[name]["mismatch"] == 0, f"{name} differs from the unfused pair's: {r[name]}"
        else:
            assert r[name]["max_rel"] <= tol["max_rel"] and r[name]["mismatch"] <= tol["mismatch"] * r[name]["n"] + 1, \
                f"{name}: {r[name]} beyond {tol}"


def summary(c: dict, r: dict) -> str:
    return f"{c['name']}: {r['splits']} split(s); q mismatches {r['q']['mismatch']}/{r['q']['n']}"


interpreted, test_interpreted = interpreted_tests(__file__, CASES, check, summary)


def test_cases_cover_split_and_unsplit_sums():
    assert {1} < {_splits(c, (c["HQ"] + 2 * c["HKV"]) * c["D"]) for c in CASES}


@pytest.mark.parametrize("c", CONTROLS, ids=[c["name"] for c in CONTROLS])
def test_negative_control_fails_the_checks(interpreted, c):
    r = interpreted[c["name"]]
    assert "error" not in r, r.get("error")
    with pytest.raises(AssertionError, match="q differs"):
        check(c, r)


def test_fits_and_refusals():
    assert qrk.fits(6, 1, 128, 32, 1024) and qrk.fits(4, 2, 32, 8, 256) and qrk.fits(6, 1, 128, None, 1024)
    assert not qrk.fits(6, 1, 128, 32, 1000)   # rows that are not whole q/k/v heads
    assert not qrk.fits(6, 1, 8, 8, 64)        # a head narrower than the dot's 16 columns
    assert not qrk.fits(6, 1, 96, 32, 768)     # head_dim not a power of two
    c = case("args", **MINI)
    gen = torch.Generator().manual_seed(0)
    w, scale = _weights(c, gen, "cpu")
    x = torch.randn(2, c["H"]).bfloat16()
    caches = [torch.zeros(21, 2, 32, dtype=torch.bfloat16) for _ in range(2)]
    args = (torch.ones(32, dtype=torch.bfloat16),) * 2 + (1e-6, None, None, torch.arange(2), torch.ones(2, dtype=torch.bool),
                                                        *caches, torch.zeros(21, dtype=torch.long))
    with pytest.raises(ValueError, match="qkv_rope_kv: 5 q and 2 kv heads"):
        qrk.qkv_rope_kv(x, w, scale, c["block"], 5, 2, *args)
    with pytest.raises(ValueError, match="live must be bool"):
        qrk.qkv_rope_kv(x, w, scale, c["block"], 4, 2, *args[:6], torch.ones(2), *args[7:])


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES + CASES, ids=[c["name"] for c in GPU_CASES + CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    print(summary(c, r))
    check(c, r, GPU_TOL)


@pytest.mark.gpu
def test_gpu_control_fails():
    c = dict(CONTROLS[0], **GPU_RANK)
    with pytest.raises(AssertionError, match="q"):
        check(c, run_case(c, "cuda"), GPU_TOL)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES + CONTROLS])
