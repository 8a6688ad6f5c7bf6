"""The fast engine with the Triton kernels (fast/triton_ops.py, by kernel plan) against its torch forms.

Every op group has kernels of the published model (fast/plan.GROUPS): the FP8 linears, attention, the norms, the router
and the experts, the heads, the sampling kernels and the glue (embedding lookups, the settle step); a group left off a
plan runs its torch form. On CPU the kernels run under Triton's interpreter, in a
worker subprocess (TRITON_INTERPRET is read when triton is imported), on single blocks: what the interpreter checks
that the GPU cannot is the wiring on exact CPU arithmetic (which calls reach which kernel, bit-identity where the
kernel's arithmetic is the torch form's, the fallbacks). Whole decodes with the kernels run on the GPU, inside the
captured decode loop, at both dtypes.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.fast.parallel import Parallel
from iquest.fast.plan import GROUPS, KernelPlan
from iquest.fast.rank import EngineOptions, EngineParts, RankEngine
from iquest.kernels.testing import worker_fixture
from iquest.qualify.agreement import compare
from iquest.tests.helpers import CASES, GPU_PLANS, PROMPTS, RING_SEQ, TINY, TOLERANCE, decode_cases, fast_dist

# The FP8 linear kernel sums its fp32 products in another order than torch's GEMM of the dequantized weight: a few
# ulps a product, far below what a wrong tile, scale or column (order 1) gives.
LINEAR_BLOCK_TOL = 1e-5


# Under the interpreter Gate/Up's default split (4 programs an expert tile, kernels/moe.py) doubles the MoE's time: the
# CPU engines below run the plain Gate/Up unless given settings, each block testing its own subject (a fold, an option,
# the controls); moe_block runs the default's, moe_split_block another split with the product scales.
INTERPRETED_MOE = (("moe", "gate_up_split", 1),)


def engine(plan: KernelPlan | str, device: str = "cpu", dtype: str = "fp32", parts: EngineParts = EngineParts(),
           max_context: int = 256, **options) -> RankEngine:
    if device == "cpu" and isinstance(plan, KernelPlan) and plan.moe:
        options.setdefault("kernel_settings", INTERPRETED_MOE)
    return RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=max_context, dtype=dtype, kernels=plan,
                                                                   **options), parts)


def two_blocks(e: RankEngine, device: str, first: int = 33) -> tuple:
    """A `first`-row prefill block, then a verification block of 8 rows with 2 padding rows, then a draft block over
    the second block's hiddens: the three forwards' outputs. 33 rows, one past TINY's sliding window (32): the window
    hides history from rows of both target blocks (the rings, W + 64 slots, do not wrap), and the prefill spans three
    of the linear and MoE kernels' 16-row tiles, the last partial. Every row more is more programs to interpret."""
    e.cache.reset()
    pos = torch.arange(first, device=device)
    a = e.model.forward(torch.tensor(RING_SEQ[:first], device=device), pos, torch.ones_like(pos, dtype=torch.bool))
    pos = torch.arange(first, first + 8, device=device)
    live = torch.arange(8, device=device) < 6
    b = e.model.forward(torch.tensor(RING_SEQ[first:first + 8], device=device), pos, live)
    d = e.model.draft(torch.tensor(RING_SEQ[first + 1:first + 9], device=device), b[1], pos, live)
    return a, b, d


def _forget_capture(e: RankEngine) -> None:
    """Count only the calls that follow: on CUDA the engine's decode-loop capture has already called the kernels."""
    for counter in ("calls", "fallbacks"):
        getattr(e.model.ops, counter, {}).clear()


