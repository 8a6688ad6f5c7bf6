"""Decode agreement between two engines: compare until the first divergence, then explain it.

Same seed, same uniforms: two engines emit the same tokens wherever their probabilities agree. A
divergence is explained when both tokens lie inside both engines' top-k/top-p supports at that
position and the engines' target distributions there differ by less than the tolerance (L1), so a
uniform near a decision boundary can fall on either side. Anything else is a defect.

One refinement: rounding can also move a token across the support's own edge (the 20th and 21st
candidates swap, or the top-p crossing moves). When a dist callback also returns the full softmax
over the vocabulary, a token absent from that engine's support still counts as inside when its full
probability is within the tolerance of the smallest probability the support kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

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


def l1(p: Dist, q: Dist) -> float:
    ids = set(p.ids.tolist()) | set(q.ids.tolist())
    return sum(abs(p.prob(t) - q.prob(t)) for t in ids)


def _inside(target, token: int, tolerance: float) -> bool:
    d, full = target if isinstance(target, tuple) else (target, None)
    if d.prob(token) > 0:
        return True
    if full is None:
        return False
    edge = float(full[d.ids].min())  # the smallest full-softmax probability the support kept
    return float(full[token]) >= edge - tolerance


def compare(prompt: Sequence[int], out_a: Sequence[int], out_b: Sequence[int],
            dist_a: Callable[[list[int]], Dist | tuple], dist_b: Callable[[list[int]], Dist | tuple],
            tolerance: float) -> Agreement:
    """`dist_x(prefix)` gives engine x's target distribution for the token after `prefix`, either a
    Dist or (Dist, full softmax over the vocabulary as a float64 tensor)."""
    total = min(len(out_a), len(out_b))
    i = next((j for j in range(total) if out_a[j] != out_b[j]), total)
    if i == total:
        return Agreement(i, total, diverged=False)
    prefix = list(prompt) + list(out_a[:i])
    ta_full, tb_full = dist_a(prefix), dist_b(prefix)
    pa = ta_full[0] if isinstance(ta_full, tuple) else ta_full
    pb = tb_full[0] if isinstance(tb_full, tuple) else tb_full
    ta, tb = out_a[i], out_b[i]
    inside = all(_inside(d, t, tolerance) for d in (ta_full, tb_full) for t in (ta, tb))
    dist = l1(pa, pb)
    detail = (f"position {len(prefix)}: tokens {ta} vs {tb}, probabilities A {pa.prob(ta):.4f}/{pa.prob(tb):.4f} "
              f"B {pb.prob(ta):.4f}/{pb.prob(tb):.4f}, L1 {dist:.2e} (tolerance {tolerance:.1e})")
    return Agreement(i, total, True, inside and dist < tolerance, dist, detail)
