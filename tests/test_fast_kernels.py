"""The fast engine with the Triton kernels (fast/triton_ops.py, by kernel plan) against its torch forms.

On CPU the kernels run under Triton's interpreter, in a worker subprocess (TRITON_INTERPRET is read when triton is
imported), on single blocks: what the interpreter checks that the GPU cannot is the wiring on exact CPU arithmetic
(which blocks reach which kernel, bit-identity of the scheduling forms in fp32, the fallbacks). Whole decodes with
the kernels run on the GPU, inside the captured decode loop, at both dtypes.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch

from iquest.fast.parallel import Parallel
from iquest.kernels.testing import worker_fixture
from iquest.fast.plan import KernelPlan
from iquest.fast.rank import EngineOptions, EngineParts, RankEngine
from iquest.qualify.agreement import compare
from iquest.tests.helpers import (CASES, GPU_PLANS, PROMPTS, RING_SEQ, TINY, TOLERANCE, decode_cases, fast_dist,
                                  torch_forms)

# E4M3 activations into Down (DeepSeek-V3 act_quant) change each Down input by up to 2^-4 relative;
# over a random 4-layer model that moved logits by 1.3% of their range when measured; 5% leaves room
# and is far below what a wrong expert, weight or scale produces (order 1).
MOE_BLOCK_TOL = 0.05
TINY_LAYERS = 4


def engine(plan: KernelPlan | str, device: str = "cpu", dtype: str = "fp32", parts: EngineParts = EngineParts(),
           max_context: int = 256) -> RankEngine:
    return RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=max_context, dtype=dtype, kernels=plan),
                      parts)


def two_blocks(e: RankEngine, device: str, first: int = 40) -> tuple:
    """A `first`-row prefill block, then a verification block of 8 rows with 2 padding rows: both forwards' outputs."""
    e.cache.reset()
    pos = torch.arange(first, device=device)
    a = e.model.forward(torch.tensor(RING_SEQ[:first], device=device), pos, torch.ones_like(pos, dtype=torch.bool))
    pos = torch.arange(first, first + 8, device=device)
    b = e.model.forward(torch.tensor(RING_SEQ[first:first + 8], device=device), pos, torch.arange(8, device=device) < 6)
    return a, b


def _real_slots(kv) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V without the trash slot: several padding rows write it in no defined order on a GPU (it is never
    read; tests/test_kernel_rope_kv.py checks it holds some padding row's values)."""
    return kv.k[:-1].clone(), kv.v[:-1].clone()


def moe_block_error(device: str = "cpu") -> float:
    """Relative logit error of a verification block (6 live rows of 8) with the MoE kernels vs the torch forms."""
    logits = {}
    for plan in (KernelPlan.torch(), KernelPlan(moe=True)):
        _, (lg, _) = two_blocks(engine(plan, device), device)
        logits[plan.name] = lg[:6].double().cpu()
    return float((logits["moe"] - logits["torch"]).abs().max() / logits["torch"].abs().max())


def moe_prefill_split(device: str = "cpu") -> dict:
    """A prefill-sized block (72 rows x k=2 = 144 pairs > the kernel's 128): the dispatcher splits it into row
    chunks. Returns the relative error against the torch form and how many kernel calls ran (must be > 1)."""
    from iquest.fast import triton_ops
    from iquest.fast.torch_ops import TorchOps

    e = engine(KernelPlan.torch(), device)
    lw, c = e.model.w.layers[0], e.config
    g = torch.Generator().manual_seed(5)
    R = 72
    b = torch.randn(R, c.hidden_size, generator=g).to(device)
    experts = torch.stack([torch.randperm(c.n_routed_experts, generator=g)[:c.num_experts_per_tok]
                           for _ in range(R)]).to(device)
    weights = torch.rand(R, c.num_experts_per_tok, generator=g).to(device)
    live = (torch.arange(R) % 9 != 4).to(device)  # a few padding rows inside the block
    ops, calls, kernel = triton_ops.TritonOps(KernelPlan(moe=True)), [], triton_ops.moe.moe
    triton_ops.moe.moe = lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k)
    try:
        got = ops.moe(b, experts, weights, live, lw.gate, lw.up, lw.down)
    finally:
        triton_ops.moe.moe = kernel
    want = TorchOps().moe(b, experts, weights, live, lw.gate, lw.up, lw.down)
    return {"rel_err": float((got - want)[live].abs().max() / want[live].abs().max()), "calls": calls}