def _real_slots(kv) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V without the trash slot: several padding rows write it in no defined order on a GPU (it is never
    read)."""
    return kv.k[:-1].clone(), kv.v[:-1].clone()


def linear_block(device: str = "cpu") -> dict:
    """The FP8 linear kernel (q/k/v as one weight, o_proj, the dense MLP, eh_proj) against the torch forms' matmul of
    the dequantized weights over a prefill block, a verification block and a draft block: the logits' relative error
    and the kernel calls (each must take its weight: no fallback)."""
    from iquest.fast import triton_ops

    out, calls = {}, []
    kernel = triton_ops.fp8_linear.fp8_linear
    for plan in (KernelPlan.torch(), KernelPlan(linear=True)):
        e = engine(plan, device)
        triton_ops.fp8_linear.fp8_linear = lambda x, w, *a, **k: calls.append(tuple(w.shape)) or kernel(x, w, *a, **k)
        try:
            out[plan.name] = (two_blocks(e, device), dict(getattr(e.model.ops, "fallbacks", {})))
        finally:
            triton_ops.fp8_linear.fp8_linear = kernel
    (want, _), (got, fallbacks) = out["torch"], out[KernelPlan(linear=True).name]
    err = max(float((g[0] - w[0]).abs().max() / w[0].abs().max()) for g, w in zip(got, want))
    return {"rel_err": err, "calls": calls, "fallbacks": fallbacks}


# A group's kernels against its torch forms over the three blocks: fp32 sums in other orders (the norms' and the
# attention's reductions, the splits' merge), a few ulps a value, where a wrong row, head, slot or weight is order 1.
GROUP_BLOCK_TOL = {"attention": 1e-5, "norm": 1e-5, "moe": 1e-5, "lm_head": 1e-5, "moe_norm": 1e-5,
                   "linear_attention": 1e-5}


# fold -> (the op groups it needs, the kernel path it adds)
FOLDS = {"moe_combine": (("moe", "norm"), "combine_add_norm"), "qkv_rope": (("linear", "attention"), "qkv_rope_kv")}
# a fold left off by default, an EngineOptions field -> (the op groups it needs, the default's path, the option's)
OPTION_FOLDS = {"down_tail": (("moe", "norm"), "combine_add_norm", "down_add_norm")}


def group_block(*groups: str, device: str = "cpu", kernel_settings: tuple | None = None) -> dict:
    """Op groups' kernels (the rest on torch forms) against the torch forms over a prefill block, a verification
    block with padding rows and a draft block: the largest relative error of the live rows' logits and hiddens, the
    caches' (their real slots'), and the kernel calls and fallbacks. With them, under "unfolds", each fold of exactly
    these groups against its control (lab/unfold.py `^fold`: the launches the fold removed put back), and under
    "options" each fold left to an EngineOptions field against the default: outputs and caches bit for bit against
    the kernels' run, and which paths each ran."""
    from iquest.lab.unfold import unfold

    out, engines = {}, {}
    with_kernels = KernelPlan(**{group: True for group in groups})
    settings = {} if kernel_settings is None else {"kernel_settings": kernel_settings}  # None: engine()'s
    for plan in (KernelPlan.torch(), with_kernels):
        e = engines[plan.name] = engine(plan, device, **(settings if plan.uses_triton else {}))
        _forget_capture(e)
        outputs = two_blocks(e, device)
        out[plan.name] = ([t for block in outputs for t in block], [_real_slots(kv) for kv in e.cache.layers],
                          dict(getattr(e.model.ops, "calls", {})), dict(getattr(e.model.ops, "fallbacks", {})))
    (o0, c0, _, _), (o1, c1, calls, fallbacks) = out["torch"], out[with_kernels.name]
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
    live = [None, None, 6, 6, 6, 6]  # the verification and draft blocks' padding rows are no one's output

    def identical(other: RankEngine) -> bool:
        """Whether another engine's three blocks give the kernels' run's outputs and caches bit for bit."""
        _forget_capture(other)
        got = [t for block in two_blocks(other, device) for t in block]
        caches = [_real_slots(kv) for kv in other.cache.layers]
        return (all(torch.equal(x, y) for x, y in zip(o1, got))
                and all(torch.equal(x, y) for l0, l1 in zip(c1, caches) for x, y in zip(l0, l1)))

    unfolds = {}
    for fold in (f for f, (g, _) in FOLDS.items() if g == groups):
        control = engine(with_kernels, device, **settings)
        unfold(control.model.ops, {fold})
        path = FOLDS[fold][1]
        unfolds[fold] = {"identical": identical(control), "folded": calls.get(path, 0),
                         "control": control.model.ops.calls[path],
                         "unfolded": control.model.ops.unfolded_calls.get(fold, 0)}
    options = {}
    for fold in (f for f, (g, *_) in OPTION_FOLDS.items() if g == groups):
        folded = engine(with_kernels, device, **settings, **{fold: True})
        default_path, option_path = OPTION_FOLDS[fold][1:]
        options[fold] = {"identical": identical(folded),
                         "default": [calls.get(default_path, 0), calls.get(option_path, 0)],
                         "option": [folded.model.ops.calls[default_path], folded.model.ops.calls[option_path]]}
    locks = getattr(engines[with_kernels.name].model.ops, "_gate_up_locks", None)
    return {"rel_err": max(rel(x[:n], y[:n]) for x, y, n in zip(o1, o0, live)),
            "cache_err": max(rel(x, y) for l0, l1 in zip(c0, c1) for x, y in zip(l1, l0)),
            "calls": calls, "fallbacks": fallbacks, "unfolds": unfolds, "options": options,
            "gate_up_locks": None if locks is None else int(locks.count_nonzero())}


