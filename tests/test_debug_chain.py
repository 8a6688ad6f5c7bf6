"""`iquest debug chain`: per recursive draft row, the error along the chain and the error the depth adds.

On the tiny preset in fp32 both stay at rounding level and the fast engine routes like the step reference. A
deliberately broken recursion (each depth >= 2 fed its previous output reversed, substituted as an engine part and
counted) is invisible to a check that starts from what the engine fed itself, but the step error starts from the
engine's recorded previous *output*, so it must expose it."""

from __future__ import annotations

import json
import math

import torch

from iquest.cli.main import main
from iquest.fast.model import FastModel
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, EngineParts, RankEngine
from iquest.qualify import tolerances
from iquest.qualify.chain import chain_rows, swap
from iquest.qualify.checks import Case
from iquest.qualify.replay import recording_parts
from iquest.tests.helpers import TINY

FP32_STEP = tolerances.value("numerics.hidden", "fp32")


class FlippedRecursion(FastModel):
    """Recursive draft rows (one row: depth >= 2) fed their previous output reversed; counts them."""

    fed: list[int] = []

    def draft(self, tokens, hidden, positions, live, taps=None):
        if tokens.shape[0] == 1:
            type(self).fed.append(int(positions[0]))
            hidden = hidden.flip(-1)
        return super().draft(tokens, hidden, positions, live, taps)


def _engine(parts: EngineParts = EngineParts()):
    return RankEngine(str(TINY), Parallel.single("cpu"), EngineOptions(max_context=256, dtype="fp32", graphs=False),
                      recording_parts(parts))


def _case():
    gen = torch.Generator().manual_seed(3)
    return Case(tuple(int(x) for x in torch.randint(2, 500, (20,), generator=gen)), 11, 5, 48)


def test_fp32_chain_and_step_stay_at_rounding_level():
    engine = _engine()
    rows = chain_rows(engine, str(TINY), _case(), 0)
    deep = [r for r in rows if r.depth >= 2]
    assert {r.depth for r in rows} >= {1, 2, 3, 4, 5}, "the case must reach depth 5"
    assert deep and all(not math.isnan(r.step_hidden) for r in deep)
    assert max(r.step_hidden for r in deep) < FP32_STEP
    assert max(r.chain_hidden for r in rows) < FP32_STEP
    k = engine.config.num_experts_per_tok
    assert all(r.experts_fast and len(r.experts_fast) == k for r in rows)
    assert not any(swap(r) for r in deep)
    assert all(r.margin > 0 for r in deep)


def test_a_perturbed_recursion_shows_in_the_step_error():
    FlippedRecursion.fed = []
    rows = chain_rows(_engine(EngineParts(model=FlippedRecursion)), str(TINY), _case(), 0)
    deep = [r for r in rows if r.depth >= 2]
    assert FlippedRecursion.fed, "the broken branch never ran"
    assert deep and min(r.step_hidden for r in deep) > 100 * FP32_STEP


def test_cli_prints_the_table(capsys):
    """--quick decodes qualify --quick's two requests (the full six are the same code with more cases)."""
    assert main(["debug", "chain", "--model", str(TINY), "--dtype", "fp32", "--quick", "--json"]) == 0
    out, err = capsys.readouterr()  # --json: the rows on stdout, the table on stderr
    assert "step hidden" in err and "worst chain hidden error" in err
    rows = json.loads(out)
    assert isinstance(rows, list) and {r["case"] for r in rows} == {0, 1}
    # the quick requests themselves: the long one drafts 3 a round and the wide one 7 (the full mode's first two: 7, 3)
    depth = {case: max(r["depth"] for r in rows if r["case"] == case) for case in (0, 1)}
    assert depth[0] <= 3 < depth[1], depth
