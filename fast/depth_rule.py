"""The depth controller's rule on the round's device tensors (docs/round.md, "Depth controller"): after draft d,

    score = sum_f w_f x_f        over the fitted rule's features, in its file's order
    more  = score > ln(t / (1 - t))        (sigmoid(score) > t, with no exp)

from the depth's draft distribution q (its K candidates' probabilities, zeros past the top-p cut), the served
probability q(d) and the running product of served probabilities, in float32: the contract kernels/depth_rule.py
computes in one launch. The features are reference/depth.py's (`DraftFeatures.vector`), there in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..reference.depth import FEATURES, TINY


def logit_threshold(threshold: float) -> float:
    """The score's threshold: sigmoid(score) > t exactly where score > ln(t / (1 - t))."""
    return math.log(threshold / (1 - threshold))


def score(weights: Mapping[str, float], depth: int, served: torch.Tensor, probs: torch.Tensor,
          product: torch.Tensor) -> torch.Tensor:
    """float32 [1]: the rule's score after `depth`, from probs [K] (the depth's draft distribution), served [1] (q(d))
    and product [] (the running product, this depth's included)."""
    plogp = torch.where(probs > 0, probs * torch.log(probs.clamp(min=TINY)), torch.zeros_like(probs))
    feats = {"bias": torch.ones_like(served), "log_running_product": torch.log(product.clamp(min=TINY)),
             "log_served_prob": torch.log(served.clamp(min=TINY)), "entropy": -plogp.sum(),
             "depth": torch.full_like(served, float(depth))}
    assert set(feats) == set(FEATURES)  # the same features as reference/depth.py
    return sum(w * feats[name] for name, w in weights.items()).view(1)


def more(weights: Mapping[str, float], threshold: float, depth: int, served: torch.Tensor, probs: torch.Tensor,
         product: torch.Tensor) -> torch.Tensor:
    """int32 [1]: whether drafting continues past `depth` (`score` above the threshold's logit)."""
    return (score(weights, depth, served, probs, product) > logit_threshold(threshold)).to(torch.int32)