def moe_split_block(device: str = "cpu") -> dict:
    """`group_block("moe")` with Gate/Up split 2 ways (not the default 4) and scaling its products (a bench variant's
    kernel settings, `triton@moe.gate_up_split=2@moe.gate_up_scale=product`), with what each Gate/Up launch was given:
    its settings, and whether it was handed the engine's own counters."""
    import iquest.kernels.moe as mk

    seen, real = [], mk.gate_up

    def spy(*args, **kwargs):
        s = kwargs["settings"]
        seen.append((s.gate_up_split, s.gate_up_scale, kwargs["locks"] is not None))
        return real(*args, **kwargs)
    mk.gate_up = spy
    try:
        r = group_block("moe", device=device, kernel_settings=(("moe", "gate_up_split", 2),
                                                               ("moe", "gate_up_scale", "product")))
    finally:
        mk.gate_up = real
    return {**r, "gate_up_launches": sorted(set(seen)), "gate_up_count": len(seen)}


def router_fold_block(device: str = "cpu") -> dict:
    """The router fold's kernels (kernels/o_proj_router.py, kernels/route_tail.py: the linear, norm and MoE groups)
    against the fold's torch form (fast/router_fold.py) over the three blocks: the largest relative error of the live
    rows' logits and hiddens, the live rows' chosen experts' agreement, and the paths each ran."""
    out = {}
    plan = KernelPlan(linear=True, norm=True, moe=True)
    for p in (KernelPlan.torch(), plan):
        e = engine(p, device, router_fold=True)
        _forget_capture(e)
        experts = []
        route = e.model.ops.route
        e.model.ops.route = lambda *a: (lambda r: experts.append(r[1].clone()) or r)(route(*a))
        outputs = two_blocks(e, device)
        out[p.name] = ([t for block in outputs for t in block], experts, dict(e.model.ops.calls),
                       dict(getattr(e.model.ops, "fallbacks", {})))
    (o0, x0, c0, _), (o1, x1, calls, fallbacks) = out["torch"], out[plan.name]
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
    live = [None, None, 6, 6, 6, 6]
    # the routing calls: the prefill block's three MoE layers, then the verification block's and the draft's, whose
    # padding rows are no one's (their router inputs differ between the two forms, as their outputs may)
    routed = [None] * 3 + [6] * 4
    return {"rel_err": max(rel(x[:n], y[:n]) for x, y, n in zip(o1, o0, live)),
            "experts_equal": len(x0) == len(x1) == len(routed)
            and all(torch.equal(a[:n], b[:n]) for a, b, n in zip(x0, x1, routed)),
            "torch_calls": c0, "calls": calls, "fallbacks": fallbacks}


def prefetch_block(device: str = "cpu") -> dict:
    """The expert prefetch on its kernels (the MoE group): a 9-row prefill block (no branch: more rows than it takes),
    then verification blocks of 8 rows with 5 live (it predicts) and 6 live (it returns at once). A hint: the outputs
    and caches are those without it, bit for bit."""
    out = {}
    plan = KernelPlan(moe=True)
    for prefetch in (False, True):
        e = engine(plan, device, expert_prefetch=prefetch)
        _forget_capture(e)
        e.cache.reset()
        pos = torch.arange(9, device=device)
        outputs = list(e.model.forward(torch.tensor(RING_SEQ[:9], device=device), pos,
                                       torch.ones_like(pos, dtype=torch.bool)))
        predicted = {}
        for n, start in ((5, 9), (6, 17)):
            taps: dict = {}
            pos = torch.arange(start, start + 8, device=device)
            outputs += e.model.forward(torch.tensor(RING_SEQ[start:start + 8], device=device), pos,
                                       torch.arange(8, device=device) < n, taps)
            predicted[n] = {k: v.tolist() for k, v in taps.items() if k.endswith("predicted_experts")}
        out[prefetch] = (outputs, [_real_slots(kv) for kv in e.cache.layers], predicted, dict(e.model.ops.calls))
    (o0, c0, _, _), (o1, c1, predicted, calls) = out[False], out[True]
    same = all(torch.equal(a, b) for a, b in zip(o0, o1))
    caches = all(torch.equal(x, y) for l0, l1 in zip(c0, c1) for x, y in zip(l0, l1))
    return {"identical": same and caches, "calls": calls, "predicted": predicted}


