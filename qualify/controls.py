"""Negative controls: deliberately broken fast engines that qualification must reject.

Each control is a broken piece substituted when its candidate is built (`EngineParts`: a subclass of the weight
loader, the cache, the model or the round runner, defined here), with the check and position class(es) that should
catch it; no product file carries a branch for it. A control proves something only if its broken code actually ran
on an input where it matters, so each one also counts those occasions from the recorded run (`branch`); a control
with a zero count is reported as not caught.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

from ..fast import sampler
from ..fast.cache import LayerKV, StaticKV
from ..fast.model import Block, FastModel
from ..fast.rank import EngineParts
from ..fast.round import RoundRunner
from ..fast.torch_ops import TorchOps
from ..fast.weights import FP8Weight, WeightLoader
from ..reference.checkpoint import CheckpointReader
from ..reference.rng import PURPOSE_ACCEPT, PURPOSE_COMMIT

VERIFY = [f"verify_row{i}" for i in range(8)]
DRAFT = [f"draft_depth{d}" for d in range(1, 8)]


@dataclass(frozen=True)
class Control:
    name: str
    what: str
    parts: EngineParts              # the candidate's pieces, one of them broken
    catches: tuple[tuple[str, str], ...]  # (check, class): caught when any of these fails
    family: str                     # "decode" (recorded sessions) or "lossless"
    branch: Callable                # (sessions or lossless info, model_dir) -> times the broken path mattered
    branch_what: str


def _verify_blocks(sessions, pred=lambda b: True) -> int:
    return sum(1 for s in sessions for b in s.blocks if b.kind == "verify" and pred(b))


def _rounds(sessions, pred) -> int:
    return sum(1 for s in sessions for st in s.steps[1:] if pred(st))


def _forward_rows(sessions) -> int:
    return sum(sum(b.live) for s in sessions for b in s.blocks if b.kind != "draft")


def _draft_rows(sessions) -> int:
    return sum(sum(b.live) for s in sessions for b in s.blocks if b.kind == "draft")


def _square_scales(model_dir) -> int:
    reader = CheckpointReader(model_dir)
    count = 0
    for name in reader.names():
        if name.endswith("_scale_inv"):
            continue
        _, s = reader.read_weight(name)
        if s is not None and s.shape[-1] == s.shape[-2] and not bool((s == s.transpose(-1, -2)).all()):
            count += 1
    return count


def _cut_rows(sessions) -> int:
    """Sampled rows where ROUND.md's top-p keeps more than one token (so there is a crossing token to drop)."""
    from ..reference import sampling

    return sum(1 for s in sessions for b in s.blocks for _, _, _, logits in b.dists
               if sampling.dist(logits, s.params).ids.numel() >= 2)


def _ring_wrapped(sessions) -> int:
    return sum(1 for s in sessions for b in s.blocks if b.kind == "verify" and b.positions[0] >= s.ring)


# ---- the broken pieces ---------------------------------------------------------------------------------------
class ExactWindowRing(StaticKV):
    """ring_exact_w: sliding-window rings of exactly W slots, no 64-slot slack."""

    ring_slack = 0


class OpenMaskKV(LayerKV):
    causal = False


class OpenCausalMask(StaticKV):
    """open_causal_mask: every verification row sees the whole block, later rows included."""

    layer_kv = OpenMaskKV


class TransposedScales(WeightLoader):
    """fp8_scales_transposed: square FP8 scale grids indexed transposed, scale[c // B1, r // B0], in the whole
    matrix's coordinates: under tensor parallelism each rank takes its slice of the transposed grid (a rank's own
    slice of a square grid is seldom square, so transposing that would leave most weights healthy)."""

    def fp8(self, name: str) -> FP8Weight:
        w = super().fp8(name)
        whole = self.reader.read(self.reader.specs[name].scale_name)
        if whole.shape[-1] != whole.shape[-2]:
            return w
        scale = whole.transpose(-1, -2)
        part = self.reader.scale_part(name, self.par.world, self.par.rank)
        if part is not None:
            dim, start, stop = part
            scale = scale.narrow(dim, start, stop - start)
        return FP8Weight(w.q, scale.contiguous().to(w.scale.device, w.scale.dtype), w.block, w.dtype)


