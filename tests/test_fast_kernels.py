"""The fast engine with the Triton kernels (`EngineOptions(kernels="triton")`) against its torch fallback.

On CPU the kernels run under Triton's interpreter, in a worker subprocess (TRITON_INTERPRET is read
when triton is imported); on a GPU they run compiled, inside the captured decode loop.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine
from iquest.qualify.agreement import compare
from iquest.tests.test_fast_engine import PROMPTS, TINY, TOLERANCE, fast_dist, fast_steps, tokens

CASES = [(0, 3), (1, "auto")]  # (prompt index, drafts)
N_TOKENS = 10
# Interpreting every kernel for a whole decode takes many minutes: the decode runs the linear and
# attention kernels; the MoE and sampling kernels run on one verification block each.
DECODE_KERNELS = "linear+attention+norm+rope+lm_head+rng+route"
# E4M3 activations into Down (DeepSeek-V3 act_quant) change each Down input by up to 2^-4 relative;
# over a random 4-layer model that moved logits by 1.3% of their range when measured; 5% leaves room
# and is far below what a wrong expert, weight or scale produces (order 1).
MOE_BLOCK_TOL = 0.05
# Kernel stages of the GPU agreement test, per dtype. fp32 leaves out the MoE kernel: its E4M3 Down activations
# (a designed change, ~2-4% per row per layer) flip expert choices on this random fixture, and a flipped expert
# changes a row completely (measured under the interpreter, prefix PROMPTS[1] + [142]: experts differ on the last
# row at layers 2 and 3, logits move by 49% of their range, L1 1.04; the GPU run at commit d572fe8 failed there).
# No probability-gap bound explains that, so in fp32 the MoE kernel is held to its block error (MOE_BLOCK_TOL) and
# qualified against the reference on the trained mini model (iquest qualify --kernels triton); bf16 runs everything.
GPU_KERNELS = {"fp32": "linear+attention+norm+sampling+rope+lm_head+rng+route", "bf16": "triton"}


def moe_block_error(device: str = "cpu") -> float:
    """Relative logit error of a verification block (6 live rows of 8) with the MoE kernels vs the fallback."""
    from iquest.tests.test_fast_engine import RING_SEQ

    logits = {}
    for kernels in ("torch", "moe"):
        e = RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=256, dtype="fp32", kernels=kernels))
        e.cache.reset()
        pos = torch.arange(40, device=device)
        e.model.forward(torch.tensor(RING_SEQ[:40], device=device), pos, torch.ones_like(pos, dtype=torch.bool))
        pos = torch.arange(40, 48, device=device)
        lg, _ = e.model.forward(torch.tensor(RING_SEQ[40:48], device=device), pos, torch.arange(8, device=device) < 6)
        logits[kernels] = lg[:6].double().cpu()
    return float((logits["moe"] - logits["torch"]).abs().max() / logits["torch"].abs().max())


def moe_prefill_split(device: str = "cpu") -> dict:
    """A prefill-sized block (72 rows x k=2 = 144 pairs > the kernel's 128): TritonOps splits it into row chunks.
    Returns the relative error against the fallback and how many kernel calls ran (must be > 1)."""
    from iquest.fast.ops import TritonOps
    from iquest.fast.torch_ops import TorchOps

    e = RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=256, dtype="fp32"))
    lw, c = e.model.w.layers[0], e.config
    g = torch.Generator().manual_seed(5)
    R = 72
    b = torch.randn(R, c.hidden_size, generator=g).to(device)
    experts = torch.stack([torch.randperm(c.n_routed_experts, generator=g)[:c.num_experts_per_tok]
                           for _ in range(R)]).to(device)
    weights = torch.rand(R, c.num_experts_per_tok, generator=g).to(device)
    live = (torch.arange(R) % 9 != 4).to(device)  # a few padding rows inside the block
    ops, calls = TritonOps(("moe",)), []
    kernel = ops._moe
    ops._moe = lambda *a, **k: calls.append(a[0].shape[0]) or kernel(*a, **k)
    got = ops.moe(b, experts, weights, live, lw.gate, lw.up, lw.down)
    want = TorchOps().moe(b, experts, weights, live, lw.gate, lw.up, lw.down)
    err = float((got - want)[live].abs().max() / want[live].abs().max())
    return {"rel_err": err, "calls": calls}


def _real_slots(kv) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V without the trash slot: several padding rows write it in no defined order on a GPU (it is never
    read; tests/test_kernel_rope_kv.py checks it holds some padding row's values)."""
    return kv.k[:-1].clone(), kv.v[:-1].clone()


def rope_block(device: str = "cpu") -> dict:
    """The fused rotary + KV-write kernel against the fallback, fp32: a 40-row prefill block, then a verification
    block with 2 padding rows that wraps nothing; logits, hidden states, caches and slot labels must be identical."""
    from iquest.tests.test_fast_engine import RING_SEQ

    out = {}
    for kernels in ("torch", "rope"):
        e = RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=256, dtype="fp32", kernels=kernels))
        e.cache.reset()
        pos = torch.arange(40, device=device)
        a = e.model.forward(torch.tensor(RING_SEQ[:40], device=device), pos, torch.ones_like(pos, dtype=torch.bool))
        pos = torch.arange(40, 48, device=device)
        b = e.model.forward(torch.tensor(RING_SEQ[40:48], device=device), pos, torch.arange(8, device=device) < 6)
        out[kernels] = (a, b, [(*_real_slots(kv), kv.slot_pos.clone()) for kv in e.cache.layers],
                        dict(getattr(e.model.ops, "fallbacks", {})))
    (a0, b0, c0, _), (a1, b1, c1, fb) = out["torch"], out["rope"]
    same = all(torch.equal(x, y) for x, y in zip(a0 + b0, a1 + b1))
    caches = all(torch.equal(x, y) for l0, l1 in zip(c0, c1) for x, y in zip(l0, l1))
    return {"outputs_identical": same, "caches_identical": caches, "fallbacks": fb}


