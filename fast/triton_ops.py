"""The Triton dispatcher: each op of the torch forms (fast/torch_ops.py) as one call to its kernel in `kernels/`, for
the op groups the kernel plan (fast/plan.py) puts on the kernels; a shape a kernel cannot take runs the torch form
and is counted in `fallbacks`.

Same math as the torch forms; the kernels round differently (fp32 accumulation in other orders, E4M3 activations
into Down, the draws' sums in the kernels' order), which the qualification suite measures. At a decode block every
kernel is launch- or latency-bound, so most of them exist to launch less. On CUDA every kernel launches with
programmatic dependent launch (kernels/launch.py), reads its constant weights before its wait ("preload"), and
reads what was written two launches back or earlier before it ("early": the MoE's routing, attention's positions):
scheduling only, the same bits. Importing this module imports triton: the engine imports it only for a plan with
kernels.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

from ..kernels import decode_attention, embed, fp8_linear, lm_head, moe, philox, rmsnorm_residual, rope_kv, router
from ..kernels import sample, settle, topk
from ..kernels.f16_operands import empty_tiles
from ..kernels.fp8_linear_direct import direct_weight
from ..kernels.moe_route import MAX_PAIRS
from .cache import LayerKV
from .plan import KernelPlan
from .profiling import stage
from .residual import PendingNorm, Residual
from .torch_ops import TorchOps
from .weights import FP8Weight

LINEAR_LOCKS = 4096  # arrival counters: one per output tile of the largest decode or prefill-block linear
MAX_MATRIX_ROWS = 128  # decode_attention packs rows x query heads per KV head into one matrix


def moe_group(width: int) -> bool:
    """Whether the MoE kernel takes weight blocks this wide along K: a power of two >= 16."""
    return width >= 16 and width & (width - 1) == 0


def moe_takes(gate_block: tuple[int, int], down_block: tuple[int, int], intermediate: int) -> bool:
    """Whether the MoE kernel takes these weights: its act_quant groups are Down's K blocks (a power of two >= 16
    dividing the rank's intermediate size), and Gate/Up share that block width."""
    group = down_block[1]
    return gate_block[1] == group and intermediate % group == 0 and moe_group(group)


def _k_tiles(n: int) -> bool:
    """Whether a weight block of n columns holds whole K tiles of 16 (the kernels' smallest)."""
    return n >= 16 and n % 16 == 0


def _rope_takes(head_dim: int, kv: LayerKV, dtype: torch.dtype) -> bool:
    """Whether the rotary kernel takes these heads: a power-of-two head_dim, a cache in the activations' dtype."""
    return head_dim >= 2 and head_dim & (head_dim - 1) == 0 and kv.k.dtype == dtype


