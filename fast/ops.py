"""The two implementations of the model's heavy stages, chosen once per engine (`EngineOptions.kernels`).

`TorchOps` is the fallback every device runs (CPU CI included): dequantized matmuls, masked attention
over the whole static cache, gathered-expert MoE, a full sort for top-k, Philox in integer ops. `TritonOps`
calls the kernels of `kernels/`: the FP8 block-scaled linear (q/k/v as one weight; split-K summed in the
launch); split-KV decode attention, which evaluates visibility from `slot_pos` in the kernel and reads a
full layer only up to the block's last position (which the kernels take from the positions: no host read,
graph-capturable); rotary (from the model's tables) + KV write in one launch; the embedding lookup in one; RMSNorm with and without the residual add (the MoE
output's add folded into the next norm); router logits with softmax/top-k; the MoE over live rows, each chosen
expert's weights read once, with act_quant'ed E4M3 activations into Down; the LM head from its bf16 rows; the
tiled top-k scan and the global top-k/top-p (a draft depth's draw and state update inside it); the accept step and
the settle step, one kernel each; Philox uniforms in one launch. Same math; the kernels round
differently (fp32 accumulation in other orders, E4M3 activations into Down), which the qualification suite
measures. At one decode block every kernel
is launch- or latency-bound, so the point of most of them is fewer launches (docs/PERF.md), and every one is
launched with programmatic dependent launch ("pdl", kernels/launch.py) so that its start overlaps the previous
kernel's tail.
"""

from __future__ import annotations

import os

import torch

from .cache import LayerKV
from .profiling import stage
from .residual import PendingNorm, Residual
from .torch_ops import TorchOps
from .weights import FP8Weight


# "triton" = every stage whose kernels passed their GPU tests (docs/PERF.md); qualified with `iquest qualify` at
# 7f9f77c. residual (added after): the MoE output's residual add folded into the next norm kernel, one launch fewer
# per layer; bit-identical to the add then the norm kernel on the GPU (bench/results/gpu-tests-residual-*.log), so
# that qualification holds for it.
# "pdl" is not a kernel but how all of them launch (programmatic dependent launch, kernels/launch.py): the same
# bits, 10,572 -> 9,779 us a full-size round on an H200 (docs/PERF.md,
# bench/results/step-full-tp8slice-ctx1k-d5-pdl-a788a79.*).
# "f16" is the MoE's operand format: fp16 instead of bf16 into the tensor cores (kernels/f16_operands.py), so E4M3
# weights convert in one instruction per two; bf16 activations are scaled into exact fp16 by powers of two. The same
# bits as bf16 operands on every GPU test and decode (tests/test_kernel_f16_operands.py) and in qualification (every
# value of the 8b8e3a1 report again at 6177dfe); 48.6 -> 37.5 us a call, 9,228 -> 8,208 us a full-size round.
# "f16_norm": the post-attention norm also writes the MoE input's fp16 operand tiles (kernels/rmsnorm_residual.py),
# which every Gate/Up program rescaled for itself before: the same operands, so the same bits. "tma": the MoE reads
# its weight tiles through tensor descriptors (kernels/moe.py), the same tiles. At 242fbb5 on an H200 (docs/PERF.md,
# bench/results/*-242fbb5.*): MoE 37.4 -> 30.8 us a call with both, all "="; full-size round 8,108 (neither) -> 7,663
# (f16_norm) -> 7,413 us (both), same process.
STAGES = ("linear", "attention", "norm", "moe", "sampling", "rope", "lm_head", "rng", "route", "residual", "pdl",
          "f16", "f16_norm", "tma", "embed", "sample_draw", "accept", "settle", "preload", "early", "fp8_down",
          "rope_sum", "norm_qkv", "linear_direct")