def control_models_block(device: str = "cpu") -> dict:
    """Each negative control of qualify/ that substitutes the model (EngineParts.model) on the kernels' path (the
    norm and MoE groups; the linear group and the router fold where the control needs them), over a verification and a
    draft block: a control must run where qualification runs it, and on the kernels an op may hand on a pending value
    (the MoE's Down, the fold's o-projection) that a control's override must pass through untouched. Per control:
    "ok", or the error."""
    from iquest.fast.model import FastModel
    from iquest.qualify.controls import REGISTRY

    out = {}
    for control in REGISTRY:
        if control.parts.model is FastModel:
            continue
        fold = control.name == "router_fold_w_out"  # the fold's o-projection is the linear group's
        try:
            e = engine(KernelPlan(linear=fold, norm=True, moe=True), device, parts=control.parts, router_fold=fold)
            e.cache.reset()
            pos, live = torch.arange(8, device=device), torch.arange(8, device=device) < 6
            _, hidden = e.model.forward(torch.tensor(RING_SEQ[:8], device=device), pos, live)
            e.model.draft(torch.tensor(RING_SEQ[1:9], device=device), hidden, pos, live)
            out[control.name] = "ok"
        except Exception as err:  # reported per control, so one broken control does not hide the others
            out[control.name] = f"{type(err).__name__}: {err}"
    return out


def sampling_block(device: str = "cpu") -> dict:
    """The sampling kernels' distributions of one 8-row logits block against the torch forms'."""
    out = {}
    for plan in (KernelPlan.torch(), KernelPlan(sampling=True)):
        e = engine(plan, device)
        runner, _ = e.runner(3, 20)
        e.state.temperature.fill_(1.0)
        e.state.top_p.fill_(0.95)
        logits = torch.randn(8, e.config.vocab_size, generator=torch.Generator().manual_seed(5)).to(device) * 2
        out[plan.name] = runner.dist(logits)
    (ti, tp), (ki, kp) = out["torch"], out[KernelPlan(sampling=True).name]
    return {"same_ids": bool(torch.equal(ti.cpu(), ki.cpu())), "prob_err": float((tp - kp).abs().max())}


def glue_block(device: str = "cpu") -> dict:
    """The embedding kernel (the target's and the draft's own table) against the torch form: a gather, so the blocks'
    outputs and caches must be identical, and every lookup must have run as the kernel."""
    out = {}
    for plan in (KernelPlan.torch(), KernelPlan(glue=True)):
        e = engine(plan, device)
        _forget_capture(e)
        outputs = two_blocks(e, device)
        out[plan.name] = ([t for block in outputs for t in block], [_real_slots(kv) for kv in e.cache.layers],
                          dict(getattr(e.model.ops, "calls", {})), dict(getattr(e.model.ops, "fallbacks", {})))
    (o0, c0, _, _), (o1, c1, calls, fallbacks) = out["torch"], out[KernelPlan(glue=True).name]
    return {"outputs_identical": all(torch.equal(x, y) for x, y in zip(o0, o1)),
            "caches_identical": all(torch.equal(x, y) for l0, l1 in zip(c0, c1) for x, y in zip(l0, l1)),
            "embed_calls": calls.get("embed", 0), "fallbacks": fallbacks}


# ---- under the interpreter (CPU) -------------------------------------------------------------------------------
interpreted = worker_fixture(__file__)


def test_interpreted_linear_kernel_within_its_tolerance(interpreted):
    r = interpreted["linear_block"]
    assert "error" not in r, r
    print(f"[interpreted FP8 linear] relative logit error {r['rel_err']:.2e} (tolerance {LINEAR_BLOCK_TOL:.0e})")
    assert not r["fallbacks"], r
    # three forwards (prefill, verification, draft): q/k/v as one weight and o_proj in each layer, the dense MLP's
    # three in layer 0 (and none in the MoE layers: their experts run the torch form), eh_proj in the draft
    layers = 4
    assert len(r["calls"]) == 2 * (2 * layers + 3) + (2 + 1), r["calls"]
    assert r["rel_err"] <= LINEAR_BLOCK_TOL, r


@pytest.mark.parametrize("group, kernels", [("attention", {"qk_rope_kv", "attention"}),
                                            ("norm", {"rmsnorm", "add_norm"}), ("moe", {"route", "moe"}),
                                            ("lm_head", {"lm_head"}),
                                            # the MoE's combine inside the sandwich tail's launch
                                            ("moe_norm", {"route", "moe", "add_norm", "combine_add_norm"}),
                                            # the q/k norm, RoPE and KV write inside the projection's launch
                                            ("linear_attention", {"qkv_rope_kv", "attention"})])
