"""kernels/depth_rule.py against its contract, fast/depth_rule.py (the torch form the CPU engine runs).

Each case is a rule (the mini model's fitted one, the default, its features reversed, one feature alone) over draft
distributions shaped like the sampler's (K candidates sorted, zeros past a top-p cut of 0.95, K = 1 included), random
served probabilities and running products down to below the logs' floor. The score may differ from the torch form's
by the rounding of its sums (the entropy's over K in another order): the bound is fp32's epsilon times 8 x the
terms' magnitudes plus K x the entropy term's, from float64 features. Decisions must agree with the torch form's and
with float64's wherever the score lies farther than that from the threshold; each draw is also judged at thresholds
4 bounds below and above the torch score, so both answers are exercised. A negative control drops the entropy from
the kernel's score (a substituted piece), and the decisions must then differ.
"""

from __future__ import annotations

import json
import math
import sys
import zlib
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from iquest.fast import depth_rule as torch_rule
from iquest.kernels import depth_rule as dr
from iquest.kernels.testing import interpreted_tests

MINI = Path(__file__).resolve().parents[1] / "fixtures" / "iquest-q1-mini" / "depth_controller.json"
EPS32 = 2.0 ** -23


def mini_rule() -> tuple[dict, float]:
    raw = json.loads(MINI.read_text())
    return raw["weights"], raw["threshold"]


def rules() -> dict[str, tuple[dict, float]]:
    w, t = mini_rule()
    return {"mini": (w, t), "default": ({"bias": 1.2, "log_running_product": 1.0}, 0.5),
            "reversed": (dict(reversed(list(w.items()))), t), "entropy_only": ({"entropy": -1.0}, 0.3)}


CASES = [dict(name=f"{rule}_k{k}", rule=rule, k=k, draws=draws)
         for rule, k, draws in (("mini", 20, 48), ("default", 20, 16), ("reversed", 20, 16), ("entropy_only", 64, 16),
                                ("mini", 1, 8), ("mini", 64, 16))]


@triton.jit
def _score_probe(probs_ptr, K, served_ptr, product_ptr, out_ptr, depth, w0, w1, w2, w3, w4,
                 C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                 TERMS: tl.constexpr, KP: tl.constexpr, LIBDEVICE: tl.constexpr):
    tl.store(out_ptr, dr.score(probs_ptr, K, served_ptr, product_ptr, depth, w0, w1, w2, w3, w4, C0, C1, C2, C3, C4,
                               TERMS, KP, LIBDEVICE))


