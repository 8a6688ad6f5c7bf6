"""EngineOptions.kernel_settings (fast/kernel_settings.py): each op's settings reach that op's kernel calls, and only
them; the parse of OP.FIELD=VALUE. The kernels are not run: each product call is replaced by a spy that records the
settings it was handed and either stands in with the kernel's torch form or stops the forward there (the values are
the kernels' own tests')."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from iquest.fast.kernel_settings import KernelSettings, build
from iquest.fast.parallel import Parallel
from iquest.fast.plan import KernelPlan
from iquest.fast.rank import EngineOptions, RankEngine, kernel_setting
from iquest.kernels import decode_attention, fp8_linear, lm_head, o_proj_router, qkv_rope_kv, topk
from iquest.tests.helpers import TINY


class Reached(Exception):
    pass


def forward(plan: KernelPlan, triples: tuple, router_fold: bool = False) -> RankEngine:
    """A TINY engine under `plan` and `triples`, after one 8-row prefill forward (or as far as a spy let it go)."""
    e = RankEngine(TINY, Parallel.single("cpu"), EngineOptions(max_context=64, dtype="fp32", kernels=plan,
                                                                  kernel_settings=triples, router_fold=router_fold))
    pos = torch.arange(8)
    try:
        e.model.forward(torch.arange(8), pos, torch.ones_like(pos, dtype=torch.bool))
    except Reached:
        pass
    return e


def stopping_spy(seen: list, key: str = "settings"):
    def spy(*args, **kwargs):
        seen.append(kwargs[key])
        raise Reached
    return spy


def linear_calls(monkeypatch, triples: tuple) -> tuple[list, RankEngine]:
    """(weight, settings) of every FP8 linear call of a forward with the linears' kernels (the torch form stands in)."""
    seen = []

    def spy(x, w, scale, block, *, out_dtype=None, settings, **kwargs):
        seen.append((w, settings))
        return fp8_linear.fp8_linear_ref(x, w, scale, block).to(out_dtype or x.dtype)

    monkeypatch.setattr(fp8_linear, "fp8_linear", spy)
    return seen, forward(KernelPlan(linear=True), triples)


def test_the_o_projection_and_the_other_linears_take_their_own_settings(monkeypatch):
    calls, e = linear_calls(monkeypatch, (("o_proj", "num_stages", 3), ("linear", "num_warps", 2)))
    wo = {id(lw.attn.wo.q) for lw in e.model.w.layers}
    o = [s for w, s in calls if id(w) in wo]
    rest = [s for w, s in calls if id(w) not in wo]
    product = KernelSettings()
    assert len(o) == len(e.model.w.layers) and rest  # every layer's o-projection, and q/k/v and the dense MLP
    assert all(s == replace(product.o_proj, num_stages=3) for s in o), o
    assert all(s == replace(product.linear, num_warps=2) for s in rest), rest  # over the product's, not the file's
    calls, _ = linear_calls(monkeypatch, ())
    assert {s for _, s in calls} == {product.linear, product.o_proj}


# op -> (a plan whose first kernel call in a forward is that op's, the module and call spied on, a non-default field)
STOPS = {
    "qkv_rope_kv": (KernelPlan(linear=True, attention=True), qkv_rope_kv, "qkv_rope_kv", ("num_warps", 2)),
    "lm_head": (KernelPlan(lm_head=True), lm_head, "lm_head", ("block_v", 16)),
}


@pytest.mark.parametrize("op", sorted(STOPS))
def test_an_ops_settings_reach_its_kernel_and_no_other(monkeypatch, op):
    plan, module, call, (field, value) = STOPS[op]
    seen = []
    monkeypatch.setattr(module, call, stopping_spy(seen))
    forward(plan, ())
    forward(plan, ((op, field, value),))
    if plan.linear:  # other ops' settings, where the plan runs their kernels
        forward(plan, (("linear", "num_stages", 3), ("o_proj", "num_stages", 3)))
    default, mine, *others = seen
    assert default == getattr(KernelSettings(), op) and getattr(default, field) != value  # what the variant changes
    assert mine == replace(default, **{field: value})
    assert others == [default] * plan.linear


