"""kernels/rope_kv.py against the torch sequence it replaces (apply_rope_ref twice, LayerKV.write): its own references,
the kernel being off the product path until re-based to docs/model.md (kernels/rope_kv.py).

Interpreted on CPU in one worker subprocess: fp32 must be bit-identical (the interpreter evaluates each
operation in NumPy, like torch's separate kernels); bf16 may differ by one unit in the last place because
the interpreter truncates fp32 -> bf16 where the GPU and torch round to nearest even. On the GPU both
dtypes must be bit-identical (the kernel is compiled without FMA contraction). Every case pre-fills the
rotated-q output with NaN and the caches with random values, and checks that only the rows' slots (and
the trash slot for padding rows) changed. The interpreter runs every case (~4 s): its cases are the boundary shapes
(ring wrap, table ends, split partials) whose roundings it checks bit for bit.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import rope_kv as rk
from iquest.kernels.testing import interpreted_tests

apply_rope = rk.apply_rope_ref  # the kernel's own references (not on the product path: kernels/rope_kv.py)


def rope_cos_sin(positions, head_dim, theta, scaling, dtype):
    assert scaling is None
    return rk.rope_tables_ref(positions, head_dim, theta, dtype)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Interpreted bf16: each of the three roundings (two products, one sum) may truncate where torch rounds, one
# unit in the last place each (2^-7 relative to the operand at most), so 3 ulps of the tensor's largest value.
INTERPRETED_BF16_TOL = 3 * 2.0 ** -7

BASE = dict(R=8, HQ=6, HKV=1, D=128, slots=96, start=40, dead=(), dtype="fp32", fused=False, seed=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_fp32", R=1),
    case("8rows_fp32"),
    case("8rows_padding_fp32", dead=(5, 6, 7)),                 # a verification block with k = 4 drafts
    case("ring_wrap_fp32", start=92, dead=(7,)),                # positions 92..99 wrap a 96-slot ring
    case("gqa_2kv_d16_fp32", HQ=4, HKV=2, D=16, slots=20, start=17),
    case("8rows_bf16", dtype="bf16", dead=(6, 7)),
    case("ring_wrap_bf16", dtype="bf16", start=92),
    case("qkv_column_views_fp32", dead=(7,), fused=True),       # q, k, v as column views of one projection
    case("qkv_column_views_gqa_fp32", HQ=4, HKV=2, D=16, slots=20, start=17, fused=True),
    case("rows_shifted_fp32", row_shift=1),                     # rope rows other than the positions (a defect)
    case("table_ends_in_block_bf16", dtype="bf16", dead=(5, 6, 7), table_rows=45),  # rows 45..47 clamped to 44
]
GPU_CASES = [case("gpu_tp8_rank_bf16", dtype="bf16", slots=4160, start=4157, dead=(6, 7)),
             case("gpu_tp8_rank_qkv_views_bf16", dtype="bf16", slots=4160, start=4157, dead=(7,), fused=True),
             case("gpu_full_layer_fp32", slots=196608, start=196600)]


def run_case(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, HQ, HKV, D, S, dt = c["R"], c["HQ"], c["HKV"], c["D"], c["slots"], DTYPES[c["dtype"]]
    q, k, v = ((torch.randn(R, h, D, generator=gen) * 2).to(dt).to(device) for h in (HQ, HKV, HKV))
    if c["fused"]:  # one [R, (HQ + 2 HKV) D] product, as TritonOps.qkv returns it: row stride != heads * D
        y = torch.cat([t.reshape(R, -1) for t in (q, k, v)], dim=1)
        q, k, v = (y[:, a:b].view(R, -1, D) for a, b in ((0, HQ * D), (HQ * D, (HQ + HKV) * D),
                                                          ((HQ + HKV) * D, (HQ + 2 * HKV) * D)))
        assert not q.is_contiguous() and not v.is_contiguous()
    positions = torch.arange(c["start"], c["start"] + R, device=device)
    live = torch.ones(R, dtype=torch.bool)
    live[list(c["dead"])] = False
    live = live.to(device)
    # The model's rotary tables (fast/model.rope_tables): rows 0..T-1; a case may end them inside the block (its
    # last rows are clamped to the last entry, as padding rows past the tables are) or rotate rows by other rows.
    T = c.get("table_rows") or c["start"] + R + 3
    table_cos, table_sin = (t.to(device) for t in rope_cos_sin(torch.arange(T), D, 1e6, None, dt))
    rope_rows = positions + c.get("row_shift", 0) * (torch.arange(R, device=device) > 0)
    rows = rope_rows.clamp(max=T - 1)
    cos, sin = table_cos[rows], table_sin[rows]
    # The gathered entries are bit for bit what the per-block computation gives for those rows
    block_cos, block_sin = rope_cos_sin(rows.cpu(), D, 1e6, None, dt)
    table_equal = bool(torch.equal(cos.cpu(), block_cos) and torch.equal(sin.cpu(), block_sin))
    cache = [(torch.randn(S + 1, HKV, D, generator=gen)).to(dt).to(device) for _ in range(2)]
    slot_pos = torch.randint(-1, 1000, (S + 1,), generator=gen).to(device)
    before = [t.clone() for t in cache]
    want_k, want_v, want_sp = cache[0].clone(), cache[1].clone(), slot_pos.clone()
    want_q = rk.rope_kv_ref(q, k, v, table_cos, table_sin, positions, live, want_k, want_v, want_sp, rope_rows)
    early = dict(early=True, pdl=True) if c.get("early") else {}  # the factors read before the PDL wait (GPU)
    got_q = rk.rope_kv(q, k, v, table_cos, table_sin, positions, live, cache[0], cache[1], slot_pos,
                       rope_rows=None if "row_shift" not in c else rope_rows, out=torch.full_like(q, float("nan")),
                       **early)

    def rel(a, b):  # relative to the largest value: rotation sums cancel, so per-element ratios mean nothing
        a, b = a.float().cpu(), b.float().cpu()
        return float((a - b).abs().max() / b.abs().max())

    written = torch.zeros(S + 1, dtype=torch.bool)
    written[(positions[live] % S).cpu()] = True
    written[S] = bool((~live).any())  # padding rows write the trash slot
    untouched = (~written).to(device)
    # Several padding rows all write the trash slot, in no defined order (it is never read: its slot_pos is -1),
    # and a row's k and v are separate stores, so one padding row's k may land beside another's v. So the live
    # slots are compared exactly, and the trash slot must hold, per KV head, some padding row's rotated k and
    # some padding row's v.
    trash_err = 0.0
    dead = (~live).nonzero().flatten().tolist()
    if dead:
        rot_k = apply_rope(k, cos, sin)
        for h in range(HKV):
            trash_err = max(trash_err, min(rel(cache[0][S, h], rot_k[r, h]) for r in dead),
                            min(rel(cache[1][S, h], v[r, h]) for r in dead))
    return {"q_rel": rel(got_q, want_q), "q_bits": bool(torch.equal(got_q, want_q)),
            "k_rel": rel(cache[0][:S], want_k[:S]), "k_bits": bool(torch.equal(cache[0][:S], want_k[:S])),
            "v_bits": bool(torch.equal(cache[1][:S], want_v[:S])), "slot_pos": bool(torch.equal(slot_pos, want_sp)),
            "trash_err": trash_err, "table_equal": table_equal,
            "rotated_as_block": bool(torch.equal(want_q, apply_rope(q, cos, sin))),
            "finite": bool(torch.isfinite(got_q).all()),
            "others_untouched": all(bool(torch.equal(t[untouched], b[untouched])) for t, b in zip(cache, before))}


def _check(c: dict, r: dict, interpreted: bool) -> None:
    assert r["finite"], "NaN left in the rotated q"
    assert r["slot_pos"], "slot_pos differs: live rows must record their positions, padding rows -1 in the trash slot"
    assert r["v_bits"], "V cache differs: v is copied, so it must be bit-identical"
    assert r["others_untouched"], "a slot outside the rows' slots changed"
    assert r["table_equal"], "the tables' rows differ from rope_cos_sin at those positions"
    assert r["rotated_as_block"], "the reference did not rotate by the rows' table entries"
    if interpreted and c["dtype"] == "bf16":
        assert r["q_rel"] <= INTERPRETED_BF16_TOL and r["k_rel"] <= INTERPRETED_BF16_TOL, (r["q_rel"], r["k_rel"])
        assert r["trash_err"] <= INTERPRETED_BF16_TOL, f"trash slot holds no padding row's k/v ({r['trash_err']:.1e})"
    else:
        assert r["q_bits"] and r["k_bits"], f"{c['name']}: not bit-identical (q rel {r['q_rel']:.1e}, k rel {r['k_rel']:.1e})"
        assert r["trash_err"] == 0.0, f"trash slot holds no padding row's k/v ({r['trash_err']:.1e})"


interpreted, test_interpreted = interpreted_tests(__file__, CASES, lambda c, r: _check(c, r, interpreted=True))


def test_interpreted_negative_control(interpreted):
    """A kernel that forgets the rotation's sign must fail the same comparison (the checks can fail)."""
    r = interpreted["negative_control"]
    assert "error" not in r, r.get("error")
    assert not r["q_bits"] and r["q_rel"] > 0.1