def rope_block(device: str = "cpu") -> dict:
    """The fused rotary + KV-write kernel (the attention group, with attention itself in its torch form) against the
    torch forms, fp32: logits, hidden states, caches and slot labels must be identical."""
    out = {}
    for name, plan, parts in (("torch", KernelPlan.torch(), EngineParts()),
                              ("rope", KernelPlan(attention=True), torch_forms("attention"))):
        e = engine(plan, device, parts=parts)
        a, b = two_blocks(e, device)
        out[name] = (a, b, [(*_real_slots(kv), kv.slot_pos.clone()) for kv in e.cache.layers],
                     dict(e.model.ops.fallbacks) if name == "rope" else {}, e.model.ops)
    (a0, b0, c0, _, _), (a1, b1, c1, fb, ops) = out["torch"], out["rope"]
    return {"outputs_identical": all(torch.equal(x, y) for x, y in zip(a0 + b0, a1 + b1)),
            "caches_identical": all(torch.equal(x, y) for l0, l1 in zip(c0, c1) for x, y in zip(l0, l1)),
            "fallbacks": fb}


def residual_block(device: str = "cpu", dtype: str = "fp32") -> dict:
    """The residual add folded into the next norm kernel against the add (torch) then the norm kernel: a 40-row
    prefill block, a verification block with 2 padding rows and a draft block; logits, hidden states and caches must
    be identical, and the fold must have run (`fused_calls`: the norm's residual-input launches). bf16 only on a GPU:
    Triton's interpreter casts fp32 to bf16 by truncation, torch and the GPU round to nearest even."""
    from iquest.fast import triton_ops

    out = {}
    for name, parts in (("unfused", torch_forms("residual_norm")), ("fused", EngineParts())):
        e = engine(KernelPlan(norm=True), device, dtype, parts)
        calls, kernel = [], triton_ops.rmsnorm_residual.rmsnorm_residual
        triton_ops.rmsnorm_residual.rmsnorm_residual = lambda *a, **k: calls.append(1) or kernel(*a, **k)
        try:
            a, b = two_blocks(e, device)
            live = torch.arange(8, device=device) < 6
            pos = torch.arange(41, 49, device=device)
            d = e.model.draft(torch.tensor(RING_SEQ[41:49], device=device), b[1], pos, live)
        finally:
            triton_ops.rmsnorm_residual.rmsnorm_residual = kernel
        out[name] = (a + b + d, [_real_slots(kv) for kv in e.cache.layers], dict(e.model.ops.fallbacks), len(calls))
    (o0, c0, _, n0), (o1, c1, fb, n1) = out["unfused"], out["fused"]
    return {"outputs_identical": all(torch.equal(x, y) for x, y in zip(o0, o1)),
            "caches_identical": all(torch.equal(x, y) for l0, l1 in zip(c0, c1) for x, y in zip(l0, l1)),
            "fallbacks": fb, "fused_calls": n1 - n0}


NORM_QKV = KernelPlan(moe=True, linear=True, attention=True, norm=True)
# fp32: the input norm's 1 / rms applied after the product instead of before its rounding (and its squares summed in
# another order) moves the products by an ulp or so; 1e-5 of the logits' range is far above that and ~1e-4 of what the
# negative control (sums of squares off by 4) produces.
NORM_QKV_TOL = 1e-5


def norm_qkv_block(device: str = "cpu", dtype: str = "fp32", broken: bool = False, base: KernelPlan = NORM_QKV) -> dict:
    """The input norm done by the q/k/v projection from the MoE combine's sums of squares (the plan's
    fused_input_norm) against the norm kernel: an 8-row block, then a verification block with 2 padding rows; the
    second block's logits (live rows) relative to their range. `broken`: the negative control, every normalizing
    projection given sums of squares 4x too large (1/rms halved); `calls` counts the projections that normalized,
    `adds` the combines that added."""
    logits = {}
    for plan in (replace(base, fused_input_norm=False), replace(base, fused_input_norm=True)):
        e = engine(plan, device, dtype)
        ops = e.model.ops
        counts = (ops.calls["fused_input_norm"], ops.calls["residual_add"])  # a GPU engine's capture ran forwards
        if broken:
            fp8 = ops._fp8
            ops._fp8 = lambda w, x, unsummed=False, rms=None: fp8(w, x, unsummed,
                                                                   None if rms is None else (rms[0] * 4, rms[1]))
        _, (lg, _) = two_blocks(e, device, first=8)
        logits[plan.fused_input_norm] = lg[:6].double().cpu()
    want, got = logits[False], logits[True]
    return {"rel_err": float((got - want).abs().max() / want.abs().max()),
            "calls": ops.calls["fused_input_norm"] - counts[0], "adds": ops.calls["residual_add"] - counts[1],
            "fallbacks": dict(ops.fallbacks)}


