"""kernels/decode_attention.py against its own reference (`attention_ref`: one sink logit per head, the retired
architecture's form; the kernel is not on the product path until re-based to docs/model.md) with the cache's
visibility rule.

Small shapes run under Triton's CPU interpreter in one worker subprocess (TRITON_INTERPRET is read when
triton is imported); `@pytest.mark.gpu` cases run the compiled kernel at TP8 rank shapes (6 query
heads x 1 KV head, D = 128, W = 4096 ring + 64 slack, 192K full capacity).

The interpreter runs every case against the reference, but the forms that must give the same bits (the preloaded
sinks, kv_len from the positions) only where `also` names them: each is another full run.

Every case builds a cache the way fast/cache.py fills it (ring slot = pos % slots for sliding layers,
slot = pos for full ones, a trash slot last), writes a few rejected-draft positions past the last
query, poisons the output and the split workspace with NaN, and for full layers with `kv_len` fills
the slots past it with NaN K/V whose slot_pos would be visible: a kernel that read them shows NaN.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import decode_attention as da
from iquest.kernels.testing import interpreted_tests

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 2e-5, "bf16": 2e-2, "bf16_gpu": 3e-2, "fp32_gpu": 1e-4}

BASE = dict(R=8, Hq=6, Hkv=1, D=32, dtype="fp32", kv_dtype=None, kind="full", W=20, slack=16, capacity=200,
            last=77, first=0, sinks=True, kv_len="max", num_splits=4, block_n=16, min_split=16, causal=True,
            pad_row=None, seed=0, combine=None)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


# Each case runs the kernel against the reference; `also` names the forms that must give its bits beside it (the
# sinks preloaded with the sink control, kv_len from the positions). The interpreter runs them where named, the GPU
# in every case. `combine`: the combine's keywords (its splits a step, columns a program, warps).
FORMS = ("preload", "from_q")
CASES = [
    case("full_1row_fp32", R=1),
    case("full_8rows_fp32", also=FORMS),
    case("full_8rows_bf16_2kvheads", Hq=12, Hkv=2, D=16, dtype="bf16"),
    case("full_1row_bf16", R=1, dtype="bf16"),
    case("full_no_kv_len_reads_capacity_and_trash", capacity=60, last=50, kv_len=None, num_splits=3),
    case("full_no_sinks", sinks=False),
    case("full_one_split", num_splits=1),
    case("full_mostly_dead_splits", last=39, num_splits=16),
    case("full_q_fp32_kv_bf16", Hq=4, Hkv=2, kv_dtype="bf16"),
    case("full_padding_row_sees_only_sink", pad_row=3),
    case("full_causal_open_control", causal=False, capacity=82, kv_len=None),
    case("full_default_splits_and_tiles", capacity=300, last=290, num_splits=None, block_n=64, min_split=None),
    case("sliding_ring_wrap_8rows_fp32", kind="sliding", last=100, kv_len=None, num_splits=3),
    case("sliding_ring_wrap_1row_fp32", kind="sliding", R=1, last=101, kv_len=None, num_splits=2),
    case("sliding_ring_wrap_8rows_bf16", kind="sliding", dtype="bf16", last=163, kv_len=None, num_splits=3),
    case("sliding_before_wrap_kv_len", kind="sliding", last=9, num_splits=3),
    case("sliding_window_edge_exact", kind="sliding", W=29, slack=16, last=60, kv_len="max", num_splits=2,
         also=("from_q",)),
    case("mtp_first_position_1", kind="sliding", R=6, last=5, first=1),
    # the combine's steps: 20 live splits in one step of 32, 40 in three steps of 16 (the last one partly live), over
    # column blocks of 16 of 32 and of the whole head
    case("full_20_live_splits_one_step", capacity=400, last=319, num_splits=24,
         combine=dict(combine_splits=32, combine_cols=16, combine_warps=2)),
    case("full_40_live_splits_three_steps", capacity=700, last=639, num_splits=48, dtype="bf16",
         combine=dict(combine_splits=16, combine_cols=32, combine_warps=1)),
]


GPU_CASES = [
    case("gpu_sliding_ring_1row", R=1, D=128, dtype="bf16", kind="sliding", W=4096, slack=64, last=10_000,
         kv_len=None, num_splits=None, block_n=64, min_split=None),
    case("gpu_sliding_ring_8rows", D=128, dtype="bf16", kind="sliding", W=4096, slack=64, last=9_001,
         kv_len="max", num_splits=None, block_n=64, min_split=None),
    case("gpu_mtp_8rows", D=128, dtype="bf16", kind="sliding", W=4096, slack=64, last=5_000, first=1,
         num_splits=None, block_n=64, min_split=None),
    case("gpu_full_192k_capacity_short", D=128, dtype="bf16", capacity=196_608, last=5_003, num_splits=None,
         block_n=64, min_split=None),
    case("gpu_full_192k_capacity_long", R=1, D=128, dtype="bf16", capacity=196_608, last=150_000,
         num_splits=None, block_n=64, min_split=None),
    case("gpu_full_8rows_fp32", D=128, dtype="fp32", capacity=40_000, last=33_000, num_splits=None, block_n=64,
         min_split=None),
    case("gpu_full_q_fp32_kv_bf16", D=128, dtype="fp32", kv_dtype="bf16", capacity=40_000, last=20_000,
         num_splits=None, block_n=64, min_split=None),
    # 1K context as the full-size step runs it: 16 and 17 live splits of 64 slots (one and two combine chunks)
    *[case(f"gpu_full_1k_{n}_live_splits", R=6, D=128, dtype="bf16", capacity=196_608, last=64 * n - 1 + extra,
           num_splits=None, block_n=64, min_split=None) for n, extra in ((16, 0), (17, -58))],
]


def build(c: dict, device: str) -> dict:
    """Cache and queries for one case, plus clean copies for the reference (NaN poison zeroed)."""
    gen = torch.Generator().manual_seed(c["seed"])
    dtype, kv_dtype = DTYPES[c["dtype"]], DTYPES[c["kv_dtype"] or c["dtype"]]
    slots = c["W"] + c["slack"] if c["kind"] == "sliding" else c["capacity"]
    S, R, last = slots + 1, c["R"], c["last"]
    k = torch.randn(S, c["Hkv"], c["D"], generator=gen).to(kv_dtype)
    v = torch.randn(S, c["Hkv"], c["D"], generator=gen).to(kv_dtype)
    q = (torch.randn(R, c["Hq"], c["D"], generator=gen) * 0.6).to(dtype)
    # Positions 0..last+3 written in order (history, the block's own rows, 3 rejected-draft positions):
    # a ring slot keeps the latest position that maps to it.
    top, slot = last + 3, torch.arange(slots)
    held = top - (top - slot) % slots if c["kind"] == "sliding" else slot
    slot_pos = torch.cat([torch.where((held >= 0) & (held <= top), held, -1), torch.tensor([-1])])
    q_pos = torch.arange(last - R + 1, last + 1, dtype=torch.int64)
    if c["pad_row"] is not None:
        q_pos[c["pad_row"]] = -1
    kv_len = torch.tensor([last + 1]) if c["kv_len"] == "max" else None
    k_ref, v_ref = k.clone(), v.clone()
    if kv_len is not None and c["kind"] == "full":
        k[last + 1: S - 1] = float("nan")
        v[last + 1: S - 1] = float("nan")
        slot_pos[last + 1: S - 1] = torch.arange(S - 2 - last) % (last + 1)  # would be visible if read
    if c["kind"] == "sliding":
        edge = int(q_pos[0]) - c["W"]
        assert edge < 0 or edge in slot_pos.tolist(), "the ring should hold the first position outside the window"
    sinks = torch.randn(c["Hq"], generator=gen) if c["sinks"] else None
    t = dict(q=q, k=k, v=v, slot_pos=slot_pos, q_pos=q_pos, sinks=sinks, kv_len=kv_len, k_ref=k_ref, v_ref=v_ref)
    return {n: (x.to(device) if x is not None else None) for n, x in t.items()}


def run_case(c: dict, device: str) -> dict:
    t = build(c, device)
    forms = FORMS if device != "cpu" else c.get("also", ())
    window = c["W"] if c["kind"] == "sliding" else None
    out = torch.full_like(t["q"], float("nan"))
    kw = dict(causal=c["causal"], block_n=c["block_n"], **(c["combine"] or {}))
    if c["min_split"] is not None:
        kw["min_split"] = c["min_split"]
    splits = c["num_splits"] or da.default_num_splits(t["k"].shape[0], c["Hkv"], t["q"].device,
                                                      c["min_split"] or 4 * c["block_n"])
    ws = tuple(x.fill_(float("nan")) for x in da.decode_attention_workspace(
        c["R"], c["Hq"], c["Hkv"], c["D"], splits, t["q"].device))
    got = da.decode_attention(t["q"], t["k"], t["v"], t["slot_pos"], t["q_pos"], t["sinks"], window, c["first"],
                              t["kv_len"], num_splits=splits, out=out, workspace=ws, **kw)
    assert got is out
    r = {}
    if "preload" in forms:  # the sinks read before the combine's PDL wait (with the wait on the GPU): the same bits
        ws4 = tuple(x.clone().fill_(float("nan")) for x in ws)
        pre = da.decode_attention(t["q"], t["k"], t["v"], t["slot_pos"], t["q_pos"], t["sinks"], window, c["first"],
                                  t["kv_len"], num_splits=splits, out=torch.full_like(out, float("nan")),
                                  workspace=ws4, preload=True, pdl=t["q"].is_cuda, **kw)
        r["preload_same"] = bool(torch.equal(got, pre))
    control_same = None  # negative control of that check: the last head's sink changed must change the output
    if t["sinks"] is not None and "preload" in forms:
        sinks = t["sinks"].clone()
        sinks[-1] += 1.0
        bad = da.decode_attention(t["q"], t["k"], t["v"], t["slot_pos"], t["q_pos"], sinks, window, c["first"],
                                  t["kv_len"], num_splits=splits, out=torch.full_like(out, float("nan")),
                                  workspace=tuple(x.clone().fill_(float("nan")) for x in ws), preload=True,
                                  pdl=t["q"].is_cuda, **kw)
        control_same = bool(torch.equal(got, bad))
    from_q_same = None  # kv_len taken by the kernels from the rows' positions: the same bound, so the same bits
    if "from_q" in forms and t["kv_len"] is not None and int(t["q_pos"].max()) + 1 == int(t["kv_len"]):
        ws3 = tuple(x.clone().fill_(float("nan")) for x in ws)
        from_q = da.decode_attention(t["q"], t["k"], t["v"], t["slot_pos"], t["q_pos"], t["sinks"], window,
                                     c["first"], num_splits=splits, out=torch.full_like(out, float("nan")),
                                     workspace=ws3, kv_len_from_q=True, **kw)
        from_q_same = bool(torch.equal(got, from_q))
    early_same = None  # on the GPU, the splits' first K/V slots requested into L2 before the wait (a hint): the same bits
    if t["q"].is_cuda and (from_q_same is not None or t["kv_len"] is None):
        kv = dict(kv_len_from_q=True) if from_q_same is not None else dict(kv_len=None)
        early = da.decode_attention(t["q"], t["k"], t["v"], t["slot_pos"], t["q_pos"], t["sinks"], window, c["first"],
                                    num_splits=splits, out=torch.full_like(out, float("nan")),
                                    workspace=tuple(x.clone().fill_(float("nan")) for x in ws), early=True, pdl=True,
                                    **kv, **kw)
        early_same = bool(torch.equal(got, early))
    kv_len = int(t["kv_len"]) if t["kv_len"] is not None else t["k"].shape[0]
    min_split = c["min_split"] or c["block_n"]
    per = max(-(-(-(-kv_len // splits)) // c["block_n"]) * c["block_n"], min_split)  # the kernels' _split_len
    ref = da.decode_attention_ref(t["q"], t["k_ref"], t["v_ref"], t["slot_pos"], t["q_pos"], t["sinks"], window,
                                  c["first"], t["kv_len"], causal=c["causal"])
    err = (got.float() - ref.float()).abs().max().item()
    return {**r, "err": err, "finite": bool(torch.isfinite(got).all()), "ref_finite": bool(torch.isfinite(ref).all()),
            "ref_scale": ref.float().abs().max().item(), "from_q_same": from_q_same, "control_same": control_same,
            "early_same": early_same, "live_splits": -(-kv_len // per)}


def _check(c: dict, r: dict, tol: float) -> None:
    assert r["ref_finite"], "reference produced non-finite values: the case is ill-posed"
    assert r["finite"], "kernel left NaN in the output (unwritten element or a read past kv_len)"
    assert r["from_q_same"] in (None, True), "kv_len from the rows' positions differs from the kv_len tensor"
    assert r["err"] <= tol, (f"{c['name']}: max |kernel - ref| = {r['err']:.3e} > {tol:.1e} "
                             f"(|ref| <= {r['ref_scale']:.2f})")
    assert r.get("preload_same", True), "the sinks read before the wait changed the output"
    assert r["early_same"] in (None, True), "the K/V prefetch before the wait changed the output"
    if "preload_same" in r:
        assert r["control_same"] is (None if not c["sinks"] else False), "a changed sink gave the same output"
    for n in (16, 17, 20, 40):  # the cases meant to take each form of the combine do
        if f"_{n}_live_splits" in c["name"]:
            assert r["live_splits"] == n, r


# ---- interpreter tests ---------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(__file__, CASES, lambda c, r: _check(c, r, TOL[c["dtype"]]),
                                                  lambda c, r: f"{c['name']}: max err {r['err']:.2e}")


def test_visible_ref_is_the_cache_rule():
    """visible_ref is LayerKV.visible, for the cache and for the open mask (the class attribute `causal` False, as
    qualify's open_causal_mask control sets it); its first visible position is the cache's rule with the slots below
    it emptied."""
    from iquest.fast.cache import LayerKV

    class OpenKV(LayerKV):
        causal = False

    gen = torch.Generator().manual_seed(1)
    slot_pos = torch.randint(-1, 50, (41,), generator=gen)
    q_pos = torch.tensor([-1, 0, 3, 20, 45, 49])
    for window in (None, 7):
        for first in (0, 1):
            for kind in (LayerKV, OpenKV):
                held = torch.where(slot_pos >= first, slot_pos, torch.full_like(slot_pos, -1))
                kv = kind(k=torch.empty(0), v=torch.empty(0), slot_pos=held, slots=40, window=window)
                assert torch.equal(kv.visible(q_pos), da.visible_ref(slot_pos, q_pos, window, first,
                                                                     causal=kind.causal))


def _args(**over):
    a = dict(q=torch.randn(2, 6, 16), k=torch.randn(9, 1, 16), v=torch.randn(9, 1, 16),
             slot_pos=torch.arange(9), q_pos=torch.tensor([7, 8]), sinks=torch.randn(6), window=None)
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(q=torch.randn(2, 6, 24)), "head_dim"),
    (dict(k=torch.randn(9, 4, 16), v=torch.randn(9, 4, 16)), "multiple of kv heads"),
    (dict(v=torch.randn(9, 1, 16).to(torch.bfloat16)), "k and v dtypes"),
    (dict(q=torch.randn(2, 6, 16).to(torch.int32)), "bf16, fp16 or fp32"),
    (dict(slot_pos=torch.arange(9, dtype=torch.int32)), "slot_pos"),
    (dict(q_pos=torch.tensor([7])), "q_pos"),
    (dict(sinks=torch.randn(6).double()), "sinks"),
    (dict(k=torch.randn(9, 2, 16)[:, :1]), "contiguous"),
    (dict(window=0), "window"),
    (dict(q=torch.randn(30, 6, 16), q_pos=torch.arange(30)), "rows x heads"),
    (dict(kv_len=5), "kv_len"),
    (dict(kv_len=torch.tensor([5.0])), "kv_len"),
])
def test_rejects_bad_inputs(over, message):
    with pytest.raises(ValueError, match=message):
        da.decode_attention(**_args(**over))


# ---- GPU tests (real shapes) -------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    _check(c, r, TOL[c["dtype"] + "_gpu"])
    print(f"{c['name']}: max err {r['err']:.2e}")


@pytest.mark.gpu
def test_gpu_capacity_adds_no_reads():
    """A 192K-capacity full layer holding 4K positions costs about what a 4K-capacity one does."""
    from triton.testing import do_bench

    times = {}
    for capacity in (4_200, 196_608):
        c = case("t", D=128, dtype="bf16", capacity=capacity, last=4_095, num_splits=None, block_n=64, min_split=None)
        t = build(c, "cuda")
        times[capacity] = do_bench(lambda: da.decode_attention(t["q"], t["k"], t["v"], t["slot_pos"], t["q_pos"],
                                                               t["sinks"], None, 0, t["kv_len"]), warmup=20, rep=200)
    print({k: f"{v * 1e3:.1f} us" for k, v in times.items()})
    assert times[196_608] < 1.5 * times[4_200] + 0.005, times


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES])
