"""Divergences at temperature 0 (qualify/agreement.py `greedy_gap`): one-hot distributions are 0 or 2 apart in L1
however near the tie, so decode.tokens and decode.acceptance measure a greedy pick by its gap below the reference's
largest logit, against the same bound 2 e (e = tol_rel * scale) that the logits' tolerance gives."""

import pytest
import torch

from iquest.qualify import checks
from iquest.qualify.agreement import greedy_gap
from iquest.qualify.replay import distribution_ratio, l1
from iquest.reference import sampling
from iquest.reference.sampling import SamplingParams

GREEDY = SamplingParams(0.0, 20, 0.95)
TOL = 0.08  # numerics.logits at bf16 (qualify/tolerances.json)


def logits(top: float, second: float) -> torch.Tensor:
    """A reference row of scale 10: token 7 at `top`, token 3 at `second`, the rest far below."""
    x = torch.full((32,), -10.0, dtype=torch.float64)
    x[7], x[3] = top, second
    return x


def one_hot(token: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor([token, 5]), torch.tensor([1.0, 0.0])


def test_the_gap_is_zero_at_the_argmax_and_the_logit_difference_elsewhere():
    x = logits(9.5, 9.2)
    assert greedy_gap(x, 7) == 0.0
    assert greedy_gap(x, 3) == pytest.approx(0.3)
    assert greedy_gap(x, 0) == pytest.approx(19.5)


def test_a_greedy_flip_between_near_tied_tokens_is_explained_and_a_far_one_is_not():
    scale = 10.0  # the rows' largest |logit|
    near, far = logits(9.5, 9.2), logits(9.5, 7.0)  # gaps 0.03 and 0.25 of the scale, against 2 * 0.08
    agree = distribution_ratio(near, *one_hot(7), GREEDY, TOL, scale)
    flip_near = distribution_ratio(near, *one_hot(3), GREEDY, TOL, scale)
    flip_far = distribution_ratio(far, *one_hot(3), GREEDY, TOL, scale)
    assert agree == 0.0
    assert flip_near == pytest.approx(0.3 / (2 * TOL * scale))
    assert flip_near < 1 < flip_far
    # the L1 of the two one-hot distributions is 2 for both flips: it cannot tell them apart
    assert l1(sampling.dist(near, GREEDY), *one_hot(3)) == l1(sampling.dist(far, GREEDY), *one_hot(3)) == 2.0


def test_sampled_rows_keep_the_l1_measure():
    params, scale = SamplingParams(0.7, 20, 0.95), 10.0
    x = logits(9.5, 9.2)
    ref = sampling.dist(x, params)
    probs = ref.probs.clone()
    probs[0], probs[1] = probs[0] - 0.01, probs[1] + 0.01
    got = distribution_ratio(x, ref.ids, probs, params, TOL, scale)
    assert got == pytest.approx(l1(ref, ref.ids, probs) / (2 * TOL * scale / 0.7))
    assert got == pytest.approx(0.02 / (2 * TOL * scale / 0.7))


class _Model:
    def __init__(self, row: torch.Tensor):
        self.row = row

    def new_cache(self):
        return None

    def forward(self, tokens, positions, cache):
        return self.row.expand(len(tokens), -1), None


class _Ref:
    def __init__(self, row):
        self.row = row

    def model(self):
        return _Model(self.row)


@pytest.mark.parametrize("second, explained", [(9.2, True), (7.0, False)])
def test_the_tokens_row_judges_a_greedy_divergence_by_its_gap(monkeypatch, second, explained):
    """decode.tokens at temperature 0: the fast engine picked token 3 where the reference picked 7 (the reference's
    forward over the common prefix gives the row); the acceptance sequences agree."""
    case = checks.Case((1, 2), 105, 4, 3, (0.0, 20, 0.95))
    monkeypatch.setattr(checks, "reference_decode", lambda ref, c, p: ((4, 7, 9), ((4, 1),)))
    rows = checks.agreement(None, _Ref(logits(9.5, second)), case, GREEDY, [4, 3, 9], [(4, 1)], {0: 0.0}, TOL)
    tokens, acceptance = rows
    assert tokens.check == "decode.tokens" and tokens.passed is explained
    assert tokens.value == pytest.approx(9.5 - second) and tokens.tol == pytest.approx(2 * TOL * 10.0)
    assert "greedy picks 3 vs 7" in tokens.where
    assert acceptance.passed and acceptance.value == 0.0