def test_interpreted_negative_control_rows(interpreted):
    """A kernel that rotates by the positions instead of the given table rows fails on rows that differ: the
    rows after the first (shifted) are wrong, with nothing else changed."""
    r = interpreted["negative_control_rows"]
    assert "error" not in r, r.get("error")
    assert not r["q_bits"] and not r["k_bits"] and r["v_bits"] and r["slot_pos"]


@pytest.mark.parametrize("over, message", [
    (dict(k=torch.randn(3, 2, 8)), "must be"),
    (dict(cos=torch.randn(2, 8, dtype=torch.float64)), "cos and sin"),
    (dict(positions=torch.arange(2, dtype=torch.int32)), "positions"),
    (dict(cos=torch.randn(5, 4), sin=torch.randn(5, 4)), "cos and sin"),
    (dict(rope_rows=torch.arange(3)), "rope_rows"),
    (dict(live=torch.ones(2, dtype=torch.int64)), "live"),
    (dict(q=torch.randn(2, 4, 6), k=torch.randn(2, 1, 6), v=torch.randn(2, 1, 6)), "power of two"),
    (dict(cache_v=torch.randn(9, 1, 8)), "caches"),
])
def test_rejects_bad_inputs(over, message):
    a = dict(q=torch.randn(2, 4, 8), k=torch.randn(2, 1, 8), v=torch.randn(2, 1, 8), cos=torch.randn(5, 8),
             sin=torch.randn(5, 8), positions=torch.arange(2), live=torch.ones(2, dtype=torch.bool),
             cache_k=torch.randn(17, 1, 8), cache_v=torch.randn(17, 1, 8), slot_pos=torch.zeros(17, dtype=torch.int64))
    a.update(over)
    with pytest.raises(ValueError, match=message):
        rk.rope_kv(**a)


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"), interpreted=False)


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=[c["name"] for c in GPU_CASES])
def test_gpu_early(c):
    """With PDL and the rotary factors read before the wait (`early`): still torch's bits."""
    _check(c, run_case(dict(c, early=True), "cuda"), interpreted=False)


