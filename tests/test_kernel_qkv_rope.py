"""kernels/fp8_linear.fp8_linear_rope (the q/k/v projection with the rotary embedding and the KV write done by each
output tile's last split) against the two launches it replaces: fp8_linear, then rope_kv.

Both paths run the same kernels' arithmetic, so the rotated q, the written K/V slots and slot_pos must be equal bit
for bit: under the interpreter on the CPU (both paths interpreted) and on the GPU (bf16: the roundings between the
rotary products leave nothing for FMA contraction). Every case pre-fills the outputs with NaN and the caches with
random values and checks that only the rows' slots changed. Several padding rows write the trash slot in no defined
order, so there the check is that it holds one padding row's rotated k with that row's v.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import fp8_linear as fl
from iquest.kernels import rope_kv as rk
from iquest.kernels.testing import interpreted_tests
from iquest.reference.fp8 import quantize
from iquest.reference.layers import apply_rope, rope_cos_sin

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BASE = dict(R=8, HQ=6, HKV=1, D=32, K=64, block=(16, 16), block_n=16, split_k=None, locks=True, slots=40, start=10,
            dead=(), dtype="bf16", seed=0, table_rows=None, row_shift=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row", R=1),
    case("8rows_split2", split_k=2),
    case("8rows_padding_split4", split_k=4, dead=(5, 6, 7)),   # a verification block with k = 4 drafts
    case("ring_wrap_split1", start=36, dead=(7,), split_k=1),  # positions 36..43 wrap a 40-slot ring
    case("gqa_2kv", HQ=4, HKV=2, split_k=2),
    case("fp16_split3", dtype="fp16", K=96, split_k=3),
    case("table_ends_in_block", dead=(5, 6, 7), table_rows=15),  # rows 15..17 clamped to 14
    case("rows_shifted", row_shift=1),                           # rope rows other than the positions
    case("20rows_two_row_blocks", R=20, split_k=2, dead=(19,)),  # a prefill block: two BLOCK_M row blocks
]
GPU_CASES = [case(f"gpu_tp8_rank_{r}rows", R=r, D=128, K=6144, block=(128, 128), block_n=fl.BLOCK_N, slots=4160,
                  start=4157, dead=tuple(range(max(1, r - 2), r)) if r > 1 else ())
             for r in (1, 6, 8)] + [
    case("gpu_tp8_rank_16rows_fp16", R=16, D=128, K=6144, block=(128, 128), block_n=fl.BLOCK_N, slots=4160, start=90,
         dtype="fp16"),
    case("gpu_full_layer_no_split", R=6, D=128, K=6144, block=(128, 128), block_n=fl.BLOCK_N, slots=196608,
         start=1000, split_k=1)]


def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    R, HQ, HKV, D, K, S, dt = c["R"], c["HQ"], c["HKV"], c["D"], c["K"], c["slots"], DTYPES[c["dtype"]]
    w, scale = quantize(torch.randn((HQ + 2 * HKV) * D, K, generator=gen) / K ** 0.5, c["block"])
    x = (torch.randn(R, K, generator=gen) * 2).to(dt)
    positions = torch.arange(c["start"], c["start"] + R)
    live = torch.ones(R, dtype=torch.bool)
    live[list(c["dead"])] = False
    T = c["table_rows"] or c["start"] + R + 3
    cos, sin = rope_cos_sin(torch.arange(T), D, 1e6, None, dt)
    rope_rows = positions + c["row_shift"] * (torch.arange(R) > 0)
    cache = [torch.randn(S + 1, HKV, D, generator=gen).to(dt) for _ in range(2)]
    slot_pos = torch.randint(-1, 1000, (S + 1,), generator=gen)
    t = dict(x=x, w=w, scale=scale, positions=positions, live=live, cos=cos, sin=sin, rope_rows=rope_rows,
             cache_k=cache[0], cache_v=cache[1], slot_pos=slot_pos)
    return {k: v.to(device) for k, v in t.items()}


def run_case(c: dict, device: str, broken_rows: bool = False) -> dict:
    t = build(c, device)
    R, HQ, HKV, D, S = c["R"], c["HQ"], c["HKV"], c["D"], c["slots"]
    locks = torch.zeros(4096, dtype=torch.int32, device=device) if c["locks"] else None
    # the two launches
    want_k, want_v, want_sp = t["cache_k"].clone(), t["cache_v"].clone(), t["slot_pos"].clone()
    y = fl.fp8_linear(t["x"], t["w"], t["scale"], c["block"], split_k=c["split_k"], block_n=c["block_n"], locks=locks)
    q, k, v = (y[:, a:b].view(R, -1, D) for a, b in ((0, HQ * D), (HQ * D, (HQ + HKV) * D),
                                                      ((HQ + HKV) * D, (HQ + 2 * HKV) * D)))
    want_q = rk.rope_kv(q, k, v, t["cos"], t["sin"], t["positions"], t["live"], want_k, want_v, want_sp,
                        rope_rows=t["rope_rows"])
    # the one launch
    got_k, got_v, got_sp = t["cache_k"].clone(), t["cache_v"].clone(), t["slot_pos"].clone()
    rows = t["positions"] if broken_rows else t["rope_rows"]  # negative control: rotated by the positions
    got_q = fl.fp8_linear_rope(t["x"], t["w"], t["scale"], c["block"], (HQ, HKV), t["cos"], t["sin"], rows,
                               t["positions"], t["live"], got_k, got_v, got_sp, locks=locks, split_k=c["split_k"],
                               block_n=c["block_n"], out=torch.full((R, HQ, D), float("nan"), dtype=t["x"].dtype,
                                                                    device=device))
    written = torch.zeros(S + 1, dtype=torch.bool)
    written[(t["positions"][t["live"]] % S).cpu()] = True
    written[S] = bool((~t["live"]).any())
    untouched = (~written).to(device)
    dead = (~t["live"]).nonzero().flatten().tolist()
    trash_ok = True
    if dead:  # some padding row's (rotated k, v) pair, as the two launches computed them for that row
        rot_k = apply_rope(k.float(), t["cos"][t["rope_rows"].clamp(max=t["cos"].shape[0] - 1)].float(),
                           t["sin"][t["rope_rows"].clamp(max=t["cos"].shape[0] - 1)].float())
        trash_ok = any(bool(torch.allclose(got_k[S].float(), rot_k[r], rtol=0, atol=0.05)
                            and torch.equal(got_v[S], v[r])) for r in dead)
    return {"q": bool(torch.equal(got_q, want_q)), "k": bool(torch.equal(got_k[:S], want_k[:S])),
            "v": bool(torch.equal(got_v[:S], want_v[:S])), "slot_pos": bool(torch.equal(got_sp, want_sp)),
            "finite": bool(torch.isfinite(got_q).all()), "trash": trash_ok,
            "untouched": bool(torch.equal(got_k[untouched], t["cache_k"][untouched])
                              and torch.equal(got_v[untouched], t["cache_v"][untouched])),
            "split": fl.choose_split_k((HQ + 2 * HKV) * D, c["K"], c["block_n"], fl._block_k(c["block"][1]),
                                       torch.device(device)) if c["split_k"] is None else c["split_k"]}


def _check(c: dict, r: dict) -> None:
    assert r["finite"], "NaN left in the rotated q"
    assert r["untouched"], "a slot outside the rows' slots changed"
    assert r["slot_pos"], "slot_pos differs"
    assert r["v"], "V cache differs"
    assert r["q"] and r["k"], f"{c['name']}: rotated q / k not bit-identical to fp8_linear then rope_kv: {r}"
    assert r["trash"], "the trash slot holds no padding row's k with its v"


interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check)


def test_interpreted_negative_control(interpreted):
    """The check catches a rotation by the wrong table rows (the positions instead of rope_rows), on the case whose
    rows differ from its positions."""
    r = interpreted["negative_control"]
    assert "error" not in r, r.get("error")
    assert r["v"] and r["slot_pos"], "only the rotation is broken"
    with pytest.raises(AssertionError, match="not bit-identical"):
        _check(CASES[7], r)


def engine_blocks(device: str, dtype: str = "bf16") -> dict:
    """The mini model (head_dim 32) through the engine with the projection, rotary and KV write as one launch
    ("qkv_rope") against the same kernels as two: a 20-row prefill block, a verification block with 2 padding rows
    and a draft block; logits, hidden states and every layer's caches and slot labels must be identical, and the
    fused path must have run (counted)."""
    from iquest.fast.parallel import Parallel
    from iquest.fast.rank import EngineOptions, RankEngine
    from iquest.tests.test_fast_engine import MINI

    gen = torch.Generator().manual_seed(7)
    seq = torch.randint(2, 4096, (30,), generator=gen).to(device)
    out = {}
    for kernels in ("linear+rope", "linear+rope+qkv_rope"):
        e = RankEngine(MINI, Parallel.single(device), EngineOptions(max_context=256, dtype=dtype, kernels=kernels))
        e.cache.reset()
        m = e.model
        pos = torch.arange(20, device=device)
        a = m.forward(seq[:20], pos, torch.ones_like(pos, dtype=torch.bool))
        pos = torch.arange(20, 28, device=device)
        live = torch.arange(8, device=device) < 6
        b = m.forward(seq[20:28], pos, live)
        d = m.draft(seq[21:29], b[1], pos + 1, live)
        caches = [(kv.k[:-1].clone(), kv.v[:-1].clone(), kv.slot_pos[:-1].clone()) for kv in e.cache.layers]
        out[kernels] = (a + b + d, caches, m.ops.qkv_rope_calls, dict(m.ops.fallbacks))
    (o0, c0, _, _), (o1, c1, calls, fb) = out["linear+rope"], out["linear+rope+qkv_rope"]
    return {"outputs_identical": all(torch.equal(x, y) for x, y in zip(o0, o1)),
            "caches_identical": all(torch.equal(x, y) for l0, l1 in zip(c0, c1) for x, y in zip(l0, l1)),
            "fused_calls": calls, "fallbacks": fb, "layers": len(c0)}


def _check_engine(r: dict) -> None:
    assert "error" not in r, r.get("error")
    assert not r["fallbacks"], r
    # 2 forwards x 4 layers + the draft layer
    assert r["fused_calls"] == 2 * 4 + 1, r
    assert r["outputs_identical"] and r["caches_identical"], r


def test_interpreted_engine_blocks(interpreted):
    _check_engine(interpreted["engine"])


@pytest.mark.gpu
def test_gpu_engine_blocks():
    _check_engine(engine_blocks("cuda"))


@pytest.mark.gpu
def test_cuda_decode_with_and_without_the_fused_projection():
    """The default kernels decode the mini model (bf16, captured decode loop) with the same tokens, logprobs and
    acceptance sequence with and without "qkv_rope", the fused path counted."""
    from iquest.fast.ops import STAGES
    from iquest.fast.parallel import Parallel
    from iquest.fast.rank import EngineOptions, RankEngine
    from iquest.tests.test_fast_engine import MINI, fast_steps

    out = {}
    for kernels in ("triton", "+".join(s for s in STAGES if s != "qkv_rope")):
        e = RankEngine(MINI, Parallel.single("cuda"), EngineOptions(max_context=512, dtype="bf16", kernels=kernels))
        out[kernels] = ([[(s.tokens, s.logprobs, s.drafts, s.accepted) for s in
                          fast_steps(e, [5 + i, 17, 300 + i, 41], 60 + i, drafts, n=40)]
                         for i, drafts in enumerate((3, 5, 7))], e.model.ops.qkv_rope_calls)
    (on, calls), (off, none) = out.values()
    assert calls > 0 and none == 0
    assert on == off


@pytest.mark.parametrize("over, message", [
    (dict(dtype=torch.float32), "bf16/fp16 x"),
    (dict(rows=7), "w has"),
    (dict(locks=None, split_k=2), "needs locks"),
])
def test_rejects_bad_inputs(over, message):
    c = case("bad")
    t = build(c, "cpu")
    x = t["x"].to(over.get("dtype", t["x"].dtype))
    w, scale = t["w"], t["scale"]
    if "rows" in over:
        w = w[:-over["rows"]].contiguous()
        scale = scale[: -(-w.shape[0] // 16)].contiguous()
    locks = over.get("locks", torch.zeros(64, dtype=torch.int32))
    with pytest.raises(ValueError, match=message):
        fl.fp8_linear_rope(x, w, scale, c["block"], (6, 1), t["cos"], t["sin"], t["rope_rows"], t["positions"],
                           t["live"], t["cache_k"], t["cache_v"], t["slot_pos"], locks=locks,
                           split_k=over.get("split_k"), block_n=16)


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


@pytest.mark.gpu
def test_gpu_negative_control():
    r = run_case(CASES[7], "cuda", broken_rows=True)
    with pytest.raises(AssertionError, match="not bit-identical"):
        _check(CASES[7], r)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [("negative_control", lambda: run_case(CASES[7], "cpu", broken_rows=True)),
                   ("engine", lambda: engine_blocks("cpu"))])
