"""The router fold (fast/router_fold.py, docs/round.md "The router fold") on the torch forms: its algebra against
float64, the engine with the option on (fp32: the reference's rounds; the folded path counted as taken), where it
runs and where it does not, and qualification's router checks on its rows: the fold's own scores pass
numerics.router_scores against its exact input, and a broken fold (rstd_o left out) is caught."""

from __future__ import annotations

import pytest
import torch

from iquest.fast import router_fold
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine
from iquest.qualify.router import RouterInput, fold_terms, plain_input, router_input, scores_error
from iquest.reference.layers import rms_norm, route
from iquest.tests.helpers import PROMPTS, TINY, fast_steps
from iquest.tests.test_fast_engine import ref_steps, rounds

EPS = 1e-6


def layer(seed: int, R: int = 5, H: int = 64, E: int = 16, scale: float = 1.0):
    """Random activations and weights of one MoE layer, as the engine holds them (bf16 r and o)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(R, H, generator=g).to(torch.bfloat16)
    o = (3 * torch.randn(R, H, generator=g)).to(torch.bfloat16)
    w_out = (1 + 0.2 * torch.randn(H, generator=g)).to(torch.bfloat16)
    w_ffn = (1 + 0.2 * torch.randn(H, generator=g)).to(torch.bfloat16)
    router = 0.1 * torch.randn(E, H, generator=g)
    return r, o, w_out, w_ffn, router, scale


@pytest.mark.parametrize("scale", [1.0, 0.7])
def test_the_fold_is_the_router_on_the_unrounded_normalized_h(scale):
    """b_fold (exact_input) is the reference's b = ffn_norm(r + s attn_out_norm(o)) with nothing rounded, its bound
    covers it term by term, and the fold's fp32 logits are router @ b_fold within qualification's band
    (qualify/router.py: gamma_n sum_j |w_ej| mag_j, n = fold_terms(H))."""
    r, o, w_out, w_ffn, router, s = layer(0, scale=scale)
    fold = router_fold.make(router, w_ffn, w_out, 4)
    got = router_fold.logits(router_fold.parts(r, o, fold), r, o, w_out, s, EPS).double()
    b_fold, bound = router_fold.exact_input(r, o, w_out, w_ffn, s, EPS)
    h = r.double() + s * rms_norm(o.double(), w_out.double(), EPS)
    assert torch.allclose(b_fold, rms_norm(h, w_ffn.double(), EPS), rtol=0, atol=1e-12)
    assert bool((bound >= b_fold.abs() * (1 - 1e-12)).all())
    n = fold_terms(r.shape[1])
    band = n * 2.0 ** -24 / (1 - n * 2.0 ** -24) * (bound @ router.double().abs().T)
    err = (got - b_fold @ router.double().T).abs()
    assert bool((err <= band).all()) and float(err.max()) > 0, float((err / band).max())


def test_router_checks_pass_the_fold_and_catch_a_broken_one():
    """numerics.router_scores on the fold's fp32 rows: within the band (value <= 1) against b_fold; rstd_o left out
    of the B partials' factor (a broken fold), far outside it; the plain check (b = mlp_in) would not explain the
    fold's own rounding-free input either (its value is reported, not asserted: b is bf16-rounded)."""
    worst_ok, worst_broken = 0.0, 0.0
    for seed in range(6):
        r, o, w_out, w_ffn, router, s = layer(seed, scale=0.7)
        fold = router_fold.make(router, w_ffn, w_out, 4)
        p = router_fold.parts(r, o, fold)
        _, experts, scores = router_fold.select(p, r, o, w_out, s, EPS, 4)
        b_fold, bound = router_fold.exact_input(r, o, w_out, w_ffn, s, EPS)
        y32 = o.float()
        rstd_o = torch.rsqrt(y32.pow(2).mean(-1, keepdim=True) + EPS)
        broken = router_fold.logits(p, r, o, w_out, s, EPS) + s * (1 - 1 / rstd_o) * torch.rsqrt(
            (r.float() + s * y32 * rstd_o * w_out.float()).pow(2).mean(-1, keepdim=True) + EPS) * p[0, 1]
        _, b_exp, b_scores = route(broken, 4)
        for i in range(r.shape[0]):
            fin = RouterInput(b_fold[i], bound[i], fold_terms(r.shape[1]))
            worst_ok = max(worst_ok, scores_error(router.double(), fin, scores[i], experts[i])[0])
            worst_broken = max(worst_broken, scores_error(router.double(), fin, b_scores[i], b_exp[i])[0])
    assert worst_ok <= 1.0, worst_ok
    assert worst_broken > 100.0, worst_broken


