"""The Triton dispatcher: each op of the torch forms (fast/torch_ops.py) that has a kernel implementing the published
architecture as one call to its kernel in `kernels/`, for the op groups of the plan (fast/plan.py); every other op runs its torch form (the
class inherits it). A shape a kernel cannot take runs the torch form and is counted in `fallbacks`.

Same math as the torch forms; the kernels round differently (fp32 accumulation in other orders, the draws' sums in
the kernels' order), which the qualification suite measures. On CUDA every kernel launches with programmatic
dependent launch (kernels/launch.py) and reads its constant weights before its wait ("preload"): scheduling only, the
same bits. Importing this module imports triton: the engine imports it only for a plan with kernels.
"""

from __future__ import annotations

import functools
import os
import weakref
from collections import Counter
from typing import NamedTuple

import torch

from ..kernels import (decode_attention, depth_rule, embed, expert_prefetch, fp8_linear, fp8_linear_direct, launch,
                       lm_head, logprobs, moe, o_proj_router, philox, qk_rope_kv, qkv_rope_kv, rmsnorm, route_tail,
                       router, sample, settle, topk)
from . import sampler
from .depth_rule import logit_threshold
from .flow import destroy_stream, private_stream
from .kernel_settings import KernelSettings
from .plan import KernelPlan
from .profiling import stage
from .router_fold import PendingProjection
from .torch_ops import TorchOps
from .weights import DenseMLP, MoE, Weight

LINEAR_LOCKS = 4096  # arrival counters: one per output tile of the largest decode or prefill-block linear


class PendingDown(NamedTuple):
    """The routed experts after Gate/Up: their Down launches in the op that reads the MoE's output
    (`reduce_add_norm`), where it can end in the combine and the sandwich tail (kernels/moe.py `down_add_norm`,
    EngineOptions.down_tail)."""

    hidden: moe.ExpertHidden
    weights: torch.Tensor
    down: moe.ExpertWeights


def _k_tiles(n: int) -> bool:
    """Whether a weight block of n columns holds whole K tiles of 16 (the kernels' smallest)."""
    return n >= 16 and n % 16 == 0


def _fp8_takes(w: Weight) -> bool:
    """Whether the FP8 linear kernel takes this weight: E4M3 blocks starting on a block boundary, whole K tiles."""
    return w.quantized and w.q.dim() == 2 and w.offset == (0, 0) and _k_tiles(w.block[1])