def sampling_block(device: str = "cpu") -> dict:
    """The sampling kernels' distributions of one 8-row logits block against the torch forms'."""
    out = {}
    for plan in (KernelPlan.torch(), KernelPlan(sampling=True)):
        e = engine(plan, device)
        runner, _ = e.runner(3, 20)
        e.state.temperature.fill_(1.0)
        e.state.top_p.fill_(0.95)
        logits = torch.randn(8, e.config.vocab_size, generator=torch.Generator().manual_seed(5)).to(device) * 2
        out[plan.name] = runner.dist(logits)
    (ti, tp), (ki, kp) = out["torch"], out["sampling"]
    return {"same_ids": bool(torch.equal(ti.cpu(), ki.cpu())), "prob_err": float((tp - kp).abs().max())}


def _check_norm_qkv(r: dict, broken: dict, layers: int) -> None:
    assert "error" not in r and "error" not in broken, (r, broken)
    print(f"[fused input norm] relative logit error {r['rel_err']:.2e} (tolerance {NORM_QKV_TOL:.0e}); "
          f"control {broken['rel_err']:.2e}")
    # two forwards, each adding in every layer's combine but the last's and normalizing in every layer's q/k/v but the
    # first's
    assert r["calls"] == r["adds"] == 2 * (layers - 1) and not r["fallbacks"], r
    assert r["rel_err"] <= NORM_QKV_TOL, r
    assert broken["calls"] == r["calls"] and broken["rel_err"] > 100 * NORM_QKV_TOL, broken


# ---- under the interpreter (CPU) -------------------------------------------------------------------------------
interpreted = worker_fixture(__file__)


def test_interpreted_moe_block_within_its_e4m3_tolerance(interpreted):
    r = interpreted["moe_block"]
    assert "error" not in r, r
    print(f"[interpreted MoE kernels] relative logit error {r['rel_err']:.2e} (tolerance {MOE_BLOCK_TOL})")
    assert r["rel_err"] < MOE_BLOCK_TOL


def test_interpreted_moe_splits_prefill_blocks(interpreted):
    split = interpreted["moe_prefill_split"]
    assert "error" not in split, split
    assert len(split["calls"]) > 1 and sum(split["calls"]) == 72 and split["rel_err"] < MOE_BLOCK_TOL, split


def test_interpreted_rope_kernel_changes_nothing(interpreted):
    rope = interpreted["rope_block"]
    assert "error" not in rope, rope
    assert rope["outputs_identical"] and rope["caches_identical"] and not rope["fallbacks"], rope


def test_interpreted_residual_fold_changes_nothing(interpreted):
    fused = interpreted["residual_block"]
    assert "error" not in fused, fused
    # 2 forwards x 4 layers (3 next-layer norms + the final norm) + the draft head's norm
    assert fused["outputs_identical"] and fused["caches_identical"] and not fused["fallbacks"], fused
    assert fused["fused_calls"] == 2 * TINY_LAYERS + 1, fused


def test_interpreted_fused_input_norm_and_its_control(interpreted):
    _check_norm_qkv(interpreted["norm_qkv_block"], interpreted["norm_qkv_broken"], TINY_LAYERS)


def test_interpreted_sampling_kernels_match_the_torch_forms(interpreted):
    samp = interpreted["sampling_block"]
    assert "error" not in samp, samp
    print(f"[interpreted sampling kernels] same candidates {samp['same_ids']}, max prob error {samp['prob_err']:.1e}")
    assert samp["same_ids"] and samp["prob_err"] < 1e-6


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([("moe_block", lambda: {"rel_err": moe_block_error()}),
                 ("moe_prefill_split", moe_prefill_split),
                 ("rope_block", rope_block),
                 ("residual_block", residual_block),
                 ("norm_qkv_block", norm_qkv_block),
                 ("norm_qkv_broken", lambda: norm_qkv_block(broken=True)),
                 ("sampling_block", sampling_block)])