class TritonOps(TorchOps):
    name = "triton"

    def __init__(self, plan: KernelPlan = KernelPlan.triton()) -> None:
        self.plan = plan
        self.calls: Counter = Counter()     # kernel paths taken, by name (tests check that a path ran)
        self.fallbacks: Counter = Counter()  # op group -> calls a kernel could not take (ran the torch form)
        self._locks: torch.Tensor | None = None
        if os.environ.get("TRITON_INTERPRET") == "1":  # on CPU: the interpreter, with its loop-bound fix
            from ..kernels.testing import patch_interpreter

            patch_interpreter()

    def _fits(self, group: str, ok: bool) -> bool:
        """Whether this call of an op of `group` runs as its kernel: the plan has the group, and the kernel takes the
        shape (a shape it cannot take is counted in `fallbacks`)."""
        if not getattr(self.plan, group):
            return False
        if not ok:
            self.fallbacks[group] += 1
        return ok

    def prepare(self, w):
        if not self.plan.lm_head:  # the torch forms' fp32 copies, only for the groups that run them
            w.hold_lm_head_fp32()
        if not self.plan.moe:
            w.hold_router_fp32()
        # The arrival counters of the FP8 linear's split-K sum: zeroed once, before any capture; every call leaves them
        # zeroed, and the engine's calls run one after another on one stream.
        self._locks = torch.zeros(LINEAR_LOCKS, dtype=torch.int32, device=w.embed.device)
        if self.plan.linear and w.embed.is_cuda:  # the decode linears' weights in the MMA fragments' order
            w.hold_linear_direct(direct_weight)

    # ---- linears -------------------------------------------------------------------------------------
    def linear(self, w: FP8Weight, x: torch.Tensor) -> torch.Tensor:
        if not self._fits("linear", w.q.dim() == 2 and _k_tiles(w.block[1])):
            return super().linear(w, x)
        return self._fp8(w, x)

    def _fp8(self, w: FP8Weight, x: torch.Tensor, unsummed: bool = False, rms: tuple | None = None) -> torch.Tensor:
        cuda = x.is_cuda
        tiles = fp8_linear.preload_plan(x.shape[0], *w.q.shape, w.block, device=x.device) if cuda else 0
        direct = None
        if tiles:
            self.calls["preload"] += 1
            if w.direct is not None and x.shape[0] <= 8 and fp8_linear.direct_applies(x, w.block[1], tiles):
                direct = w.direct  # a decode block: one row block of 8
                self.calls["direct"] += 1
        locks = self._locks  # None before prepare(), too few for a long prefill block: the sum as a second pass
        fits = (locks is not None
                and fp8_linear.lock_count(x.shape[0], w.q.shape[0], direct=direct is not None) <= locks.numel())
        return fp8_linear.fp8_linear(x, w.q, w.scale, w.block, out_dtype=x.dtype, locks=locks if fits else None,
                                     pdl=cuda, preload=cuda, unsummed=unsummed, rms=rms, direct=direct)

    def qkv(self, lw, x):
        w = lw.wqkv
        if w is None or not self._fits("linear", _k_tiles(w.block[1])):
            return super().qkv(lw, x)
        y = self._fp8(w, x)  # one launch: column views, no copies
        nq, nk = lw.wq.q.shape[0], lw.wk.q.shape[0]
        return y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:]

    def qkv_rope(self, lw, kv, x, head_dim, cos, sin, rope_rows, positions, live):
        """The projection's split-K partials left unsummed, summed by the rotary kernel in split order (the same sums
        and roundings as the projection's own); given a PendingNorm, the product's rows scaled by its 1 / rms."""
        w = lw.wqkv
        pending, rms = x, None
        if isinstance(x, PendingNorm):
            x, rms = x.residual.g, (x.residual.sumsq, x.eps)
        takes = (w is not None and _k_tiles(w.block[1]) and rope_rows is not None
                 and _rope_takes(head_dim, kv, x.dtype))
        if not (self.plan.linear and self._fits("attention", takes)):
            return super().qkv_rope(lw, kv, self.normed(pending), head_dim, cos, sin, rope_rows, positions, live)
        self.calls["rope_sum"] += 1
        self.calls["fused_input_norm"] += rms is not None
        parts = self._fp8(w, x, unsummed=True, rms=rms)
        nq, nk = lw.wq.q.shape[0] // head_dim, lw.wk.q.shape[0] // head_dim
        return rope_kv.rope_kv_parts(parts, nq, nk, cos, sin, positions, live, kv.k, kv.v, kv.slot_pos,
                                     dtype=x.dtype, rope_rows=rope_rows, pdl=x.is_cuda, early=x.is_cuda)

    # ---- attention ---------------------------------------------------------------------------------
    def rotary(self, cos, sin, rope_rows):
        if not self.plan.attention:
            return super().rotary(cos, sin, rope_rows)
        return cos, sin, rope_rows  # the kernel gathers each row's entries itself

    def rope_write(self, kv, q, k, v, cos, sin, rope_rows, positions, live):
        d = q.shape[-1]
        if not self._fits("attention", _rope_takes(d, kv, q.dtype)):
            return super().rope_write(kv, q, k, v, cos, sin, rope_rows, positions, live)
        dense = (lambda t: t if t.stride(-1) == 1 and t.stride(-2) == d else t.contiguous())  # row views pass as is
        return rope_kv.rope_kv(dense(q), dense(k), dense(v), cos, sin, positions, live, kv.k, kv.v, kv.slot_pos,
                               rope_rows=rope_rows, pdl=q.is_cuda, early=q.is_cuda)

    def attention(self, q, kv, positions, sinks):
        rows, q_heads, d = q.shape[0], q.shape[1], q.shape[-1]
        if not self._fits("attention", rows * (q_heads // kv.k.shape[1]) <= MAX_MATRIX_ROWS
                          and d >= 16 and d & (d - 1) == 0):
            return super().attention(q, kv, positions, sinks)
        # kv_len (how far a full layer's history is read) = the block's last position + 1, taken by the kernels
        self.calls["early"] += q.is_cuda
        return decode_attention.decode_attention(q.contiguous(), kv.k, kv.v, kv.slot_pos, positions, sinks, kv.window,
                                                 kv.first_position, causal=kv.causal, pdl=q.is_cuda,
                                                 kv_len_from_q=True, preload=q.is_cuda, early=q.is_cuda)

    # ---- norms ---------------------------------------------------------------------------------------
    @stage("norm")  # an override keeps the label of the method it replaces (the breakdown's norms)
    def norm(self, x, weight, eps, out=None):
        if not self._fits("norm", True):
            return super().norm(x, weight, eps, out)
        return rmsnorm_residual.rmsnorm(x.contiguous(), weight, eps, out=out, pdl=x.is_cuda, preload=x.is_cuda)

    @stage("norm")
    def residual_norm(self, x, residual, weight, eps):
        # The norm kernel with its residual input on: the sum is rounded to x's dtype and the norm reads that rounded
        # row, as the unfused add then the norm kernel does, so the two are bit-identical.
        if not self._fits("norm", True):
            return super().residual_norm(x, residual, weight, eps)
        y, h = rmsnorm_residual.rmsnorm_residual(residual.contiguous(), x.contiguous(), weight, eps,
                                                 out_dtype=x.dtype, pdl=x.is_cuda, preload=x.is_cuda)
        return h, y

    @stage("norm")
    def add_norm(self, x, residual, weight, eps, moe_block=None):
        if not self._fits("norm", True):
            return super().add_norm(x, residual, weight, eps, moe_block)
        f16_input = None
        tile = self.f16_tile(moe_block, x.shape[1])
        if self.plan.moe and tile and x.dtype == torch.bfloat16:  # bf16: what moe() rounds b32 to
            f16_input = empty_tiles(*x.shape, tile, x.device)  # the MoE's fp16 operand tiles, written by the norm
            self.calls["f16_norm"] += 1
        y, h = rmsnorm_residual.rmsnorm_residual(residual.contiguous(), x.contiguous(), weight, eps,
                                                 out_dtype=torch.float32, f16_out=f16_input, pdl=x.is_cuda,
                                                 preload=x.is_cuda)
        return h, y, f16_input

    # ---- routing and experts -------------------------------------------------------------------------------
    def route(self, b32, lw, top_k, norm_topk_prob, scaling):
        if not self._fits("moe", True):
            return super().route(b32, lw, top_k, norm_topk_prob, scaling)
        return router.route(b32, lw.router, top_k, norm_topk_prob, scaling, pdl=b32.is_cuda, preload=b32.is_cuda)

    @staticmethod
    def f16_tile(moe_block: tuple[int, int] | None, hidden: int) -> int | None:
        """The width of the MoE input's fp16 operand tiles for weight blocks `moe_block` (Gate/Up's K tile), or None
        where the MoE kernel does not take such blocks or the hidden size is not whole tiles."""
        if moe_block is None or not moe_group(moe_block[1]):
            return None
        tile = moe.gate_up_k_tile(moe_block)
        return tile if hidden % tile == 0 else None

    def moe(self, b, experts, weights, live, gate, up, down, compute_dtype=None, f16_input=None, residual=None):
        if not self._fits("moe", moe_takes(gate.block, down.block, down.q.shape[-1])):
            return super().moe(b, experts, weights, live, gate, up, down, compute_dtype)
        cuda = b.is_cuda
        tma = moe.tma_fits(gate.q, up.q, down.q)
        self.calls["tma"] += tma
        self.calls["fp8_down"] += moe.fp8_down_applies(self.plan.fp8_down, compute_dtype or b.dtype, b.device)
        self.calls["early"] += cuda
        step = MAX_PAIRS // experts.shape[1]  # prefill blocks exceed the kernel's pair capacity: split rows
        rows = lambda t, s: None if t is None else tuple(part[s:s + step] for part in t)
        add = None  # the next norm's add and sums of squares, where one call covers the rows
        if self.plan.fused_input_norm and residual is not None and b.shape[0] <= step:
            add = (*residual, *moe.residual_buffers(residual[0]))  # (stream, weight, h, g, sumsq)
            self.calls["residual_add"] += 1
        parts = [moe.moe(b[s:s + step], experts[s:s + step], weights[s:s + step], live[s:s + step],
                         gate.q, gate.scale, up.q, up.scale, down.q, down.scale, gate.block, group=down.block[1],
                         out_dtype=compute_dtype or b.dtype, compute_dtype=compute_dtype, pdl=cuda,
                         f16_input=rows(f16_input, s), tma=tma, fp8_down=self.plan.fp8_down, early_down=cuda,
                         residual=add)
                 for s in range(0, b.shape[0], step)]
        if add is not None:
            stream, weight, h, g, sumsq = add
            return Residual(h, g, sumsq, weight, parts[0])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # ---- head and sampling -----------------------------------------------------------------------------
    def lm_head(self, a, w):
        if not self._fits("lm_head", True):
            return super().lm_head(a, w)
        return lm_head.lm_head(a.contiguous(), w.lm_head, pdl=a.is_cuda)

    def uniforms(self, seed, positions, purpose, depth=0, out=None):
        if not self._fits("sampling", True):
            return super().uniforms(seed, positions, purpose, depth, out)
        return philox.uniforms(seed, positions, purpose, depth, out=out, pdl=positions.is_cuda)  # tl.rand = rng.rand

    def _keys(self, local_logits, k, vocab_offset, gather):
        keys = topk.local_topk_keys(local_logits.float().contiguous(), k, vocab_offset, pdl=local_logits.is_cuda)[0]
        return gather(keys).contiguous()

    def dist(self, local_logits, k, vocab_offset, gather, top_k, temperature, top_p):
        if not self._fits("sampling", True):
            return super().dist(local_logits, k, vocab_offset, gather, top_k, temperature, top_p)
        keys = self._keys(local_logits, k, vocab_offset, gather)
        return sample.global_dist(keys, top_k, temperature, top_p, pdl=keys.is_cuda)

    def sample(self, local_logits, k, vocab_offset, gather, top_k, temperature, top_p, u, out, chain=None):
        if not self._fits("sampling", top_k <= sample.MAX_K):
            return super().sample(local_logits, k, vocab_offset, gather, top_k, temperature, top_p, u, out, chain)
        keys = self._keys(local_logits, k, vocab_offset, gather)
        served = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        sample.global_sample(keys, top_k, temperature, top_p, uniforms=u, out=out, served=served, chain=chain,
                             pdl=keys.is_cuda)
        self.calls["sample_draw"] += 1
        return served

    def accept(self, p_ids, p_probs, q_ids, q_probs, drafts, k, n, seed):
        if not self._fits("sampling", max(p_ids.shape[1], q_ids.shape[1]) <= sample.MAX_K):
            return super().accept(p_ids, p_probs, q_ids, q_probs, drafts, k, n, seed)
        self.calls["accept"] += 1
        r = sample.accept_settle(p_ids.contiguous(), p_probs.contiguous(), q_ids, q_probs, drafts, k, n, seed,
                                 pdl=p_ids.is_cuda)
        return r["a"], r["token"], r["emitted"], r["logprobs"]

    # ---- glue ----------------------------------------------------------------------------------------
    def embed(self, tokens, w):
        if not self._fits("glue", w.embed.is_contiguous()):
            return super().embed(tokens, w)
        self.calls["embed"] += 1
        return embed.embed(tokens.contiguous(), w.embed, w.vocab_offset, pdl=tokens.is_cuda)

    def settle(self, st, committed, count, emitted, n_emit, logprobs, k, a, out):
        if not self._fits("glue", True):
            return super().settle(st, committed, count, emitted, n_emit, logprobs, k, a, out)
        self.calls["settle"] += 1
        return settle.settle(st, committed.contiguous(), count, emitted.contiguous(), n_emit, logprobs.float(), k, a,
                             out, pdl=st.n.is_cuda)