def test_router_input_reads_the_fold_taps_where_present():
    b = torch.randn(3, 8, dtype=torch.float64)
    plain = router_input({"layer1.mlp_in": b}, "layer1.", 2)
    assert torch.equal(plain.b, b[2]) and plain.terms == 8 and torch.equal(plain.mag, plain_input(b[2]).mag)
    taps = {"layer1.mlp_in": b, "layer1.router_in": 2 * b, "layer1.router_in_bound": 3 * b.abs()}
    fin = router_input(taps, "layer1.", 1)
    assert torch.equal(fin.b, 2 * b[1]) and torch.equal(fin.mag, 3 * b[1].abs()) and fin.terms == fold_terms(8)


def test_the_engine_with_the_fold_reproduces_the_reference_at_fp32():
    """fp32 on the CPU: the folded engine decides the reference's rounds (tokens, drafts, accepts, bonus); every MoE
    layer call routed through the folded tail (route_folded), none through the router's own pass."""
    engine = RankEngine(TINY, Parallel.single(), EngineOptions(max_context=512, router_fold=True))
    ops = engine.model.ops
    own = []
    route_on = ops.route_on
    ops.route_on = lambda *a: own.append(1) or route_on(*a)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert rounds(fast_steps(engine, prompt, 1000 + i, 3)) == rounds(ref_steps(TINY, prompt, 1000 + i, 3))
    assert ops.calls["route_folded"] > 0 and not own


def test_the_fold_is_off_without_the_option_and_across_ranks():
    """Only MoE layers fold, only with the option, and only where o is whole on the rank: across ranks (a partial
    o per rank) the o-projection runs as the plain linear, never left pending."""
    from iquest.fast.router_fold import PendingProjection
    from iquest.fast.torch_ops import TorchOps

    plain = RankEngine(TINY, Parallel.single(), EngineOptions(max_context=64))
    folded = RankEngine(TINY, Parallel.single(), EngineOptions(max_context=64, router_fold=True))
    moe, dense = folded.model.w.layers[-1].attn, folded.model.w.layers[0].attn
    assert plain.model.ops.router_fold_for(plain.model.w.layers[-1].attn) is None
    assert folded.model.ops.router_fold_for(moe) is not None and folded.model.ops.router_fold_for(dense) is None
    x = torch.zeros(2, moe.wo.q.shape[-1])
    assert isinstance(folded.model.ops.o_proj(moe, x), PendingProjection)

    class Across:
        active = True
    across = TorchOps(fold_router=True)
    across.prepare(folded.model.w, 4, Across())
    assert across.router_fold_for(moe) is None and isinstance(across.o_proj(moe, x), torch.Tensor)


def test_the_engine_says_it_folds_routing():
    from iquest.fast.engine import FastEngine

    folded = FastEngine.load(TINY, tp=1, device="cpu", options=EngineOptions(max_context=64, router_fold=True))
    plain = FastEngine.load(TINY, tp=1, device="cpu", options=EngineOptions(max_context=64))
    assert folded.describe()["router_fold"] and "routing folded" in folded.describe()["text"]
    assert not plain.describe()["router_fold"] and "routing folded" not in plain.describe()["text"]


