"""lab/router_fold.py: the fold's algebra (W' = W_r * w_ffn, the scale inside rstd_h's bracket) gives the reference's
logits exactly in float64, its "path" is the fast engine's own roundings, and the report holds every figure."""

from __future__ import annotations

import json

import pytest
import torch

from iquest.fast.torch_ops import TorchOps
from iquest.lab.router_fold import (PAIRS, branch_input, branch_logits, fold_logits, layer_inputs, logits_of,
                                    path_logits, run, table)
from iquest.reference.checkpoint import layer_prefix
from iquest.reference.layers import rms_norm
from iquest.reference.model import ReferenceModel
from iquest.tests.helpers import MINI


@pytest.fixture(scope="module")
def report():
    return json.loads(json.dumps(run(MINI, 1)))  # what the file holds


@pytest.fixture(scope="module")
def layer():
    model = ReferenceModel.load(MINI)
    i, inp = next(iter(layer_inputs(model, list(range(3, 40))).items()))
    return model, i, inp


def test_report_has_every_figure(report):
    assert report["commit"] and report["model"] and report["prompts"] == 1 and report["positions"] > 0
    assert report["positions_kind"] == "prefill" and report["moe_layers"] == [1, 2, 3]
    for fig in [*report["per_layer"].values(), report["overall"]]:
        for a, b in PAIRS:
            f = fig[f"{a}_vs_{b}"]
            for key in ("max_abs", "median_abs", "max_rel", "median_rel", "topk_set_differs",
                        "max_weight_err_agreeing"):
                assert f[key] is not None and f[key] >= 0.0, (a, b, key)
            assert 0.0 <= f["topk_set_differs"] <= 1.0
    assert "verdict" in table(report) and report["verdict"]


def test_fold_in_float64_is_the_reference(report, layer):
    model, i, inp = layer
    logits = logits_of(model, i, inp)
    scale = inp["ref"].abs().amax(-1, keepdim=True)
    assert ((logits["fold64"] - inp["ref"]).abs() / scale).max() < 1e-12
    for fig in report["per_layer"].values():
        assert fig["fold64_vs_ref"]["max_rel"] < 1e-12


def test_fold_scale_placement_at_a_non_unit_scale():
    """At s = 1 a misplaced scale is invisible: check the algebra against b @ W_r^T on random inputs at s != 1."""
    g = torch.Generator().manual_seed(0)
    H, E, T, eps, s = 64, 8, 5, 1e-6, 0.53881590608
    r, o = torch.randn(T, H, generator=g, dtype=torch.float64), 3 * torch.randn(T, H, generator=g, dtype=torch.float64)
    w_out, w_ffn = (1 + 0.3 * torch.randn(H, generator=g, dtype=torch.float64) for _ in range(2))
    router = torch.randn(E, H, generator=g, dtype=torch.float64)
    b = rms_norm(r + s * rms_norm(o, w_out, eps), w_ffn, eps)
    ref = b @ router.T
    fold = fold_logits(r, o, w_out, w_ffn, router, s, eps, torch.float64, round_inputs=False)
    assert ((fold - ref).abs().max() / ref.abs().max()) < 1e-12
    wrong = fold_logits(r, o, w_out, w_ffn, router, 1.0, eps, torch.float64, round_inputs=False)
    assert ((wrong - ref).abs().max() / ref.abs().max()) > 1e-3  # the check can fail


