"""Decode agreement between two engines: compare until the first divergence, then explain it.

Same seed, same uniforms: two engines emit the same tokens wherever their probabilities agree. At
the first divergence (engine A emitted ta, engine B emitted tb at the same position) the decision
is explained when each engine's own token lies in its top-k/top-p support and, for both tokens,
the two engines' sampling probabilities differ by less than the tolerance: then a uniform near a
decision boundary (a cumulative sum, an acceptance ratio) can fall on either side. A token outside
one engine's support passes only if the other engine gives it less than the tolerance, i.e. it sat
at the support's edge (rounding swapped the 20th and 21st candidates, or moved the top-p crossing).
Anything else is a defect. The L1 distance of the two distributions is reported beside it.

At temperature 0 (greedy) both distributions are one-hot, so their L1 distance is 0 or 2 whatever the margin
between the tied tokens: there a divergence is measured in the reference's logits instead (`greedy_gap`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..reference.sampling import Dist


@dataclass(frozen=True)
class Agreement:
    agreed: int                 # output tokens equal before the first divergence
    total: int                  # tokens compared (shorter of the two outputs)
    diverged: bool
    explained: bool = True
    l1: float = 0.0             # L1 distance of the two target distributions at the divergence
    detail: str = ""

    def __str__(self) -> str:
        if not self.diverged:
            return f"agree on all {self.total} tokens"
        verdict = "explained" if self.explained else "UNEXPLAINED"
        return f"agree on {self.agreed}/{self.total} tokens, then diverge ({verdict}: {self.detail})"


def divergence_bound(tol_rel: float, scale: float, temperature: float) -> float:
    """2 e / T, e = tol_rel * scale: how far two sampling distributions may lie apart in L1 when each logit is within e
    of the reference's (qualify/tolerances.json, decode.tokens); T taken as 1 at temperature 0, where it bounds a
    greedy pick's `greedy_gap`."""
    return 2 * tol_rel * scale / (temperature if temperature > 0 else 1.0)


def greedy_gap(ref_logits: torch.Tensor, token: int) -> float:
    """How far below the reference's largest logit a greedy engine's pick lies (0 where it is the reference's own
    argmax). An engine whose logits are each within e of the reference's can pick a token at most 2e below it, so a
    pick is explained by a logit tolerance e when its gap is at most 2e (`divergence_bound`)."""
    return float(ref_logits.max() - ref_logits[token])


def l1(p: Dist, q: Dist) -> float:
    ids = set(p.ids.tolist()) | set(q.ids.tolist())
    return sum(abs(p.prob(t) - q.prob(t)) for t in ids)


def compare(prompt: Sequence[int], out_a: Sequence[int], out_b: Sequence[int],
            dist_a: Callable[[list[int]], Dist], dist_b: Callable[[list[int]], Dist], tolerance: float) -> Agreement:
    """`dist_x(prefix)` gives engine x's target distribution for the token after `prefix`."""
    total = min(len(out_a), len(out_b))
    i = next((j for j in range(total) if out_a[j] != out_b[j]), total)
    if i == total:
        return Agreement(i, total, diverged=False)
    prefix = list(prompt) + list(out_a[:i])
    pa, pb = dist_a(prefix), dist_b(prefix)
    ta, tb = out_a[i], out_b[i]
    own = pa.prob(ta) > 0 and pb.prob(tb) > 0
    gap = max(abs(pa.prob(t) - pb.prob(t)) for t in (ta, tb))
    dist = l1(pa, pb)
    detail = (f"position {len(prefix)}: tokens {ta} vs {tb}, probabilities A {pa.prob(ta):.4f}/{pa.prob(tb):.4f} "
              f"B {pb.prob(ta):.4f}/{pb.prob(tb):.4f} (largest gap {gap:.2e}, tolerance {tolerance:.1e}), "
              f"L1 {dist:.2e}")
    return Agreement(i, total, True, own and gap < tolerance, dist, detail)
