"""The speculative round on the device: verify, accept, settle, draft (docs/round.md), with no host read.

Every quantity the round decides (accepted count, replacement or bonus token, draft depth, stop)
stays a device tensor; data-dependent work is expressed with masks over fixed shapes (8 verification
rows, 8 redraft rows) and, for draft depths 4-7, with `Flow.when`, which is a CUDA conditional node
inside a captured graph and a plain `if` in eager mode. All ranks compute identical candidates and
uniforms, so they reach the same tokens without broadcasting them.
"""

from __future__ import annotations

import torch

from ..reference.depth import MIN_DRAFTS, FixedDepth, LogisticDepth
from ..reference.rng import PURPOSE_COMMIT, PURPOSE_DRAFT
from . import sampler
from .model import FastModel
from .profiling import stage
from .state import MAX_DRAFTS, VERIFY_ROWS, DecodeState, DraftInputs


class RoundRunner:
    def __init__(self, model: FastModel, state: DecodeState, top_k: int, controller, flow, top_logprobs: int = 0):
        self.m, self.st, self.top_k, self.controller, self.flow = model, state, top_k, controller, flow
        self.top_logprobs = top_logprobs  # alternatives logged per emitted token (0: none, no extra kernels)
        # The one place plain sampling (--drafts 0: no controller) and speculative rounds part ways
        self.round = self.plain_round if controller is None else self.speculative_round
        dev = state.n.device
        self.rows = torch.arange(VERIFY_ROWS, device=dev)
        self.depths = torch.arange(1, MAX_DRAFTS + 1, device=dev)
        self.next = DraftInputs.allocate(dev)  # the drafting inputs each settle step leaves (kernels/settle.py)
        self.one_live = torch.ones(1, dtype=torch.bool, device=dev)  # a draft row's live mask

    # ---- sampling helpers ---------------------------------------------------------------------
    def _sampling_args(self) -> tuple:
        m = self.m
        return (min(self.top_k, m.vocab_local), m.w.vocab_offset, m.par.all_gather_last, self.top_k,
                self.st.temperature, self.st.top_p)

    @stage("sampling")
    def dist(self, local_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Vocabulary-parallel top-k/top-p: (ids [R, K], probs [R, K]), identical on every rank."""
        return self.m.ops.dist(local_logits, *self._sampling_args())

    def sample(self, local_logits: torch.Tensor, u: torch.Tensor,
               out: tuple[torch.Tensor, torch.Tensor, torch.Tensor], chain: tuple | None = None) -> torch.Tensor:
        """dist() and the draw with uniforms u [R], written into out = (tokens [R], ids [R, K], probs [R, K]);
        returns the drawn tokens' probabilities [R]. `chain` = (k, depth, product): a draft depth's state update."""
        return self.m.ops.sample(local_logits, *self._sampling_args(), u, out, chain)

    def uniform(self, positions: torch.Tensor, purpose: int, depth: int | torch.Tensor = 0,
                out: torch.Tensor | None = None) -> torch.Tensor:
        return self.m.ops.uniforms(self.st.seed, positions, purpose, depth, out)

    # ---- the round ---------------------------------------------------------------------------------
    def speculative_round(self) -> None:
        st, j = self.st, self.rows
        n, k = st.n, st.k  # read before the settle step changes n and the drafting changes k: no copies
        # 1. Verify x_n and the k drafts at positions n..n+k; row i gives p_i for position n+i+1.
        #    Rows past k are padding: computed, never written to the cache, never accepted.
        rows = torch.cat([st.tokens.index_select(0, n.view(1)), st.drafts])
        logits, hidden = self.m.forward(rows, n + j, j <= k)
        p_ids, p_probs = self.dist(logits)
        # 2. Accept: d_i when u < min(1, p_{i-1}(d_i) / q_i(d_i)), up to the first rejection, whose replacement
        #    comes from normalize(max(0, p - q)); all k accepted: a bonus token from p_k. Emitted: d_1..d_a, then x.
        a, x, emitted = self.accept(p_ids, p_probs, n, k)
        logprobs = self.logprobs(logits, emitted)  # emitted token j (d_1..d_a, then x) is drawn at row j
        # 3. Settle: a+1 tokens committed; main KV is valid through n+a, later rows are stale and
        #    rewritten before any query reaches them. Rollback is this length change.
        st.hid.copy_(hidden)
        n_emit = a + 1
        nxt = self.settle(emitted, n_emit, emitted, n_emit, logprobs, k, a)
        # 4. Draft: depth 0 re-runs the draft layer at positions n+j, row p reading the target's hidden at p and the
        #    committed token at p+1 (overwriting draft KV written from draft hiddens), then one row per deeper depth.
        self.draft(nxt.tokens, st.hid, nxt.positions, nxt.live, last=nxt.last)

    def accept(self, p_ids: torch.Tensor, p_probs: torch.Tensor, n: torch.Tensor,
               k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(a, x, emitted [VERIFY_ROWS]) of step 2 (fast/torch_ops.py writes the rule)."""
        st = self.st
        return self.m.ops.accept(p_ids, p_probs, st.q_ids, st.q_probs, st.drafts, k, n, st.seed)

    def plain_round(self) -> None:
        """Plain autoregressive sampling (--drafts 0): the baseline every speculative result is compared with."""
        st, j = self.st, self.rows
        n = st.n.clone().view(1)
        logits, _ = self.m.forward(st.tokens.index_select(0, n), n, torch.ones_like(n, dtype=torch.bool))
        ids, probs = self.dist(logits)
        t = sampler.draw(ids, probs, self.uniform(n + 1, PURPOSE_COMMIT))
        emitted = torch.where(j == 0, t, torch.zeros_like(j))
        logprobs = self.logprobs(logits, t).expand(VERIFY_ROWS)
        one, zero = torch.ones_like(st.k), torch.zeros_like(st.k)
        self.settle(emitted, one, emitted, one, logprobs, zero, zero)

    @stage("sampling")
    def logprobs(self, local_logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The model's own log-probability [R] of row r's token tokens[r] (log-softmax of the raw logits: what a
        token's logprob reports, not the sampling distribution's); with `top_logprobs`, each row's most likely
        tokens under the model are logged too, where the settle step that follows logs row r's token (slot emitted +
        r; rows past what it keeps are overwritten by the next round and never read)."""
        m, st = self.m, self.st
        lp, top_ids, top_lp = m.ops.model_logprobs(local_logits, tokens.view(-1, 1), self.top_logprobs,
                                                   m.w.vocab_offset, m.par.all_gather_last)
        if self.top_logprobs:
            n = self.top_logprobs
            slots = (st.emitted + torch.arange(tokens.numel(), device=tokens.device)).clamp(max=st.log_trash)
            st.log_top_ids[:, :n].index_copy_(0, slots, top_ids)
            st.log_top_lp[:, :n].index_copy_(0, slots, top_lp)
        return lp.view(-1)

    def settle(self, committed: torch.Tensor, count: torch.Tensor, emitted: torch.Tensor, n_emit: torch.Tensor,
               logprobs: torch.Tensor, k: torch.Tensor, a: torch.Tensor) -> DraftInputs:
        """Commit `count` tokens at n+1.., log the first `n_emit` emitted ones cut at a stop token or the budget, record
        the round, set done (kernels/settle.py in one kernel, or fast/torch_ops.settle); returns the next
        drafting's inputs (the committed rows read back with their positions, each depth's positions)."""
        return self.m.ops.settle(self.st, committed, count, emitted, n_emit, logprobs, k, a, self.next)

    # ---- drafting -----------------------------------------------------------------------------
    @stage("draft")
    def draft(self, tokens: torch.Tensor, hiddens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
              last: torch.Tensor) -> None:
        """Depth 0 over a block (its row `last` gives q_1), then depths 2.. one row each.
        Drafts 1-3 always run; after each of 3..6 the controller decides on the device (a fixed depth k runs
        depths 1..k unconditionally)."""
        logits, h = self.m.draft(tokens, hiddens, positions, live)
        st = self.st
        # The settle step that precedes every drafting reset product and more. Every depth's uniform in one Philox
        # evaluation (each is a function of its own counter only), at positions n + d from that step.
        self.uniform(self.next.u_pos, PURPOSE_DRAFT, self.depths, out=st.u_draft)
        self.sample_draft(1, logits.index_select(0, last.view(1)), h.index_select(0, last.view(1)))
        fixed = self.controller.k if isinstance(self.controller, FixedDepth) else None
        for depth in range(2, (fixed or MIN_DRAFTS) + 1):
            self.draft_row(depth)
        if fixed is None:  # a fixed depth is known when the round is built: no device decision to wait on
            self.deeper(MIN_DRAFTS + 1)

    def deeper(self, depth: int) -> None:
        """Depth `depth` if the controller chose it, and the decision on the next inside its branch: a round that
        stops at depth d evaluates d - 2 conditions, not all four (each a condition kernel and a graph node)."""
        def branch():
            self.draft_row(depth)
            if depth < MAX_DRAFTS:
                self.deeper(depth + 1)

        self.flow.when(self.st.more[depth], branch)

    def draft_row(self, depth: int) -> None:
        """One recursive draft row at position n+depth-2: the previous depth's output and its draft d_{depth-1}."""
        st = self.st
        logits, h = self.m.draft(st.drafts[depth - 2].view(1), st.draft_h, self.next.row_pos[depth - 1:depth],
                                 self.one_live)
        self.sample_draft(depth, logits, h)

    @stage("sampling")
    def sample_draft(self, depth: int, logits: torch.Tensor, h: torch.Tensor) -> None:
        st = self.st
        # dist() and the draw into this depth's draft and proposal rows, with k = depth and product *= the served
        # probability (all one kernel where the ops have it)
        out = (st.drafts[depth - 1:depth], st.q_ids[depth - 1:depth], st.q_probs[depth - 1:depth])
        served = self.sample(logits, st.u_draft[depth - 1:depth], out, chain=(st.k, depth, st.product))[0]
        probs = out[2][0]
        st.draft_h.copy_(h)
        # only depths from MIN_DRAFTS on decide: the rows before them always run, so their flags would go unread
        if MIN_DRAFTS <= depth < MAX_DRAFTS and not isinstance(self.controller, FixedDepth):
            self.more(depth, served, probs)

    def more(self, depth: int, served: torch.Tensor, probs: torch.Tensor) -> None:
        """more[depth + 1]: the fitted depth controller's decision after `depth` (fast/depth_rule.py), on the device."""
        assert isinstance(self.controller, LogisticDepth)
        self.m.ops.more(self.controller, depth, served, probs, self.st.product, self.st.more[depth + 1:depth + 2])
