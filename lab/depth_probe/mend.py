"""Prototype (lab only): the depth controller's round without its launch overhead.
Since the commit after 4d95180 the product's round (fast/round.py) is `lean` + `nested`, so `base` is too; `fused`
(the rule as one kernel, a numerical change to qualify) is the step still open (docs/PERF.md, the depth row).

Variants of fast/round.RoundRunner, built as subclasses so no product file changes:
  lean    - no controller work after drafts 1 and 2 (more[2], more[3] are written and never read): bit-exact.
  nested  - lean + depths 4..7 as NESTED Flow.when (depth d+1's IF node lives inside depth d's body), so a round that
            stops at 3 evaluates one IF node and one set_cond kernel instead of four: the same ops run, bit-exact.
  fused   - nested + the controller's rule (entropy, features, score, threshold, more[d+1]) in ONE Triton kernel
            instead of ~27 torch launches; same float32 formula (libdevice log, no FMA contraction, weights in the
            file's order); only the entropy's 20-term sum may round in another order (see gpu_bench.py's check).
Ablations (for attribution, same tokens as fixed 3):
  nodes3  - fixed depth 3 plus the auto round's four IF nodes on flags that stay 0 (no controller ops).
  ops3    - fixed depth 3 plus the auto round's controller ops (more() after depths 1..3, results unused), no IF nodes.
"""
from __future__ import annotations

import math

import torch

from iquest.fast.round import RoundRunner
from iquest.fast.state import MAX_DRAFTS
from iquest.reference.depth import FEATURES, MIN_DRAFTS, FixedDepth, LogisticDepth
from iquest.reference.rng import PURPOSE_DRAFT

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

INTERPRETED = bool(triton.knobs.runtime.interpret)


class ProbeRunner(RoundRunner):
    def __init__(self, *a, variant: str = "base", **k):
        super().__init__(*a, **k)
        self.variant = variant
        if variant == "fused":
            c = self.controller
            assert isinstance(c, LogisticDepth)
            names = list(c.weights)
            self.codes = tuple(FEATURES.index(n) for n in names) + (0,) * (5 - len(names))
            self.ws = tuple(float(c.weights[n]) for n in names) + (0.0,) * (5 - len(names))
            self.thr = math.log(c.threshold / (1 - c.threshold))

    # ---- drafting ----------------------------------------------------------------------------------
    def draft(self, tokens, hiddens, positions, live, last):
        v = self.variant
        if v in ("base", "lean", "ops3"):
            return super().draft(tokens, hiddens, positions, live, last)
        logits, h = self.m.draft(tokens, hiddens, positions, live)
        st = self.st
        self.uniform(self.next.u_pos, PURPOSE_DRAFT, self.depths, out=st.u_draft)
        self.sample_draft(1, logits.index_select(0, last.view(1)), h.index_select(0, last.view(1)))
        for depth in range(2, MIN_DRAFTS + 1):
            self.draft_row(depth)
        if v == "nodes3":  # the auto round's four sequential IF nodes; the flags stay 0 (settle zeroes them)
            for depth in range(MIN_DRAFTS + 1, MAX_DRAFTS + 1):
                self.flow.when(st.more[depth], lambda d=depth: self.draft_row(d))
            return
        self._deeper(MIN_DRAFTS + 1)

    def _deeper(self, depth: int) -> None:
        if depth > MAX_DRAFTS:
            return

        def body():
            self.draft_row(depth)
            self._deeper(depth + 1)
        self.flow.when(self.st.more[depth], body)

    def sample_draft(self, depth, logits, h):
        st, v = self.st, self.variant
        out = (st.drafts[depth - 1:depth], st.q_ids[depth - 1:depth], st.q_probs[depth - 1:depth])
        served = self.sample(logits, st.u_draft[depth - 1:depth], out, chain=(st.k, depth, st.product))[0]
        probs = out[2][0]
        st.draft_h.copy_(h)
        if v == "base":
            if depth < MAX_DRAFTS and not isinstance(self.controller, FixedDepth):
                st.more[depth + 1] = self.more(depth, served, probs)
        elif v == "ops3":  # the controller's launches, result thrown away (fixed-3 controller: its more() asserts)
            if depth <= MIN_DRAFTS:
                self.scratch_more(depth, served, probs)
        elif v == "nodes3":
            pass
        elif MIN_DRAFTS <= depth < MAX_DRAFTS:  # lean, nested, fused: only decisions that a Flow.when reads
            if v == "fused" and (served.is_cuda or INTERPRETED):
                decide(probs, served, st.product, st.more[depth + 1:depth + 2], depth, self.codes, self.ws, self.thr)
            else:
                st.more[depth + 1] = self.more(depth, served, probs)

    def scratch_more(self, depth, served, probs):
        if not hasattr(self, "_scratch"):
            self._scratch = torch.zeros(MAX_DRAFTS + 2, dtype=torch.int32, device=served.device)
        if depth < MIN_DRAFTS:
            self._scratch[depth + 1] = torch.ones((), dtype=torch.int32, device=served.device)
            return
        weights = {"bias": 0.36, "log_running_product": 0.5, "log_served_prob": -0.3, "entropy": -0.55, "depth": 0.03}
        plogp = torch.where(probs > 0, probs * torch.log(probs.clamp(min=1e-30)), torch.zeros_like(probs))
        feats = {"bias": torch.ones_like(served), "log_running_product": torch.log(self.st.product.clamp(min=1e-30)),
                 "log_served_prob": torch.log(served.clamp(min=1e-30)), "entropy": -plogp.sum(),
                 "depth": torch.full_like(served, float(depth))}
        score = sum(w * feats[name] for name, w in weights.items())
        self._scratch[depth + 1] = (score > 0.0).to(torch.int32)