# rope_kv_parts: the q/k/v projection's split-K partials summed inside the rotary kernel. Held bit for bit to
# fp8_linear (its in-launch sum) followed by rope_kv, over the same inputs and caches; `drop` is the negative control
# (the last split left out of the sum).
PARTS_CASES = [
    dict(name="parts_split3_fp32", R=8, HQ=6, HKV=1, D=32, K=192, splits=3, dtype="fp32", dead=(7,), start=40),
    dict(name="parts_split3_bf16", R=6, HQ=4, HKV=2, D=16, K=256, splits=3, dtype="bf16", dead=(), start=17),
    dict(name="parts_one_split_bf16", R=1, HQ=2, HKV=1, D=16, K=64, splits=1, dtype="bf16", dead=(), start=5),
    dict(name="parts_ring_wrap_fp32", R=8, HQ=4, HKV=1, D=16, K=128, splits=4, dtype="fp32", dead=(6, 7), start=92),
]
PARTS_GPU_CASES = [dict(name="gpu_parts_tp8_rank_bf16", R=8, HQ=6, HKV=1, D=128, K=6144, splits=8, dtype="bf16",
                        dead=(6, 7), start=4157)]
SLOTS = 96


def run_parts_case(c: dict, device: str, drop: bool = False) -> dict:
    from iquest.kernels import fp8_linear as fl
    from iquest.reference.fp8 import quantize

    gen = torch.Generator().manual_seed(1)
    R, HQ, HKV, D, K, dt = c["R"], c["HQ"], c["HKV"], c["D"], c["K"], DTYPES[c["dtype"]]
    N, S = (HQ + 2 * HKV) * D, (4160 if D == 128 else SLOTS)
    block = (16, 32) if D < 128 else (128, 128)
    w, scale = (t.to(device) for t in quantize(torch.randn(N, K, generator=gen) * 0.05, block))
    x = torch.randn(R, K, generator=gen).to(dt).to(device)
    positions = torch.arange(c["start"], c["start"] + R, device=device)
    live = torch.ones(R, dtype=torch.bool)
    live[list(c["dead"])] = False
    live = live.to(device)
    cos, sin = (t.to(device) for t in rope_cos_sin(torch.arange(c["start"] + R + 3), D, 1e6, None, dt))
    caches = [(torch.randn(S + 1, HKV, D, generator=gen)).to(dt).to(device) for _ in range(2)]
    slot_pos = torch.randint(-1, 1000, (S + 1,), generator=gen).to(device)
    mine = [t.clone() for t in caches] + [slot_pos.clone()]
    locks = torch.zeros(4096, dtype=torch.int32, device=device)
    y = fl.fp8_linear(x, w, scale, block, split_k=c["splits"], locks=locks)
    q, k, v = (y[:, a:b].view(R, -1, D) for a, b in ((0, HQ * D), (HQ * D, (HQ + HKV) * D), ((HQ + HKV) * D, N)))
    want = rk.rope_kv(q, k, v, cos, sin, positions, live, caches[0], caches[1], slot_pos)
    parts = fl.fp8_linear(x, w, scale, block, split_k=c["splits"], unsummed=True)
    if drop:
        parts = parts[:-1].contiguous()
    got = rk.rope_kv_parts(parts, HQ, HKV, cos, sin, positions, live, mine[0], mine[1], mine[2], dtype=dt,
                           out=torch.full((R, HQ, D), float("nan"), dtype=dt, device=device))
    # The caches' last slot is the trash slot every padding row writes (and slot_pos marks -1): with two padding
    # rows, which one's values land there is up to the GPU's program order, in either form, and nothing reads it.
    return {"splits": parts.shape[0], "q_bits": bool(torch.equal(got, want)),
            "k_bits": bool(torch.equal(mine[0][:S], caches[0][:S])),
            "v_bits": bool(torch.equal(mine[1][:S], caches[1][:S])),
            "slot_pos": bool(torch.equal(mine[2], slot_pos)), "finite": bool(torch.isfinite(got).all())}