# ---- on the GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_moe_block_and_prefill_split():
    assert moe_block_error("cuda") < MOE_BLOCK_TOL
    split = moe_prefill_split("cuda")
    assert len(split["calls"]) > 1 and sum(split["calls"]) == 72 and split["rel_err"] < MOE_BLOCK_TOL, split


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_residual_fold_changes_nothing(dtype):
    """The residual add folded into the next norm: the same outputs and caches per block, and the same tokens and
    acceptance sequence over a decode through the captured loop, as the add in torch then the norm kernel."""
    fused = residual_block("cuda", dtype)
    assert fused["outputs_identical"] and fused["caches_identical"] and not fused["fallbacks"], fused
    plan = KernelPlan.triton()
    assert decode_cases(engine(plan, "cuda", dtype)) == decode_cases(
        engine(plan, "cuda", dtype, torch_forms("residual_norm")))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", pytest.param("bf16", marks=pytest.mark.xfail(strict=True, reason=(
    "at 6951322 on the H200 the bf16 block error against every other kernel is 0.103 of the logits' range (its "
    "control 0.481), past the 0.02 this bound had when it was set against a plan without fp16 MoE operands and E4M3 "
    "Down; the bf16 decode with and without the fused norm agrees up to explained divergences (the next test). "
    "Open: a principled bf16 block bound (docs/PERF.md)")))])
def test_cuda_fused_input_norm_block(dtype):
    """The input norm done on load, per block on the GPU: fp32 within NORM_QKV_TOL; bf16 (a rounding of the normalized
    rows that may flip) within the torch comparison's bf16 tolerance of the logits' range."""
    base = NORM_QKV if dtype == "fp32" else KernelPlan.triton()  # bf16: against every other kernel, as it runs
    r, broken = norm_qkv_block("cuda", dtype, base=base), norm_qkv_block("cuda", dtype, broken=True, base=base)
    if dtype == "fp32":
        _check_norm_qkv(r, broken, TINY_LAYERS)
    else:
        print(f"[fused input norm bf16] {r}; control {broken}")
        assert r["calls"] == r["adds"] == 2 * (TINY_LAYERS - 1) and r["rel_err"] < 0.02 < broken["rel_err"], (r, broken)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_fused_input_norm_decodes_like_without_it(dtype):
    """A decode with the input norm done on load against the same kernels without it, through the captured loop:
    every divergence explained by the two engines' own distributions (a numerical change)."""
    base = KernelPlan.triton() if dtype == "bf16" else replace(GPU_PLANS["fp32"], moe=True)
    engines = [engine(replace(base, fused_input_norm=on), "cuda", dtype) for on in (True, False)]
    got, want = (decode_cases(e) for e in engines)
    for i, drafts in CASES:
        key = f"{i}-{drafts}"
        result = compare(PROMPTS[i], got[key]["tokens"], want[key]["tokens"], fast_dist(engines[0]),
                         fast_dist(engines[1]), TOLERANCE[dtype])
        print(f"[fused input norm decode {dtype}, {key}] {result}")
        assert result.explained, str(result)  # that the fold ran is counted per block: test_cuda_fused_input_norm_block


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_kernels_decode_like_the_torch_forms(dtype):
    with_kernels, torch_engine = engine(GPU_PLANS[dtype], "cuda", dtype), engine("torch", "cuda", dtype)
    got, want = decode_cases(with_kernels), decode_cases(torch_engine)
    # Each side's divergence is explained with its own engine's distributions.
    for i, drafts in CASES:
        key = f"{i}-{drafts}"
        result = compare(PROMPTS[i], got[key]["tokens"], want[key]["tokens"], fast_dist(with_kernels),
                         fast_dist(torch_engine), TOLERANCE[dtype])
        print(f"[cuda kernels {dtype}, {key}] {result}")
        assert result.explained, str(result)


@pytest.mark.gpu
def test_cuda_kernel_paths_all_ran():
    """The default plan's kernel paths, counted over a bf16 decode through the captured loop: every path the tiny
    fixture's shapes allow ran, and no op group fell back. (Its 16-wide blocks keep out the direct linears, which need
    128-wide K tiles, and whatever of TMA and E4M3 Down its shapes refuse: kernel tests cover those at full size.)"""
    e = engine(KernelPlan.triton(), "cuda", "bf16")
    decode_cases(e)
    ops = e.model.ops
    ran = {name for name, n in ops.calls.items() if n > 0}
    assert {"preload", "f16_norm", "embed", "sample_draw", "accept", "settle", "early", "rope_sum", "residual_add",
            "fused_input_norm"} <= ran, dict(ops.calls)
    assert not ops.fallbacks, dict(ops.fallbacks)


