"""Sampling math of one speculative round (docs/round.md, "Sampling a distribution" and "The round"), float64.

A distribution is sparse: at most top_k (ids, probs) pairs, kept in *Dist order* (descending
probability, ties: lower token id). Every draw walks that order with one uniform, so the reference and
the fast engine pick the same token from the same uniform wherever their probabilities agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from iquest.reference.config import check_sampling


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 20
    top_p: float = 0.95

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class Dist:
    """Sparse distribution: int64 ids [n] and float64 probs [n] (n >= 1, all > 0), in Dist order."""

    ids: torch.Tensor
    probs: torch.Tensor

    def __post_init__(self) -> None:
        if self.ids.dtype != torch.int64 or self.probs.dtype != torch.float64:
            raise ValueError(f"Dist needs int64 ids and float64 probs, got {self.ids.dtype}, {self.probs.dtype}")
        if self.ids.dim() != 1 or self.ids.shape != self.probs.shape or self.ids.numel() == 0:
            raise ValueError(f"Dist needs non-empty 1-D ids and probs of one length, got "
                             f"{tuple(self.ids.shape)}, {tuple(self.probs.shape)}")

    def prob(self, token: int) -> float:
        """Probability of `token` (0.0 when it is outside the support)."""
        hit = (self.ids == token).nonzero()
        return float(self.probs[hit[0, 0]]) if hit.numel() else 0.0


def _ordered(ids: torch.Tensor, probs: torch.Tensor) -> Dist:
    """Dist of the positive entries, sorted descending by probability, ties to the lower id.

    Two stable sorts: by id, then by -prob. Zero-probability tokens are dropped so that no rule
    (in particular draw()'s rounding fallback to the last token) can ever return one.
    """
    keep = probs > 0
    ids, probs = ids[keep], probs[keep]
    by_id = torch.argsort(ids, stable=True)
    ids, probs = ids[by_id], probs[by_id]
    by_prob = torch.argsort(-probs, stable=True)
    return Dist(ids[by_prob].contiguous(), probs[by_prob].contiguous())


def _top_p_count(probs: torch.Tensor, top_p: float) -> int:
    """Length of the shortest prefix of `probs` (Dist order) whose cumulative sum reaches top_p.

    The token that crosses top_p stays. When rounding keeps the total below top_p, all stay.
    """
    reached = (torch.cumsum(probs, 0) >= top_p).nonzero()
    return int(reached[0, 0]) + 1 if reached.numel() else probs.numel()


def dist(logits: torch.Tensor, params: SamplingParams) -> Dist:
    """The sampling distribution of one row of logits [V] under `params`."""
    if logits.dim() != 1 or logits.numel() == 0 or not logits.dtype.is_floating_point:
        raise ValueError(f"dist() takes one non-empty floating row of logits [V], got "
                         f"{logits.dtype} {tuple(logits.shape)}")
    x = logits.detach().to(device="cpu", dtype=torch.float64)
    if not math.isfinite(float(x.max())):  # the max is NaN if any logit is, +inf if any is, -inf if all are
        raise ValueError("logits must not contain NaN or +inf, and not all be -inf")
    if params.temperature == 0:
        token = int(torch.argmax(x))  # argmax returns the first maximum: ties go to the lower id
        return Dist(torch.tensor([token]), torch.tensor([1.0], dtype=torch.float64))
    # Top-k on the raw logits: dividing by a positive temperature keeps their order, and ranking the
    # unscaled values avoids ties that overflow of x / T could create for tiny temperatures.
    k = min(params.top_k, x.numel())
    ids = torch.argsort(-x, stable=True)[:k]  # stable: equal logits keep ascending id order
    # Softmax of x / T, shifted by the max first so that no temperature overflows exp().
    top = x[ids]
    z = (top - top[0]) / params.temperature
    e = torch.exp(z)
    d = _ordered(ids, e / e.sum())
    n = _top_p_count(d.probs, params.top_p)
    probs = d.probs[:n]
    return _ordered(d.ids[:n], probs / probs.sum())


def draw(d: Dist, u: float) -> int:
    """Inverse CDF in Dist order: the first token whose cumulative probability exceeds u.

    If rounding leaves u at or above the total, the last token is taken.
    """
    if not 0 <= u < 1:
        raise ValueError(f"u must be a uniform in [0, 1), got {u!r}")
    above = (torch.cumsum(d.probs, 0) > u).nonzero()
    i = int(above[0, 0]) if above.numel() else d.ids.numel() - 1
    return int(d.ids[i])


def accept(p: Dist, q: Dist, token: int, u: float) -> bool:
    """Speculative acceptance of a draft `token` drawn from q, under target p: u < min(1, p/q)."""
    q_tok = q.prob(token)
    if q_tok <= 0:
        raise ValueError(f"draft token {token} has zero probability under its own proposal q")
    return u < min(1.0, p.prob(token) / q_tok)


def residual(p: Dist, q: Dist) -> Dist:
    """normalize(max(0, p - q)) over the union of supports; p itself when that has no mass."""
    union = torch.unique(torch.cat([p.ids, q.ids]))  # sorted ascending
    pv = torch.zeros(union.numel(), dtype=torch.float64)
    qv = torch.zeros_like(pv)
    pv[torch.searchsorted(union, p.ids)] = p.probs
    qv[torch.searchsorted(union, q.ids)] = q.probs
    r = torch.clamp(pv - qv, min=0.0)
    total = r.sum()
    if not total > 0:
        return p
    return _ordered(union, r / total)
