"""lab/greedy_margins.py: the reference's greedy continuation of qualification's greedy request, with each position's
gap between its two largest logits over the bound that decode.tokens and decode.acceptance judge a greedy flip by."""

from __future__ import annotations

import pytest

from iquest.lab import greedy_margins as gm
from iquest.qualify.checks import RefSpec
from iquest.qualify.run import qualify_cases
from iquest.reference.speculative import generate
from iquest.reference.sampling import SamplingParams
from iquest.tests.helpers import MINI


def test_the_rows_follow_the_references_greedy_decode_and_state_each_ratio():
    r = gm.margins(str(MINI), 6)
    assert r["tol_rel"] == 0.08 and r["seed"] == 105 and len(r["rows"]) == 6
    ref = RefSpec(str(MINI)).model()
    case = next(c for c in qualify_cases(ref.config.vocab_size, False, 0)[0] if c.seed == 105)
    steps = list(generate(ref, list(case.prompt), seed=case.seed, params=SamplingParams(0.0, 20, 0.95),
                          max_new_tokens=6, drafts=0))
    emitted = [t for s in steps for t in s.tokens][:6]
    assert [row["argmax"] for row in r["rows"]] == emitted
    for row in r["rows"]:
        assert row["gap"] > 0 and row["argmax"] != row["runner_up"]
        assert row["ratio"] == pytest.approx(row["gap"] / (2 * 0.08 * row["scale"]))
    assert r["flips_explained_at"] == [row["position"] for row in r["rows"] if row["ratio"] <= 1]


def test_the_command_refuses_no_positions():
    with pytest.raises(SystemExit):
        gm.main(["--tokens", "0"])