class TritonOps(TorchOps):
    name = "triton"

    def __init__(self, plan: KernelPlan = KernelPlan.triton(), fold_router: bool = False,
                 warm_experts: bool = False, settings: KernelSettings = KernelSettings(),
                 routed_prefetch: bool = False, down_tail: bool = False) -> None:
        super().__init__(fold_router, warm_experts)
        self.plan = plan
        self.settings = settings  # KernelSettings() is the product's; a bench variant or qualify passes others
        self.routed_prefetch = routed_prefetch  # EngineOptions.routed_prefetch
        self.down_tail = down_tail  # EngineOptions.down_tail
        self.fallbacks: Counter = Counter()  # op group -> calls a kernel could not take (ran the torch form)
        self._locks: torch.Tensor | None = None
        self._gate_up_locks: torch.Tensor | None = None  # Gate/Up's split sum's own: no PDL overlap with Down's tail
        self._experts: dict[int, list] = {}  # id(MoE) -> its gate, up, down as the MoE kernel takes them
        self._slabs: dict[int, tuple] = {}  # id(router) -> its layer's Gate and Up codes, for the select to warm
                                             # (filled with the routed prefetch on)
        self._direct: dict[int, torch.Tensor] = {}  # id(Weight) -> its codes in the MMA fragments' order (`direct`)
        self._side: torch.cuda.Stream | None = None  # the expert prefetch's branch stream (CUDA)
        self._branch: list = []  # what the branches launched since the last join read and write: kept alive until it
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

    def prepare(self, w, top_k, par, sliding=frozenset()):
        super().prepare(w, top_k, par, sliding)
        # The arrival counters of the FP8 linear's split-K sum: zeroed once, before any capture; every call leaves them
        # zeroed, and the engine's calls run one after another on one stream.
        self._locks = torch.zeros(LINEAR_LOCKS, dtype=torch.int32, device=w.embed.device)
        if self.settings.moe.gate_up_split > 1:
            self._gate_up_locks = torch.zeros(LINEAR_LOCKS, dtype=torch.int32, device=w.embed.device)
        for lw in [*w.layers, w.draft.block]:
            if isinstance(lw.mlp, MoE):
                self._experts[id(lw.mlp)] = [moe.ExpertWeights(p.q, p.scale, p.block, p.offset) if p.quantized else None
                                             for p in (lw.mlp.gate, lw.mlp.up, lw.mlp.down)]
                gate, up = lw.mlp.gate, lw.mlp.up
                if (self.routed_prefetch and gate.quantized and up.quantized and launch.slab_ok(gate.q)
                        and launch.slab_ok(up.q)):
                    self._slabs[id(lw.mlp.router)] = (gate.q, up.q)
        if self._warm and w.embed.is_cuda:
            self._side = private_stream(w.embed.device)  # the branch forks off the decode loop's capture
            weakref.finalize(self, destroy_stream, self._side).atexit = False  # an exiting process frees it anyway
        if w.embed.is_cuda:  # the direct kernel is compiled only (no interpreter)
            for weight in self._direct_weights(w):
                self._direct[id(weight)] = fp8_linear_direct.direct_weight(weight.q)

    def _direct_weights(self, w) -> list[Weight]:
        """The weights of the ops whose settings take the direct kernel (`LinearSettings.direct`) that it can read:
        the o-projections under `o_proj`; the dense MLP, eh_proj and the unfolded q/k/v under `linear`."""
        blocks, o, lin = [*w.layers, w.draft.block], self.settings.o_proj, self.settings.linear
        chosen = [(lw.attn.wo, o) for lw in blocks] if o.direct else []
        if lin.direct:
            chosen += [(p, lin) for lw in blocks if isinstance(lw.mlp, DenseMLP)
                       for p in (lw.mlp.gate, lw.mlp.up, lw.mlp.down)]
            chosen += [(p, lin) for p in (w.draft.eh_proj, *(lw.attn.wqkv for lw in blocks)) if p is not None]
        return [p for p, s in chosen
                if _fp8_takes(p) and fp8_linear_direct.takes_weight(*p.q.shape, p.block, s, p.q.device)]

    # ---- the expert prefetch's side branch -------------------------------------------------------------
    def warm_experts(self, mlp, a, live):
        warm = self._warm.get(id(mlp))
        gate, up = (self._experts.get(id(mlp)) or [None, None])[:2]
        if warm is None or gate is None or up is None or not self.plan.moe:
            return super().warm_experts(mlp, a, live)
        if not expert_prefetch.fits(a.shape[0], warm.predictor, gate.q, up.q):
            return None  # a prefill block: no branch (a hint, not an op to fall back on)
        self.calls["expert_prefetch"] += 1
        if self._side is None:  # the interpreter: the branch in line (it predicts; there is no L2 to warm)
            return expert_prefetch.warm(a, live, warm.predictor, gate.q, up.q, warm.top_k)
        out = expert_prefetch.scratch(a, warm.predictor, warm.top_k)  # the main stream's memory (a capture's pool)
        self._side.wait_stream(torch.cuda.current_stream(a.device))  # after a is written; nothing waits for the branch
        with torch.cuda.stream(self._side):                            # until the join
            expert_prefetch.warm(a, live, warm.predictor, gate.q, up.q, warm.top_k, out=out)
        self._branch.append((a, live, out))
        return out[1]

    def join_branches(self):
        if self._branch:
            torch.cuda.current_stream(self._branch[0][0].device).wait_stream(self._side)
            self._branch = []

    # ---- linears -------------------------------------------------------------------------------------
    def linear(self, w: Weight, x: torch.Tensor) -> torch.Tensor:
        if not self._fits("linear", _fp8_takes(w)):
            return super().linear(w, x)
        return self._fp8(w, x, self.settings.linear)

    def o_proj(self, attn, x):
        # the plain projection under its own settings; a folded layer's is left pending, as TorchOps leaves it
        if id(attn) in self._folds or not (self.plan.linear and _fp8_takes(attn.wo)):
            return super().o_proj(attn, x)
        return self._fp8(attn.wo, x, self.settings.o_proj)

    def _fp8(self, w: Weight, x: torch.Tensor, s) -> torch.Tensor:
        cuda = x.is_cuda
        locks = self._locks  # None before prepare(), too few for a long prefill block: the sum as a second pass
        direct = self._direct.get(id(w)) if s.direct else None
        if direct is not None and fp8_linear_direct.applies(x, w.q.shape[0], w.block, s):
            self.calls["direct"] += 1
            fits = locks is not None and fp8_linear_direct.lock_count(x.shape[0], w.q.shape[0]) <= locks.numel()
            return fp8_linear_direct.fp8_linear_direct(x.contiguous(), direct, w.scale, w.block, out_dtype=x.dtype,
                                                       locks=locks if fits else None, pdl=True, settings=s)
        if cuda and fp8_linear.preload_plan(x.shape[0], *w.q.shape, w.block, s, device=x.device):
            self.calls["preload"] += 1
        fits = locks is not None and fp8_linear.lock_count(x.shape[0], w.q.shape[0], s) <= locks.numel()
        return fp8_linear.fp8_linear(x.contiguous(), w.q, w.scale, w.block, out_dtype=x.dtype,
                                     locks=locks if fits else None, pdl=cuda, settings=s)

    @stage("attention")  # as TorchOps.o_proj_parts
    def o_proj_parts(self, pending, residual):
        # the router fold (fast/router_fold.py): the projection's tiles also write the router's partial logits
        w, x, fold = pending
        if not self._fits("linear", _fp8_takes(w) and o_proj_router.fits(x.shape[0], *fold.router_w.shape)):
            return super().o_proj_parts(pending, residual)
        self.calls["o_proj_router"] += 1
        locks = self._locks
        s = self.settings.o_proj  # its `direct` is the plain o-projection's: the fold's kernel has no direct form
        fits = locks is not None and o_proj_router.lock_count(x.shape[0], w.q.shape[0], s) <= locks.numel()
        return o_proj_router.o_proj_router(x.contiguous(), w.q, w.scale, w.block, residual, fold.router_w, fold.w_out,
                                           locks=locks if fits else None, pdl=x.is_cuda, settings=s,
                                           parts_settings=self.settings.o_proj_router)

    def qkv(self, attn, x):
        w = attn.wqkv
        if w is None or not self._fits("linear", _fp8_takes(w)):
            return super().qkv(attn, x)
        y = self._fp8(w, x, self.settings.linear)  # one launch: column views, no copies
        nq, nk = attn.wq.q.shape[0], attn.wk.q.shape[0]
        return y[:, :nq], y[:, nq:nq + nk], y[:, nq + nk:]

    def qkv_rope_write(self, attn, a, kv, eps, cos, sin, positions, live):
        heads = self.folds_qkv_rope(attn, kv, cos)
        if heads is None:  # the projection and the prologue apart: each runs its kernel or is counted where it cannot
            return super().qkv_rope_write(attn, a, kv, eps, cos, sin, positions, live)
        self.calls["qkv_rope_kv"] += 1
        w, locks = attn.wqkv, self._locks
        fits = locks is not None and qkv_rope_kv.lock_count(a.shape[0], kv.k.shape[-1], w.q.shape[0]) <= locks.numel()
        return qkv_rope_kv.qkv_rope_kv(a.contiguous(), w.q, w.scale, w.block, *heads, attn.q_norm, attn.k_norm, eps,
                                       cos, sin, positions, live, kv.k, kv.v, kv.slot_pos,
                                       locks=locks if fits else None, pdl=a.is_cuda, settings=self.settings.qkv_rope_kv)

    def folds_qkv_rope(self, attn, kv, cos) -> tuple[int, int] | None:
        """(q heads, kv heads) where the projection and the prologue run as one launch (kernels/qkv_rope_kv.py): both
        groups on the plan, a weight the FP8 kernel takes, a layout the fused kernel takes; else None."""
        w, D = attn.wqkv, kv.k.shape[-1]
        if w is None or not (self.plan.linear and self.plan.attention and _fp8_takes(w)):
            return None
        heads = attn.wq.q.shape[0] // D, attn.wk.q.shape[0] // D
        return heads if qkv_rope_kv.fits(*heads, D, None if cos is None else cos.shape[-1], w.q.shape[0]) else None

    # ---- attention -----------------------------------------------------------------------------------
    def qk_rope_write(self, kv, q, k, v, q_norm, k_norm, eps, cos, sin, positions, live):
        rot = None if cos is None else cos.shape[-1]
        if not self._fits("attention", qk_rope_kv.qk_rope_kv_fits(q.shape[1], k.shape[1], q.shape[2], rot)):
            return super().qk_rope_write(kv, q, k, v, q_norm, k_norm, eps, cos, sin, positions, live)
        self.calls["qk_rope_kv"] += 1
        return qk_rope_kv.qk_rope_kv(q, k, v, q_norm, k_norm, eps, cos, sin, positions, live, kv.k, kv.v, kv.slot_pos,
                                     pdl=q.is_cuda)

    def attention(self, q, kv, positions, scale, sink_k):
        R, Hq, D = q.shape
        # The kernel applies the causal rule always (qualification's open-mask control runs the torch form).
        ok = kv.causal and D >= 16 and D & (D - 1) == 0 and q.stride(2) == 1
        if not self._fits("attention", ok and R * (Hq // kv.k.shape[1]) <= decode_attention.MAX_MATRIX_ROWS):
            return super().attention(q, kv, positions, scale, sink_k)
        self.calls["attention"] += 1
        s = self.settings.attention_full if kv.window is None else self.settings.attention_sliding
        return decode_attention.decode_attention(q, kv.k, kv.v, kv.slot_pos, positions, scale, sink_k, kv.window,
                                                 settings=s, pdl=q.is_cuda)

    # ---- the heads -------------------------------------------------------------------------------------
    def lm_head(self, hidden, head):
        if not self._fits("lm_head", lm_head.fits(hidden.shape[0], *head.shape)):
            return super().lm_head(hidden, head)
        self.calls["lm_head"] += 1
        return lm_head.lm_head(hidden, head, settings=self.settings.lm_head, pdl=hidden.is_cuda)

    # ---- the routed experts ----------------------------------------------------------------------------
    def route_on(self, b, router_w, top_k):
        if not self._fits("moe", router.fits(b.shape[0], *router_w.shape)):
            return super().route_on(b, router_w, top_k)
        self.calls["route"] += 1
        return router.route(b, router_w, top_k, pdl=b.is_cuda, warm=self.route_warm(router_w))

    def route_warm(self, router_w):
        """The Gate and Up codes the router's select asks L2 for once it has chosen (kernels/router.py `route`'s
        `warm`): the layer's, with the routed prefetch on, where the MoE's kernels take them."""
        return self._slabs.get(id(router_w)) if self.plan.moe else None

    def moe(self, b, experts, weights, live, mw):
        ew = self._experts.get(id(mw), [None])  # made in prepare(); absent: a BF16 MoE, on its torch form
        if not self._fits("moe", None not in ew and moe.fits(b, experts, *ew)):
            return super().moe(b, experts, weights, live, mw)
        self.calls["moe"] += 1
        # Down is left to the op that reads the output (reduce_add_norm), which ends it in the combine and the tail
        s, locks = self.settings.moe, self._gate_up_locks
        R, k, inter = b.shape[0], experts.shape[1], ew[0].q.shape[1]
        if locks is not None and moe.gate_up_lock_count(R, k, inter, s) > locks.numel():
            locks = None  # a long prefill block: counters of its own, zeroed by gate_up
        hidden = moe.gate_up(b, experts, live, *ew[:2], settings=s, locks=locks, pdl=b.is_cuda)
        return PendingDown(hidden, weights, ew[2])

    @stage("mlp")  # launched by the op that reads the output, but the experts' work: bench step's stages keep it there
    def expert_outputs(self, partial):
        """The routed experts' outputs, uncombined: a pending Down launched on its own (kernels/moe.py `down`)."""
        if not isinstance(partial, PendingDown):
            return partial
        return moe.down(*partial, settings=self.settings.moe, pdl=partial.weights.is_cuda)

    @stage("mlp")  # Down's launch, ending in the combine and the tail: the experts' work, mostly
    def down_add_norm(self, pending, residual, scale, y_norm, next_norm, eps, dtype):
        self.calls["down_add_norm"] += 1
        return moe.down_add_norm(*pending, residual, scale, y_norm, next_norm, eps, dtype, locks=self._locks,
                                 settings=self.settings.moe, pdl=residual.is_cuda)

    # ---- norms ---------------------------------------------------------------------------------------
    @stage("norm")
    def norm(self, x, weight, eps, dtype=None, out=None):
        if not self._fits("norm", rmsnorm.rmsnorm_fits(x.shape[-1])):
            return super().norm(x, weight, eps, dtype, out)
        self.calls["rmsnorm"] += 1
        rows = x.reshape(-1, x.shape[-1])  # q/k heads: one row a head
        y = rmsnorm.rmsnorm(rows, weight, eps, dtype or x.dtype, out=out, pdl=x.is_cuda)
        return y if out is not None else y.view(x.shape)

    @stage("norm")
    def add_norm(self, residual, y, scale, y_norm, next_norm, eps, dtype):
        if not self._fits("norm", rmsnorm.rmsnorm_fits(y.shape[-1])):
            return super().add_norm(residual, y, scale, y_norm, next_norm, eps, dtype)
        self.calls["add_norm"] += 1
        return rmsnorm.add_norm(residual, y, scale, y_norm, next_norm, eps, dtype, pdl=y.is_cuda)

    def add_norm_route(self, residual, y, scale, y_norm, next_norm, eps, dtype, parts, top_k):
        if not (self.plan.moe and self._fits("norm", route_tail.fits(*y.shape, parts.shape[0], parts.shape[-1],
                                                                       top_k))):
            return super().add_norm_route(residual, y, scale, y_norm, next_norm, eps, dtype, parts, top_k)
        self.calls["add_norm_route"] += 1
        h, b, *routing = route_tail.add_norm_route(residual, y, scale, y_norm, next_norm, eps, dtype, parts, top_k,
                                                   pdl=y.is_cuda)
        return h, b, tuple(routing)

    @stage("norm")
    def reduce_add_norm(self, par, partial, residual, scale, y_norm, next_norm, eps, dtype):
        # The same bits as the sequence: with peer collectives (GPUs, TP > 1) the all-reduce ends in the tail; the
        # MoE's pending Down (TP 1, rank slices) launches, ending in the combine and the tail with down_tail on; its
        # uncombined output (kernels/moe.ExpertOutputs) is combined by the reduction or by the tail
        if isinstance(partial, PendingProjection):  # the router fold (TorchOps: the projection, then the tail)
            return super().reduce_add_norm(par, partial, residual, scale, y_norm, next_norm, eps, dtype)
        fused = self._fits("norm", rmsnorm.rmsnorm_fits(residual.shape[-1]))
        if isinstance(partial, PendingDown):
            locks = self._locks
            if (self.down_tail and fused and not par.active and locks is not None
                    and moe.lock_count(partial.hidden.rows) <= locks.numel()):
                return self.down_add_norm(partial, residual, scale, y_norm, next_norm, eps, dtype)
            partial = self.expert_outputs(partial)
        if fused and par.peers is not None:
            self.calls["reduce_add_norm"] += 1
            return par.peers.all_reduce_add_norm(partial, residual, scale, y_norm, next_norm, eps, dtype)
        if isinstance(partial, moe.ExpertOutputs):
            if fused and not par.active:
                self.calls["combine_add_norm"] += 1
                return moe.combine_add_norm(partial, residual, scale, y_norm, next_norm, eps, dtype,
                                            pdl=residual.is_cuda)
            partial = self.combined(partial)
        return super().reduce_add_norm(par, partial, residual, scale, y_norm, next_norm, eps, dtype)

    def combined(self, partial):
        """A branch output as a tensor in the compute dtype: the MoE's uncombined output combined (its own launch)."""
        partial = self.expert_outputs(partial)
        if not isinstance(partial, moe.ExpertOutputs):
            return partial
        return moe.combine(partial, settings=self.settings.moe, pdl=partial.y.is_cuda).to(partial.dtype)

    # ---- sampling --------------------------------------------------------------------------------------
    def uniforms(self, seed, positions, purpose, depth=0, out=None):
        if not self._fits("sampling", True):
            return super().uniforms(seed, positions, purpose, depth, out)
        return philox.uniforms(seed, positions, purpose, depth, out=out, pdl=positions.is_cuda)  # tl.rand = rng.rand

    def _keys(self, local_logits, k, vocab_offset, gather):
        keys = topk.local_topk_keys(local_logits.float().contiguous(), k, vocab_offset, settings=self.settings.topk,
                                    pdl=local_logits.is_cuda)[0]
        return gather(keys).contiguous()

    def dist(self, local_logits, k, vocab_offset, gather, top_k, temperature, top_p):
        if not self._fits("sampling", k <= topk.MAX_K and top_k <= sample.MAX_K):
            return super().dist(local_logits, k, vocab_offset, gather, top_k, temperature, top_p)
        keys = self._keys(local_logits, k, vocab_offset, gather)
        return sample.global_dist(keys, top_k, temperature, top_p, pdl=keys.is_cuda)

    def model_logprobs(self, local_logits, tokens, n_top, vocab_offset, gather):
        # a rank's part (its log-normalizer and the logits of the tokens it holds) in one launch; the all-gather and
        # the combine over ranks as the torch form has them
        if not self._fits("sampling", tokens.shape[-1] <= logprobs.MAX_TOKENS and local_logits.stride(-1) == 1):
            return super().model_logprobs(local_logits, tokens, n_top, vocab_offset, gather)
        self.calls["logprob_parts"] += 1
        parts = functools.partial(logprobs.logprob_parts, pdl=local_logits.is_cuda)
        return sampler.model_logprobs(local_logits, tokens.contiguous(), n_top, vocab_offset, gather,
                                      local_parts=parts)

    def sample(self, local_logits, k, vocab_offset, gather, top_k, temperature, top_p, u, out, chain=None):
        if not self._fits("sampling", k <= topk.MAX_K and top_k <= sample.MAX_K):
            return super().sample(local_logits, k, vocab_offset, gather, top_k, temperature, top_p, u, out, chain)
        keys = self._keys(local_logits, k, vocab_offset, gather)
        served = torch.empty(u.shape, dtype=torch.float32, device=u.device)
        sample.global_sample(keys, top_k, temperature, top_p, uniforms=u, out=out, served=served, chain=chain,
                             pdl=keys.is_cuda)
        self.calls["sample_draw"] += 1
        return served

    def more(self, rule, depth, served, probs, product, out):
        if not self._fits("sampling", probs.numel() <= depth_rule.MAX_K):
            return super().more(rule, depth, served, probs, product, out)
        self.calls["depth_rule"] += 1
        depth_rule.more(probs, served, product, out, depth, rule.weights, logit_threshold(rule.threshold),
                        pdl=probs.is_cuda)

    def accept(self, p_ids, p_probs, q_ids, q_probs, drafts, k, n, seed):
        if not self._fits("sampling", max(p_ids.shape[1], q_ids.shape[1]) <= sample.MAX_K):
            return super().accept(p_ids, p_probs, q_ids, q_probs, drafts, k, n, seed)
        self.calls["accept"] += 1
        r = sample.accept_settle(p_ids.contiguous(), p_probs.contiguous(), q_ids, q_probs, drafts, k, n, seed,
                                 pdl=p_ids.is_cuda)
        return r["a"], r["token"], r["emitted"]

    # ---- glue ----------------------------------------------------------------------------------------
    def embed(self, tokens, table, offset):
        if not self._fits("glue", table.is_contiguous()):
            return super().embed(tokens, table, offset)
        self.calls["embed"] += 1
        return embed.embed(tokens.contiguous(), table, offset, pdl=tokens.is_cuda)

    def settle(self, st, committed, count, emitted, n_emit, logprobs, k, a, out):
        if not self._fits("glue", True):
            return super().settle(st, committed, count, emitted, n_emit, logprobs, k, a, out)
        self.calls["settle"] += 1
        return settle.settle(st, committed.contiguous(), count, emitted.contiguous(), n_emit, logprobs.float(), k, a,
                             out, pdl=st.n.is_cuda)
