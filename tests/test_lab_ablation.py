"""lab/ablation.py: a benchmark variant `X~op` removes an op from the round for timing; the decode still runs, the op's first
result per shape is returned from then on (no launches), and the ablation really changes what the model computes.
lab/unfold.py's `X^fold` controls are parsed and refused off their path here; their bits are checked against the fold
under the interpreter (tests/test_fast_kernels.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, strategies as st

from iquest.bench import variants
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine
from iquest.lab.ablation import ABLATABLE, check_reached, pinned_experts, unreached
from iquest.tests.helpers import PROMPTS, TINY, fast_steps, tokens


def _engine(variant: str) -> RankEngine:
    base = EngineOptions(max_context=256, dtype="fp32")
    return variants.prepare(RankEngine(TINY, Parallel.single("cpu"), variants.options(variant, base)), variant)


def _decode(variant: str):
    engine = _engine(variant)
    return tokens(fast_steps(engine, PROMPTS[0], 40, 3, n=12)), engine.model.ops


def test_ablated_ops_launch_once_per_shape_and_change_the_output():
    base, _ = _decode("torch")
    for name in ("moe", "norm", "qkv", "rope"):
        got, ops = _decode(f"torch~{name}")
        assert ops.ablated == {name}
        stubbed = ABLATABLE[name]
        assert sum(ops.ablated_calls.get(m, 0) for m in stubbed) > 0, ops.ablated_calls  # calls that ran nothing
        assert set(ops.ablated_calls) <= set(stubbed)
        assert got != base, f"removing {name} left the decode unchanged: the stub did not take effect"


def test_an_ablation_off_the_path_is_refused():
    """An ablation whose op the round never calls (~moe on a model without MoE layers, say) would time the unablated
    round: the benchmarks refuse such a variant after its decode."""
    _, ops = _decode("torch~moe")
    assert unreached(ops) == []
    check_reached(ops, "torch~moe")
    ops.ablated_calls.clear()  # as if the MoE were off this variant's path
    assert unreached(ops) == ["moe"]
    with pytest.raises(ValueError, match="never ran"):
        check_reached(ops, "torch~moe")
    off_path = SimpleNamespace(ablated=frozenset({"qkv", "moe"}), ablated_calls={"qkv": 5})
    assert unreached(off_path) == ["moe"]


def test_variant_names_are_checked():
    assert not hasattr(_engine("torch").model.ops, "ablated")
    for bad in ("torch~bogus", "torch~route:0", "torch~route:x", "torch~moe:3"):
        with pytest.raises(ValueError, match="unknown ablation"):
            _engine(bad)
    for bad in ("triton-settle", "bogus~moe", "triton^", "triton~"):  # torch or triton, then ablations and unfolds
        with pytest.raises(ValueError, match="kernels must be torch or triton"):
            variants.split(bad)
    assert variants.split("triton^moe_combine~route:38") == ("triton", {"route:38"}, {"moe_combine"}, set(), ())
    assert variants.split("triton+router_fold~moe") == ("triton", {"moe"}, set(), {"router_fold"}, ())
    assert variants.split("triton^qkv_rope''") == variants.split("triton^qkv_rope")  # an A' arm
    v = variants.split("triton@moe.gate_up_split=1^qkv_rope@moe.gate_up_scale=product@linear.preload=False")
    assert v.unfolded == {"qkv_rope"} and v.kernel_settings == (("moe", "gate_up_split", 1),
                                                                  ("moe", "gate_up_scale", "product"),
                                                                  ("linear", "preload", False))
    assert variants.options("triton@lm_head.block_v=8", EngineOptions()).kernel_settings == (("lm_head", "block_v", 8),)
    for bad in ("triton@gate_up_split=4", "triton@moe.gate_up_split", "triton@.x=4", "triton@moe.=4",
                "triton@moe.gate_up_split="):
        with pytest.raises(ValueError, match="a kernel setting is @OP.FIELD=VALUE"):
            variants.split(bad)
    assert _engine("torch+router_fold").options.router_fold and not _engine("torch").options.router_fold
    with pytest.raises(ValueError, match="unknown unfold"):
        _engine("torch^bogus")
    for bad in ("torch+bogus", "triton+"):
        with pytest.raises(ValueError, match="unknown option|kernels must be"):
            variants.split(bad)


def test_an_unfold_off_the_variants_path_is_refused():
    """The torch forms have no fold: `torch^moe_combine` substitutes nothing, and the check after a decode says so."""
    got, ops = _decode("torch^moe_combine")
    assert got == _decode("torch")[0]
    with pytest.raises(ValueError, match="never folded on its path"):
        variants.check(SimpleNamespace(model=SimpleNamespace(ops=ops)), "torch^moe_combine")


def test_the_routed_prefetch_hands_the_select_slabs_only_when_on():
    """The router's select is handed each MoE layer's Gate and Up codes to warm only under
    `triton+routed_prefetch` (EngineOptions.routed_prefetch, off by default: it measured slower), and never without
    the MoE's kernels."""
    from dataclasses import replace

    from iquest.fast.plan import KernelPlan
    from iquest.fast.weights import MoE

    def ops_of(kernels, name):  # the variant's options with a plan of the MoE's kernels alone (no launch on a CPU)
        options = replace(variants.options(name, EngineOptions(max_context=64)), kernels=kernels)
        return RankEngine(TINY, Parallel.single("cpu"), options).model

    on = ops_of(KernelPlan(moe=True), "triton+routed_prefetch")
    moes = [lw.mlp for lw in [*on.w.layers, on.w.draft.block] if isinstance(lw.mlp, MoE)]
    assert moes and all(on.ops.route_warm(m.router) == (m.gate.q, m.up.q) for m in moes)
    off = ops_of(KernelPlan(moe=True), "triton")
    assert all(off.ops.route_warm(m.router) is None for m in moes)
    plain = ops_of(KernelPlan(sampling=True), "triton+routed_prefetch")
    assert all(plain.ops.route_warm(m.router) is None for m in moes)  # no MoE kernels: no select to warm


