"""Depth controller: after each of drafts d_3..d_6, decide whether one more draft depth pays (docs/round.md).

The rule is a logistic score over features of the drafts so far; its parameters live in a JSON file
shipped beside the model (`depth_controller.json`), fitted from replay data. Both engines evaluate
the same rule on the same features. `FixedDepth` drafts exactly k, for paired comparison.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

MIN_DRAFTS, MAX_DRAFTS = 3, 7
CONTROLLER_FILE = "depth_controller.json"
FEATURES = ("bias", "log_running_product", "log_served_prob", "entropy", "depth")
TINY = 1e-30  # the logs' floor: served probabilities are > 0 (the draft drew the token), guard the log anyway


@dataclass(frozen=True)
class DraftFeatures:
    """What the controller sees after draft `depth`: its served probability q(d), entropy of q,
    and the product of all served probabilities so far (a proxy for P(all drafts accepted))."""

    depth: int
    served_prob: float
    entropy: float
    running_product: float

    def vector(self) -> dict[str, float]:
        return {"bias": 1.0, "log_running_product": math.log(max(self.running_product, TINY)),
                "log_served_prob": math.log(max(self.served_prob, TINY)), "entropy": self.entropy,
                "depth": float(self.depth)}


@dataclass(frozen=True)
class LogisticDepth:
    """Continue drafting while sigmoid(w . features) > threshold (and below MAX_DRAFTS)."""

    weights: dict[str, float] = field(default_factory=lambda: {"bias": 1.2, "log_running_product": 1.0})
    threshold: float = 0.5

    def __post_init__(self) -> None:
        unknown = set(self.weights) - set(FEATURES)
        if unknown:
            raise ValueError(f"depth controller: unknown feature(s) {sorted(unknown)}; known: {FEATURES}")
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(f"depth controller: threshold {self.threshold} is not in (0, 1)")

    def score(self, f: DraftFeatures) -> float:
        x = f.vector()
        return sum(w * x[name] for name, w in self.weights.items())

    def more(self, f: DraftFeatures) -> bool:
        if f.depth < MIN_DRAFTS:
            return True
        if f.depth >= MAX_DRAFTS:
            return False
        return 1.0 / (1.0 + math.exp(-self.score(f))) > self.threshold

    @classmethod
    def from_file(cls, path: str | Path) -> "LogisticDepth":
        raw = json.loads(Path(path).read_text())
        if raw.get("rule") != "logistic":
            raise ValueError(f"{path}: rule {raw.get('rule')!r} is not 'logistic'")
        return cls(weights={k: float(v) for k, v in raw["weights"].items()},
                   threshold=float(raw.get("threshold", 0.5)))

    def to_dict(self) -> dict:
        return {"rule": "logistic", "weights": dict(self.weights), "threshold": self.threshold}


@dataclass(frozen=True)
class FixedDepth:
    """Always exactly `k` drafts (3..7)."""

    k: int

    def __post_init__(self) -> None:
        if not MIN_DRAFTS <= self.k <= MAX_DRAFTS:
            raise ValueError(f"fixed draft depth must be in {MIN_DRAFTS}..{MAX_DRAFTS}, got {self.k}")

    def more(self, f: DraftFeatures) -> bool:
        return f.depth < self.k


def load_controller(model_dir: str | Path | None) -> LogisticDepth:
    """The model's fitted rule when it ships one, else the default rule (continue while P(all) > ~0.3)."""
    if model_dir is not None and (Path(model_dir) / CONTROLLER_FILE).exists():
        return LogisticDepth.from_file(Path(model_dir) / CONTROLLER_FILE)
    return LogisticDepth()
