"""The engine variants a benchmark compares side by side: `torch` or `triton` (the kernel plans of fast/plan.py), each
optionally with ops removed from the round for timing (`triton~moe`, `triton~route:38`: lab/ablation.py)."""

from __future__ import annotations

from dataclasses import replace

from ..fast.rank import EngineOptions, RankEngine
from ..lab.ablation import ablate, check_reached


def split(name: str) -> tuple[str, frozenset[str]]:
    """(kernels, ablations) of a variant name such as "triton~route:38~lm_head"."""
    kernels, *ablated = name.split("~")
    if kernels not in ("torch", "triton"):
        raise ValueError(f"variant {name!r}: kernels must be torch or triton (then ~op ablations), got {kernels!r}")
    return kernels, frozenset(ablated)


def options(name: str, base: EngineOptions) -> EngineOptions:
    return replace(base, kernels=split(name)[0])


def prepare(engine: RankEngine, name: str) -> RankEngine:
    """Apply the variant's ablations to a freshly built engine (before its first runner is captured)."""
    ablated = split(name)[1]
    if ablated:
        ablate(engine.model.ops, set(ablated))
    return engine


def check(engine: RankEngine, name: str) -> None:
    """After a decode: refuse a variant whose ablated op never ran (it timed the unablated round)."""
    check_reached(engine.model.ops, name)
