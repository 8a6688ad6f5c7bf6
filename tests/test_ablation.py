"""fast/ablation.py: `--kernels X~op` removes an op from the round for timing; the decode still runs, the op's first
result per shape is returned from then on (no launches), and the ablation really changes what the model computes."""

from __future__ import annotations

import pytest

from iquest.fast.ablation import ABLATABLE
from iquest.fast.ops import TorchOps, make_ops
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine
from iquest.tests.test_fast_engine import PROMPTS, TINY, fast_steps, tokens


def _decode(kernels: str):
    engine = RankEngine(TINY, Parallel.single("cpu"), EngineOptions(max_context=256, dtype="fp32", kernels=kernels))
    return tokens(fast_steps(engine, PROMPTS[0], 40, 3, n=12)), engine.model.ops


def test_ablated_ops_launch_once_per_shape_and_change_the_output():
    base, _ = _decode("torch")
    for name in ("moe", "norm"):
        got, ops = _decode(f"torch~{name}")
        assert ops.ablated == {name}
        stubbed = ABLATABLE[name]
        assert sum(ops.ablated_calls.get(m, 0) for m in stubbed) > 0, ops.ablated_calls  # calls that ran nothing
        assert set(ops.ablated_calls) <= set(stubbed)
        assert got != base, f"removing {name} left the decode unchanged: the stub did not take effect"


def test_ablation_names_are_checked():
    assert isinstance(make_ops("torch"), TorchOps) and not hasattr(make_ops("torch"), "ablated")
    with pytest.raises(ValueError, match="unknown ablation"):
        make_ops("torch~bogus")