# "settle": the round's settle step (commit, log, stop, round record) and the next drafting's inputs as one kernel
# (kernels/settle.py) instead of ~45 torch kernels; integer bookkeeping, the same state (tests/test_kernel_settle.py).
# "embed": the embedding lookup in one launch (kernels/embed.py) instead of eight torch kernels, six times a round;
# bit-identical (tests/test_kernel_embed.py, with a decode on and off on the GPU). Figures in docs/PERF.md.
# "sample_draw": a draft depth's draw (and its served probability) inside the sampling kernel, written straight into
# the draft and proposal rows (kernels/sample.global_sample), instead of ~19 torch kernels; "accept": the round's
# accept step (acceptance, residual or bonus, the commit draw, emitted tokens and logprobs) as one kernel
# (kernels/sample.accept_settle) instead of ~50. Numerical change: the draws' cumulative sums and the residual's
# normalizing sum are summed in the kernels' order, so a draw whose uniform lies within rounding of a boundary may
# differ; qualification measures it (docs/PERF.md).
# "early": kernels read what was written two launches back or earlier before their PDL wait (kernels/launch.py): the
# MoE's Down reads the routing and asks L2 for its expert's weight tile; attention's splits ask L2 for their first K/V
# slots (their range follows from the positions) and its combine counts the live splits; rotary reads its factors.
# Hints and earlier reads of final values: the same bits (the GPU tests and a decode on and off). Full-size round on an
# H200, same process: 6,635 -> 6,533 us (bench/results/step-full-tp8slice-ctx1k-d5-early-4d25f80.*; docs/PERF.md).
# "preload": the FP8 linears, the router, the norms and the attention combine (its sinks) load their constant weights
# into registers before the PDL wait (the same values in the same dots: the same bits), so those reads overlap the
# previous kernel. Full-size round on an H200, same process: 6,776 -> 6,591 us
# (bench/results/step-full-tp8slice-ctx1k-d5-67412c6.*; docs/PERF.md).
# Only when named, e.g. "triton+prefetch": measured at 0.2% of a round, within reach of noise (same file).
# "fp8_down": the MoE's Down takes its E4M3 activations and weights into the tensor cores as E4M3 (kernels/moe.py
# fp8_down; bf16/fp16 compute on the GPU only, `fp8_down_applies`): no conversions, but the MMA accumulates a tile's
# exact products in its own precision, so a numerical change. 6,615 -> 6,448 us a full-size round on an H200
# (c199d16). Qualified at 3594ef6 (docs/PERF.md): every check of the healthy run passed and 10 of 10 negative controls
# were caught, ring_exact_w by the structural cache.window check (bench/results/qualify-mini-cuda-bf16-fp8down-3594ef6.*);
# at c199d16, before that check, the bf16 logits alone held that control only by the default's rounding noise.
# "moe_fold": the MoE's finalize and combine done by the last program of each Gate/Up and Down tile to arrive (an
# atomic arrival count, as the FP8 linear's split-K sum): two launches a layer fewer, the same sums in the same order,
# so the same bits (tests/test_kernel_moe.py, and a decode on and off on the GPU). Slower: a full-size round on an H200
# 6,645 -> 7,211 us, same process (the release fence, the arrival and the one program's serial tail cost more than a
# PDL kernel boundary; bench/results/step-full-tp8slice-ctx1k-d5-fold-038ed47.*, docs/PERF.md), so only when named.
# "rope_sum": the q/k/v projection leaves its split-K partials unsummed and the rotary kernel sums them in split order
# as it loads them (kernels/rope_kv.rope_kv_parts): the same sums and roundings, so the same bits, and the projection's
# arrival count and serial tail are gone. Bit-identical on an H200: a decode through the captured loop (fp32, bf16) at
# 2dd3a78 and the kernel cases (fp32, bf16, one TP8 rank's shape) at 6d2346c, bench/results/gpu-tests-cascade-ropesum-*;
# so the qualification of the set without it holds. Full-size round, same process: 6,333 -> 6,220 us at 2dd3a78
# (bench/results/step-full-tp8slice-ctx1k-d5-cascade-2dd3a78.*; docs/PERF.md).
# "cascade": every kernel signals the next one's launch before its PDL wait instead of after it (kernels/launch.Pdl):
# kernels many launches ahead park at their waits with their constant weights loaded (preload), so the next layer's
# projections and router read theirs while this layer's experts stream. Scheduling only: the same bits. It voids the
# bound "early" relies on (two launches back are complete), so the two are refused together: "triton-early+cascade".
# Measured slower on an H200, same process: 6,499 -> 6,769 us a full-size round at 2dd3a78; so only when named
# (bench/results/step-full-tp8slice-ctx1k-d5-cascade-*.*, docs/PERF.md). "cascade" stands for one stage per op group,
# cascade_OP, so that a subset can be measured: "triton-early+cascade-cascade_moe" cascades all but the MoE's kernels.
CASCADE_OPS = ("norm", "linear", "rope", "attention", "route", "moe", "lm_head", "glue")
CASCADE = tuple(f"cascade_{op}" for op in CASCADE_OPS)
# "norm_qkv": a layer's input norm taken into the previous layer's MoE combine and its own q/k/v projection, no launch of
# its own: the combine adds its output to the stream (h), writes g = h * the norm's weight and each row's sums of h^2
# over 256-column tiles (kernels/moe.py `residual`); the projection multiplies g and scales its product's rows by
# 1 / rms (kernels/fp8_linear.py `rms`). 87 of a round's 93 input norms (not the first layer's, nor the draft layer's,
# nor a block wider than one MoE call). A numerical change: the normalized rows are rounded before their 1 / rms is
# applied, and the squares are summed in another order. Qualified on an H200 at d521403 (bf16, every check, 10/10
# controls: bench/results/qualify-mini-cuda-bf16-normqkv-d521403.*); full-size round 6,208 -> 6,100 us, same process
# (bench/results/step-full-tp8slice-ctx1k-d5-normqkv-d521403.*; docs/PERF.md). Normalizing every loaded tile in the
# projection instead (1e78bc2) cost it 1.7 us a call, all the norm saved. Taken only where the collectives are local
# (one rank, or a rank-slice benchmark): at TP > 1 the MoE output's all-reduce sits between the combine and the add,
# and a fused all-reduce would have to write h, g and the sums itself.
# "linear_direct": the decode FP8 linears (rows <= 8, preloading; q/k/v and o_proj) by kernels/fp8_linear_direct.py's
# Gluon kernel, which loads each thread's MMA operands straight into registers from a copy of the weight in the
# fragments' order (made at prepare: ~1 GB more at one full-size TP8 rank). The same tiles, scales, order and splits as
# the Triton kernel's preloading path: the same bits (tests/test_kernel_fp8_linear_direct.py on the H200, kernel cases
# and a decode through the captured loop with the calls counted), so the qualification of the set without it holds.
# Full-size round on an H200, same process: 6,098.9 -> 5,735.1 us at 123b6fb (q/k/v 5.91 -> 4.11 us, o_proj 5.89 ->
# 3.80 us a call in the captured forward; bench/results/*-123b6fb.*, docs/PERF.md). "direct_qkv" and "direct_o" take
# one kind only, "direct_hold" makes the copies without reading them, "direct_smem" and "direct_driver" change the
# kernel's shared-memory carveout (diagnostics: the carveout is what made the direct o_proj slow the round at first).
# "carveout_l1", "carveout_smem" (benchmarks only): every kernel compiled in the process so far prefers the least (or
# the most) shared memory, set when the engine is prepared, before its capture (kernels/launch.prefer_carveout);
# "carveout_small": the least, for the kernels using at most 48 KB of shared memory only.
OPT_IN: tuple[str, ...] = ("prefetch", "moe_fold", "direct_qkv", "direct_o", "direct_hold",
                           "direct_smem", "direct_driver", "carveout_l1", "carveout_smem", "carveout_small") + CASCADE