@triton.jit
def _score_without_entropy(probs_ptr, K, served_ptr, product_ptr, depth, w0, w1, w2, w3, w4,
                           C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr, C4: tl.constexpr,
                           TERMS: tl.constexpr, KP: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The control's broken piece: the score with the entropy taken as 0."""
    log_product = tl.log(tl.maximum(tl.load(product_ptr), 1e-30))
    log_served = tl.log(tl.maximum(tl.load(served_ptr), 1e-30))
    zero = log_product * 0.0
    s = dr._feature(C0, log_product, log_served, zero, depth) * w0
    if TERMS > 1:
        s = s + dr._feature(C1, log_product, log_served, zero, depth) * w1
    if TERMS > 2:
        s = s + dr._feature(C2, log_product, log_served, zero, depth) * w2
    if TERMS > 3:
        s = s + dr._feature(C3, log_product, log_served, zero, depth) * w3
    if TERMS > 4:
        s = s + dr._feature(C4, log_product, log_served, zero, depth) * w4
    return s


def draw(g: torch.Generator, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A sorted draft distribution over k candidates cut at top-p 0.95, the served probability of one kept candidate,
    a running product (some below the logs' floor) and a depth 3..6."""
    logits = torch.randn(k, generator=g, dtype=torch.float64) * (0.5 + 4 * float(torch.rand(1, generator=g)))
    p = torch.softmax(logits, 0).sort(descending=True).values
    keep = (p.cumsum(0) - p) < 0.95
    p = torch.where(keep, p, 0.0)
    probs = (p / p.sum()).float()
    top = float(torch.rand(1, generator=g)) < 0.7  # a draft mostly draws its most likely candidate
    served = probs[0 if top else int(torch.randint(0, int(keep.sum()), (1,), generator=g))].view(1).clone()
    scale = float(torch.rand(1, generator=g)) * (1e-34 if float(torch.rand(1, generator=g)) < 0.1 else 1.0)
    product = (served[0] * scale).float().view(())
    return probs, served, product, 3 + int(torch.randint(0, 4, (1,), generator=g))


def float64_terms(weights: dict, depth: int, served, probs, product) -> tuple[list[float], float]:
    """Each term w_f x_f in float64 from the fp32 inputs, and the entropy's sum of |q ln q|."""
    p = probs.double()
    plogp = torch.where(p > 0, p * torch.log(p.clamp(min=1e-30)), torch.zeros_like(p))
    x = {"bias": 1.0, "log_running_product": math.log(max(float(product), 1e-30)),
         "log_served_prob": math.log(max(float(served[0]), 1e-30)), "entropy": -float(plogp.sum()),
         "depth": float(depth)}
    return [w * x[f] for f, w in weights.items()], float(plogp.abs().sum())


def kernel_score(weights, depth, served, probs, product) -> float:
    out = torch.zeros(1, dtype=torch.float32, device=probs.device)
    consts, ws = dr.rule_args(weights)
    _score_probe[(1,)](probs, probs.numel(), served, product, out, float(depth), *ws, **consts,
                       KP=triton.next_power_of_2(probs.numel()), LIBDEVICE=not dr.INTERPRETED,
                       **({} if dr.INTERPRETED else {"enable_fp_fusion": False}))
    return float(out[0])


def run_case(c: dict, device: str) -> dict:
    weights, threshold = rules()[c["rule"]]
    g = torch.Generator().manual_seed(zlib.crc32(c["name"].encode()))
    thr = torch_rule.logit_threshold(threshold)
    out = torch.zeros(1, dtype=torch.int32, device=device)
    worst, clear, agree, agree64, both, ones = 0.0, 0, 0, 0, 0, 0
    for _ in range(c["draws"]):
        probs, served, product, depth = (t.to(device) if isinstance(t, torch.Tensor) else t for t in draw(g, c["k"]))
        s_torch = float(torch_rule.score(weights, depth, served, probs, product)[0])
        s_kernel = kernel_score(weights, depth, served, probs, product)
        terms, plogp_abs = float64_terms(weights, depth, served, probs, product)
        bound = EPS32 * (8 * sum(abs(t) for t in terms) + c["k"] * abs(weights.get("entropy", 0.0)) * plogp_abs)
        worst = max(worst, abs(s_kernel - s_torch) / bound)
        dr.more(probs, served, product, out, depth, weights, thr)
        want = int(torch_rule.more(weights, threshold, depth, served, probs, product)[0])
        if abs(sum(terms) - thr) > 2 * bound:
            clear += 1
            agree += int(out[0]) == want
            agree64 += int(out[0]) == int(sum(terms) > thr)
        for shifted, expect in ((s_torch - 4 * bound, 1), (s_torch + 4 * bound, 0)):
            dr.more(probs, served, product, out, depth, weights, shifted)
            both += int(out[0]) == expect
        ones += want
    return {"worst_over_bound": worst, "clear": clear, "agree": agree, "agree64": agree64, "shifted_ok": both,
            "draws": c["draws"], "continued": ones}


def run_control(device: str) -> dict:
    """The mini rule's decisions with the entropy dropped from the kernel's score, against the torch form's."""
    from iquest.kernels.testing import substituted

    weights, threshold = mini_rule()
    g = torch.Generator().manual_seed(7)
    out = torch.zeros(1, dtype=torch.int32, device=device)
    differ = 0
    with substituted(dr, {"_more_kernel": {"score": _score_without_entropy}}):
        for _ in range(24):
            probs, served, product, depth = (t.to(device) if isinstance(t, torch.Tensor) else t for t in draw(g, 20))
            dr.more(probs, served, product, out, depth, weights, torch_rule.logit_threshold(threshold))
            differ += int(out[0]) != int(torch_rule.more(weights, threshold, depth, served, probs, product)[0])
    return {"differ": differ}


def _check(c: dict, r: dict) -> None:
    assert r["worst_over_bound"] <= 1.0, r
    assert r["clear"] >= c["draws"] // 2, f"too few draws away from the threshold to judge: {r}"
    assert r["agree"] == r["clear"] and r["agree64"] == r["clear"], r
    assert r["shifted_ok"] == 2 * r["draws"], r


interpreted, test_interpreted = interpreted_tests(__file__, CASES, _check)


def test_interpreted_negative_control(interpreted):
    r = interpreted["negative_control"]
    assert "error" not in r, r.get("error")
    assert r["differ"] > 0, r


def test_the_cases_reach_both_decisions(interpreted):
    """The fitted rule continues on some draws and stops on others, so agreement covers both branches unshifted."""
    r = interpreted["mini_k20"]
    assert 0 < r["continued"] < r["draws"], r


@pytest.mark.parametrize("over, message", [
    (dict(probs=torch.zeros(65)), "probs"),
    (dict(probs=torch.zeros(4, dtype=torch.float64)), "probs"),
    (dict(served=torch.zeros(2)), "served"),
    (dict(product=torch.zeros((), dtype=torch.float64)), "product"),
    (dict(out=torch.zeros(1)), "out"),
    (dict(depth=0), "depth"),
    (dict(weights={"bias": 1.0, "speed": 2.0}), "weights"),
    (dict(weights={}), "weights"),
])
def test_rejects_bad_inputs(over, message):
    a = dict(probs=torch.full((4,), 0.25), served=torch.full((1,), 0.25), product=torch.full((), 0.1),
             out=torch.zeros(1, dtype=torch.int32), depth=3, weights={"bias": 1.0}, logit_threshold=0.0)
    a.update(over)
    with pytest.raises(ValueError, match=message):
        dr.more(**a)


@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES, ids=[c["name"] for c in CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


@pytest.mark.gpu
def test_gpu_negative_control():
    assert run_control("cuda")["differ"] > 0


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES]
                + [("negative_control", lambda: run_control("cpu"))])