def test_generate_takes_the_fold_and_the_reference_refuses_it(capsys):
    from iquest.cli.main import main

    assert main(["generate", "--model", str(TINY), "--router-fold", "--max-new-tokens", "4", "--prompt-ids", "3,4,5",
                 "--drafts", "0"]) == 0
    assert "routing folded into o_proj" in capsys.readouterr().err
    assert main(["generate", "--engine", "reference", "--model", str(TINY), "--router-fold", "--max-new-tokens", "4",
                 "--prompt-ids", "3,4,5"]) != 0
    assert "--router-fold is a fast-engine option" in capsys.readouterr().err


def test_the_memory_check_counts_the_folds_scaled_routers(monkeypatch):
    """The fold holds an fp32 [E, H] scaled router beside every MoE layer's (the draft's too): counted where it folds
    (TP 1), not across ranks; a device with room for the plain engine only refuses the folded one."""
    from iquest.fast import memory
    from iquest.reference.config import Config, ConfigError

    config = Config.from_dir(TINY)
    moe_layers = sum(not config.is_dense(i) for i in range(config.num_hidden_layers)) + 1
    scaled = moe_layers * config.num_experts * config.hidden_size * 4
    assert memory.router_fold_bytes(config, 1) == scaled and memory.router_fold_bytes(config, 2) == 0
    assert memory.rank_bytes(config, 1, 512, router_fold=True) - memory.rank_bytes(config, 1, 512) == scaled
    plain = memory.rank_bytes(config, 1, 512) * memory.HEADROOM
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda gpu: (int(plain) + 1, 0))
    memory.check_memory(config, 1, EngineOptions(max_context=512, dtype="bf16"), "cuda")
    with pytest.raises(ConfigError, match="router fold's scaled routers"):
        memory.check_memory(config, 1, EngineOptions(max_context=512, dtype="bf16", router_fold=True), "cuda")


def test_bench_steps_stages_keep_the_projection_and_the_experts_work_where_it_was():
    """bench step's per-stage profile ties a kernel to the innermost stage label open at its launch. The fold launches
    the o-projection from the attention's tail (labelled "norm"): it carries the "attention" label inside the tail's,
    so its work stays in its stage (without the label this fails). TritonOps' pending Down is labelled "mlp" the same
    way; launching it needs the MoE kernels, so it is not run here."""
    from torch.profiler import ProfilerActivity, profile

    from iquest.fast.plan import KernelPlan
    from iquest.fast.router_fold import PendingProjection
    from iquest.fast.triton_ops import TritonOps

    engine = RankEngine(TINY, Parallel.single(), EngineOptions(max_context=64, router_fold=True))
    lw, c = engine.model.w.layers[1], engine.config
    ops = TritonOps(KernelPlan(), fold_router=True)  # every group on its torch form: no kernel launches on a CPU
    ops.prepare(engine.model.w, c.num_experts_per_tok, engine.par)
    x = torch.randn(3, lw.attn.wo.q.shape[-1])
    pending = ops.o_proj(lw.attn, x)
    assert isinstance(pending, PendingProjection)
    r = torch.randn(3, c.hidden_size)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ops.reduce_add_norm(engine.par, pending, r, 1.0, lw.attn_out_norm, lw.feed_forward_norm, c.rms_norm_eps,
                            torch.float32)
    events = list(prof.events())
    projection = [e for e in events if e.name == "attention"]
    assert projection and all("norm" in {a.name for a in _ancestors(e)} for e in projection)  # inside the tail
    assert any(e.name in ("aten::mm", "aten::matmul", "aten::linear") for a in projection for e in _descendants(a))


def _ancestors(e):
    while e.cpu_parent is not None:
        e = e.cpu_parent
        yield e


def _descendants(e):
    for child in e.cpu_children:
        yield child
        yield from _descendants(child)