def test_branch_in_float64_is_the_reference(report, layer):
    """The branch form's o term from the recorded heads through F = W' diag(w_out) W_o gives the reference's logits
    in float64 from exact inputs (the heads are the layer's own, F composed right); with W_o a little off, it does
    not (the check can fail)."""
    model, i, inp = layer
    p, c = layer_prefix(i), model.config
    s, eps = c.out_scales(i)[0], c.rms_norm_eps
    w_out, w_ffn, router, wo = (model.w[p + n] for n in ("attn_out_norm.weight", "feed_forward_norm.weight",
                                                          "mlp.router.weight", "self_attn.o_proj.weight"))
    scale = inp["ref"].abs().amax(-1, keepdim=True)
    exact = branch_logits(inp["r"], inp["o"], inp["heads"], w_out, w_ffn, router, wo, s, eps, torch.float64, False)
    assert ((exact - inp["ref"]).abs() / scale).max() < 1e-12
    off = branch_logits(inp["r"], inp["o"], inp["heads"], w_out, w_ffn, router, wo * 1.01, s, eps, torch.float64,
                        False)
    assert ((off - inp["ref"]).abs() / scale).max() > 1e-4
    for fig in report["per_layer"].values():
        assert fig["branch64_vs_ref"]["max_rel"] < 1e-12 and fig["branch_vs_ref"]["max_rel"] > 1e-6  # fp32 rounds


def test_the_branch_input_is_what_the_branch_evaluates_and_its_band_holds(report, layer):
    """router @ b of `branch_input` is the branch's logits in float64 from the same bf16 inputs; its fp32 logits lie
    within gamma_n |router| mag of them (qualification's band), and not within the band of an input made with W_o
    0.1% off (the check can fail). The report scores every swap with it."""
    model, i, inp = layer
    p, c = layer_prefix(i), model.config
    s, eps = c.out_scales(i)[0], c.rms_norm_eps
    w_out, w_ffn, router, wo = (model.w[p + n] for n in ("attn_out_norm.weight", "feed_forward_norm.weight",
                                                          "mlp.router.weight", "self_attn.o_proj.weight"))
    args = (inp["r"], inp["o"], inp["heads"], w_out, w_ffn, router, wo, s, eps)
    fin = branch_input(inp["r"], inp["o"], inp["heads"], w_out, w_ffn, wo, s, eps)
    exact = fin.b @ router.T
    assert ((exact - branch_logits(*args, dtype=torch.float64)).abs().max() / exact.abs().max()) < 1e-12
    assert bool((fin.mag >= fin.b.abs()).all())
    err = (branch_logits(*args).double() - exact).abs()

    band = fin.terms * 2.0 ** -24 / (1 - fin.terms * 2.0 ** -24) * (fin.mag @ router.abs().T)
    assert bool((err <= band).all())
    off = branch_input(inp["r"], inp["o"], inp["heads"], w_out, w_ffn, wo * 1.001, s, eps)
    assert not bool(((branch_logits(*args).double() - off.b @ router.T).abs() <= band).all())
    for fig in [*report["per_layer"].values(), report["overall"]]:
        for q in fig["qualify_swaps"].values():
            assert q["swapped_rows"] >= q["unexplained"] >= 0


@pytest.mark.parametrize("s", [1.0, 0.53881590608])
def test_path_is_the_engines_roundings(layer, s):
    """path_logits equals fast/torch_ops.py's add_norm + route on the same bf16 inputs, bitwise, and differs from
    the float64 reference (the bf16 rounding is really applied)."""
    model, i, inp = layer
    p, eps = layer_prefix(i), model.config.rms_norm_eps
    w_out, w_ffn, router = (model.w[p + n] for n in ("attn_out_norm.weight", "feed_forward_norm.weight",
                                                      "mlp.router.weight"))
    ops = TorchOps()
    _, b = ops.add_norm(inp["r"].bfloat16(), inp["o"].bfloat16(), s, w_out.bfloat16(), w_ffn.bfloat16(), eps,
                        torch.bfloat16)
    engine = b.float() @ router.float().T
    path = path_logits(inp["r"], inp["o"], w_out, w_ffn, router, s, eps)
    assert path.dtype == torch.float32 and torch.equal(path, engine)
    if s == 1.0:
        err = (path.double() - inp["ref"]).abs().max()
        assert err > 1e-5 * inp["ref"].abs().max()
        fold = fold_logits(inp["r"], inp["o"], w_out, w_ffn, router, s, eps)
        assert not torch.equal(fold, path)
