"""Tolerances as data (`tolerances.json`): one entry per check and position class, each with its reason."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

PATH = Path(__file__).with_name("tolerances.json")


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


def scheme(dtype: str, plan=None, config=None, tp: int = 1) -> str:
    """The tolerance column for an engine: its compute dtype, plus "+e4m3act" when the kernel plan (fast/plan.py) runs
    the MoE as the Triton kernel, whose Down input is act_quant'ed to E4M3 (ROUND.md) where the reference and the
    torch form keep it. With `config`, only when the kernel takes that model's shapes at `tp` (else the MoE runs its
    torch form, exactly)."""
    if plan is None or not plan.moe:
        return dtype
    if config is not None:
        from ..fast.triton_ops import moe_takes

        block = tuple(config.weight_block_size)
        if not moe_takes(block, block, config.moe_intermediate_size // tp):
            return dtype
    return f"{dtype}+e4m3act"


def value(check: str, dtype: str, cls: str = "*"):
    e = entry(check, cls)
    if dtype not in e:
        raise KeyError(f"tolerance {check!r}/{cls!r} states no value for dtype {dtype!r}")
    return e[dtype]


def reason(check: str, cls: str = "*") -> str:
    return entry(check, cls)["reason"]