# ---- the fused rule (GPU) ------------------------------------------------------------------------------
_dbg = None




@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)  # CUDA's logf, as torch's log
    else:
        return tl.log(x)


@triton.jit
def _pick(code: tl.constexpr, bias, lrp, lsp, ent, dep):
    if code == 0:
        return bias
    elif code == 1:
        return lrp
    elif code == 2:
        return lsp
    elif code == 3:
        return ent
    else:
        return dep

@triton.jit
def _decide_kernel(probs_ptr, K, served_ptr, product_ptr, more_ptr, dbg_ptr, w0, w1, w2, w3, w4, dep, thr,
                   C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                   KP: tl.constexpr, LIBDEVICE: tl.constexpr):
    j = tl.arange(0, KP)
    p = tl.load(probs_ptr + j, mask=j < K, other=0.0)
    plogp = tl.where(p > 0, p * _log(tl.maximum(p, 1e-30), LIBDEVICE), 0.0)
    ent = -tl.sum(plogp, 0)
    lrp = _log(tl.maximum(tl.load(product_ptr), 1e-30), LIBDEVICE)
    lsp = _log(tl.maximum(tl.load(served_ptr), 1e-30), LIBDEVICE)
    bias = lrp * 0.0 + 1.0
    s = _pick(C0, bias, lrp, lsp, ent, dep) * w0
    s = s + _pick(C1, bias, lrp, lsp, ent, dep) * w1
    s = s + _pick(C2, bias, lrp, lsp, ent, dep) * w2
    s = s + _pick(C3, bias, lrp, lsp, ent, dep) * w3
    s = s + _pick(C4, bias, lrp, lsp, ent, dep) * w4
    tl.store(more_ptr, (s > thr).to(tl.int32))
    tl.store(dbg_ptr, s)
    tl.store(dbg_ptr + 1, ent)




def decide(probs, served, product, more_slot, depth, codes, ws, thr, score_out=None):
    """more_slot[0] = the controller's decision after `depth` (one launch)."""
    K = probs.numel()
    if score_out is None:
        global _dbg
        if _dbg is None or _dbg.device != probs.device:
            _dbg = torch.zeros(2, dtype=torch.float32, device=probs.device)
        score_out = _dbg
    _decide_kernel[(1,)](probs, K, served, product, more_slot, score_out, *ws, float(depth), thr, *codes,
                  KP=triton.next_power_of_2(K), LIBDEVICE=probs.is_cuda, num_warps=1,
                  **({'enable_fp_fusion': False} if probs.is_cuda else {}))