def _check_parts(c: dict, r: dict) -> None:
    assert "error" not in r, r.get("error")
    assert r["splits"] == c["splits"], r
    assert r["finite"] and r["q_bits"] and r["k_bits"] and r["v_bits"] and r["slot_pos"], r


@pytest.mark.parametrize("c", PARTS_CASES, ids=[c["name"] for c in PARTS_CASES])
def test_interpreted_parts_bit_identical(interpreted, c):
    _check_parts(c, interpreted[c["name"]])


def test_interpreted_parts_negative_control(interpreted):
    """A sum missing its last split must fail the same comparison, with the slot bookkeeping unchanged."""
    r = interpreted["parts_negative_control"]
    assert "error" not in r, r.get("error")
    assert not r["q_bits"] and not r["k_bits"] and not r["v_bits"] and r["slot_pos"], r


@pytest.mark.gpu
@pytest.mark.parametrize("c", PARTS_CASES + PARTS_GPU_CASES, ids=[c["name"] for c in PARTS_CASES + PARTS_GPU_CASES])
def test_gpu_parts_bit_identical(c):
    _check_parts(c, run_parts_case(c, "cuda"))


def _negative_control() -> dict:
    """rope_kv with the rotate_half sign flipped (sin negated), run through the same case."""
    c = case("negative_control")
    original = rk.rope_kv

    def broken(q, k, v, cos, sin, *args, **kw):
        return original(q, k, v, cos, -sin, *args, **kw)

    rk.rope_kv = broken
    try:
        return run_case(c, "cpu")
    finally:
        rk.rope_kv = original


def _negative_control_rows() -> dict:
    """rope_kv told to rotate by the positions instead of the given table rows, on the shifted-rows case."""
    c = next(c for c in CASES if c["name"] == "rows_shifted_fp32")
    original = rk.rope_kv

    def broken(*args, rope_rows=None, **kw):
        return original(*args, **kw)

    rk.rope_kv = broken
    try:
        return run_case(c, "cpu")
    finally:
        rk.rope_kv = original


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [(c["name"], lambda c=c: run_parts_case(c, "cpu")) for c in PARTS_CASES]
                + [("negative_control", _negative_control), ("negative_control_rows", _negative_control_rows),
                   ("parts_negative_control", lambda: run_parts_case(PARTS_CASES[0], "cpu", drop=True))])
