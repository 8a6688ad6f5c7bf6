"""reference/sampling.py: properties of dist/draw/accept/residual, an independent oracle, a negative control."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from iquest.reference import sampling
from iquest.reference.config import ConfigError
from iquest.reference.sampling import Dist, SamplingParams, accept, dist, draw, residual

EPS = 1e-12  # float64 rounding slack for sums of at most a few dozen probabilities

# Integer-valued logits make ties (the lower-id rules) common; float logits make them rare.
_tied = st.lists(st.integers(-3, 3).map(float), min_size=1, max_size=48)
_spread = st.lists(st.floats(-30, 30, allow_nan=False), min_size=1, max_size=48)
_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 5.0)),
    top_k=st.integers(1, 40),
    top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
)


def _ranking(x: list[float]) -> list[int]:
    """Token ids by descending logit, ties to the lower id (the plain Python sort as the oracle)."""
    return sorted(range(len(x)), key=lambda i: (-x[i], i))


def _in_dist_order(d: Dist) -> bool:
    """Strictly descending by (probability, then lower id first)."""
    pairs = [(-p, i) for i, p in zip(d.ids.tolist(), d.probs.tolist())]
    return all(a < b for a, b in zip(pairs, pairs[1:]))


def check_dist(x: list[float], params: SamplingParams, d: Dist) -> None:
    """Every property docs/round.md asks of dist(), checked against a from-scratch recomputation."""
    ids, probs = d.ids.tolist(), d.probs.tolist()
    assert len(set(ids)) == len(ids) and all(0 <= i < len(x) for i in ids)
    assert all(p > 0 for p in probs) and abs(sum(probs) - 1) < EPS
    assert _in_dist_order(d)
    if params.temperature == 0:
        assert ids == [_ranking(x)[0]] and probs == [1.0]
        return
    top = _ranking(x)[: params.top_k]
    assert len(ids) <= params.top_k
    z = [math.exp((x[i] - x[top[0]]) / params.temperature) for i in top]
    soft = {i: v / sum(z) for i, v in zip(top, z)}
    # The kept set is a prefix of the top-k set in Dist order (probability, then lower id), cut by top-p. That order
    # is the logits' except where two logits closer than float64 resolution give one probability: [-1.2e-38, 0.0]
    # is a tie, kept as token 0 (hypothesis found it). The oracle's probabilities may round differently from the
    # reference's in the last bit, so the prefix is checked up to ties within EPS.
    n = len(ids)
    order = sorted(top, key=lambda i: (-soft[i], i))
    dropped = [i for i in top if i not in set(ids)]
    assert set(ids) <= set(top)
    assert all(soft[a] >= soft[b] - EPS for a in ids for b in dropped), f"kept {ids}, dropped {dropped}: not a prefix"
    cum = [sum(soft[i] for i in order[: m + 1]) for m in range(len(order))]
    reaches = cum[n - 1] >= params.top_p - EPS or n == len(top)
    minimal = n == 1 or cum[n - 2] < params.top_p + EPS
    assert reaches, f"kept {n} tokens with mass {cum[n - 1]} < top_p={params.top_p}"
    assert minimal, f"kept {n} tokens although {n - 1} already reach top_p={params.top_p}"
    kept = sum(soft[i] for i in ids)
    assert all(abs(p - soft[i] / kept) < EPS for i, p in zip(ids, probs))


@settings(max_examples=300, deadline=None)
@given(st.one_of(_tied, _spread), _params)
@example([-1.1754943508222875e-38, 0.0], SamplingParams(temperature=1.0, top_k=2, top_p=0.5))  # a probability tie
def test_dist_properties(x, params):
    logits = torch.tensor(x, dtype=torch.float32)  # the engines' logits are fp32
    check_dist(logits.tolist(), params, dist(logits, params))


def test_ties_go_to_lower_ids():
    x = torch.tensor([1.0, 3.0, 3.0, 0.0, 3.0])
    assert dist(x, SamplingParams(temperature=0.0)).ids.tolist() == [1]
    d = dist(x, SamplingParams(top_k=2, top_p=1.0))
    assert d.ids.tolist() == [1, 2] and d.probs.tolist() == [0.5, 0.5]


def test_edge_cases():
    one = dist(torch.tensor([0.5]), SamplingParams())
    assert one.ids.tolist() == [0] and one.probs.tolist() == [1.0]
    assert dist(torch.tensor([1.0, 2.0, 0.0]), SamplingParams(top_p=1e-6)).ids.tolist() == [1]
    masked = dist(torch.tensor([0.0, -math.inf, 0.0]), SamplingParams(top_p=1.0))
    assert masked.ids.tolist() == [0, 2]  # -inf tokens are never in the support
    tiny_t = dist(torch.tensor([1.0, 1.5, 1.25]), SamplingParams(temperature=1e-300))
    assert tiny_t.ids.tolist() == [1]  # no overflow to inf - inf = nan
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        assert dist(torch.tensor([0.0, 1.0], dtype=dtype), SamplingParams()).ids.tolist() == [1, 0]
    for bad in ([math.nan, 0.0], [math.inf, 0.0], [-math.inf, -math.inf]):
        with pytest.raises(ValueError):
            dist(torch.tensor(bad), SamplingParams())
    for kwargs in ({"temperature": -1.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ConfigError):
            SamplingParams(**kwargs)
    assert one.prob(0) == 1.0 and one.prob(7) == 0.0


# ---- an independent oracle: transformers' logits processors ------------------------------------
# Same rule in exact arithmetic: TopPLogitsWarper sorts ascending and removes tokens whose cumulative
# probability is <= 1 - top_p, which keeps exactly the shortest descending prefix with mass >= top_p
# (the crossing token stays; mass == top_p exactly also stops there). Differences, avoided here:
# (1) its top-k keeps every token tied with the k-th value (more than k), and it ranks by logit where
#     we rank by probability (logits closer than rounding give equal probabilities, ties to the lower
#     id), so logits here are at least 1e-6 apart;
# (2) it rounds on the ascending side against 1 - top_p, so a prefix sum within rounding of top_p
#     may cut differently: such cases are skipped (margin 1e-9); with top_p = 1 it keeps tokens whose
#     mass vanishes below one ulp of the total, which our literal prefix rule may drop.
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-10, 10), min_size=1, max_size=48, unique=True),
       st.floats(0.05, 5.0), st.integers(1, 40), st.floats(0.01, 0.99))
def test_matches_transformers(x, temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    logits = torch.tensor(x, dtype=torch.float64)
    assume(len(x) == 1 or float(torch.diff(torch.sort(logits).values).min()) > 1e-6)
    ours = dist(logits, SamplingParams(temperature, top_k, top_p))
    sorted_p = torch.softmax(torch.topk(logits / temperature, min(top_k, len(x))).values, 0)
    assume(bool(((torch.cumsum(sorted_p, 0) - top_p).abs() > 1e-9).all()))
    scores = logits[None].clone()
    for warper in (TemperatureLogitsWarper(temperature), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)):
        scores = warper(None, scores)
    theirs = torch.softmax(scores[0], 0)
    kept = (theirs > 0).nonzero()[:, 0]
    assert set(kept.tolist()) == set(ours.ids.tolist())
    assert torch.allclose(theirs[ours.ids], ours.probs, rtol=1e-12, atol=0)


# ---- draw, accept, residual --------------------------------------------------------------------
@given(_spread, _params, st.floats(0, 1, exclude_max=True))
def test_draw_is_inverse_cdf(x, params, u):
    d = dist(torch.tensor(x), params)
    i = d.ids.tolist().index(draw(d, u))
    cum = torch.cumsum(d.probs, 0).tolist()
    if cum[-1] <= u:  # rounding left u above the total: the last token
        assert i == len(cum) - 1
    else:
        assert cum[i] > u and (i == 0 or cum[i - 1] <= u)


def test_draw_boundaries():
    d = Dist(torch.tensor([4, 2, 9]), torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64))
    assert [draw(d, u) for u in (0.0, 0.4999, 0.5, 0.75, 0.9999)] == [4, 4, 2, 9, 9]
    short = Dist(torch.tensor([1, 3]), torch.tensor([0.5, 0.4999], dtype=torch.float64))
    assert draw(short, 0.99995) == 3  # u above the (rounded) total: the last token
    for u in (-0.1, 1.0):
        with pytest.raises(ValueError):
            draw(d, u)


_pair = st.integers(1, 40).flatmap(
    lambda v: st.tuples(*[st.lists(st.floats(-8, 8), min_size=v, max_size=v)] * 2))


@settings(max_examples=300, deadline=None)
@given(_pair, _params, _params)
def test_residual_and_acceptance_recover_p(rows, pp, qp):
    p, q = dist(torch.tensor(rows[0]), pp), dist(torch.tensor(rows[1]), qp)
    r = residual(p, q)
    rp = r.probs.tolist()
    assert all(v > 0 for v in rp) and abs(sum(rp) - 1) < EPS
    assert _in_dist_order(r)
    excess = {t: p.prob(t) - q.prob(t) for t in set(p.ids.tolist()) | set(q.ids.tolist())}
    mass = sum(max(0.0, e) for e in excess.values())
    if mass <= 0:
        assert r is p
        return
    for t, e in excess.items():
        assert abs(r.prob(t) - max(0.0, e) / mass) < EPS  # zero exactly where q >= p
    # Speculative sampling is exact: accept-or-replace yields p itself.
    a = {t: q.prob(t) * min(1.0, p.prob(t) / q.prob(t)) for t in q.ids.tolist()}
    reject = 1 - sum(a.values())
    for t in excess:
        assert abs(a.get(t, 0.0) + reject * r.prob(t) - p.prob(t)) < 1e-9


@given(_pair, _params, _params, st.floats(0, 1, exclude_max=True))
def test_accept_rule(rows, pp, qp, u):
    p, q = dist(torch.tensor(rows[0]), pp), dist(torch.tensor(rows[1]), qp)
    t = draw(q, u)
    assert accept(p, q, t, u) == (u < min(1.0, p.prob(t) / q.prob(t)))
    if p.prob(t) >= q.prob(t):
        assert accept(p, q, t, u)
    if p.prob(t) == 0:
        assert not accept(p, q, t, 0.0)


def test_accept_rejects_token_outside_q():
    p = Dist(torch.tensor([1]), torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(ValueError):
        accept(p, p, 5, 0.5)


# ---- negative control: a top-p that drops the crossing token must be caught -------------------
def test_broken_top_p_is_caught(monkeypatch):
    real = sampling._top_p_count
    monkeypatch.setattr(sampling, "_top_p_count", lambda probs, top_p: max(1, real(probs, top_p) - 1))
    x, params = [2.0, 1.0, 0.0, -1.0], SamplingParams(top_p=0.9)
    with pytest.raises(AssertionError, match="top_p"):
        check_dist(x, params, dist(torch.tensor(x), params))
    with pytest.raises((AssertionError, ExceptionGroup)):
        test_dist_properties()