@given(rows=st.integers(1, 8), k=st.integers(1, 8), distinct=st.integers(8, 64))
def test_pinned_experts_have_the_asked_count(rows, k, distinct):
    e = pinned_experts(rows, k, distinct, torch.zeros(1, dtype=torch.long))
    assert e.shape == (rows, k) and e.dtype == torch.long and int(e.max()) < distinct
    assert all(len(set(row.tolist())) == k for row in e)  # a row never picks an expert twice
    assert len(set(e.flatten().tolist())) == min(distinct, rows * k)


def test_pinned_routing_reaches_the_moe():
    engine = _engine("torch~route:5")
    ops, seen = engine.model.ops, []
    moe = ops.moe

    def spy(b, experts, *args, **kwargs):
        seen.append(experts.clone())
        return moe(b, experts, *args, **kwargs)
    ops.moe = spy
    fast_steps(engine, PROMPTS[0], 40, 3, n=4)
    assert seen and ops.ablated_calls.get("route", 0) > 0
    for experts in seen:  # every block's experts are the pinned pattern, its first call per shape included
        assert torch.equal(experts, pinned_experts(*experts.shape, 5, experts))


def test_a_norm_written_into_out_gets_the_kept_value():
    """`~norm`: the draft's norms write halves of one row through `out=`; the stub copies its kept value there."""
    from iquest.lab.ablation import _stub

    calls: dict = {}

    def norm(x, w, eps, dtype=None, out=None):
        y = x * w
        return y if out is None else out.copy_(y)

    stub = _stub(norm, calls)
    first, later = torch.zeros(2, 8), torch.zeros(2, 8)
    stub(torch.ones(2, 4), torch.full((4,), 2.0), 1e-6, out=first[:, :4])
    got = stub(torch.ones(2, 4), torch.full((4,), 5.0), 1e-6, out=later[:, 4:])
    assert calls == {"norm": 1} and got.data_ptr() == later[:, 4:].data_ptr()
    assert torch.equal(later[:, 4:], torch.full((2, 4), 2.0)) and torch.equal(later[:, :4], torch.zeros(2, 4))