def residual_block(device: str = "cpu", dtype: str = "fp32") -> dict:
    """The residual add folded into the next norm kernel ("+residual") against the add then norm kernel: a
    40-row prefill block, a verification block with 2 padding rows and a draft block; logits, hidden states and
    caches must be identical, and the fold must have run: `fused_calls` counts the residual-add kernel's launches
    beyond those of the unfused engine (0 if the fold fell back to add then norm). bf16 only on a GPU: Triton's
    interpreter casts fp32 to bf16 by truncation, torch and the GPU round to nearest even."""
    from iquest.tests.test_fast_engine import RING_SEQ

    out = {}
    for kernels in ("norm", "norm+residual"):
        e = RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=256, dtype=dtype, kernels=kernels))
        e.cache.reset()
        m, calls = e.model, []
        kernel = m.ops._add_norm  # the residual-add kernel: post-attention norms, and the fold when it runs
        m.ops._add_norm = lambda *a, **k: calls.append(1) or kernel(*a, **k)
        pos = torch.arange(40, device=device)
        a = m.forward(torch.tensor(RING_SEQ[:40], device=device), pos, torch.ones_like(pos, dtype=torch.bool))
        pos = torch.arange(40, 48, device=device)
        live = torch.arange(8, device=device) < 6
        b = m.forward(torch.tensor(RING_SEQ[40:48], device=device), pos, live)
        d = m.draft(torch.tensor(RING_SEQ[41:49], device=device), b[1], pos + 1, live)
        out[kernels] = (a + b + d, [_real_slots(kv) for kv in e.cache.layers],
                        dict(getattr(m.ops, "fallbacks", {})), len(calls))
    (o0, c0, _, n0), (o1, c1, fb, n1) = out["norm"], out["norm+residual"]
    return {"outputs_identical": all(torch.equal(x, y) for x, y in zip(o0, o1)),
            "caches_identical": all(torch.equal(x, y) for l0, l1 in zip(c0, c1) for x, y in zip(l0, l1)),
            "fallbacks": fb, "fused_calls": n1 - n0}


