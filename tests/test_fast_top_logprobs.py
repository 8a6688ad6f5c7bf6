"""The fast engine's logprobs and top alternatives per token (generate(top_logprobs=N), for the server's logprobs):
the model's own log-probabilities at the token's position (log-softmax of the raw logits, docs/round.md), against the
float64 reference's, at any temperature."""

from __future__ import annotations

import math

import pytest

from iquest.cli.engines import ReferenceEngine
from iquest.fast.engine import FastEngine
from iquest.fast.rank import EngineOptions
from iquest.reference.sampling import SamplingParams
from iquest.tests.helpers import PARAMS, PROMPTS, TINY


@pytest.fixture(scope="module")
def engines():
    fast = FastEngine.load(TINY, device="cpu", options=EngineOptions(max_context=256, dtype="fp32"))
    yield fast, ReferenceEngine(TINY)
    fast.close()


@pytest.mark.parametrize("drafts", [0, 3, "auto"])
def test_alternatives_match_the_reference_and_hold_the_chosen_token(engines, drafts):
    fast, ref = engines
    kw = dict(seed=11, params=PARAMS, max_new_tokens=14, drafts=drafts, stop_ids=(), top_logprobs=5)
    got, want = list(fast.generate(PROMPTS[0], **kw)), list(ref.generate(PROMPTS[0], **kw))
    tokens = [t for s in got for t in s.tokens]
    assert tokens == [t for s in want for t in s.tokens]  # fp32 on this fixture: the engines agree here
    tops = [row for s in got for row in s.top_logprobs]
    ref_tops = [row for s in want for row in s.top_logprobs]
    assert len(tops) == len(tokens)
    for token, lp, row, ref_row in zip(tokens, [lp for s in got for lp in s.logprobs], tops, ref_tops):
        assert len(row) == 5 and [t for t, _ in row] == [t for t, _ in ref_row]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(row, ref_row))
        assert all(x >= y for (_, x), (_, y) in zip(row, row[1:]))  # most likely first
        if token in dict(row):  # the token's own logprob is the one its alternatives list gives it
            assert math.isclose(dict(row)[token], lp, abs_tol=1e-6)


def test_no_alternatives_unless_asked_and_a_bound(engines):
    fast, _ = engines
    steps = list(fast.generate(PROMPTS[1], seed=2, params=PARAMS, max_new_tokens=6, drafts=3))
    assert all(s.top_logprobs is None for s in steps)
    with pytest.raises(ValueError, match="top_logprobs"):
        list(fast.generate(PROMPTS[1], seed=2, params=PARAMS, max_new_tokens=6, drafts=3, top_logprobs=21))


@pytest.mark.parametrize("drafts", [0, 3])
def test_greedy_logprobs_are_the_models_not_zero(engines, drafts):
    """At temperature 0 the sampling distribution is one-hot (log p = 0): the reported logprobs are the model's, with
    all 5 alternatives, as the reference computes them in float64."""
    fast, ref = engines
    kw = dict(seed=3, params=SamplingParams(temperature=0.0), max_new_tokens=10, drafts=drafts, stop_ids=(),
              top_logprobs=5)
    got, want = list(fast.generate(PROMPTS[2], **kw)), list(ref.generate(PROMPTS[2], **kw))
    assert [t for s in got for t in s.tokens] == [t for s in want for t in s.tokens]
    lps, ref_lps = [lp for s in got for lp in s.logprobs], [lp for s in want for lp in s.logprobs]
    assert all(lp < 0 for lp in lps) and all(abs(a - b) < 1e-4 for a, b in zip(lps, ref_lps))
    for s in got:
        for token, lp, row in zip(s.tokens, s.logprobs, s.top_logprobs):
            assert len(row) == 5 and row[0][0] == token  # greedy: the most likely token is the one emitted
            assert math.isclose(row[0][1], lp, abs_tol=1e-6)
            assert sum(math.exp(v) for _, v in row) < 1  # probabilities of the whole vocabulary, not of the top 5
