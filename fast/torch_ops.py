"""The torch form of every op the fast engine runs: the fallback every device has (CPU CI included), and the
reference each kernel of `kernels/` is tested against.

Dequantized matmuls, masked attention over the whole static cache, gathered-expert MoE, a full sort for top-k,
Philox in integer ops. Importing this module needs no triton: the CPU path of the engine runs from here alone.
"""

from __future__ import annotations

from collections import Counter

import torch

from ..reference.layers import apply_rope, attention, rms_norm, route
from ..reference.rng import PURPOSE_ACCEPT, PURPOSE_COMMIT
from . import depth_rule, expert_prefetch, philox, router_fold, sampler
from .cache import LayerKV
from .profiling import stage
from .weights import Attention, ModelWeights, MoE, Weight


class TorchOps:
    name = "torch"

    def __init__(self, fold_router: bool = False, warm_experts: bool = False) -> None:
        self.calls: Counter = Counter()  # paths taken, by name (tests check that a path ran)
        self.fold_router = fold_router  # EngineOptions.router_fold: a numerical change (fast/router_fold.py)
        self.warm_experts_on = warm_experts  # EngineOptions.expert_prefetch: a cache hint (fast/expert_prefetch.py)
        self._folds: dict[int, router_fold.RouterFold] = {}  # id(Attention) of a MoE layer -> its fold: prepare()
        self._warm: dict[int, expert_prefetch.ExpertWarm] = {}  # id(MoE) of a target MoE layer -> its branch
        self._routed: tuple | None = None  # (b, routing) a folded tail selected, until route(b) takes it

    def prepare(self, w: ModelWeights, top_k: int, par, sliding: frozenset[int] = frozenset()) -> None:
        """Derived weights this implementation reads, made before any graph capture: with the router fold, each MoE
        layer's scaled router (the heads and routers are otherwise held in fp32 as loaded); with the expert prefetch,
        the predictor of each MoE layer in `sliding` (the target's sliding layers' indices), the fold's when it has
        one. The fold needs the o-projection's output whole on the rank: TP 1 or a rank slice (`par`), not across
        ranks."""
        if self.fold_router and not par.active:
            for lw in [*w.layers, w.draft.block]:
                if isinstance(lw.mlp, MoE):
                    self._folds[id(lw.attn)] = router_fold.make(lw.mlp.router, lw.feed_forward_norm,
                                                                lw.attn_out_norm, top_k)
        if self.warm_experts_on:  # the target's sliding MoE layers (`sliding`: their indices); not the draft's block
            for i, lw in enumerate(w.layers):
                if i in sliding and isinstance(lw.mlp, MoE):
                    fold = self._folds.get(id(lw.attn))
                    self._warm[id(lw.mlp)] = expert_prefetch.make(lw.mlp.router, lw.feed_forward_norm, top_k,
                                                                  None if fold is None else fold.router_w)

    def router_fold_for(self, attn: Attention) -> router_fold.RouterFold | None:
        """The layer's fold where its routing is folded into its o-projection and attention tail (`prepare`)."""
        return self._folds.get(id(attn))

    def warm_experts(self, mlp, a: torch.Tensor, live: torch.Tensor) -> torch.Tensor | None:
        """Expert prefetch (fast/expert_prefetch.py), a cache hint on a sliding MoE layer: the experts [R, k] its
        branch predicts from the layer's input a (None where the layer has no branch). The torch form only predicts
        (for the coverage report); the kernels also warm L2 on a side branch."""
        warm = self._warm.get(id(mlp))
        if warm is None:
            return None
        self.calls["warm_experts"] += 1
        return expert_prefetch.predict(a, live, warm)

    def join_branches(self) -> None:
        """The end of a forward: side branches launched during it (`warm_experts`) are joined to the stream."""

    def o_proj(self, attn: Attention, x: torch.Tensor) -> torch.Tensor | router_fold.PendingProjection:
        """The attention's output projection (row-parallel); a folded layer's is left to the tail that reads it
        (`reduce_add_norm`), which has the residual its router partials need (fast/router_fold.py)."""
        fold = self._folds.get(id(attn))
        return self.linear(attn.wo, x) if fold is None else router_fold.PendingProjection(attn.wo, x, fold)

    @stage("attention")  # launched from the tail, but the projection's work: bench step's stages keep it there
    def o_proj_parts(self, pending: router_fold.PendingProjection,
                     residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A pending o-projection run: (y, the router's partial logits of the residual and y)."""
        y = self.linear(pending.w, pending.x)
        return y, router_fold.parts(residual, y, pending.fold)

    def add_norm_route(self, residual, y, scale, y_norm, next_norm, eps, dtype, parts, top_k):
        """The attention's sandwich tail (`add_norm`) and the folded routing: (h, b, (weights, experts, scores))."""
        h, b = self.add_norm(residual, y, scale, y_norm, next_norm, eps, dtype)
        return h, b, router_fold.select(parts, residual, y, y_norm, scale, eps, top_k)

    def lm_head(self, hidden: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """fp32 logits [R, V/tp] of the post-norm rows: fp32 products with the head (held bf16 or fp32) widened."""
        return hidden.float() @ head.float().T

    def linear(self, w: Weight, x: torch.Tensor) -> torch.Tensor:
        return w.linear(x)

    def qkv(self, attn: Attention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The q, k, v projections [R, n] each (possibly column views of one product)."""
        return self.linear(attn.wq, x), self.linear(attn.wk, x), self.linear(attn.wv, x)

    @stage("norm")
    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype | None = None,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """rmsnorm over the last dimension computed in fp32 (x * rsqrt(mean(x^2) + eps) * w), rounded to `dtype`
        (default x's), into `out` (a view, e.g. half of a wider row) when given."""
        y = rms_norm(x.float(), weight.float(), eps).to(dtype or x.dtype)
        return y if out is None else out.copy_(y)

    def attention(self, q: torch.Tensor, kv: LayerKV, positions: torch.Tensor, scale: float,
                  sink_k: torch.Tensor | None) -> torch.Tensor:
        """Attention of the rows' rotated queries over the cache's visible slots, with the zero-value sink key, in
        fp32."""
        return attention(q.float(), kv.k.float(), kv.v.float(), kv.visible(positions), scale, sink_k).to(q.dtype)

    @staticmethod
    def rotary(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A forward's rotary factors, from the model's table [T, bases, 2, rotary_dim] (fast/model.rope_table), once
        for all its layers and bases: the rows' entries gathered, [R, bases, 2, rotary_dim]."""
        rows = positions.clamp(max=table.shape[0] - 1)  # padding rows may run past the table; live rows never do
        return table.index_select(0, rows)

    def qkv_rope_write(self, attn, a: torch.Tensor, kv: LayerKV, eps: float, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, positions: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """The attention's projections of a, then `qk_rope_write`: the rotated q [R, Hq, D] (fast/triton_ops.py: one
        launch, kernels/qkv_rope_kv.py)."""
        R, D = a.shape[0], kv.k.shape[-1]
        q, k, v = (t.view(R, -1, D) for t in self.qkv(attn, a))
        return self.qk_rope_write(kv, q, k, v, attn.q_norm, attn.k_norm, eps, cos, sin, positions, live)

    def qk_rope_write(self, kv: LayerKV, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                      k_norm: torch.Tensor, eps: float, cos: torch.Tensor | None, sin: torch.Tensor | None,
                      positions: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """q and k normalized per head (rounded to their dtype), their first rotary_dim dims rotated by the rows'
        factors (fp32, rounded; None: a layer without RoPE), k and v stored at the rows' slots (padding rows: the
        trash slot). Returns the rotated q (kernels/qk_rope_kv.py is this in one launch)."""
        q, k = self.norm(q, q_norm, eps), self.norm(k, k_norm, eps)
        if cos is not None:
            q = apply_rope(q.float(), cos, sin).to(q.dtype)
            k = apply_rope(k.float(), cos, sin).to(k.dtype)
        kv.write(positions, live, k, v)  # the block's own K/V first: rows see each other causally
        return q

    @stage("norm")
    def add_norm(self, residual: torch.Tensor, y: torch.Tensor, scale: float, y_norm: torch.Tensor | None,
                 next_norm: torch.Tensor, eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """A sandwich tail: h = residual + t * scale with t = y_norm(y) (rounded to `dtype`), or y itself when y_norm
        is None, each op rounded to the residual's dtype (a scale of 1 is skipped: exact); returns (h, next_norm(h)
        rounded to `dtype`). kernels/rmsnorm.py's add_norm is this in one launch."""
        t = y if y_norm is None else self.norm(y, y_norm, eps, dtype)
        t = t.to(residual.dtype)
        h = residual + (t if scale == 1.0 else t * scale)
        return h, self.norm(h, next_norm, eps, dtype)

    @staticmethod
    def expert_outputs(partial):
        """The routed experts' outputs as the op after them reads them (the torch forms': already a tensor)."""
        return partial

    @staticmethod
    def combined(partial: torch.Tensor) -> torch.Tensor:
        """A branch output as a tensor (the torch forms' always are; fast/triton_ops.py may leave the MoE's
        uncombined)."""
        return partial

    def reduce_add_norm(self, par, partial: torch.Tensor, residual: torch.Tensor, scale: float,
                        y_norm: torch.Tensor | None, next_norm: torch.Tensor, eps: float,
                        dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A row-parallel branch's partial output summed over the ranks of `par` (fast/parallel.py), then the sandwich
        tail on the sum: (sum, h, next_norm(h)). The peer all-reduce does both in one launch (fast/triton_ops.py)."""
        if isinstance(partial, router_fold.PendingProjection):  # the projection with its partial logits, the tail
            y, parts = self.o_proj_parts(partial, residual)         # selecting (prepare: never across ranks)
            h, b, routing = self.add_norm_route(residual, y, scale, y_norm, next_norm, eps, dtype, parts,
                                                partial.fold.top_k)
            self._routed = (b, routing)
            return y, h, b
        total = par.all_reduce(partial)
        return (total, *self.add_norm(residual, total, scale, y_norm, next_norm, eps, dtype))

    @staticmethod
    def embed(tokens: torch.Tensor, table: torch.Tensor, offset: int) -> torch.Tensor:
        """This rank's rows of an embedding `table` for `tokens` [R] (zero rows for tokens outside its vocabulary
        slice), before the all-reduce that sums them over ranks: the torch sequence kernels/embed.py replaces."""
        return embed(tokens, table, offset)

    def route(self, b: torch.Tensor, router: torch.Tensor,
              top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Softmax routing: (weights [R, k], experts [R, k] long, scores [R, E]) from fp32 logits, the product of the
        input's values widened to fp32 and the fp32 router; or, after a folded tail made b, the routing it selected."""
        routed, self._routed = self._routed, None
        if routed is not None and routed[0] is b:
            self.calls["route_folded"] += 1
            return routed[1]
        return self.route_on(b, router, top_k)

    @staticmethod
    def route_on(b: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The router's own pass on b (what `route` runs unless a folded tail already selected)."""
        return route(b.float() @ router.T, top_k)

    def moe(self, b: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, live: torch.Tensor,
            moe: MoE) -> torch.Tensor:
        """sum_j w_j Down_e(silu(Gate_e b) * Up_e b) over each row's chosen experts [R, H], each expert's output in
        b's dtype, the weighted sum in fp32 rounded to b's dtype."""
        g, u, d = (w.select(experts) for w in (moe.gate, moe.up, moe.down))
        hidden = torch.nn.functional.silu(torch.einsum("rh,rkih->rki", b, g)) * torch.einsum("rh,rkih->rki", b, u)
        y = torch.einsum("rki,rkhi->rkh", hidden, d)
        return (y.float() * weights[..., None]).sum(dim=1).to(b.dtype)

    @staticmethod
    def uniforms(seed: torch.Tensor, positions: torch.Tensor, purpose: int,
                 depth: int | torch.Tensor = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 Philox uniforms for decisions at `positions` (fast/philox.py: ~100 integer kernels each), into
        `out` when given."""
        u = philox.uniforms(seed, philox.offsets(positions, purpose, depth))
        return u if out is None else out.copy_(u)

    def dist(self, local_logits, k, vocab_offset, gather, top_k, temperature, top_p):
        return sampler.sample_rows(local_logits, k, vocab_offset, gather, top_k, temperature, top_p)

    def model_logprobs(self, local_logits, tokens, n_top, vocab_offset, gather):
        """The model's own log-probabilities of tokens [R, m] and of each row's n_top most likely tokens
        (fast.sampler.model_logprobs)."""
        return sampler.model_logprobs(local_logits, tokens, n_top, vocab_offset, gather)

    def sample(self, local_logits, k, vocab_offset, gather, top_k, temperature, top_p, u: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], chain=None) -> torch.Tensor:
        """`dist` and the draw with uniforms u [R]: writes out = (tokens [R], ids [R, K], probs [R, K]) and returns the
        drawn tokens' probabilities [R] (fast.sampler.prob_of). `chain` = (k, depth, product) for a draft depth's one
        row: then also k = depth and product *= the drawn token's probability."""
        ids, probs = self.dist(local_logits, k, vocab_offset, gather, top_k, temperature, top_p)
        tokens = sampler.draw(ids, probs, u)
        for dst, src in zip(out, (tokens, ids, probs)):
            dst.copy_(src)
        served = sampler.prob_of(ids, probs, tokens)
        if chain is not None:
            made, depth, product = chain
            made.fill_(depth)
            product.mul_(served[0])
        return served

    def more(self, rule, depth: int, served: torch.Tensor, probs: torch.Tensor, product: torch.Tensor,
             out: torch.Tensor) -> None:
        """out[0] = whether the round drafts past `depth` under the fitted rule (reference.depth.LogisticDepth), from
        the depth's distribution probs [K], its served probability [1] and the running product []
        (fast/depth_rule.py; kernels/depth_rule.py in one launch)."""
        out.copy_(depth_rule.more(rule.weights, rule.threshold, depth, served, probs, product).view(out.shape))

    commit_dist = staticmethod(sampler.commit_dist)  # the distribution of a round's new token (the accept step's)

    def accept(self, p_ids: torch.Tensor, p_probs: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor,
               drafts: torch.Tensor, k: torch.Tensor, n: torch.Tensor,
               seed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The round's accept step (docs/round.md step 2) on the verification rows' distributions p_0..p_K (row i = p_i) and
        the proposals q_1..q_K (row i = q_{i+1}) of drafts d_1..d_K, k of them live, x_n at position n. Returns
        (a, x, emitted [K+1]): accepted drafts, the round's new token at n+a+1, the emitted tokens d_1..d_a then x
        (their logprobs are the model's: RoundRunner.logprobs). kernels/sample.accept_settle is this in one launch."""
        kmax = q_ids.shape[0]
        depths = torch.arange(1, kmax + 1, device=drafts.device)
        j = torch.arange(kmax + 1, device=drafts.device)
        # Accept d_i when u < min(1, p_{i-1}(d_i) / q_i(d_i)); a = leading accepted drafts (only live ones count).
        p_d = sampler.prob_of(p_ids[:kmax], p_probs[:kmax], drafts)
        q_d = sampler.prob_of(q_ids, q_probs, drafts)
        _, a = sampler.acceptance(p_d, q_d, self.uniforms(seed, n + depths, PURPOSE_ACCEPT), depths <= k)
        # At the first rejection draw from normalize(max(0, p_a - q_{a+1})); if all k passed, p_k gives a bonus
        # token. Both are the commit draw of position n+a+1.
        f_ids, f_probs = self.commit_dist(p_ids, p_probs, q_ids, q_probs, a, k)
        x = sampler.draw(f_ids, f_probs, self.uniforms(seed, (n + a + 1).view(1), PURPOSE_COMMIT))
        emitted = torch.where(j < a, torch.cat([drafts, drafts[:1]]), x)
        return a, x[0], emitted

    @staticmethod
    def settle(st, committed, count, emitted, n_emit, logprobs, k, a, out):
        """The round's settle step and the next drafting's inputs (`settle` below; kernels/settle.py in one launch)."""
        return settle(st, committed, count, emitted, n_emit, logprobs, k, a, out)


def embed(tokens: torch.Tensor, table: torch.Tensor, offset: int) -> torch.Tensor:
    """This rank's embedding rows of `tokens` [R]: table[t - offset], zero rows for tokens outside its vocabulary
    slice [offset, offset + V); the all-reduce that follows sums the owning rank's row into every rank."""
    local = tokens - offset
    mine = (local >= 0) & (local < table.shape[0])
    return table[local.clamp(0, table.shape[0] - 1)] * mine[:, None].to(table.dtype)


def settle(st, committed: torch.Tensor, count: torch.Tensor, emitted: torch.Tensor, n_emit: torch.Tensor,
               logprobs: torch.Tensor, k: torch.Tensor, a: torch.Tensor, out):
    """The round's settle step (docs/round.md: commit `count` tokens at n+1.., log the first `n_emit` emitted ones cut at
    a stop token or the budget, record the round, set done) and the next drafting's inputs `out` (DraftInputs).
    `st`: fast.state.DecodeState. Scalars are int64 device tensors."""
    rows = committed.shape[0]
    j = torch.arange(rows, device=st.n.device)
    trash, log_trash = st.trash, st.log_trash
    n = st.n.clone()
    st.tokens.index_copy_(0, torch.where(j < count, st.n + 1 + j, trash), committed)
    st.n.add_(count)
    is_stop = (emitted[:, None] == st.stop_ids[None, :]).any(-1) & (j < n_emit)
    first_stop = torch.where(is_stop.any(), is_stop.int().argmax() + 1, n_emit)
    keep = torch.minimum(first_stop, st.budget - st.emitted).clamp(min=0)
    slots = torch.where(j < keep, st.emitted + j, log_trash)
    st.log_tokens.index_copy_(0, slots, emitted)
    st.log_logprobs.index_copy_(0, slots, logprobs.float())
    record = torch.stack([k, a, keep, (a == k) & (k > 0)]).to(torch.int64)
    st.log_rounds.index_copy_(0, st.rounds.view(1).clamp(max=log_trash), record.view(1, 4))
    st.emitted.add_(keep)
    st.rounds.add_(1)
    # The budget check keeps a healthy request inside its context; the capacity check is a backstop
    # (a run whose length outgrows what it emitted, e.g. a negative control, stops instead of overrunning).
    full = st.n + 2 * rows >= trash
    st.done.copy_(((first_stop <= keep) & is_stop.any()) | (st.emitted >= st.budget) | full)
    out.tokens.copy_(st.tokens[n + 1 + j])
    out.positions.copy_(n + j)  # a draft row at p reads the hidden at p and the token at p + 1
    out.live.copy_(j < count)
    out.last.copy_(count - 1)
    depths = torch.arange(1, out.row_pos.numel() + 1, device=st.n.device)
    out.row_pos.copy_(st.n + depths - 2)
    out.u_pos.copy_(st.n + depths)
    st.product.fill_(1.0)
    st.more.zero_()
    return out