NORM_QKV_BASE = "moe+linear+rope+rope_sum+norm+residual"
# fp32: the input norm's 1 / rms applied after the product instead of before its rounding (and its squares summed in
# another order) moves the products by an ulp or so; 1e-5 of the logits' range is far above that and ~1e-4 of what the
# negative control (sums of squares off by 4) produces.
NORM_QKV_TOL = 1e-5


def norm_qkv_block(device: str = "cpu", dtype: str = "fp32", broken: bool = False) -> dict:
    """The input norm done by the q/k/v projection from the MoE combine's sums of squares (stage norm_qkv) against the
    norm kernel: an 8-row block, then a verification block with 2 padding rows; the second block's logits (live rows)
    relative to their range. `broken`: the negative control, every normalizing projection given sums of squares 4x too
    large (1/rms halved); `calls` counts the projections that normalized, `adds` the combines that added."""
    from iquest.tests.test_fast_engine import RING_SEQ

    logits = {}
    for kernels in (NORM_QKV_BASE, NORM_QKV_BASE + "+norm_qkv"):
        e = RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=256, dtype=dtype, kernels=kernels))
        e.cache.reset()
        ops = e.model.ops
        counts = (ops.norm_qkv_calls, ops.residual_adds)  # the GPU engine's capture has run forwards already
        if broken:
            fp8 = ops._fp8
            ops._fp8 = lambda w, x, unsummed=False, rms=None, **kw: fp8(
                w, x, unsummed, None if rms is None else (rms[0] * 4, rms[1]), **kw)
        pos = torch.arange(8, device=device)
        e.model.forward(torch.tensor(RING_SEQ[:8], device=device), pos, torch.ones_like(pos, dtype=torch.bool))
        pos = torch.arange(8, 16, device=device)
        lg, _ = e.model.forward(torch.tensor(RING_SEQ[8:16], device=device), pos, torch.arange(8, device=device) < 6)
        logits[kernels] = lg[:6].double().cpu()
    want, got = logits[NORM_QKV_BASE], logits[NORM_QKV_BASE + "+norm_qkv"]
    return {"rel_err": float((got - want).abs().max() / want.abs().max()), "calls": ops.norm_qkv_calls - counts[0],
            "adds": ops.residual_adds - counts[1], "fallbacks": dict(ops.fallbacks)}


def sampling_block(device: str = "cpu") -> dict:
    """The sampling kernels' distributions of one 8-row logits block against the fallback's."""
    out = {}
    for kernels in ("torch", "sampling"):
        e = RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=256, dtype="fp32", kernels=kernels))
        runner, _ = e.runner(3, 20)
        e.state.temperature.fill_(1.0)
        e.state.top_p.fill_(0.95)
        logits = torch.randn(8, e.config.vocab_size, generator=torch.Generator().manual_seed(5)).to(device) * 2
        out[kernels] = runner.dist(logits)
    (ti, tp), (ki, kp) = out["torch"], out["sampling"]
    return {"same_ids": bool(torch.equal(ti.cpu(), ki.cpu())), "prob_err": float((tp - kp).abs().max())}


def decode(kernels: str, device: str = "cpu", dtype: str = "fp32") -> dict:
    engine = RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=256, dtype=dtype, kernels=kernels))
    out = {}
    for i, drafts in CASES:
        steps = fast_steps(engine, PROMPTS[i], 40 + i, drafts, n=N_TOKENS)
        out[f"{i}-{drafts}"] = {"tokens": tokens(steps), "rounds": [(s.drafts, s.accepted) for s in steps]}
    return out