class NoSinkModel(FastModel):
    """drop_sink: attention without the sink logit in the softmax denominator."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        attention = self.ops.attention
        self.ops.attention = lambda q, kv, positions, sinks: attention(q, kv, positions, None)


class ShiftedRopeModel(FastModel):
    """rope_shift_rows: rows after a block's first rotated one position too far."""

    def _block(self, positions: torch.Tensor, live: torch.Tensor) -> Block:
        shifted = positions + (torch.arange(positions.shape[0], device=positions.device) > 0)
        return Block(positions, live, *self.ops.rotary(self.rope_cos, self.rope_sin, shifted))


class ShiftedDraftRouterModel(FastModel):
    """mtp_router_shift: the draft layer's router skips its best expert (ranks 2..k+1 chosen)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        route, draft_layer = self.ops.route, self.w.mtp.block

        def shifted(b32, lw, top_k, norm_topk_prob, scaling):
            weights, experts, scores = route(b32, lw, top_k, norm_topk_prob, scaling)
            if lw is not draft_layer:
                return weights, experts, scores
            experts = torch.topk(scores, top_k + 1, dim=-1).indices[:, 1:]
            weights = scores.gather(-1, experts)
            weights = weights / weights.sum(-1, keepdim=True) if norm_topk_prob else weights
            return weights * scaling, experts, scores
        self.ops.route = shifted


class KeepRejectedKV(RoundRunner):
    """keep_rejected_kv: the rejected drafts stay in the context (no rollback): d_1..d_k and x committed. (Where no
    draft was verified, k = 0: prefill's first token and plain rounds commit what they would anyway.)"""

    def settle(self, committed, count, emitted, n_emit, logprobs, k, a):
        x = emitted.index_select(0, a.view(1))
        committed = torch.where(self.rows < k, torch.cat([self.st.drafts, self.st.drafts[:1]]), x)
        return super().settle(committed, k + 1, emitted, n_emit, logprobs, k, a)


class SkipRedraft(RoundRunner):
    """skip_redraft: depth 0 drafts only the round's last committed row, so the accepted positions keep the draft
    KV written from draft hiddens."""

    def settle(self, committed, count, emitted, n_emit, logprobs, k, a):
        nxt = super().settle(committed, count, emitted, n_emit, logprobs, k, a)
        return nxt._replace(live=self.rows == nxt.last)


class ReplacementFromP(RoundRunner):
    """replacement_from_p: at a rejection the replacement is drawn from p_a itself, not normalize(max(0, p - q))."""

    def accept(self, p_ids, p_probs, n, k):
        st, ops, j = self.st, self.m.ops, self.rows
        p_d = sampler.prob_of(p_ids[:-1], p_probs[:-1], st.drafts)
        q_d = sampler.prob_of(st.q_ids, st.q_probs, st.drafts)
        _, a = sampler.acceptance(p_d, q_d, ops.uniforms(st.seed, n + self.depths, PURPOSE_ACCEPT), self.depths <= k)
        f_ids, f_probs = p_ids.index_select(0, a.view(1)), p_probs.index_select(0, a.view(1))
        x = sampler.draw(f_ids, f_probs, ops.uniforms(st.seed, (n + a + 1).view(1), PURPOSE_COMMIT))
        emitted = torch.where(j < a, torch.cat([st.drafts, st.drafts[:1]]), x)
        return a, x[0], emitted, torch.log(sampler.prob_of(p_ids, p_probs, emitted))


class TopPDropsCrossing(RoundRunner):
    """top_p_drops_crossing: top-p also drops the token that crosses the threshold (every distribution the round
    samples or verifies with, drafts included: their draws then come from the edited distribution, by the torch form
    of the draw)."""

    @staticmethod
    def _drop_crossing(ids, probs):
        last = (probs > 0).sum(-1, keepdim=True) - 1  # Dist order: the crossing token is the last one kept
        probs = torch.where((torch.arange(probs.shape[-1], device=probs.device) == last) & (last > 0), 0.0, probs)
        return ids, probs / probs.sum(-1, keepdim=True)

    def dist(self, local_logits):
        return self._drop_crossing(*super().dist(local_logits))

    def sample(self, local_logits, u, out, chain=None):
        edited = SimpleNamespace(dist=lambda *args: self._drop_crossing(*self.m.ops.dist(*args)))
        return TorchOps.sample(edited, local_logits, *self._sampling_args(), u, out, chain)


REGISTRY: list[Control] = [
    Control("ring_exact_w", "sliding-window ring of exactly W slots (no 64-slot slack)",
            EngineParts(cache=ExactWindowRing),
            # Held to the main layers' reused ring slots only. The MTP layer's ring shrinks too, and in bf16 with the
            # fallback the defect showed only there (numerics.hidden/draft_depth1, GPU run at afb0573); accepting that
            # would let a main-layer ring defect pass, so that run stays a failure (see docs/PERF.md). The evicted keys
            # move bf16 logits by less than their tolerance (docs/PERF.md), so the structural check is the one that
            # holds it in bf16; the numerical one is kept, and its margin reported.
            (("cache.window", "ring_reused"), ("numerics.logits", "ring_reused")), "decode",
            lambda s, d: _ring_wrapped(s),
            "verification blocks written after the W-slot ring wrapped"),
    Control("drop_sink", "attention sink logit dropped from the softmax denominator", EngineParts(model=NoSinkModel),
            (("numerics.logits", "prefill"),), "decode", lambda s, d: _forward_rows(s),
            "main-model rows whose attention ran without the sink"),
    Control("rope_shift_rows", "rotary position off by one for rows after a block's first",
            EngineParts(model=ShiftedRopeModel), tuple(("numerics.logits", c) for c in VERIFY[1:]), "decode",
            lambda s, d: _verify_blocks(s, lambda b: sum(b.live) > 1), "verification blocks with more than one row"),
    Control("open_causal_mask", "causal mask open inside the verification block", EngineParts(cache=OpenCausalMask),
            tuple(("numerics.logits", c) for c in VERIFY[:7]), "decode",
            lambda s, d: _verify_blocks(s, lambda b: sum(b.live) > 1), "verification blocks with a later live row"),
    Control("keep_rejected_kv", "rejected rows' KV left valid (no rollback)", EngineParts(runner=KeepRejectedKV),
            (("numerics.logits", "verify_row0"),), "decode",
            lambda s, d: _rounds(s, lambda st: st.accepted < st.drafts), "rounds with a rejected draft"),
    Control("skip_redraft", "depth-0 redraft skipped (draft KV of accepted positions from draft hiddens)",
            EngineParts(runner=SkipRedraft),
            (("decode.acceptance", "first_divergence"),) + tuple(("numerics.logits", c) for c in DRAFT), "decode",
            lambda s, d: _rounds(s, lambda st: st.accepted >= 1), "rounds with an accepted draft (redraft > 1 row)"),
    Control("mtp_router_shift", "draft layer's router skips its best expert (ranks 2..k+1 chosen)",
            EngineParts(model=ShiftedDraftRouterModel), tuple(("numerics.router", c) for c in DRAFT), "decode",
            lambda s, d: _draft_rows(s), "live draft rows (each routed by the shifted router)"),
    Control("fp8_scales_transposed", "FP8 scale blocks indexed transposed (scale[c//B1, r//B0])",
            EngineParts(loader=TransposedScales), (("numerics.logits", "prefill"),), "decode",
            lambda s, d: _square_scales(d), "quantized weights whose square scale grid is not symmetric"),
    Control("top_p_drops_crossing", "top-p drops the token that crosses the threshold",
            EngineParts(runner=TopPDropsCrossing), tuple(("numerics.sampler", c) for c in VERIFY + DRAFT),
            "decode", lambda s, d: _cut_rows(s), "sampled rows"),
    Control("replacement_from_p", "replacement drawn from p instead of normalize(max(0, p - q))",
            EngineParts(runner=ReplacementFromP), (("lossless", "speculative_token"),), "lossless",
            lambda info, d: info["replacement_drew_tested_token"],
            "requests whose tested token came from the replacement branch"),
]


def control(name: str) -> Control:
    """The registered control called `name` (a clear error naming the known ones otherwise)."""
    for c in REGISTRY:
        if c.name == name:
            return c
    raise ValueError(f"unknown negative control {name!r}; known: {', '.join(c.name for c in REGISTRY)}")
