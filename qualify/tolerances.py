"""Position classes and tolerances as data (`tolerances.json`): one entry per check and position class, each with
the argument it comes from (`why`)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

PATH = Path(__file__).with_name("tolerances.json")
DTYPES = ("fp32", "bf16")


@lru_cache(maxsize=None)
def table() -> dict:
    return json.loads(PATH.read_text())


def entry(check: str, cls: str = "*") -> dict:
    checks = table()["checks"]
    if check not in checks:
        raise KeyError(f"no tolerance for check {check!r} in {PATH}")
    per = checks[check]
    found = per.get(cls, per.get("*"))
    if found is None:
        raise KeyError(f"no tolerance for check {check!r}, class {cls!r} in {PATH}")
    return found


def scheme(dtype: str) -> str:
    """The tolerance column of a candidate: its compute dtype (the kernel plan changes no column: every kernel that may
    run computes the published ops in the compute dtype, fast/plan.py)."""
    if dtype not in DTYPES:
        raise ValueError(f"no tolerance column for compute dtype {dtype!r}; known: {', '.join(DTYPES)}")
    return dtype


def fp8w(column: str) -> str:
    """The column of the fp8w.* checks (a BF16 checkpoint quantized at load, against the BF16 reference)."""
    return f"{column}+fp8w"


def value(check: str, column: str, cls: str = "*"):
    e = entry(check, cls)
    if column not in e:
        raise KeyError(f"tolerance {check!r}/{cls!r} states no value for column {column!r}")
    return e[column]


def column(column: str, checks=("numerics.logits", "numerics.hidden", "numerics.topk", "numerics.sampler",
                                "numerics.router", "numerics.router_scores", "cache.window")) -> dict:
    """check -> value of one column, for the replay's scoring (qualify/replay.score)."""
    return {c: value(c, column) for c in checks}


def why(check: str, cls: str = "*") -> str:
    return entry(check, cls)["why"]


def suite_alpha() -> float:
    """The whole suite's statistical false-alarm rate per run (tolerances.json, "statistics")."""
    return float(table()["statistics"]["suite_alpha"])
