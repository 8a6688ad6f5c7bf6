"""The engine variants a benchmark compares side by side: `torch` or `triton` (the kernel plans of fast/plan.py), each
optionally with a product option that changes numerics turned on (`triton+router_fold`: EngineOptions), with ops
removed from the round for timing (`triton~moe`, `triton~route:38`: lab/ablation.py), with folds undone, as the
control of a fold (`triton^moe_combine`: lab/unfold.py), and with other kernel launch settings
(`triton@moe.gate_up_split=1@linear.num_stages=2`: fast/kernel_settings.py, EngineOptions.kernel_settings), so a tuned
setting is timed in the whole round."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import NamedTuple

from ..fast.rank import EngineOptions, KernelSetting, RankEngine, kernel_setting
from ..lab.ablation import ablate, check_reached
from ..lab.unfold import check_unfolded, unfold


# +option: the EngineOptions bool field it turns on (a product option: the router fold, a numerical change qualified
# apart; the expert prefetch and the routed prefetch, cache hints; the Down tail, a fold measured slower)
OPTIONS = frozenset({"router_fold", "expert_prefetch", "routed_prefetch", "down_tail"})


class Variant(NamedTuple):
    kernels: str
    ablated: frozenset[str]
    unfolded: frozenset[str]
    options: frozenset[str] = frozenset()
    kernel_settings: tuple[KernelSetting, ...] = ()


def _setting(name: str, part: str) -> KernelSetting:
    try:
        return kernel_setting(part)
    except ValueError:
        raise ValueError(f"variant {name!r}: a kernel setting is @OP.FIELD=VALUE, got @{part}") from None


def split(name: str) -> Variant:
    """The parts of a variant name such as "triton+router_fold^moe_combine~route:38@moe.gate_up_split=1": kernels, then
    +options, ~ablations, ^unfolds and @kernel settings in any order. Trailing primes name an A' arm: "triton'" is
    "triton" again, an engine of its own built alike, whose spread against the first is the benchmark's noise floor."""
    kernels, *parts = re.split(r"(?=[~^+@])", name.rstrip("'"))
    if kernels not in ("torch", "triton") or any(len(p) < 2 for p in parts):
        raise ValueError(f"variant {name!r}: kernels must be torch or triton (then +options, ~op ablations, ^fold "
                         f"unfolds and @kernel settings), got {kernels!r}")
    chosen = frozenset(p[1:] for p in parts if p[0] == "+")
    if chosen - OPTIONS:
        raise ValueError(f"variant {name!r}: unknown option {sorted(chosen - OPTIONS)}: choose from "
                         f"{sorted(OPTIONS)}")
    return Variant(kernels, frozenset(p[1:] for p in parts if p[0] == "~"),
                   frozenset(p[1:] for p in parts if p[0] == "^"), chosen,
                   tuple(_setting(name, p[1:]) for p in parts if p[0] == "@"))


def options(name: str, base: EngineOptions) -> EngineOptions:
    v = split(name)
    return replace(base, kernels=v.kernels, kernel_settings=v.kernel_settings, **dict.fromkeys(v.options, True))


def prepare(engine: RankEngine, name: str) -> RankEngine:
    """Apply the variant's unfolds and ablations to a freshly built engine (before its first runner is captured)."""
    v = split(name)
    if v.unfolded:
        unfold(engine.model.ops, set(v.unfolded))
    if v.ablated:
        ablate(engine.model.ops, set(v.ablated))
    return engine


def check(engine: RankEngine, name: str) -> None:
    """After a decode: refuse a variant whose ablated op never ran, or whose unfolded fold was never on its path (it
    timed the unablated or the folded round)."""
    check_reached(engine.model.ops, name)
    check_unfolded(engine.model.ops, name)