LINEAR_LOCKS = 4096  # arrival counters: one per output tile of the largest decode and prefill-block linear (or MoE)


class TritonOps(TorchOps):
    """The kernels for the chosen `stages` (all by default); the other stages stay on the fallback."""

    name = "triton"
    MAX_MATRIX_ROWS = 128  # decode_attention packs rows x query heads per KV head into one matrix

    def __init__(self, stages: tuple[str, ...] = STAGES) -> None:
        self.stages = frozenset(stages)
        # Programmatic dependent launch of every kernel (kernels/launch.py): scheduling only, the same bits; taken for
        # CUDA tensors only (`_pdl`). With it, "prefetch" lets the FP8 linears and the router ask L2 for their
        # constant weights before the wait.
        self.pdl = "pdl" in self.stages
        self.prefetch = self.pdl and "prefetch" in self.stages
        self.preload = self.pdl and "preload" in self.stages
        self.f16 = "f16" in self.stages
        self.f16_norm = self.f16 and {"f16_norm", "moe", "norm"} <= self.stages
        self.tma = "tma" in self.stages and "moe" in self.stages
        self.fp8_down = "fp8_down" in self.stages
        self.early = self.pdl and "early" in self.stages
        self.cascade_ops = frozenset(op for op in CASCADE_OPS if self.pdl and f"cascade_{op}" in self.stages)
        self.cascade = bool(self.cascade_ops)
        self.norm_qkv = "norm_qkv" in self.stages and {"moe", "linear", "rope", "rope_sum"} <= self.stages
        # stage linear_direct: both kinds of decode linear; direct_qkv, direct_o: one of them; direct_hold: the copies
        # made but not read (diagnostics: which of them moves what in the round)
        self.direct_qkv = self.preload and bool({"linear_direct", "direct_qkv"} & self.stages)
        self.direct_o = self.preload and bool({"linear_direct", "direct_o"} & self.stages)
        self.hold_direct = self.direct_qkv or self.direct_o or (self.preload and "direct_hold" in self.stages)
        # direct_smem, direct_driver (diagnostics): the direct kernel's preferred shared-memory carveout all shared
        # memory, or the driver's choice, instead of its default (least shared memory: kernels/fp8_linear_direct.py)
        self.direct_carveout = 100 if "direct_smem" in self.stages else -1 if "direct_driver" in self.stages else None
        self.direct_calls = 0  # FP8 linear calls by the direct kernel (tests check the path was taken)
        self.carveout_kernels = 0  # kernels whose carveout stage carveout_l1 / carveout_smem set (likewise)
        if self.cascade and self.early:
            raise ValueError("stage 'cascade' lets kernels launch any number of launches ahead, so the reads 'early' "
                             "makes before the wait are no longer final: drop it, e.g. 'triton-early+cascade'")
        self.f16_norm_calls = 0  # norms that wrote the MoE's operand tiles (tests check the path was taken)
        self.tma_calls = 0  # MoE calls through tensor descriptors (likewise)
        self.fp8_down_calls = 0  # MoE calls whose Down took E4M3 operands (likewise)
        self.embed_calls = 0  # embedding lookups by the kernel (likewise)
        self.sample_draw_calls = 0  # draft draws inside the sampling kernel (likewise)
        self.accept_calls = 0  # accept steps by the one kernel (likewise)
        self.settle_calls = 0  # settle steps by the one kernel (likewise)
        self.preload_calls = 0  # FP8 linear calls that preloaded their weight tiles (likewise)
        self.moe_fold_calls = 0  # MoE calls with the finalize and combine folded in (likewise)
        self.early_calls = 0  # MoE and attention calls that read ahead of their wait (likewise)
        self.rope_sum_calls = 0  # q/k/v projections summed by the rotary kernel (likewise)
        self.cascade_calls = 0  # kernel calls launched to signal before their wait (likewise)
        self.residual_adds = 0  # MoE calls whose combine added the residual stream (likewise)
        # Benchmarks only (bench/graph_trace.py): a list receives each preloading FP8 linear call's per-program timeline
        # ({"n", "k", "stamps"}: fp8_linear(stamps=)) while it is not None
        self.linear_stamps: list | None = None
        self.norm_qkv_calls = 0  # q/k/v projections that took their input norm as a row scaling (likewise)
        self.fallbacks: dict[str, int] = {}  # stage -> calls the kernel could not take (see _fits)
        self._locks: torch.Tensor | None = None
        if os.environ.get("TRITON_INTERPRET") == "1":  # on CPU: the interpreter, with its loop-bound fix
            from ..kernels.testing import patch_interpreter

            patch_interpreter()
        from ..kernels import moe, sample, topk
        from ..kernels.f16_operands import empty_tiles
        from ..kernels.moe import fp8_down_applies, gate_up_k_tile, lock_count as moe_lock_count, tma_fits
        from ..kernels.decode_attention import decode_attention
        from ..kernels.fp8_linear import direct_applies, fp8_linear, linear_stamps, lock_count, preload_plan
        from ..kernels.fp8_linear_direct import direct_weight
        from ..kernels.lm_head import lm_head
        from ..kernels.moe_route import MAX_PAIRS
        from ..kernels.philox import uniforms
        from ..kernels.router import route as router_route
        from ..kernels.rmsnorm_residual import rmsnorm, rmsnorm_residual
        from ..kernels.rope_kv import rope_kv, rope_kv_parts
        from ..kernels.embed import embed
        from ..kernels.launch import Pdl
        from ..kernels.settle import settle

        self._attention, self._linear, self._lm_head, self._lock_count = decode_attention, fp8_linear, lm_head, lock_count
        self._settle, self._preload_plan, self._fp8_down_applies = settle, preload_plan, fp8_down_applies
        self._direct_applies, self._direct_weight = direct_applies, direct_weight
        self._linear_stamps = linear_stamps
        self._moe, self._topk, self._global_dist = moe.moe, topk.local_topk_keys, sample.global_dist
        self._global_sample, self._accept_settle, self._max_k = sample.global_sample, sample.accept_settle, sample.MAX_K
        self._max_pairs, self._uniforms, self._route = MAX_PAIRS, uniforms, router_route
        self._add_norm, self._norm, self._rope_kv, self._embed = rmsnorm_residual, rmsnorm, rope_kv, embed
        self._gate_up_k_tile, self._tma_fits, self._empty_tiles = gate_up_k_tile, tma_fits, empty_tiles
        self._moe_lock_count, self._rope_kv_parts = moe_lock_count, rope_kv_parts
        self._residual_buffers = moe.residual_buffers
        self._Pdl = Pdl  # kernels/launch.py is imported with the kernels, not at module level

    def _fits(self, stage: str, ok: bool) -> bool:
        """Whether `stage` runs as its kernel here; a shape the kernel cannot take (the 8-wide blocks and heads of
        the micro preset, long prefill blocks) falls back and is counted in `self.fallbacks`."""
        if stage not in self.stages:
            return False
        if not ok:
            self.fallbacks[stage] = self.fallbacks.get(stage, 0) + 1
        return ok

    def _pdl(self, t: torch.Tensor, op: str) -> Pdl:
        """How a kernel call of `op` (one of CASCADE_OPS) on `t` launches (kernels/launch.Pdl)."""
        if not (self.pdl and t.is_cuda):
            return self._Pdl.OFF
        if op in self.cascade_ops:
            self.cascade_calls += 1
            return self._Pdl.CASCADE
        return self._Pdl.CHAINED

    def _prefetch(self, t: torch.Tensor) -> bool:
        return self.prefetch and t.is_cuda

    def _preload(self, t: torch.Tensor) -> bool:
        return self.preload and t.is_cuda

    @staticmethod
    def moe_takes(gate_block: tuple[int, int], down_block: tuple[int, int], intermediate: int) -> bool:
        """Whether the MoE kernel takes these weights: its act_quant groups are Down's K blocks (a power of two
        >= 16 dividing the rank's intermediate size), and Gate/Up share that block width."""
        group = down_block[1]
        return gate_block[1] == group and intermediate % group == 0 and TritonOps.moe_group(group)

    @staticmethod
    def moe_group(width: int) -> bool:
        """Whether the MoE kernel takes weight blocks this wide along K: a power of two >= 16."""
        return width >= 16 and width & (width - 1) == 0

    @staticmethod
    def _k_tiles(n: int) -> bool:
        """Whether a weight block of n columns holds whole K tiles of 16 (the kernels' smallest)."""
        return n >= 16 and n % 16 == 0

    def linear(self, w: FP8Weight, x: torch.Tensor) -> torch.Tensor:
        if not self._fits("linear", w.q.dim() == 2 and self._k_tiles(w.block[1])):
            return super().linear(w, x)
        return self._fp8(w, x)

    def _fp8(self, w: FP8Weight, x: torch.Tensor, unsummed: bool = False, rms: tuple | None = None,
             qkv: bool = False) -> torch.Tensor:
        preload = self._preload(x)
        stamps = direct = None
        tiles = self._preload_plan(x.shape[0], *w.q.shape, w.block, device=x.device) if preload else 0
        if tiles:
            self.preload_calls += 1
            if ((self.direct_qkv if qkv else self.direct_o) and w.direct is not None and x.shape[0] <= 8
                    and self._direct_applies(x, w.block[1], tiles)):  # a decode block: one row block of 8
                direct = w.direct
                self.direct_calls += 1
            elif self.linear_stamps is not None and x.is_cuda:  # a timeline of this call (bench/graph_trace.py)
                stamps = self._linear_stamps(x.shape[0], *w.q.shape, w.block, x.device)
                self.linear_stamps.append({"n": w.q.shape[0], "k": w.q.shape[1], "stamps": stamps})
        locks = self._locks  # None before prepare(), too few for a long prefill block: the sum as a second pass
        fits = (locks is not None
                and self._lock_count(x.shape[0], w.q.shape[0], direct=direct is not None) <= locks.numel())
        return self._linear(x, w.q, w.scale, w.block, out_dtype=x.dtype, locks=locks if fits else None,
                            pdl=self._pdl(x, "linear"), prefetch=self._prefetch(x), preload=preload,
                            unsummed=unsummed, rms=rms, stamps=stamps, direct=direct,
                            direct_carveout=self.direct_carveout if direct is not None else None)

    def qkv_rope(self, lw, kv, x, head_dim, cos, sin, rope_rows, positions, live):
        w = lw.wqkv
        pending, rms = x, None
        if isinstance(x, PendingNorm):  # the input norm as g's product scaled by 1 / rms (stage norm_qkv)
            x, rms = x.residual.g, (x.residual.sumsq, x.eps)
        takes = (w is not None and {"linear", "rope"} <= self.stages and self._k_tiles(w.block[1])
                 and rope_rows is not None and self._rope_takes(head_dim, kv, x.dtype))
        if not self._fits("rope_sum", takes):
            return super().qkv_rope(lw, kv, self.normed(pending), head_dim, cos, sin, rope_rows, positions, live)
        self.rope_sum_calls += 1
        self.norm_qkv_calls += rms is not None
        parts = self._fp8(w, x, unsummed=True, rms=rms, qkv=True)
        nq, nk = lw.wq.q.shape[0] // head_dim, lw.wk.q.shape[0] // head_dim
        return self._rope_kv_parts(parts, nq, nk, cos, sin, positions, live, kv.k, kv.v, kv.slot_pos, dtype=x.dtype,
                                   rope_rows=rope_rows, pdl=self._pdl(x, "rope"), early=self.early)

    def prepare(self, w):
        if "lm_head" not in self.stages:  # the fallbacks' fp32 copies, only for the stages that fall back
            w.hold_lm_head_fp32()
        if "route" not in self.stages:
            w.hold_router_fp32()
        # The arrival counters of the FP8 linear's split-K sum and the MoE's folded finalize and combine: zeroed once,
        # before any capture; every call leaves them zeroed, and the engine's calls run one after another on one stream.
        self._locks = torch.zeros(LINEAR_LOCKS, dtype=torch.int32, device=w.embed.device)
        if self.hold_direct and w.embed.is_cuda:  # the linears' weights in the MMA's order (stage linear_direct)
            w.hold_linear_direct(self._direct_weight)
        if w.embed.is_cuda and {"carveout_l1", "carveout_smem", "carveout_small"} & self.stages:  # benchmarks only
            from ..kernels.launch import prefer_carveout

            if "carveout_small" in self.stages:  # the least shared memory for kernels using at most 48 KB
                self.carveout_kernels = prefer_carveout(0, max_shared=48 * 1024)
            else:
                self.carveout_kernels = prefer_carveout(0 if "carveout_l1" in self.stages else 100)

    def lm_head(self, a, w):
        if not self._fits("lm_head", True):
            return super().lm_head(a, w)
        return self._lm_head(a.contiguous(), w.lm_head, pdl=self._pdl(a, "lm_head"))

    def qkv(self, lw, x):
        w = lw.wqkv
        if w is None or not self._fits("linear", self._k_tiles(w.block[1])):
            return super().qkv(lw, x)
        y = self._fp8(w, x, qkv=True)  # one launch: column views, no copies
        nq, nk = lw.wq.q.shape[0], lw.wk.q.shape[0]
        return y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:]

    @stage("norm")  # an override keeps the label of the method it replaces (the breakdown's norms)
    def norm(self, x, weight, eps, out=None):
        if not self._fits("norm", True):
            return super().norm(x, weight, eps, out)
        return self._norm(x.contiguous(), weight, eps, out=out, pdl=self._pdl(x, "norm"), preload=self._preload(x))

    def rotary(self, cos, sin, rope_rows):
        if "rope" not in self.stages:
            return super().rotary(cos, sin, rope_rows)
        return cos, sin, rope_rows  # the kernel gathers each row's entries itself

    @staticmethod
    def _rope_takes(head_dim: int, kv: LayerKV, dtype: torch.dtype) -> bool:
        """Whether the rotary kernel takes these heads: a power-of-two head_dim, a cache in the activations' dtype."""
        return head_dim >= 2 and head_dim & (head_dim - 1) == 0 and kv.k.dtype == dtype

    def rope_write(self, kv, q, k, v, cos, sin, rope_rows, positions, live):
        d = q.shape[-1]
        if not self._fits("rope", self._rope_takes(d, kv, q.dtype)):
            return super().rope_write(kv, q, k, v, cos, sin, rope_rows, positions, live)
        dense = (lambda t: t if t.stride(-1) == 1 and t.stride(-2) == d else t.contiguous())  # row views pass as is
        return self._rope_kv(dense(q), dense(k), dense(v), cos, sin, positions, live, kv.k, kv.v, kv.slot_pos,
                             rope_rows=rope_rows, pdl=self._pdl(q, "rope"), early=self.early)

    def embed(self, tokens, w):
        if not self._fits("embed", w.embed.is_contiguous()):
            return super().embed(tokens, w)
        self.embed_calls += 1
        return self._embed(tokens.contiguous(), w.embed, w.vocab_offset, pdl=self._pdl(tokens, "glue"))

    @stage("norm")
    def residual_norm(self, x, residual, weight, eps):
        # The same kernel as `norm` with its residual input on: the sum is rounded to x's dtype and the norm reads
        # that rounded row, as the unfused add then the norm kernel does, so the two are bit-identical. Without the
        # norm kernel (torch's norm rounds differently) the fold is not taken, and the call counts as a fallback.
        if not self._fits("residual", "norm" in self.stages):
            return super().residual_norm(x, residual, weight, eps)
        y, h = self._add_norm(residual.contiguous(), x.contiguous(), weight, eps, out_dtype=x.dtype,
                              pdl=self._pdl(x, "norm"), preload=self._preload(x))
        return h, y

    @stage("norm")
    def add_norm(self, x, residual, weight, eps, moe_block=None):
        if not self._fits("norm", True):
            return super().add_norm(x, residual, weight, eps, moe_block)
        f16_input = None
        tile = self.f16_tile(moe_block, x.shape[1])
        if self.f16_norm and tile and x.dtype == torch.bfloat16:  # bf16: what moe() rounds b32 to
            f16_input = self._empty_tiles(*x.shape, tile, x.device)
            self.f16_norm_calls += 1
        y, h = self._add_norm(residual.contiguous(), x.contiguous(), weight, eps, out_dtype=torch.float32,
                              f16_out=f16_input, pdl=self._pdl(x, "norm"), preload=self._preload(x))
        return h, y, f16_input

    def route(self, b32, lw, top_k, norm_topk_prob, scaling):
        if not self._fits("route", True):
            return super().route(b32, lw, top_k, norm_topk_prob, scaling)
        return self._route(b32, lw.router, top_k, norm_topk_prob, scaling, pdl=self._pdl(b32, "route"),
                           prefetch=self._prefetch(b32), preload=self._preload(b32))

    def f16_tile(self, moe_block: tuple[int, int] | None, hidden: int) -> int | None:
        """The width of the MoE input's fp16 operand tiles for weight blocks `moe_block` (Gate/Up's K tile), or None
        where the MoE kernel does not take such blocks (`moe_group`: e.g. the micro preset's 8) or the hidden size is
        not whole tiles."""
        if moe_block is None or not self.moe_group(moe_block[1]):
            return None
        tile = self._gate_up_k_tile(moe_block)
        return tile if hidden % tile == 0 else None

    def moe(self, b, experts, weights, live, gate, up, down, compute_dtype=None, f16_input=None, residual=None):
        if not self._fits("moe", self.moe_takes(gate.block, down.block, down.q.shape[-1])):
            return super().moe(b, experts, weights, live, gate, up, down, compute_dtype)
        tma = self.tma and self._tma_fits(gate.q, up.q, down.q)
        self.tma_calls += tma
        self.fp8_down_calls += self._fp8_down_applies(self.fp8_down, compute_dtype or b.dtype, b.device)
        step = self._max_pairs // experts.shape[1]  # prefill blocks exceed the kernel's pair capacity: split rows
        rows = lambda t, s: None if t is None else tuple(part[s:s + step] for part in t)
        # The arrival counters (shared with the FP8 linears': every call leaves them zeroed); None before prepare()
        locks = self._locks if "moe_fold" in self.stages else None
        if locks is not None and self._moe_lock_count(min(step, b.shape[0]), experts.shape[1], down.q.shape[-1],
                                                      b.shape[1]) > locks.numel():
            locks = None
        self.moe_fold_calls += locks is not None
        self.early_calls += self.early and self._pdl(b, "moe")
        add = None  # the next norm's add and sums of squares, where one call covers the rows and the combine runs
        if self.norm_qkv and residual is not None and locks is None and b.shape[0] <= step:
            add = (*residual, *self._residual_buffers(residual[0]))  # (stream, weight, h, g, sumsq)
            self.residual_adds += 1
        parts = [self._moe(b[s:s + step], experts[s:s + step], weights[s:s + step], live[s:s + step],
                           gate.q, gate.scale, up.q, up.scale, down.q, down.scale, gate.block,
                           group=down.block[1], out_dtype=compute_dtype or b.dtype, compute_dtype=compute_dtype,
                           pdl=self._pdl(b, "moe"), f16=self.f16,  # moe() takes it on the GPU only
                           f16_input=rows(f16_input, s), tma=tma, fp8_down=self.fp8_down, locks=locks,
                           early_down=self.early, residual=add)
                 for s in range(0, b.shape[0], step)]
        if add is not None:
            stream, weight, h, g, sumsq = add
            return Residual(h, g, sumsq, weight, parts[0])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def uniforms(self, seed, positions, purpose, depth=0, out=None):
        if not self._fits("rng", True):
            return super().uniforms(seed, positions, purpose, depth, out)
        # one launch, the same bits (tl.rand = rng.rand)
        return self._uniforms(seed, positions, purpose, depth, out=out, pdl=self._pdl(positions, "glue"))

    def _keys(self, local_logits, k, vocab_offset, gather):
        keys = self._topk(local_logits.float().contiguous(), k, vocab_offset,
                          pdl=self._pdl(local_logits, "glue"))[0]
        return gather(keys).contiguous()

    def dist(self, local_logits, k, vocab_offset, gather, top_k, temperature, top_p):
        if not self._fits("sampling", True):
            return super().dist(local_logits, k, vocab_offset, gather, top_k, temperature, top_p)
        keys = self._keys(local_logits, k, vocab_offset, gather)
        return self._global_dist(keys, top_k, temperature, top_p, pdl=self._pdl(keys, "glue"))

    def sample(self, local_logits, k, vocab_offset, gather, top_k, temperature, top_p, u, out, edit=None, chain=None):
        if edit is not None or "sampling" not in self.stages or not self._fits("sample_draw", top_k <= self._max_k):
            return super().sample(local_logits, k, vocab_offset, gather, top_k, temperature, top_p, u, out, edit,
                                  chain)
        keys = self._keys(local_logits, k, vocab_offset, gather)
        served = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        self._global_sample(keys, top_k, temperature, top_p, uniforms=u, out=out, served=served, chain=chain,
                            pdl=self._pdl(keys, "glue"))
        self.sample_draw_calls += 1
        return served

    def fuses_accept(self, kp, kq):
        return self._fits("accept", max(kp, kq) <= self._max_k)

    def accept_settle(self, p_ids, p_probs, q_ids, q_probs, drafts, k, n, seed):
        self.accept_calls += 1
        return self._accept_settle(p_ids.contiguous(), p_probs.contiguous(), q_ids, q_probs, drafts, k, n, seed,
                                   pdl=self._pdl(p_ids, "glue"))

    def settle(self, st, committed, count, emitted, n_emit, logprobs, k, a, out):
        if not self._fits("settle", True):
            return super().settle(st, committed, count, emitted, n_emit, logprobs, k, a, out)
        self.settle_calls += 1
        return self._settle(st, committed.contiguous(), count, emitted.contiguous(), n_emit, logprobs.float(), k, a,
                            out, pdl=self._pdl(st.n, "glue"))

    def attention(self, q, kv, positions, sinks):
        rows, q_heads = q.shape[0], q.shape[1]
        d = q.shape[-1]
        if not self._fits("attention", rows * (q_heads // kv.k.shape[1]) <= self.MAX_MATRIX_ROWS
                          and d >= 16 and d & (d - 1) == 0):
            return super().attention(q, kv, positions, sinks)
        # kv_len (how far a full layer's history is read) = the block's last position + 1, taken by the kernels
        self.early_calls += self.early and self._pdl(q, "attention")
        return self._attention(q.contiguous(), kv.k, kv.v, kv.slot_pos, positions, sinks, kv.window,
                               kv.first_position, causal=kv.causal, pdl=self._pdl(q, "attention"), kv_len_from_q=True,
                               preload=self._preload(q), early=self.early)


def make_ops(name: str) -> TorchOps:
    """"torch", "triton" (every qualified stage), or a '+'-joined list of stages, where "triton" stands for
    STAGES: e.g. "linear+attention", "triton+prefetch"; "-stage" drops a stage from what its part has so far, e.g.
    "triton-settle" (every qualified stage but settle: the A/B of one stage); "cascade" stands for every cascade_OP.
    "~op" (benchmarks only) removes an op from the round, e.g. "triton~moe": fast/ablation.py."""
    name, *ablated = name.split("~")
    ops = _make_ops(name)
    if ablated:
        from .ablation import ablate

        ablate(ops, set(ablated))
    return ops


def _make_ops(name: str) -> TorchOps:
    if name == "torch":
        return TorchOps()
    stages: list[str] = []
    for part in name.split("+"):
        first, *dropped = part.split("-")
        stages += STAGES if first == "triton" else CASCADE if first == "cascade" else (first,)
        stages = [s for s in stages if s not in dropped]
    unknown = (set(stages) | {d for part in name.split("+") for d in part.split("-")[1:]}) - set(STAGES) - set(OPT_IN)
    if unknown:
        raise ValueError(f"unknown kernels {name!r}: choose torch, triton or a '+'-joined list of "
                         f"{STAGES + OPT_IN} (triton = all of {STAGES}; '-stage' drops one)")
    return TritonOps(tuple(dict.fromkeys(stages)))
