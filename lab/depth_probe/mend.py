"""Variants (lab only) of the depth controller's round, for attribution against the product's.
The product (fast/round.py) decides only after depths 3..6, nests each depth's condition inside the previous depth's
branch, and on the GPU evaluates the rule in one kernel (kernels/depth_rule.py); its torch form is ~20 small kernels.

Variants of fast/round.RoundRunner, built as subclasses so no product file changes:
  product    - the product's round as it is.
  torch_rule - the product with the rule's torch form (fast/depth_rule.py) on every device: the one-kernel rule's
               gain, the same decisions but where a score lies within fp32 rounding of the threshold.
Ablations (for attribution, the same tokens as fixed depth 3):
  nodes3     - fixed depth 3 plus four sibling IF nodes on flags that stay 0 (no controller ops).
  ops3       - fixed depth 3 plus the controller's torch ops after depths 1..3, results unused, no IF nodes.
"""
from __future__ import annotations

import torch

from iquest.fast import depth_rule
from iquest.fast.round import RoundRunner
from iquest.fast.state import MAX_DRAFTS
from iquest.reference.depth import MIN_DRAFTS, LogisticDepth
from iquest.reference.rng import PURPOSE_DRAFT

VARIANTS = ("product", "torch_rule", "nodes3", "ops3")
OPS3_RULE = LogisticDepth(weights={"bias": 0.36, "log_running_product": 0.5, "log_served_prob": -0.3,
                                   "entropy": -0.55, "depth": 0.03}, threshold=0.5)


class ProbeRunner(RoundRunner):
    def __init__(self, *a, variant: str = "product", **k):
        assert variant in VARIANTS, variant
        super().__init__(*a, **k)
        self.variant = variant
        self._scratch = torch.zeros(MAX_DRAFTS + 2, dtype=torch.int32, device=self.st.n.device)

    def draft(self, tokens, hiddens, positions, live, last):
        if self.variant != "nodes3":
            return super().draft(tokens, hiddens, positions, live, last)
        logits, h = self.m.draft(tokens, hiddens, positions, live)
        st = self.st
        self.uniform(self.next.u_pos, PURPOSE_DRAFT, self.depths, out=st.u_draft)
        self.sample_draft(1, logits.index_select(0, last.view(1)), h.index_select(0, last.view(1)))
        for depth in range(2, MIN_DRAFTS + 1):
            self.draft_row(depth)
        for depth in range(MIN_DRAFTS + 1, MAX_DRAFTS + 1):  # the flags stay 0 (settle zeroes them)
            self.flow.when(st.more[depth], lambda d=depth: self.draft_row(d))

    def sample_draft(self, depth, logits, h):
        if self.variant != "ops3":
            return super().sample_draft(depth, logits, h)
        st = self.st
        out = (st.drafts[depth - 1:depth], st.q_ids[depth - 1:depth], st.q_probs[depth - 1:depth])
        served = self.sample(logits, st.u_draft[depth - 1:depth], out, chain=(st.k, depth, st.product))[0]
        st.draft_h.copy_(h)
        if depth <= MIN_DRAFTS:  # the controller's ops, thrown away: a fixed-3 round pays their launches only
            self._scratch[depth + 1:depth + 2].copy_(depth_rule.more(
                OPS3_RULE.weights, OPS3_RULE.threshold, depth, served, out[2][0], st.product))

    def more(self, depth, served, probs):
        if self.variant != "torch_rule":
            return super().more(depth, served, probs)
        st = self.st
        st.more[depth + 1:depth + 2].copy_(depth_rule.more(self.controller.weights, self.controller.threshold, depth,
                                                           served, probs, st.product))