# ---- the plan and the dispatcher, no kernel launched ------------------------------------------------------------
def test_shapes_a_kernel_cannot_take_fall_back_and_are_counted():
    """The micro preset's 8-wide FP8 blocks and 8-wide heads are below what the kernels take: each such call runs the
    torch form (the same result as TorchOps) and is counted, so reports can say which op groups were not kernels."""
    from iquest.fast.torch_ops import TorchOps
    from iquest.fast.triton_ops import TritonOps, moe_takes
    from iquest.fast.weights import FP8Weight
    from iquest.reference.fp8 import E4M3

    ops = TritonOps(KernelPlan.triton())
    g = torch.Generator().manual_seed(3)
    w = FP8Weight((torch.randn(16, 16, generator=g) * 64).clamp(-448, 448).to(E4M3),
                  torch.rand(2, 2, generator=g) + 0.5, (8, 8), torch.float32)
    x = torch.randn(3, 16, generator=g)
    assert torch.equal(ops.linear(w, x), TorchOps().linear(w, x))
    assert ops.fallbacks == {"linear": 1}
    # A shape the kernel takes is not counted: a 16-wide block runs the kernel path's checks, not the fallback.
    assert moe_takes((16, 16), (16, 16), 32) and not moe_takes((8, 8), (8, 8), 32)
    assert not moe_takes((16, 16), (16, 16), 24)  # groups must divide the rank's intermediate slice
    ops = TritonOps(KernelPlan(moe=True))  # an op group off the plan runs its torch form without being counted
    assert torch.equal(ops.linear(w, x), TorchOps().linear(w, x)) and not ops.fallbacks


def test_kernel_plans_from_the_user_choices():
    assert KernelPlan.choose("auto", "cpu") == KernelPlan.torch() and KernelPlan.choose("auto", "cuda").name == "triton"
    assert KernelPlan.choose("triton", "cpu") == KernelPlan.triton()
    assert KernelPlan.choose("torch", "cuda").name == "torch"
    assert KernelPlan.triton().fp8_down and KernelPlan.triton().fused_input_norm  # the qualified variants are defaults
    assert KernelPlan(moe=True, fp8_down=True).name == "moe+fp8_down" and not KernelPlan.torch().uses_triton
    for bad in ("triton-settle", "linear+attention", "Triton", ""):
        with pytest.raises(ValueError, match="--kernels must be one of auto, torch, triton"):
            KernelPlan.choose(bad, "cpu")


def test_f16_tile_only_where_the_moe_kernel_takes_the_blocks():
    """The post-attention norm writes the MoE's fp16 operand tiles only for weight blocks the MoE kernel takes: the
    micro preset's 8-wide blocks have no tile (the first GPU qualification at b1ac415 stopped on exactly this:
    "moe: block 8 has no power-of-two divisor >= 16"), and a hidden size that is not whole tiles has none."""
    from iquest.fast.triton_ops import TritonOps

    f16_tile = TritonOps.f16_tile
    assert f16_tile((128, 128), 6144) == 128 and f16_tile((16, 16), 256) == 16
    assert f16_tile((32, 256), 512) == 128  # Gate/Up's K tile: at most 128 wide
    assert f16_tile((8, 8), 64) is None and f16_tile((4, 24), 96) is None and f16_tile(None, 64) is None
    assert f16_tile((32, 48), 96) is None  # not a power of two: the MoE kernel falls back, no tiles to make
    assert f16_tile((128, 128), 6144 + 64) is None


def test_fallback_routers_widened_once_at_build():
    """The torch forms route with an fp32 copy of each router made when the engine is built (not per call); the
    copy is exact, the held router stays bf16, and an engine whose routing is the kernel makes no copy."""
    def routers(plan):
        e = engine(plan, max_context=64)
        return [(lw.router, lw.router32) for lw in (*e.model.w.layers, e.model.w.mtp.block)]

    for held, copy in routers(KernelPlan.torch()):
        assert held.dtype == torch.bfloat16 and copy.dtype == torch.float32 and torch.equal(copy, held.float())
    assert all(copy is None for _, copy in routers(KernelPlan(linear=True, moe=True)))  # the kernel reads bf16 rows
