"""`iquest fit-depth`: the logistic fit recovers a known rule, the threshold search matches the engines'
stopping semantics, the written controller loads, and both engines make the same depth decisions with it."""

from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from iquest.cli.main import main
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine, Request
from iquest.fixtures import fit_depth as fd
from iquest.reference.depth import CONTROLLER_FILE, FEATURES, DraftFeatures, LogisticDepth, load_controller
from iquest.reference.model import ReferenceModel
from iquest.reference.sampling import SamplingParams
from iquest.reference.speculative import generate

from iquest.tests.helpers import TINY, mini_or_skip

PARAMS = SamplingParams()
HELD_OUT = ["textwrap.py", "json/decoder.py", "ast.py"]  # standard-library files every Python has


@pytest.fixture
def tiny_with_corpus(tmp_path) -> Path:
    """The tiny fixture with a corpus.json naming held-out standard-library files, as a trained model's folder has:
    what fit-depth, card and the round-cost measurement read their prompts from."""
    model = tmp_path / "tiny"
    shutil.copytree(TINY, model)
    (model / "corpus.json").write_text(json.dumps({"held_out": HELD_OUT}))
    return model


def synthetic_rounds(n: int, seed: int) -> list[fd.Round]:
    """Rounds with plausible features (served probabilities in (0, 1], entropies, running products)."""
    rng = np.random.default_rng(seed)
    rounds = []
    for i in range(n):
        q = rng.beta(2.0, 1.2, size=7).clip(1e-3, 1.0)
        ent = rng.uniform(0.0, 2.5, size=7)
        prod = np.cumprod(q)
        a = 0
        while a < 7 and rng.random() < q[a]:  # each draft accepted with its served probability
            a += 1
        rounds.append(fd.Round(i % 10, a, [DraftFeatures(d + 1, float(q[d]), float(ent[d]), float(prod[d]))
                                            for d in range(7)]))
    return rounds


def test_fit_recovers_a_known_logistic_rule():
    rng = np.random.default_rng(0)
    n = 40000
    X = np.column_stack([np.ones(n), np.log(rng.uniform(1e-3, 1, n)), np.log(rng.uniform(1e-2, 1, n)),
                         rng.uniform(0, 3, n), rng.integers(3, 7, n).astype(float)])
    assert X.shape[1] == len(FEATURES) and FEATURES[0] == "bias"
    w_true = np.array([0.8, 0.9, 0.4, -0.6, -0.15])
    y = (rng.random(n) < 1 / (1 + np.exp(-X @ w_true))).astype(float)
    w = fd.fit_logistic(X, y, l2=1.0)
    assert np.max(np.abs(w - w_true)) < 0.12, (w, w_true)
    assert np.array_equal(w, fd.fit_logistic(X, y, l2=1.0))  # deterministic
    # the penalty shrinks the non-bias weights, never the bias
    w_strong = fd.fit_logistic(X, y, l2=1e5)
    assert np.all(np.abs(w_strong[1:]) < 0.1 * np.abs(w_true[1:]))


def test_cost_model_is_the_line_through_perf_md():
    cost = fd.perf_cost_model()
    assert cost.points == {3: 4164.0, 5: 5980.0, 7: 7556.0}
    assert cost.base_us == pytest.approx(1660, abs=1) and cost.per_draft_us == pytest.approx(848, abs=1)
    assert all(abs(r) < 100 for r in cost.to_dict()["residuals_us"].values())
    assert "docs/perf-history.md" in cost.source