def test_interpreted_group_kernels_within_their_tolerance(interpreted, group, kernels):
    r = interpreted[f"{group}_block"]
    assert "error" not in r, r
    print(f"[interpreted {group}] relative error {r['rel_err']:.2e}, caches {r['cache_err']:.2e}, calls {r['calls']}, "
          f"fallbacks {r['fallbacks']}")
    assert kernels <= {name for name, n in r["calls"].items() if n}, r
    assert r["rel_err"] <= GROUP_BLOCK_TOL[group] and r["cache_err"] <= GROUP_BLOCK_TOL[group], r
    if "moe" in group:  # moe_block runs the product's Gate/Up (split: counters made, left zeroed), moe_norm the plain
        assert r["gate_up_locks"] == {"moe": 0, "moe_norm": None}[group], r


def test_interpreted_moe_settings_reach_the_kernels(interpreted):
    """A variant's MoE settings (EngineOptions.kernel_settings: Gate/Up split 2 ways, scaling its products) reach every
    Gate/Up launch of the three blocks, with the engine's own split counters, left zeroed; the outputs stay within
    the MoE group's tolerance of the torch forms (a numerical change, as each form's kernel tests measure)."""
    r = interpreted["moe_split_block"]
    assert "error" not in r, r
    print(f"[interpreted MoE, split 2, product scales] relative error {r['rel_err']:.2e}, launches "
          f"{r['gate_up_launches']}")
    assert r["gate_up_launches"] == [[2, "product", True]] and r["gate_up_count"] == r["calls"]["moe"] > 0, r
    assert r["gate_up_locks"] == 0, r
    assert r["rel_err"] <= GROUP_BLOCK_TOL["moe"] and r["cache_err"] <= GROUP_BLOCK_TOL["moe"], r


def test_kernel_settings_are_checked():
    """An unknown op or field, or settings of an op whose group runs its torch form, is refused when the engine is
    built, not ignored."""
    with pytest.raises(ValueError, match="unexpected keyword"):
        engine(KernelPlan.triton(), kernel_settings=(("moe", "gate_up_splits", 4),))
    with pytest.raises(ValueError, match="unknown op 'router'"):
        engine(KernelPlan.triton(), kernel_settings=(("router", "split", 2),))
    with pytest.raises(ValueError, match="need kernels: the plan runs the torch forms"):
        engine(KernelPlan.torch(), kernel_settings=(("moe", "gate_up_split", 4),))
    with pytest.raises(ValueError, match="needs the linear kernels"):
        engine(KernelPlan(moe=True), kernel_settings=(("qkv_rope_kv", "num_warps", 8),))


def test_direct_settings_choose_their_ops_weights():
    """`LinearSettings.direct` (kernels/fp8_linear_direct.py) per op: the o-projection's (on by default) takes every
    block's o_proj weight, the plain linears' the dense MLP, eh_proj and the q/k/v weights; off, none. On the CPU no copy is made
    (the direct kernel is compiled only), so every call runs the Triton kernel."""
    from iquest.fast.weights import DenseMLP
    from iquest.tests.helpers import fixture_dir

    model = fixture_dir("tiny-tp8", "bf16")  # quantized at load into 128 x 128 blocks: every K is whole tiles

    def chosen(*settings):
        e = RankEngine(model, Parallel.single("cpu"), EngineOptions(max_context=64, dtype="bf16", weights="fp8",
                                                                    kernels=KernelPlan.triton(),
                                                                    kernel_settings=settings))
        w, ops = e.model.w, e.model.ops
        assert ops._direct == {}
        blocks = [*w.layers, w.draft.block]
        return {id(p) for p in ops._direct_weights(w)}, w, blocks

    none, _, _ = chosen(("o_proj", "direct", False))
    o_only, w, blocks = chosen()  # the default
    assert none == set() and o_only == {id(lw.attn.wo) for lw in blocks} and len(o_only) == 5
    linear, w, blocks = chosen(("o_proj", "direct", False), ("linear", "direct", True))
    dense = [p for lw in blocks if isinstance(lw.mlp, DenseMLP) for p in (lw.mlp.gate, lw.mlp.up, lw.mlp.down)]
    qkv = [lw.attn.wqkv for lw in blocks if lw.attn.wqkv is not None]
    assert linear == {id(p) for p in [*dense, w.draft.eh_proj, *qkv]} and len(dense) == 3