def test_the_router_folds_projection_takes_the_o_projections_and_its_own(monkeypatch):
    seen = []

    def spy(*args, settings, parts_settings, **kwargs):
        seen.append((settings, parts_settings))
        raise Reached

    monkeypatch.setattr(o_proj_router, "o_proj_router", spy)
    monkeypatch.setattr(fp8_linear, "fp8_linear", lambda x, w, scale, block, *, out_dtype=None, **kw:
                        fp8_linear.fp8_linear_ref(x, w, scale, block).to(out_dtype or x.dtype))
    forward(KernelPlan(linear=True), (), router_fold=True)
    forward(KernelPlan(linear=True), (("o_proj", "split_k", 3), ("o_proj_router", "block_e", 128),
                                      ("linear", "num_stages", 3)), router_fold=True)
    product = KernelSettings()
    assert seen == [(product.o_proj, product.o_proj_router),
                    (replace(product.o_proj, split_k=3), replace(product.o_proj_router, block_e=128))]


def test_full_and_sliding_layers_take_their_own_attention_settings(monkeypatch):
    """TINY's layers 0 and 3 are full, 1 and 2 sliding: each attention call gets its layer type's settings, the
    product's or those given. (The kernels are not run: the prologue runs its torch form, the attention a stand-in.)"""
    from iquest.fast.torch_ops import TorchOps
    from iquest.fast.triton_ops import TritonOps

    seen = []

    def spy(q, k, v, slot_pos, positions, scale, sink_k, window, *, settings, **kwargs):
        seen.append((window, settings))
        return torch.zeros_like(q)

    monkeypatch.setattr(TritonOps, "qk_rope_write", TorchOps.qk_rope_write)
    monkeypatch.setattr(decode_attention, "decode_attention", spy)
    product = KernelSettings()
    for triples, full, sliding in (
            ((), product.attention_full, product.attention_sliding),
            ((("attention_full", "block_n", 16), ("attention_sliding", "num_stages", 2)),
             replace(product.attention_full, block_n=16), replace(product.attention_sliding, num_stages=2))):
        seen.clear()
        forward(KernelPlan(attention=True), triples)
        assert [w is None for w, _ in seen] == [True, False, False, True], seen
        assert [st for _, st in seen] == [full, sliding, sliding, full], seen
    assert product.attention_full != product.attention_sliding  # the layer types' defaults differ (their stages)


def test_the_vocabulary_top_k_takes_its_settings(monkeypatch):
    from iquest.fast.triton_ops import TritonOps

    seen = []
    monkeypatch.setattr(topk, "local_topk_keys", stopping_spy(seen))
    plan = KernelPlan(sampling=True)
    for triples in ((), (("topk", "tile", 256),)):
        with pytest.raises(Reached):
            TritonOps(plan, settings=build(plan, triples))._keys(torch.randn(2, 1000), 20, 0, lambda keys: keys)
    assert seen == [KernelSettings().topk, replace(KernelSettings().topk, tile=256)]
    with pytest.raises(ValueError, match="needs the sampling kernels"):
        build(KernelPlan(), (("topk", "tile", 256),))


def test_kernel_setting_parses_op_field_value():
    assert kernel_setting("moe.gate_up_split=4") == ("moe", "gate_up_split", 4)
    assert kernel_setting("linear.preload=False") == ("linear", "preload", False)
    assert kernel_setting("moe.gate_up_scale=product") == ("moe", "gate_up_scale", "product")
    assert kernel_setting("moe.down_registers=None") == ("moe", "down_registers", None)
    assert build(KernelPlan.triton(), (kernel_setting("moe.down_registers=None"),)).moe.down_registers is None
    for bad in ("gate_up_split=4", "moe.gate_up_split", "moe.=4", ".x=4", "moe.x="):
        with pytest.raises(ValueError, match="OP.FIELD=VALUE"):
            kernel_setting(bad)
