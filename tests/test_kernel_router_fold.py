"""kernels/router_fold.py (the router's partial logits from the stream and the attention output) and the norm that
routes on them (kernels/rmsnorm_residual.rmsnorm_residual_route): stage route_fold.

Small shapes run under Triton's CPU interpreter in one worker subprocess: 1, 6, 8 and 11 rows (two row blocks),
E = 20, 33, 256 (the model's), 16; H and A not multiples of the 512-wide tile (partial tiles; A = 768, the model's
per-rank attention width, is one and a half); k = 2..8; norm_topk_prob on and off; scaling != 1; a strided x. Inputs
are fresh random values, never zeros; outputs are poisoned with NaN first.

Checks, per case:
  partials  the sum over splits of part [S, R, E] against float64 W_r (g x) + F a, elementwise within
            LOGIT_TOL * (|W_r| (|g x|) + |F| |a|): fp32 sums in the kernel's order
  norm      y and h bit-equal to `rmsnorm_residual`'s (the same kernel, routing off)
  scores    within SCORE_TOL of a float64 softmax of (sum of partials) x the row's 1 / rms (float64)
  experts   ranked on the unscaled sum before 1 / rms is known, so a top-k of the kernel's own scores (1 / rms > 0
            keeps the order): the chosen scores non-increasing and none below an unchosen one; and the top-k of the
            float64 sum of the partials (ties to the lower index; the kernel's fp32 sum is within ~1e-7 of it)
  weights   the chosen scores, normalized when asked, times scaling, within WEIGHT_TOL

The algebra (`fold_weight`): W_r (g x) + F a equals W_r (g (x + W_o a)) in float64 (CPU, no kernel).

Negative control (must FAIL the partials check): the kernel leaving out F a (`drop_a`), its branch taken on every
case's A splits. `@pytest.mark.gpu`: the same cases compiled, the model's shape (R = 6, H = 6144, A = 768, E = 256,
k = 8) with a bf16 stream, preload on and off bit-identical, and graph replay bit-identical to eager.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.kernels import rmsnorm_residual as rn
from iquest.kernels import router_fold as rf
from iquest.kernels.testing import interpreted_tests

LOGIT_TOL = 1e-5  # fp32 sums of H + A products, measured ~1e-7 of the absolute sum; a dropped term moves them ~1e-1
SCORE_TOL = 2e-5  # the logits' fp32 rounding times |logit| (<~ 10 here), then exp and sum: a few ulps each
WEIGHT_TOL = 3e-5

BASE = dict(R=6, H=600, A=130, E=33, k=4, norm=True, scaling=2.5, x_stride=None, seed=0, xdtype="fp32",
            drop_a=False, preload=False, early=False)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("one_row", R=1, H=96, A=40, E=20, k=2),
    case("six_rows"),
    case("model_A_and_E", R=8, H=1024, A=768, E=256, k=8, seed=1),
    case("two_row_blocks", R=11, H=200, A=64, E=16, k=3, norm=False, scaling=1.0, seed=2),
    case("strided_x", R=3, H=136, A=520, E=24, k=5, x_stride=200, seed=3),
    case("early_reads", early=True, preload=True, seed=8),  # the forms that read before the PDL wait: the same values
    case("drop_a_control", drop_a=True, seed=4),
]


def inputs(c: dict, device: str) -> dict:
    g = torch.Generator().manual_seed(c["seed"])
    R, H, A, E = c["R"], c["H"], c["A"], c["E"]
    xd = torch.bfloat16 if c["xdtype"] == "bf16" else torch.float32
    x = torch.randn(R, c["x_stride"] or H, generator=g)[:, :H].to(xd)
    residual = torch.randn(R, H, generator=g).to(xd)
    return dict(
        x=x, residual=residual,
        g=(torch.rand(H, generator=g) + 0.5).to(torch.bfloat16),
        a=torch.randn(R, A, generator=g).to(torch.bfloat16),
        router_w=(torch.randn(E, H, generator=g) / H ** 0.5).to(torch.bfloat16),
        fold_w=(torch.randn(E, A, generator=g) / A ** 0.5).float())


def run_case(c: dict, device: str) -> dict:
    t = {k: v.to(device) for k, v in inputs(c, device).items()}
    x = t["x"]
    if c["x_stride"] is None:
        x = x.contiguous()
    sh, sa = rf.splits(c["H"], c["A"])
    part = torch.full((sh + sa, c["R"], c["E"]), float("nan"), device=device)
    pdl = c["early"] and device == "cuda"
    rf.route_parts(x, t["g"], t["a"], t["router_w"], t["fold_w"], out=part, drop_a=c["drop_a"],
                   preload=c["preload"], early=c["early"], pdl=pdl)
    y, h, weights, experts, scores = rn.rmsnorm_residual_route(
        t["residual"], x.contiguous(), t["g"], 1e-6, part, c["k"], c["norm"], c["scaling"], early=c["early"], pdl=pdl)
    y0, h0 = rn.rmsnorm_residual(t["residual"], x.contiguous(), t["g"], 1e-6, torch.float32)
    want = (x.double() * t["g"].double()) @ t["router_w"].double().T + t["a"].double() @ t["fold_w"].double().T
    bound = (x.double() * t["g"].double()).abs() @ t["router_w"].double().abs().T + \
        t["a"].double().abs() @ t["fold_w"].double().abs().T
    hd = h.double()
    inv = torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-6)
    score64 = torch.softmax(part.double().sum(0) * inv, dim=-1)
    order = torch.sort(part.double().sum(0), dim=-1, descending=True, stable=True).indices[:, :c["k"]]
    chosen = scores.gather(-1, experts)
    unchosen = scores.scatter(-1, experts, float("-inf"))
    want_w = chosen / chosen.sum(-1, keepdim=True) if c["norm"] else chosen
    return {
        "written": bool(torch.isfinite(part).all()),
        "logit_err": float(((part.double().sum(0) - want).abs() / bound).max()),
        "norm_identical": bool(torch.equal(y, y0) and torch.equal(h, h0)),
        "score_err": float((scores.double() - score64).abs().max()),
        "experts_are_top_k": bool(torch.equal(experts, order) and (chosen[:, :-1] >= chosen[:, 1:]).all()
                                  and (chosen[:, -1] >= unchosen.max(-1).values).all()),
        "weight_err": float(((weights.double() - want_w.double() * c["scaling"]).abs()
                             / (want_w.double().abs() * abs(c["scaling"]))).max()),
    }


def _check(c: dict, r: dict) -> None:
    assert r["written"], r
    if c["drop_a"]:  # negative control: the same check must fail
        assert r["logit_err"] > 100 * LOGIT_TOL, r
        return
    assert r["logit_err"] <= LOGIT_TOL, r
    assert r["norm_identical"], r
    assert r["score_err"] <= SCORE_TOL, r
    assert r["experts_are_top_k"], r
    assert r["weight_err"] <= WEIGHT_TOL, r


interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check, lambda c, r: f"{c['name']}: {r}")


def test_fold_weight_is_the_router_through_o_proj():
    """W_r (g x) + F a = W_r (g (x + W_o a)) with F = fold_weight(W_r, g, W_o): the fold changes the order of the
    sums, not what is summed (float64 here; F itself is rounded to fp32 once)."""
    gen = torch.Generator().manual_seed(7)
    E, H, A, R = 12, 48, 20, 3
    w_r = torch.randn(E, H, generator=gen).bfloat16()
    g = (torch.rand(H, generator=gen) + 0.5).bfloat16()
    w_o = torch.randn(H, A, generator=gen).double()
    x, a = torch.randn(R, H, generator=gen).double(), torch.randn(R, A, generator=gen).double()
    f = rf.fold_weight(w_r, g, w_o)
    assert f.dtype == torch.float32 and f.shape == (E, A)
    unfolded = (x + a @ w_o.T) * g.double() @ w_r.double().T
    folded = (x * g.double()) @ w_r.double().T + a @ f.double().T
    assert torch.allclose(folded, unfolded, rtol=0, atol=1e-6 * unfolded.abs().max())  # F's fp32 rounding only
    f64 = (w_r.double() * g.double()) @ w_o
    assert torch.allclose((x * g.double()) @ w_r.double().T + a @ f64.T, unfolded, rtol=1e-12, atol=1e-12)


def test_route_parts_refuses_what_it_cannot_take():
    t = inputs(BASE, "cpu")
    with pytest.raises(ValueError, match="fold_w"):
        rf.route_parts(t["x"], t["g"], t["a"], t["router_w"], t["fold_w"].bfloat16())
    with pytest.raises(ValueError, match="must be"):
        rf.route_parts(t["x"], t["g"], t["a"][:2], t["router_w"], t["fold_w"])
    with pytest.raises(ValueError, match="g"):
        rf.route_parts(t["x"], t["g"][:-1], t["a"], t["router_w"], t["fold_w"])


GPU_CASES = [dict(c, name=c["name"] + "_gpu") for c in CASES if not c["drop_a"]] + [
    case("model_shape_bf16_gpu", R=6, H=6144, A=768, E=256, k=8, xdtype="bf16", seed=5),
    case("model_shape_bf16_preload_gpu", R=6, H=6144, A=768, E=256, k=8, xdtype="bf16", seed=5, preload=True),
    case("model_shape_bf16_early_gpu", R=6, H=6144, A=768, E=256, k=8, xdtype="bf16", seed=5, preload=True,
         early=True),
    case("drop_a_control_gpu", drop_a=True, seed=4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=[c["name"] for c in GPU_CASES])
def test_gpu_cases(c):
    r = run_case(c, "cuda")
    print(f"{c['name']}: {r}")
    _check(c, r)


@pytest.mark.gpu
def test_gpu_preload_and_graph_replay_are_bit_identical():
    """Preloading the weight tiles before the PDL wait, and a CUDA graph replay, give the eager run's bits."""
    c = case("replay", R=6, H=6144, A=768, E=256, k=8, xdtype="bf16", seed=6)
    t = {k: v.cuda() for k, v in inputs(c, "cuda").items()}
    run = lambda preload, pdl: rf.route_parts(t["x"], t["g"], t["a"], t["router_w"], t["fold_w"], preload=preload,
                                             pdl=pdl)
    eager = run(False, False)
    assert torch.equal(run(True, True), eager)
    assert torch.equal(rf.route_parts(t["x"], t["g"], t["a"], t["router_w"], t["fold_w"], preload=True, pdl=True,
                                      early=True), eager)
    out = torch.full_like(eager, float("nan"))
    graph = torch.cuda.CUDAGraph()
    run(True, True)  # compiled before the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        got = rf.route_parts(t["x"], t["g"], t["a"], t["router_w"], t["fold_w"], preload=True, pdl=True, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, eager)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES])