def test_direct_is_refused_where_no_direct_form_exists():
    """The fused q/k/v kernel has no direct form: asked for one, it refuses before launching anything."""
    from dataclasses import replace

    from iquest.kernels import fp8_linear as fl, qkv_rope_kv

    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no direct form"):
        qkv_rope_kv.qkv_rope_kv(x, torch.zeros(64, 128).to(torch.float8_e4m3fn), torch.ones(1, 1), (128, 128), 2, 1,
                                torch.ones(16), torch.ones(16), 1e-6, None, None, torch.zeros(2, dtype=torch.long),
                                torch.ones(2, dtype=torch.bool), torch.zeros(9, 1, 16), torch.zeros(9, 1, 16),
                                torch.zeros(9, dtype=torch.long), settings=replace(fl.LinearSettings(), direct=True))
    with pytest.raises(ValueError, match="direct 1 must be a bool"):
        fl.LinearSettings(direct=1)


def test_interpreted_router_fold_kernels_within_their_tolerance(interpreted):
    """The router fold on its kernels: every MoE layer call of the three blocks (3 target MoE layers x 2 forwards +
    the draft) ran the o-projection with the partials and the tail that selects, and routed from it (no router pass);
    the outputs are the fold's torch form's to fp32 sums in other orders, the same experts chosen."""
    r = interpreted["router_fold_block"]
    assert "error" not in r, r
    print(f"[interpreted router fold] relative error {r['rel_err']:.2e}, calls {r['calls']}")
    moe_calls = 3 * 2 + 1
    assert r["calls"]["o_proj_router"] == r["calls"]["add_norm_route"] == r["calls"]["route_folded"] == moe_calls, r
    assert not r["calls"].get("route") and not r["fallbacks"], r
    assert r["torch_calls"]["route_folded"] == moe_calls, r
    assert r["experts_equal"] and r["rel_err"] <= GROUP_BLOCK_TOL["moe_norm"], r


@pytest.mark.parametrize("fold", list(FOLDS))
def test_interpreted_fold_and_its_control_are_bit_identical(interpreted, fold):
    """Issue 52's paired evidence rests on this: the fold's control variant computes the same bits through the
    launches the fold removed (and the control really ran them). On the interpreter, bit for bit; on the GPU the
    q/k/v fold's norm sums its squares in another layout (tests/test_kernel_qkv_rope_kv.py)."""
    r = interpreted["_".join(FOLDS[fold][0]) + "_block"]
    assert "error" not in r, r
    r = r["unfolds"][fold]
    assert r["identical"], r
    assert r["folded"] > 0 and r["control"] == 0 and r["unfolded"] > 0, r


@pytest.mark.parametrize("fold", list(OPTION_FOLDS))
def test_interpreted_option_fold_and_the_default_are_bit_identical(interpreted, fold):
    """A fold left off by default (it measured slower) stays a product option: turned on, it computes the default's
    bits through its own launch, and each engine ran its own path alone."""
    r = interpreted["_".join(OPTION_FOLDS[fold][0]) + "_block"]
    assert "error" not in r, r
    r = r["options"][fold]
    assert r["identical"], r
    assert r["default"][0] > 0 and r["default"][1] == 0 and r["option"][0] == 0 and r["option"][1] > 0, r


def test_interpreted_expert_prefetch_changes_nothing_and_predicts_only_at_its_widths(interpreted):
    r = interpreted["prefetch_block"]
    assert "error" not in r, r
    assert r["identical"], r
    # TINY's sliding MoE layers are 1 and 2: a branch each in the two verification blocks, none in the prefill block
    assert r["calls"]["expert_prefetch"] == 4, r["calls"]
    at5, at6 = r["predicted"]["5"], r["predicted"]["6"]
    assert sorted(at5) == ["layer1.predicted_experts", "layer2.predicted_experts"] == sorted(at6)
    for rows in at5.values():  # 5 live rows: predicted; padding rows -1
        assert all(min(row) >= 0 for row in rows[:5]) and all(set(row) == {-1} for row in rows[5:]), rows
    for rows in at6.values():  # 6 live rows: not a paying width, nothing predicted
        assert all(set(row) == {-1} for row in rows), rows


def test_interpreted_control_models_run_on_the_kernels_path(interpreted):
    r = interpreted["control_models_block"]
    assert "error" not in r, r
    assert len(r) >= 8 and all(v == "ok" for v in r.values()), r


