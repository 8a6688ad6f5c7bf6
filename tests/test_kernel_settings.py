"""EngineOptions.kernel_settings (fast/kernel_settings.py): each op's settings reach that op's kernel call, and only
it; the parse of OP.FIELD=VALUE. The kernels are not run: each product call is replaced by a spy that records the
settings it was handed and stops the forward there (the values are the kernels' own tests')."""

from __future__ import annotations

import pytest
import torch

from iquest.fast.parallel import Parallel
from iquest.fast.plan import KernelPlan
from iquest.fast.rank import EngineOptions, RankEngine, kernel_setting
from iquest.tests.helpers import TINY


class Reached(Exception):
    pass


def settings_at(monkeypatch, plan: KernelPlan, module: str, call: str, triples: tuple) -> object:
    """The `settings` the engine hands kernels/<module>.py's `call` in a prefill forward under `plan` and `triples`."""
    import importlib

    mod = importlib.import_module(f"iquest.kernels.{module}")
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["settings"])
        raise Reached

    monkeypatch.setattr(mod, call, spy)
    e = RankEngine(TINY, Parallel.single("cpu"), EngineOptions(max_context=64, dtype="fp32", kernels=plan,
                                                                  kernel_settings=triples))
    pos = torch.arange(8)
    with pytest.raises(Reached):
        e.model.forward(torch.arange(8), pos, torch.ones_like(pos, dtype=torch.bool))
    assert len(seen) == 1
    return seen[0]


# op -> (a plan whose first kernel call in a forward is that op's, its module and call, a non-default setting)
OPS = {
    "linear": (KernelPlan(linear=True), "fp8_linear", "fp8_linear", ("num_stages", 2)),
    "qkv_rope_kv": (KernelPlan(linear=True, attention=True), "qkv_rope_kv", "qkv_rope_kv", ("num_warps", 8)),
    "lm_head": (KernelPlan(lm_head=True), "lm_head", "lm_head", ("block_v", 8)),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_an_ops_settings_reach_its_kernel_and_no_other(monkeypatch, op):
    plan, module, call, (field, value) = OPS[op]
    default = settings_at(monkeypatch, plan, module, call, ())
    assert getattr(default, field) != value  # the product's default: what the variant below changes
    mine = settings_at(monkeypatch, plan, module, call, ((op, field, value),))
    assert getattr(mine, field) == value and mine == type(default)(**{**vars(default), field: value})
    others = [(o, f, v) for o, (p, _, _, (f, v)) in OPS.items() if o != op and all(
        getattr(p, g) <= getattr(plan, g) for g in ("linear", "attention", "lm_head"))]
    if others:  # another op's settings under the same plan leave this op's at the default
        assert settings_at(monkeypatch, plan, module, call, tuple(others)) == default


def test_kernel_setting_parses_op_field_value():
    assert kernel_setting("moe.gate_up_split=4") == ("moe", "gate_up_split", 4)
    assert kernel_setting("linear.preload=False") == ("linear", "preload", False)
    assert kernel_setting("moe.gate_up_scale=product") == ("moe", "gate_up_scale", "product")
    for bad in ("gate_up_split=4", "moe.gate_up_split", "moe.=4", ".x=4", "moe.x="):
        with pytest.raises(ValueError, match="OP.FIELD=VALUE"):
            kernel_setting(bad)