@pytest.mark.slow
def test_interpreted_kernels_decode_like_the_torch_fallback():
    from iquest.kernels.testing import run_worker

    results = run_worker(os.path.abspath(__file__))
    got = results["decode"]
    assert "error" not in got, got.get("error")
    moe, samp = results["moe_block"], results["sampling_block"]
    assert "error" not in moe and "error" not in samp, (moe, samp)
    print(f"[interpreted MoE kernels] relative logit error {moe['rel_err']:.2e} (tolerance {MOE_BLOCK_TOL})")
    assert moe["rel_err"] < MOE_BLOCK_TOL
    rng = results["rng_identical"]
    assert "error" not in rng and rng["identical"], rng  # one-launch Philox: the same tokens and acceptances
    rope = results["rope_block"]
    assert "error" not in rope, rope
    print(f"[interpreted rotary + KV write kernel] {rope}")
    assert rope["outputs_identical"] and rope["caches_identical"] and not rope["fallbacks"], rope
    fused = results["residual_block"]
    assert "error" not in fused, fused
    print(f"[interpreted residual add folded into the next norm] {fused}")
    # 2 forwards x 4 layers (3 next-layer norms + the final norm) + the draft head's norm
    assert fused["outputs_identical"] and fused["caches_identical"] and not fused["fallbacks"], fused
    assert fused["fused_calls"] == 2 * 4 + 1, fused
    _check_norm_qkv(results["norm_qkv_block"], results["norm_qkv_broken"], TINY_LAYERS)
    split = results["moe_prefill_split"]
    assert "error" not in split, split
    print(f"[interpreted MoE kernel, 72-row block] kernel calls {split['calls']}, relative error {split['rel_err']:.2e}")
    assert len(split["calls"]) > 1 and sum(split["calls"]) == 72 and split["rel_err"] < MOE_BLOCK_TOL
    print(f"[interpreted sampling kernels] same candidates {samp['same_ids']}, max prob error {samp['prob_err']:.1e}")
    assert samp["same_ids"] and samp["prob_err"] < 1e-6
    torch_engine = RankEngine(TINY, Parallel.single(), EngineOptions(max_context=256, dtype="fp32"))
    want = decode("torch")
    for i, drafts in CASES:
        key = f"{i}-{drafts}"
        # The interpreted kernels' own distributions are not available in this process: the fallback's
        # stand in for both sides (fp32 kernels differ from it by rounding only), so only support is checked.
        result = compare(PROMPTS[i], got[key]["tokens"], want[key]["tokens"], fast_dist(torch_engine),
                         fast_dist(torch_engine), TOLERANCE["fp32"])
        print(f"[interpreted kernels, {key}] {result}")
        assert result.explained and result.agreed >= N_TOKENS // 2, str(result)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_rope_kernel_decodes_bit_identically(dtype):
    """The fused rotary + KV-write kernel must change nothing, in either dtype (passed at 8530935)."""
    got, want = decode("rope", "cuda", dtype), decode("torch", "cuda", dtype)
    assert got == want


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_rng_kernel_decodes_bit_identically(dtype):
    """The one-launch Philox uniforms must change nothing: same tokens and acceptance sequence."""
    assert decode("rng", "cuda", dtype) == decode("torch", "cuda", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_residual_fold_changes_nothing(dtype):
    """The residual add folded into the next norm: the same outputs and caches per block, and the same tokens
    and acceptance sequence over a decode, as every other kernel without it."""
    from iquest.fast.ops import STAGES

    fused = residual_block("cuda", dtype)
    assert fused["outputs_identical"] and fused["caches_identical"] and not fused["fallbacks"], fused
    unfused = "triton-residual"
    assert "residual" in STAGES and decode("triton", "cuda", dtype) == decode(unfused, "cuda", dtype)


TINY_LAYERS = 4


def _check_norm_qkv(r: dict, broken: dict, layers: int) -> None:
    assert "error" not in r and "error" not in broken, (r, broken)
    print(f"[norm_qkv] relative logit error {r['rel_err']:.2e} (tolerance {NORM_QKV_TOL:.0e}); "
          f"control {broken['rel_err']:.2e}")
    # two forwards, each adding in every layer's combine but the last's and normalizing in every layer's q/k/v but the
    # first's
    assert r["calls"] == r["adds"] == 2 * (layers - 1) and not r["fallbacks"], r
    assert r["rel_err"] <= NORM_QKV_TOL, r
    assert broken["calls"] == r["calls"] and broken["rel_err"] > 100 * NORM_QKV_TOL, broken


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_norm_qkv_block(dtype):
    """The input norm done on load, per block on the GPU: fp32 within NORM_QKV_TOL; bf16 (a rounding of the normalized
    rows that may flip) within the fallback comparison's bf16 tolerance of the logits' range."""
    r, broken = norm_qkv_block("cuda", dtype), norm_qkv_block("cuda", dtype, broken=True)
    if dtype == "fp32":
        _check_norm_qkv(r, broken, TINY_LAYERS)
    else:
        print(f"[norm_qkv bf16] {r}; control {broken}")
        assert r["calls"] == r["adds"] == 2 * (TINY_LAYERS - 1) and r["rel_err"] < 0.02 < broken["rel_err"], (r, broken)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_norm_qkv_decodes_like_without_it(dtype):
    """A decode with the input norm done on load (stage norm_qkv) against the same kernels without it, through the
    captured loop: every divergence explained by the two engines' own distributions (a numerical change)."""
    kernels = "triton-norm_qkv" if dtype == "bf16" else GPU_KERNELS["fp32"] + "+moe+rope_sum+residual"
    got, want = decode(kernels + "+norm_qkv", "cuda", dtype), decode(kernels, "cuda", dtype)
    engines = [RankEngine(TINY, Parallel.single("cuda"), EngineOptions(max_context=256, dtype=dtype, kernels=k))
               for k in (kernels + "+norm_qkv", kernels)]
    for i, drafts in CASES:
        key = f"{i}-{drafts}"
        result = compare(PROMPTS[i], got[key]["tokens"], want[key]["tokens"], fast_dist(engines[0]),
                         fast_dist(engines[1]), TOLERANCE[dtype])
        print(f"[norm_qkv decode {dtype}, {key}] {result}")
        assert result.explained, str(result)  # that the fold ran is counted per block: test_cuda_norm_qkv_block


@pytest.mark.gpu
def test_cuda_moe_splits_prefill_blocks():
    split = moe_prefill_split("cuda")
    assert len(split["calls"]) > 1 and sum(split["calls"]) == 72 and split["rel_err"] < MOE_BLOCK_TOL, split


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_kernels_decode_like_the_torch_fallback(dtype):
    got, want = decode(GPU_KERNELS[dtype], "cuda", dtype), decode("torch", "cuda", dtype)
    # Each side's divergence is explained with its own engine's distributions.
    with_kernels, fallback = (RankEngine(TINY, Parallel.single("cuda"),
                                         EngineOptions(max_context=256, dtype=dtype, kernels=k))
                               for k in (GPU_KERNELS[dtype], "torch"))
    for i, drafts in CASES:
        key = f"{i}-{drafts}"
        result = compare(PROMPTS[i], got[key]["tokens"], want[key]["tokens"], fast_dist(with_kernels),
                         fast_dist(fallback), TOLERANCE[dtype])
        print(f"[cuda kernels {dtype}, {key}] {result}")
        assert result.explained, str(result)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([("decode", lambda: decode(DECODE_KERNELS)),
                 ("moe_block", lambda: {"rel_err": moe_block_error()}),
                 ("moe_prefill_split", moe_prefill_split),
                 ("rope_block", rope_block),
                 ("residual_block", residual_block),
                 ("norm_qkv_block", norm_qkv_block),
                 ("norm_qkv_broken", lambda: norm_qkv_block(broken=True)),
                 ("rng_identical", lambda: {"identical": decode("rng") == decode("torch")}),
                 ("sampling_block", sampling_block)])


def test_shapes_a_kernel_cannot_take_fall_back_and_are_counted():
    """The micro preset's 8-wide FP8 blocks and 8-wide heads are below what the kernels take: each such call runs
    the fallback (same result as TorchOps) and is counted, so reports can say which stages were not kernels."""
    from iquest.fast.ops import STAGES, TritonOps, make_ops
    from iquest.fast.torch_ops import TorchOps
    from iquest.fast.weights import FP8Weight
    from iquest.reference.fp8 import E4M3

    ops = make_ops("triton")
    g = torch.Generator().manual_seed(3)
    w = FP8Weight((torch.randn(16, 16, generator=g) * 64).clamp(-448, 448).to(E4M3),
                  torch.rand(2, 2, generator=g) + 0.5, (8, 8), torch.float32)
    x = torch.randn(3, 16, generator=g)
    assert torch.equal(ops.linear(w, x), TorchOps().linear(w, x))
    assert ops.fallbacks == {"linear": 1}
    # A shape the kernel takes is not counted: a 16-wide block runs the kernel path's checks, not the fallback.
    assert TritonOps.moe_takes((16, 16), (16, 16), 32) and not TritonOps.moe_takes((8, 8), (8, 8), 32)
    assert not TritonOps.moe_takes((16, 16), (16, 16), 24)  # groups must divide the rank's intermediate slice
    assert "rope" in make_ops("triton").stages  # its GPU tests passed (bench/results/gpu-tests-rope-8530935.log)
    # bit-identical on the H200, kernel cases and a decode (bench/results/gpu-tests-direct-123b6fb.log)
    assert "linear_direct" in make_ops("triton").stages and "linear_direct" not in make_ops("triton-linear_direct").stages
    # Their GPU tests passed (bench/results/gpu-tests-kernels-edc6542.log): part of "triton".
    assert {"lm_head", "rng", "route"} <= make_ops("triton").stages == frozenset(STAGES)


def test_stage_sets_drop_stages():
    """"triton-x" is every qualified stage but x (the A/B of one stage, as the GPU decode tests and the benchmarks run
    it); drops apply to what their part has so far; an unknown stage, kept or dropped, is refused."""
    from iquest.fast.ops import STAGES, make_ops

    assert make_ops("triton-settle").stages == frozenset(STAGES) - {"settle"}
    assert make_ops("triton-settle-embed+prefetch").stages == frozenset(STAGES) - {"settle", "embed"} | {"prefetch"}
    assert make_ops("linear+attention-linear").stages == {"attention"}
    for bad in ("triton-bogus", "triton-", "bogus"):
        with pytest.raises(ValueError, match="unknown kernels"):
            make_ops(bad)


def test_f16_tile_only_where_the_moe_kernel_takes_the_blocks():
    """The post-attention norm writes the MoE's fp16 operand tiles only for weight blocks the MoE kernel takes: the
    micro preset's 8-wide blocks have no tile (the first GPU qualification at b1ac415 stopped on exactly this:
    "moe: block 8 has no power-of-two divisor >= 16"), and a hidden size that is not whole tiles has none."""
    from iquest.fast.ops import make_ops

    ops = make_ops("triton")
    assert ops.f16_tile((128, 128), 6144) == 128 and ops.f16_tile((16, 16), 256) == 16
    assert ops.f16_tile((32, 256), 512) == 128  # Gate/Up's K tile: at most 128 wide
    assert ops.f16_tile((8, 8), 64) is None and ops.f16_tile((4, 24), 96) is None and ops.f16_tile(None, 64) is None
    assert ops.f16_tile((32, 48), 96) is None  # not a power of two: the MoE kernel falls back, no tiles to make
    assert ops.f16_tile((128, 128), 6144 + 64) is None


def test_fallback_routers_widened_once_at_build():
    """The torch fallback routes with an fp32 copy of each router made when the engine is built (not per call); the
    copy is exact, the held router stays bf16, and an engine whose routing is the kernel makes no copy."""
    def routers(kernels):
        e = RankEngine(TINY, Parallel.single("cpu"), EngineOptions(max_context=64, dtype="fp32", kernels=kernels))
        return [(lw.router, lw.router32) for lw in (*e.model.w.layers, e.model.w.mtp.block)]

    for held, copy in routers("torch"):
        assert held.dtype == torch.bfloat16 and copy.dtype == torch.float32 and torch.equal(copy, held.float())
    assert all(copy is None for _, copy in routers("linear+route"))  # the router kernel reads the bf16 rows