def test_interpreted_sampling_kernels_match_the_torch_forms(interpreted):
    samp = interpreted["sampling_block"]
    assert "error" not in samp, samp
    print(f"[interpreted sampling kernels] same candidates {samp['same_ids']}, max prob error {samp['prob_err']:.1e}")
    assert samp["same_ids"] and samp["prob_err"] < 1e-6


def test_interpreted_embedding_kernel_changes_nothing(interpreted):
    glue = interpreted["glue_block"]
    assert "error" not in glue, glue
    assert glue["outputs_identical"] and glue["caches_identical"] and not glue["fallbacks"], glue
    assert glue["embed_calls"] == 3, glue  # the target's two blocks and the draft's own table


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([("linear_block", linear_block), ("sampling_block", sampling_block), ("glue_block", glue_block),
                 ("attention_block", lambda: group_block("attention")), ("norm_block", lambda: group_block("norm")),
                 ("moe_block", lambda: group_block("moe", kernel_settings=())),
                 ("lm_head_block", lambda: group_block("lm_head")),
                 ("moe_split_block", moe_split_block),
                 ("moe_norm_block", lambda: group_block("moe", "norm")),
                 ("linear_attention_block", lambda: group_block("linear", "attention")),
                 ("router_fold_block", router_fold_block), ("prefetch_block", prefetch_block),
                 ("control_models_block", control_models_block)])


# ---- on the GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_blocks_against_the_torch_forms():
    r = linear_block("cuda")
    assert not r["fallbacks"] and r["calls"] and r["rel_err"] <= LINEAR_BLOCK_TOL, r
    glue = glue_block("cuda")
    assert glue["outputs_identical"] and glue["caches_identical"] and glue["embed_calls"] == 3, glue


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_kernels_decode_like_the_torch_forms(dtype):
    with_kernels, torch_engine = engine(GPU_PLANS[dtype], "cuda", dtype), engine("torch", "cuda", dtype)
    got, want = decode_cases(with_kernels), decode_cases(torch_engine)
    # Each side's divergence is explained with its own engine's distributions.
    for i, drafts in CASES:
        key = f"{i}-{drafts}"
        result = compare(PROMPTS[i], got[key]["tokens"], want[key]["tokens"], fast_dist(with_kernels),
                         fast_dist(torch_engine), TOLERANCE[dtype])
        print(f"[cuda kernels {dtype}, {key}] {result}")
        assert result.explained, str(result)


@pytest.mark.gpu
def test_cuda_kernel_paths_all_ran():
    """The default plan's kernel paths, counted over a bf16 decode through the captured loop: every path the tiny
    fixture's shapes allow ran, and only the prefill blocks' routing and heads fell back."""
    e = engine(KernelPlan.triton(), "cuda", "bf16")
    decode_cases(e)
    ops = e.model.ops
    ran = {name for name, n in ops.calls.items() if n > 0}
    assert {"preload", "embed", "sample_draw", "accept", "settle", "qkv_rope_kv", "attention", "rmsnorm", "add_norm",
            "route", "moe", "combine_add_norm", "lm_head"} <= ran, dict(ops.calls)
    # Only prefill blocks (tens of rows) exceed the router's 8 rows and the head's 16: no decode call falls back
    assert set(ops.fallbacks) <= {"moe", "lm_head"}, dict(ops.fallbacks)


@pytest.mark.gpu
def test_cuda_direct_linears_give_the_same_bits(monkeypatch):
    """`LinearSettings.direct` on the o-projection (the default) and the plain linears: the same tokens,
    log-probabilities and acceptances as the Triton kernel's launches through the captured loop, with the direct calls
    counted. tiny-tp8
    quantized at load: 128 x 128 blocks, so its o_proj's K of 256 is two whole tiles, which the direct kernel takes.
    The check catches a dispatcher handing the kernel the weight in its own order instead of the fragments' (the
    control below)."""
    from iquest.kernels import fp8_linear_direct
    from iquest.tests.helpers import fixture_dir

    model = fixture_dir("tiny-tp8", "bf16")
    direct = (("o_proj", "direct", True), ("linear", "direct", True))

    def decode(settings):
        e = RankEngine(model, Parallel.single("cuda"), EngineOptions(max_context=256, dtype="bf16", weights="fp8",
                                                                     kernels=KernelPlan.triton(),
                                                                     kernel_settings=settings))
        return decode_cases(e, logprobs=True), e.model.ops.calls["direct"]

    want, none = decode((("o_proj", "direct", False),))  # the Triton kernel everywhere
    got, calls = decode(direct)
    assert none == 0 and calls > 0 and got == want
    monkeypatch.setattr(fp8_linear_direct, "direct_weight", lambda q: q.clone())  # the control: W's own order
    broken, calls = decode(direct)
    assert calls > 0 and broken != want


