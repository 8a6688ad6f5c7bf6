"""kernels/decode_attention.py against the published attention (`reference.layers.attention`, fp32 math on the same
inputs, over the cache's own mask `fast.cache.LayerKV.visible`): the zero-value sink key, GQA, full layers, sliding
rings and the draft's 512-key window.

Small shapes run under Triton's CPU interpreter in one worker subprocess (TRITON_INTERPRET is read when triton is
imported); `@pytest.mark.gpu` cases run the compiled kernel at TP8 rank shapes (6 query heads x 1 KV head, D = 128,
8 rows; full layers of 4K and 64K slots, the 4,160-slot sliding ring, the draft's 576-slot ring).

Every case fills a `LayerKV` the way the engine does (`LayerKV.write`, in order: the history, the block's own rows,
then 3 rejected-draft positions past the last row, padding rows into the trash slot), poisons the output and the split
workspace with NaN, and puts NaN K/V in the slots at or past kv_len (max position + 1) that the kernels must not read: a
kernel that read one shows NaN (its zero weight times NaN). The trash slot holds large finite K/V, which a broken mask
would show.

Tolerances (`TOL`) are data with a reason. The output is a weighted mean of V rows, so rounding in the kernel's sums
scales with `mass` = sum_j p_j |v_j| (the same attention over |V|), not with |out|, which cancellation can make small;
a bf16 output adds one bf16 ulp (both sides round an fp32 value once, and fp32 values a few bits apart can round to
neighbouring bf16 values).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import triton
import triton.language as tl

from iquest.fast.cache import LayerKV
from iquest.kernels import decode_attention as da
from iquest.kernels.testing import interpreted_tests, substituted
from iquest.reference.layers import attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {
    # (bound on |kernel - ref| in units of mass, in units of |ref|, why)
    "fp32": (2.0 ** -16, 0.0, "fp32 in and out, ieee dots: the fp32 sums in another order (online softmax in tiles, "
                              "splits merged by log-sum-exp, the sink logit's dot as a tree), and exponentials of "
                              "logits up to ~40 (a dominant sink), whose relative error grows as |s| 2^-24: measured "
                              "<= 3.4e-6 mass (dominant sink), <= 5e-7 otherwise; 2^-16 = 1.5e-5"),
    "bf16": (2.0 ** -16, 2.0 ** -7, "the interpreter upcasts bf16 to fp32 (tl.dot on bf16 is wrong there), so the fp32 "
                                    "term above, plus one bf16 ulp of the output (<= 2^-7 relative)"),
    "bf16_gpu": (2.0 ** -8, 2.0 ** -7, "compiled: P is rounded to bf16 for the P.V tensor-core dot (each weight off "
                                       "by <= 2^-9 relative, so the sum by <= 2^-9 mass; 2x margin), plus one bf16 "
                                       "ulp of the output"),
}

BASE = dict(R=8, Hq=6, Hkv=1, D=32, dtype="fp32", kind="full", W=20, slack=16, capacity=200, last=77, sink="random",
            pad_rows=(), rejected=3, edge=None, q_view=False, seed=0, settings=dict(num_splits=4, block_n=16))


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("full_1row_fp32", R=1),
    case("full_8rows_fp32"),
    case("full_1row_bf16", R=1, dtype="bf16"),
    case("full_8rows_bf16", dtype="bf16"),
    case("full_8rows_d128_bf16", D=128, dtype="bf16", capacity=150, last=120),
    case("full_padding_rows", pad_rows=(3, 7)),
    case("full_padding_rows_no_sink", pad_rows=(5, 6, 7), sink=None),
    case("full_all_padding", R=2, pad_rows=(0, 1)),
    case("full_all_padding_no_sink", R=2, pad_rows=(0, 1), sink=None),
    case("full_no_sink_fp32", sink=None),
    case("full_no_sink_bf16", sink=None, dtype="bf16"),
    case("full_sink_dominates_fp32", sink="dominant"),
    case("full_sink_dominates_bf16", sink="dominant", dtype="bf16"),
    case("full_gqa_2kv_heads_bf16", Hq=12, Hkv=2, dtype="bf16"),
    case("full_gqa_4q_2kv_fp32", Hq=4, Hkv=2),
    case("full_q_view_of_qkv", q_view=True),
    case("full_one_split", settings=dict(num_splits=1, block_n=16)),
    case("full_mostly_dead_splits", last=39, settings=dict(num_splits=16, block_n=16)),
    case("full_cache_full", capacity=60, last=59, rejected=0, settings=dict(num_splits=3, block_n=16)),
    case("full_default_settings", capacity=300, last=290, settings=None),
    # more tiles in flight on long splits (`long_stages`): 2 splits of 10 tiles take the pipelined loop, 20 splits of
    # one tile the plain one; each the same bits as without it
    case("full_long_splits_three_stages", capacity=400, last=319, dtype="bf16", long_loop=True,
         settings=dict(num_splits=2, block_n=16, long_stages=3, long_tiles=2)),
    case("full_short_splits_long_stages_unused", capacity=400, last=319, long_loop=False,
         settings=dict(num_splits=20, block_n=16, long_stages=3, long_tiles=2)),
    # many splits, the combine's steps: 20 live splits in one step of 32, 40 in three steps of 16 (the last one partly
    # live), over column blocks of 16 of 32 and of the whole head
    case("full_20_live_splits_one_step", capacity=400, last=319,
         settings=dict(num_splits=24, block_n=16, combine_splits=32, combine_cols=16, combine_warps=2)),
    case("full_40_live_splits_three_steps", capacity=700, last=639, dtype="bf16",
         settings=dict(num_splits=48, block_n=16, combine_splits=16, combine_cols=32, combine_warps=1)),
    # `edge`: the ring slot of the first row's first visible position. Rings of 36 slots, window 20: at last=98 the
    # first row (91) sees from 72, in slot 0, and its last invisible position (71) sits in the ring's last slot
    case("sliding_wrap_edge_at_slot_0_8rows_fp32", kind="sliding", last=98, edge=0,
         settings=dict(num_splits=3, block_n=16)),
    case("sliding_wrap_edge_at_slot_0_1row_fp32", kind="sliding", R=1, last=91, edge=0,
         settings=dict(num_splits=2, block_n=16)),
    case("sliding_wrap_8rows_bf16", kind="sliding", dtype="bf16", last=163, settings=dict(num_splits=3, block_n=16)),
    case("sliding_before_wrap", kind="sliding", last=9, settings=dict(num_splits=3, block_n=16)),
    case("sliding_wrap_padding_no_sink", kind="sliding", last=130, sink=None, pad_rows=(7,), settings=None),
    # the draft layer: window 512 in a ring of 576, its default settings. At last=1094 the first row (1087) sees from
    # 576, in slot 0, its last invisible position in slot 575; the one row at 1151 sees from 640, in slot 64
    case("draft_512_8rows_bf16", kind="sliding", W=512, slack=64, dtype="bf16", last=1094, edge=0, settings=None),
    case("draft_512_1row_fp32", kind="sliding", W=512, slack=64, R=1, last=1151, edge=64, settings=None),
]
BY_NAME = {c["name"]: c for c in CASES}

GPU_BASE = dict(D=128, dtype="bf16", settings=None)
GPU_CASES = [
    case("gpu_full_4k_8rows", **GPU_BASE, capacity=4096, last=4000),
    case("gpu_full_4k_1row", **GPU_BASE, R=1, capacity=4096, last=2050),
    case("gpu_full_64k_8rows", **GPU_BASE, capacity=65536, last=60_000),
    case("gpu_full_64k_8rows_no_sink", **GPU_BASE, capacity=65536, last=33_333, sink=None),
    case("gpu_full_64k_8rows_long_stages", **dict(GPU_BASE, settings=dict(block_n=64, num_stages=1, long_stages=3,
                                                                          long_tiles=2)), capacity=65536, last=60_000,
         long_loop=True),  # 256 slots a split: four tiles
    case("gpu_full_64k_short_history_padding", **GPU_BASE, capacity=65536, last=700, pad_rows=(6, 7)),
    case("gpu_sliding_4160_ring_8rows", **GPU_BASE, kind="sliding", W=4096, slack=64, last=10_000),
    case("gpu_sliding_4160_ring_1row_dominant_sink", **GPU_BASE, kind="sliding", W=4096, slack=64, R=1, last=9_001,
         sink="dominant"),
    case("gpu_draft_576_ring_8rows", **GPU_BASE, kind="sliding", W=512, slack=64, last=5_000),
]


# ---- the cache, the queries, the reference --------------------------------------------------------------------------
def settings_of(c: dict, window: int | None) -> da.AttentionSettings:
    return da.settings_for(window) if c["settings"] is None else da.AttentionSettings(**c["settings"])


def build(c: dict, device: str) -> dict:
    gen = torch.Generator().manual_seed(c["seed"])
    dtype, R, D, Hq, Hkv, last = DTYPES[c["dtype"]], c["R"], c["D"], c["Hq"], c["Hkv"], c["last"]
    window = c["W"] if c["kind"] == "sliding" else None
    slots = c["W"] + c["slack"] if window else c["capacity"]
    kv = LayerKV(k=torch.zeros(slots + 1, Hkv, D, dtype=dtype), v=torch.zeros(slots + 1, Hkv, D, dtype=dtype),
                 slot_pos=torch.full((slots + 1,), -1, dtype=torch.int64), slots=slots, window=window)
    top = last + c["rejected"]  # the block's rows end at `last`; rejected drafts' K/V past it
    for p0 in range(0, top + 1, slots):  # a write's slots must be distinct: one ring's worth at a time
        pos = torch.arange(p0, min(p0 + slots, top + 1))
        kv.write(pos, torch.ones_like(pos, dtype=torch.bool), torch.randn(len(pos), Hkv, D, generator=gen),
                 torch.randn(len(pos), Hkv, D, generator=gen))
    positions = torch.arange(last - R + 1, last + 1, dtype=torch.int64)
    pad = torch.zeros(R, dtype=torch.bool)
    pad[list(c["pad_rows"])] = True
    positions[pad] = -1
    # padding rows' K/V go to the trash slot: large, so that the slot wrongly seen would dominate
    n_pad = int(pad.sum())
    big = torch.full((max(n_pad, 1), Hkv, D), 30.0)
    kv.write(positions[pad] if n_pad else torch.tensor([-1]), torch.zeros(max(n_pad, 1), dtype=torch.bool), big, big)
    if window is not None and positions.max() >= 0:
        first = int(positions[positions >= 0][0])
        assert first - window < 0 or first - window in kv.slot_pos.tolist(), "the ring should hold the window's edge"
        assert c["edge"] is None or (first - window + 1) % slots == c["edge"], "the window's edge is not where meant"
    # slots the kernels must not read: at or past kv_len (the trash slot excepted: always in range once kv_len = S)
    kv_len = min(max(int(positions.max()) + 1, 0), slots + 1)
    k, v = kv.k.clone(), kv.v.clone()
    k[kv_len:slots], v[kv_len:slots] = float("nan"), float("nan")

    unit = torch.randn(D, generator=gen)
    unit /= unit.norm()
    q_full = torch.randn(R, Hq + 2 * Hkv, D, generator=gen) * 0.6
    if c["sink"] is None:
        sink_k = None
    elif c["sink"] == "random":  # logits of the keys' size: the sink takes a few percent of each row
        sink_k = torch.randn(Hkv, D, generator=gen) * 2.0
    else:  # "dominant": every query leans on one direction that the sink key points along, s_sink ~ 20-40
        q_full[:, :Hq] += 2.0 * unit
        sink_k = (unit * 12.0 * D ** 0.5).expand(Hkv, D).contiguous() + torch.randn(Hkv, D, generator=gen)
    q_full = q_full.to(dtype)
    q = q_full[:, :Hq] if c["q_view"] else q_full[:, :Hq].contiguous()
    scale = D ** -0.5
    mask = kv.visible(positions)
    live = positions >= 0
    qf, kf, vf = q.float(), kv.k.float(), kv.v.float()  # the cache's own (finite) values
    ref = attention(qf, kf, vf, mask, scale, sink_k).to(dtype)
    mass = attention(qf, kf, vf.abs(), mask, scale, sink_k)
    t = dict(q=q, k=k, v=v, slot_pos=kv.slot_pos, positions=positions, sink_k=sink_k, ref=ref, mass=mass, live=live)
    t = {n: (x.to(device) if isinstance(x, torch.Tensor) else x) for n, x in t.items()}
    return dict(t, scale=scale, window=window)


def run_kernel(t: dict, st: da.AttentionSettings, pdl: bool = False) -> torch.Tensor:
    out = torch.full(t["q"].shape, float("nan"), dtype=t["q"].dtype, device=t["q"].device)
    ws = tuple(x.fill_(float("nan")) for x in da.decode_attention_workspace(t["q"], t["k"], st))
    got = da.decode_attention(t["q"], t["k"], t["v"], t["slot_pos"], t["positions"], t["scale"], t["sink_k"],
                              t["window"], settings=st, out=out, workspace=ws, pdl=pdl)
    assert got is out
    return got


def compare(t: dict, got: torch.Tensor, tol: tuple) -> dict:
    live = t["live"]
    diff = (got.float() - t["ref"].float()).abs()[live]
    bound = tol[0] * t["mass"][live] + tol[1] * t["ref"].float().abs()[live]
    excess = (diff - bound).max().item() if live.any() else float("-inf")
    worst = (diff / t["mass"][live].clamp_min(1e-30)).max().item() if live.any() else 0.0
    return {"excess": excess, "err_in_mass": worst, "finite": bool(torch.isfinite(got).all()),
            "padding_zero": bool((got[~live] == 0).all()), "ref_finite": bool(torch.isfinite(t["ref"][live]).all())}


def run_case(c: dict, device: str) -> dict:
    t = build(c, device)
    st = settings_of(c, t["window"])
    got = run_kernel(t, st)
    r = compare(t, got, TOL[c["dtype"] + ("_gpu" if device != "cpu" else "")])
    kv_len = max(int(t["positions"].max()) + 1, 0)
    per = max(-(-(-(-kv_len // st.splits(t["k"].shape[0], c["Hkv"], t["q"].device))) // st.block_n) * st.block_n,
              st.split_min)  # the kernels' _split_len
    r["live_splits"] = -(-kv_len // per)
    if st.long_stages:  # more tiles in flight change no value, whichever loop the split length takes
        r["long_loop"] = per > st.long_tiles * st.block_n
        r["long_same"] = bool(torch.equal(got, run_kernel(t, dataclasses.replace(st, long_stages=None))))
    if device != "cpu":  # PDL with the early reads and the preloaded sink logit: scheduling only, the same bits
        r["pdl_same"] = bool(torch.equal(got, run_kernel(t, st, pdl=True)))
    return r


def check(c: dict, r: dict, tol: tuple) -> None:
    assert r["ref_finite"], "the reference is not finite on a live row: the case is ill-posed"
    assert r["finite"], "NaN in the output: an element left unwritten, or a slot read at or past kv_len"
    assert r["padding_zero"], "a padding row's output is not zero"
    assert r["excess"] <= 0, (f"{c['name']}: |kernel - ref| over the bound ({tol[0]:.1e} mass + {tol[1]:.1e} |ref|) "
                              f"by {r['excess']:.2e}; worst error {r['err_in_mass']:.2e} mass")
    assert r.get("pdl_same", True), "PDL, early reads or the preloaded sink changed the output"
    assert r.get("long_same", True), "more tiles in flight on long splits changed the output"
    if "long_loop" in c:  # the cases meant to take each loop do
        assert r["long_loop"] == c["long_loop"], r
    for n in (20, 40):  # the cases meant to take each form of the combine do
        if f"_{n}_live_splits" in c["name"]:
            assert r["live_splits"] == n, r


# ---- the negative control: the sink in every split instead of once ---------------------------------------------------
@triton.jit
def merge_with_sink_per_split(part_m_ptr, part_l_ptr, part_acc_ptr, first, RG, row, d, n_live, s_sink,
                              D: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, COLS: tl.constexpr):
    every = tl.arange(0, MAX_SPLITS)
    m = tl.max(tl.load(part_m_ptr + (first + every) * RG + row, mask=every < n_live, other=float("-inf")), axis=0)
    m = tl.maximum(m, s_sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.arange(0, BLOCK_S)
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    acc = tl.zeros([COLS], tl.float32)
    for s0 in range(0, n_live, BLOCK_S):
        ok = s0 + s < n_live
        part = (first + s0 + s) * RG + row
        w = tl.exp2(tl.load(part_m_ptr + part, mask=ok, other=float("-inf")) - m_safe)
        den += tl.sum(tl.load(part_l_ptr + part, mask=ok, other=0.0) * w, axis=0)
        den += tl.sum(tl.where(ok, tl.exp2(s_sink - m_safe), 0.0), axis=0)  # the defect: a sink a live split
        acc += tl.sum(tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                      * w[:, None], axis=0)
    return acc, den


# Each control: a case of CASES run with the broken merge. With one live split the defect is the product's form, so
# the full_one_split run shows the substitution itself is sound (it must pass), the others that the comparison sees it.
CONTROLS = {"full_8rows_fp32": False, "full_40_live_splits_three_steps": False, "sliding_wrap_8rows_bf16": False,
            "full_one_split": True}


def run_control(name: str) -> dict:
    c = BY_NAME[name]
    t = build(c, "cpu")
    with substituted(da, {"_attention_combine_kernel": {"_merge_splits": merge_with_sink_per_split}}):
        got = run_kernel(t, settings_of(c, t["window"]))
    return compare(t, got, TOL[c["dtype"]])


# ---- interpreter tests ----------------------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(
    __file__, CASES, lambda c, r: check(c, r, TOL[c["dtype"]]),
    lambda c, r: f"{c['name']}: worst error {r['err_in_mass']:.2e} mass, {r['live_splits']} live splits")


@pytest.mark.parametrize("name", list(CONTROLS))
def test_negative_control_sink_per_split(interpreted, name):
    """The sink added in every live split, not once in the merge, fails the comparison that the kernel passes (and
    with a single split, where the two are the same, passes it)."""
    r = interpreted[f"control:{name}"]
    assert "error" not in r, r.get("error")
    assert r["finite"] and r["ref_finite"]
    if CONTROLS[name]:
        assert r["excess"] <= 0, r
    else:
        assert r["excess"] > 0, f"the broken merge passed: {r}"


def test_settings_defaults():
    """Full layers stream 64-slot K/V tiles, sliding ones (the draft's too) 32-slot tiles and merge up to 256 splits a
    combine step, both one tile in flight; the rest is shared."""
    assert da.settings_for(None) is da.FULL
    assert da.settings_for(4096) is da.SLIDING and da.settings_for(512) is da.SLIDING
    assert (da.FULL.num_stages, da.SLIDING.num_stages) == (1, 1)
    assert (da.FULL.block_n, da.SLIDING.block_n) == (64, 32)
    assert (da.FULL.combine_splits, da.SLIDING.combine_splits) == (128, 256)
    assert dataclasses.replace(da.FULL, block_n=32, num_stages=1, combine_splits=256) == da.SLIDING
    with pytest.raises(dataclasses.FrozenInstanceError):
        da.FULL.block_n = 32  # frozen: a default cannot be edited in place


def test_default_splits(monkeypatch):
    """The default grid caps a long cache's splits at two programs an SM per KV head; a short cache keeps one split a
    min_split slots, whatever the cap."""
    monkeypatch.setattr(da, "_sm_count", lambda device: 132)
    cpu, long, short = torch.device("cpu"), 512 * 1024, 1120
    assert da.FULL.splits(long, 1, cpu) == 264 and da.FULL.splits(long, 2, cpu) == 132
    assert da.FULL.splits(16480, 1, cpu) == 258 and da.FULL.splits(short, 1, cpu) == 18
    assert dataclasses.replace(da.FULL, num_splits=7).splits(long, 1, cpu) == 7  # an explicit count wins


def _args(**over):
    a = dict(q=torch.randn(2, 6, 16), cache_k=torch.randn(9, 1, 16), cache_v=torch.randn(9, 1, 16),
             slot_pos=torch.arange(9), positions=torch.tensor([7, 8]), scale=0.25, sink_k=torch.randn(1, 16),
             window=None)
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(q=torch.randn(2, 6, 24)), "head_dim"),
    (dict(cache_k=torch.randn(9, 4, 16), cache_v=torch.randn(9, 4, 16)), "multiple of kv heads"),
    (dict(cache_v=torch.randn(9, 1, 16).to(torch.bfloat16)), "dtypes differ"),
    (dict(q=torch.randn(2, 6, 16).to(torch.int32)), "bf16, fp16 or fp32"),
    (dict(slot_pos=torch.arange(9, dtype=torch.int32)), "slot_pos"),
    (dict(positions=torch.tensor([7])), "positions"),
    (dict(sink_k=torch.randn(1, 16).double()), "sink_k"),
    (dict(sink_k=torch.randn(6)), "sink_k"),  # the retired per-head constant's shape
    (dict(cache_k=torch.randn(9, 2, 16)[:, :1]), "contiguous"),
    (dict(window=0), "window"),
    (dict(scale=None), "scale"),
    (dict(q=torch.randn(30, 6, 16), positions=torch.arange(30)), "rows x heads"),
    (dict(settings=da.AttentionSettings(block_n=24)), "block_n"),
    (dict(settings=da.AttentionSettings(block_n=32, min_split=48)), "min_split"),
])
def test_rejects_bad_inputs(over, message):
    with pytest.raises(ValueError, match=message):
        da.decode_attention(**_args(**over))


# ---- GPU tests (TP8 rank shapes) ------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=[c["name"] for c in GPU_CASES])
def test_gpu(c):
    r = run_case(c, "cuda")
    check(c, r, TOL["bf16_gpu"])
    print(f"{c['name']}: worst error {r['err_in_mass']:.2e} mass, {r['live_splits']} live splits")


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [(f"control:{n}", lambda n=n: run_control(n)) for n in CONTROLS])