def test_threshold_search_uses_the_engines_stopping_rule():
    rounds = synthetic_rounds(600, 1)
    cost = fd.perf_cost_model()
    rule = fd.fit_rule(rounds, cost, l2=1.0)
    probs = fd.probabilities(rule, rounds)
    for t in (0.1, 0.3, rule.threshold, 0.7):
        r = LogisticDepth(rule.weights, t)
        assert np.array_equal(fd.policy_depths(r, rounds), fd._threshold_depths(probs, t))
    # the chosen threshold is at least as good (model-expected) as every fixed depth on the same rounds
    chosen = fd.summarize(rounds, fd.policy_depths(rule, rounds), cost, probs)["model_tpot_us"]
    for k in range(3, 8):
        assert chosen <= fd.summarize(rounds, np.full(len(rounds), k), cost, probs)["model_tpot_us"] + 1e-9
    # acceptance falls with the running product here, so the rule must have learned a positive weight
    assert rule.weights["log_running_product"] > 0
    cv = fd.cross_validate(rounds, cost, 1.0, 4)
    assert set(cv["policies"]) == {"fixed 3", "fixed 4", "fixed 5", "fixed 6", "fixed 7", "default rule", "fitted rule"}


def test_cli_writes_a_controller_that_loads(tmp_path, capsys, tiny_with_corpus):
    out = tmp_path / "model" / CONTROLLER_FILE
    out.parent.mkdir()
    code = main(["fit-depth", "--model", str(tiny_with_corpus), "--prompts", "4", "--tokens", "12", "--folds", "2",
                 "--out", str(out)])
    text, err = capsys.readouterr()
    assert code == 0, err
    assert "| fitted rule |" in text and "| fixed 7 |" in text and "| default rule |" in text
    raw = json.loads(out.read_text())
    rule = load_controller(out.parent)
    assert rule == LogisticDepth.from_file(out)
    assert rule.weights == raw["weights"] and rule.threshold == raw["threshold"] and set(rule.weights) == set(FEATURES)
    fit = raw["fit"]
    assert fit["data"]["rounds"] > 0 and len(fit["replay"]["prompts"]) == 4
    assert fit["cost_model"]["source"].startswith("docs/perf-history.md")


def test_shipped_controller_loads():
    mini = mini_or_skip()
    raw = json.loads((mini / CONTROLLER_FILE).read_text())
    rule = load_controller(mini)
    assert rule.weights == raw["weights"] and rule.threshold == raw["threshold"]
    assert "cross_validation" in raw["fit"]


# ---- both engines, same decisions -------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _reference(model_dir: Path) -> ReferenceModel:
    return ReferenceModel.load(model_dir)


def _rounds_until_divergence(model_dir: Path, prompts, n: int) -> list[tuple[list[int], list[int]]]:
    """Per prompt: the `drafts` of each round, reference and fast, over the rounds before the first round
    whose tokens differ (a round's depth decisions are made before its verification)."""
    engine = RankEngine(model_dir, Parallel.single(), EngineOptions(max_context=512, dtype="fp32"))
    controller = load_controller(model_dir)
    out = []
    for i, prompt in enumerate(prompts):
        seed = 2000 + i
        ref = list(generate(_reference(model_dir), prompt, seed=seed, params=PARAMS, max_new_tokens=n,
                            drafts="auto", controller=controller))
        fast = list(engine.decode(Request(tuple(prompt), seed, PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, n,
                                          "auto", ())))
        same = 0
        while same < min(len(ref), len(fast)) and ref[same].tokens == fast[same].tokens:
            same += 1
        # the diverging round itself was drafted from an identical state: its depth must agree too
        upto = min(same + 1, len(ref), len(fast))
        out.append(([s.drafts for s in ref[:upto]], [s.drafts for s in fast[:upto]]))
    return out


def test_engines_make_the_same_depth_decisions_tiny(tmp_path):
    model = tmp_path / "tiny"
    shutil.copytree(TINY, model)
    # A rule over every feature, tuned so the tiny random model's drafts land on both sides of it.
    rule = LogisticDepth({"bias": 4.2, "log_served_prob": 1.0, "log_running_product": 0.1, "entropy": -0.5,
                          "depth": 0.2}, 0.5)
    (model / CONTROLLER_FILE).write_text(json.dumps(rule.to_dict()))
    assert load_controller(model) == rule
    prompts = [list(range(3, 23)), [7, 100, 200, 300, 11, 5, 77, 91, 402, 33] * 3]
    seen, compared = set(), 0
    for ref, fast in _rounds_until_divergence(model, prompts, 32):
        assert ref == fast
        seen |= set(ref[1:])
        compared += len(ref) - 1
    assert compared >= 20, f"only {compared} rounds compared before the engines diverged"
    assert len(seen) >= 2, f"the test rule should give varied depths on the tiny model, got {seen}"