# ---- the plan and the dispatcher, no kernel launched ------------------------------------------------------------
def test_shapes_a_kernel_cannot_take_fall_back_and_are_counted():
    """8-wide FP8 blocks are below the linear kernel's 16-wide K tiles, and a slice that starts inside its first scale
    block (a TP 8 expert or dense shard) is not one it takes: each such call runs the torch form (the same result as
    TorchOps) and is counted, so reports can say which op groups were not kernels."""
    from iquest.fast.torch_ops import TorchOps
    from iquest.fast.triton_ops import TritonOps
    from iquest.fast.weights import Weight
    from iquest.reference.fp8 import E4M3

    ops = TritonOps(KernelPlan.triton())
    g = torch.Generator().manual_seed(3)
    q = (torch.randn(16, 16, generator=g) * 64).clamp(-448, 448).to(E4M3)
    x = torch.randn(3, 16, generator=g)
    small = Weight(q, torch.rand(2, 2, generator=g) + 0.5, (8, 8), torch.float32)
    assert torch.equal(ops.linear(small, x), TorchOps().linear(small, x))
    assert ops.fallbacks == {"linear": 1}
    straddling = Weight(q, torch.rand(2, 1, generator=g) + 0.5, (16, 16), torch.float32, offset=(8, 0))
    assert torch.equal(ops.linear(straddling, x), TorchOps().linear(straddling, x))
    bf16 = Weight(q.float().bfloat16(), None, None, torch.float32)  # a BF16 weight: no FP8 kernel
    assert torch.equal(ops.linear(bf16, x), TorchOps().linear(bf16, x))
    assert ops.fallbacks == {"linear": 3}
    ops = TritonOps(KernelPlan(sampling=True))  # an op group off the plan runs its torch form without being counted
    assert torch.equal(ops.linear(small, x), TorchOps().linear(small, x)) and not ops.fallbacks


def test_kernel_plans_from_the_user_choices():
    assert KernelPlan.choose("auto", "cpu") == KernelPlan.torch() and KernelPlan.choose("auto", "cuda") == KernelPlan.triton()
    assert KernelPlan(linear=True).name == ("linear (torch forms: attention, norm, moe, lm_head, sampling, "
                                            "glue)")  # the summary names them
    assert KernelPlan.choose("triton", "cpu") == KernelPlan.triton()
    assert KernelPlan.choose("torch", "cuda").name == "torch" and not KernelPlan.torch().uses_triton
    for bad in ("triton-settle", "linear+attention", "Triton", ""):
        with pytest.raises(ValueError, match="--kernels must be one of auto, torch, triton"):
            KernelPlan.choose(bad, "cpu")


def test_every_group_has_published_kernels_and_none_retired():
    """Every op group has kernels of the published model (a full plan leaves no group on its torch form), and the
    dispatcher imports none of the retired architecture's kernels."""
    import ast
    from pathlib import Path

    assert not KernelPlan.triton().torch_groups and set(KernelPlan.torch().torch_groups) == set(GROUPS)
    source = Path(__file__).resolve().parent.parent / "fast" / "triton_ops.py"
    imported = {a.name for node in ast.walk(ast.parse(source.read_text())) if isinstance(node, ast.ImportFrom)
                and node.module == "kernels" for a in node.names}
    retired = {"f16_operands", "rope_kv", "rmsnorm_residual"}
    assert imported and not imported & retired, imported


def test_sampling_wider_than_the_kernels_runs_the_torch_form():
    """A candidate count or top_k past the top-k and sample kernels' 64 (qualification asks for 256) runs the torch
    form, counted as a fallback, with the torch form's result: not an error from inside the kernel's wrapper."""
    from iquest.fast.torch_ops import TorchOps
    from iquest.fast.triton_ops import TritonOps

    ops = TritonOps(KernelPlan.triton())
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(0))
    args = (logits, 256, 0, lambda t: t, 256, torch.tensor(1.0), torch.tensor(0.95))
    got, want = ops.dist(*args), TorchOps().dist(*args)
    assert ops.fallbacks["sampling"] == 1 and not ops.calls
    assert all(torch.equal(g, w) for g, w in zip(got, want))
