"""Negative controls: deliberately broken fast engines that qualification must reject.

Each control is a small patch of the fast engine, switched on through `EngineOptions(defects=...)` (or the
ring size), with the check and position class(es) that should catch it. A control proves something only if
its broken code actually ran on an input where it matters, so each one also counts those occasions from the
recorded run (`branch`); a control with a zero count is reported as not caught.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..reference.checkpoint import CheckpointReader

VERIFY = [f"verify_row{i}" for i in range(8)]
DRAFT = [f"draft_depth{d}" for d in range(1, 8)]


@dataclass(frozen=True)
class Control:
    name: str
    what: str
    defects: frozenset[str]
    ring_slack: int | None          # None: the engine's default ring
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


REGISTRY: list[Control] = [
    Control("ring_exact_w", "sliding-window ring of exactly W slots (no 64-slot slack)", frozenset(), 0,
            # Held to the main layers' reused ring slots only. The MTP layer's ring shrinks too, and in bf16 with the
            # fallback the defect showed only there (numerics.hidden/draft_depth1, GPU run at afb0573); accepting that
            # would let a main-layer ring defect pass, so that run stays a failure (see docs/PERF.md). The evicted keys
            # move bf16 logits by less than their tolerance (docs/PERF.md), so the structural check is the one that
            # holds it in bf16; the numerical one is kept, and its margin reported.
            (("cache.window", "ring_reused"), ("numerics.logits", "ring_reused")), "decode",
            lambda s, d: _ring_wrapped(s),
            "verification blocks written after the W-slot ring wrapped"),
    Control("drop_sink", "attention sink logit dropped from the softmax denominator", frozenset({"drop_sink"}), None,
            (("numerics.logits", "prefill"),), "decode", lambda s, d: _forward_rows(s),
            "main-model rows whose attention ran without the sink"),
    Control("rope_shift_rows", "rotary position off by one for rows after a block's first",
            frozenset({"rope_shift_rows"}), None, tuple(("numerics.logits", c) for c in VERIFY[1:]), "decode",
            lambda s, d: _verify_blocks(s, lambda b: sum(b.live) > 1), "verification blocks with more than one row"),
    Control("open_causal_mask", "causal mask open inside the verification block", frozenset({"open_causal_mask"}),
            None, tuple(("numerics.logits", c) for c in VERIFY[:7]), "decode",
            lambda s, d: _verify_blocks(s, lambda b: sum(b.live) > 1), "verification blocks with a later live row"),
    Control("keep_rejected_kv", "rejected rows' KV left valid (no rollback)", frozenset({"keep_rejected_kv"}), None,
            (("numerics.logits", "verify_row0"),), "decode",
            lambda s, d: _rounds(s, lambda st: st.accepted < st.drafts), "rounds with a rejected draft"),
    Control("skip_redraft", "depth-0 redraft skipped (draft KV of accepted positions from draft hiddens)",
            frozenset({"skip_redraft"}), None,
            (("decode.acceptance", "first_divergence"),) + tuple(("numerics.logits", c) for c in DRAFT), "decode",
            lambda s, d: _rounds(s, lambda st: st.accepted >= 1), "rounds with an accepted draft (redraft > 1 row)"),
    Control("mtp_router_shift", "draft layer's router skips its best expert (ranks 2..k+1 chosen)",
            frozenset({"mtp_router_shift"}), None, tuple(("numerics.router", c) for c in DRAFT), "decode",
            lambda s, d: _draft_rows(s), "live draft rows (each routed by the shifted router)"),
    Control("fp8_scales_transposed", "FP8 scale blocks indexed transposed (scale[c//B1, r//B0])",
            frozenset({"fp8_scales_transposed"}), None, (("numerics.logits", "prefill"),), "decode",
            lambda s, d: _square_scales(d), "quantized weights whose square scale grid is not symmetric"),
    Control("top_p_drops_crossing", "top-p drops the token that crosses the threshold",
            frozenset({"top_p_drops_crossing"}), None, tuple(("numerics.sampler", c) for c in VERIFY + DRAFT),
            "decode", lambda s, d: _cut_rows(s), "sampled rows"),
    Control("replacement_from_p", "replacement drawn from p instead of normalize(max(0, p - q))",
            frozenset({"replacement_from_p"}), None, (("lossless", "speculative_token"),), "lossless",
            lambda info, d: info["replacement_drew_tested_token"],
            "requests whose tested token came from the replacement branch"),
]