def test_engines_make_the_same_depth_decisions_with_the_shipped_rule():
    from tokenizers import Tokenizer

    mini = mini_or_skip()
    tok = Tokenizer.from_file(str(mini / "tokenizer.json"))
    # codec-table and codec-method text: the mini model drafts these well, so the rule goes past depth 3
    texts = ["    '\\x00'     #  0x00 -> NULL\n    '\\x01'     #  0x01 -> START OF HEADING\n"
             "    '\\x02'     #  0x02 -> START OF TEXT\n    '\\x03'     #  0x03 -> END OF TEXT\n",
             "    def encode(self, input, errors='strict'):\n        return codecs.charmap_encode(input, errors, "
             "encoding_table)\n\n    def decode(self, input, errors='strict'):\n"]
    seen = set()
    for ref, fast in _rounds_until_divergence(mini, [tok.encode(t).ids for t in texts], 32):
        assert ref == fast
        seen |= set(ref[1:])
    assert {3, 7} <= seen and len(seen) >= 3, f"the shipped rule should give varied depths here, got {seen}"


# ---- the card and the round costs on the published architecture ------------------------------------------------
def test_card_figures_on_the_published_architecture(tiny_with_corpus):
    """`iquest card`'s figures: the draft's held-out loss from rows at h_p + x_{p+1} (predicting x_{p+2}), acceptance
    per depth, distinct experts of the MoE layers only (layer 0 is dense)."""
    from iquest.fixtures.card import held_out_loss, make_card, render_markdown

    card = make_card(tiny_with_corpus, prompts=2, tokens=8, loss_tokens=300)
    loss = card["held_out_loss"]
    model = _reference(tiny_with_corpus)
    assert 0 < loss["main"] < 20 and 0 < loss["mtp"] < 20 and loss["tokens"] > 0
    # the MTP loss is the draft's cross-entropy at the documented pairing, computed here row by row
    ids = [int(t) for t in torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))]
    x, cache = torch.tensor(ids[:-1]), model.new_cache()
    _, hidden = model.forward(x, torch.arange(len(x)), cache)
    want = sum(float(torch.nn.functional.cross_entropy(
        model.draft(x[p + 1:p + 2], hidden[p:p + 1], torch.tensor([p]), cache)[0], torch.tensor([ids[p + 2]])))
        for p in range(len(x) - 1)) / (len(x) - 1)
    assert held_out_loss(model, ids)["mtp"] == pytest.approx(want, rel=1e-9)
    moe = [i for i in range(model.config.num_hidden_layers) if not model.config.is_dense(i)]
    assert len(card["distinct_experts_6_rows"]["real_text"]) == len(moe) == 3
    assert all(1 <= v <= 8 for v in card["distinct_experts_6_rows"]["real_text"])
    for depth in (3, 5, 7):
        assert card[f"fixed_depth_{depth}"]["rounds"] > 0
    assert "by MoE layer" in render_markdown(card, "iquest card")


def test_round_costs_are_measured_with_the_fast_engine(tiny_with_corpus):
    from iquest.fast.depth_policy import depth_policy, round_costs as read_costs
    from iquest.fixtures import round_costs

    entry = round_costs.measure(tiny_with_corpus, "cpu", prompts=2, tokens=8)
    assert entry["plain"] > 0 and entry["auto"] > 0 and entry["tokens"]["plain"] > 0 and entry["prompts"] == 2
    round_costs.write(tiny_with_corpus, "cpu", entry)
    costs = read_costs(tiny_with_corpus, "cpu")
    assert costs["plain_us_per_token"] > 0 and costs["auto_us_per_token"] > 0
    assert depth_policy("auto", tiny_with_corpus, "cpu").drafts in (0, "auto")
