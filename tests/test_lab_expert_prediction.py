"""lab/expert_prediction.py: the expert-prediction probe reports every predictor at every k', its coverage is a
fraction that reaches 1 exactly when every expert is predicted, and its "actual experts" are the model's routing."""

from __future__ import annotations

import json

import pytest
import torch

from iquest.fast.torch_ops import TorchOps
from iquest.lab.expert_prediction import PREDICTORS, ROWS, block_stats, k_primes, merged, run, table
from iquest.reference.checkpoint import layer_prefix
from iquest.reference.model import ReferenceModel
from iquest.tests.helpers import MINI


@pytest.fixture(scope="module")
def probe():
    report, traces = run(MINI, 2, 6)
    return json.loads(json.dumps(report)), traces  # what the file holds


def test_every_predictor_and_k_prime_is_reported_as_a_fraction(probe):
    report, _ = probe
    E, K = report["experts"], report["top_k"]
    ks = [str(k) for k in k_primes(K, E)]
    assert report["k_prime"][0] == K and report["k_prime"][-1] == E
    assert report["positions"]["decoded"] == 2 * 6 and report["caveat"]
    assert "P4" in table(report)
    layers = list(report["layers"])
    fig = report["figures"]["all"]
    assert set(fig["coverage"]) == set(PREDICTORS) == set(fig["coverage_above_chance"])
    for name, cov in fig["coverage"].items():
        expected = [l for l in layers if name != "P2" or l != "0"] + ["mean"]
        assert set(cov) == set(expected), name
        for per in cov.values():
            assert set(per) == set(ks) and all(0.0 <= v <= 1.0 for v in per.values())
            assert per[str(E)] == 1.0  # every expert predicted: every needed expert covered, exactly
            assert per[str(K)] <= per[ks[1]] <= per[str(E)]  # a longer list never covers less
        for R in ROWS:
            for per in fig["live_rows"][name][str(R)].values():
                for k, v in per.items():
                    assert 0.0 <= v["warmed_fraction"] <= 1.0
                    assert K <= v["needed"] <= min(E, R * K) and int(k) <= v["warmed"] <= min(E, R * int(k))
                assert per[str(E)]["warmed_fraction"] == 1.0 and per[str(E)]["warmed"] == E


def test_actual_experts_are_the_models_own_routing(probe):
    """Recompute each MoE layer's route from the MLP input of a separate forward, with the fast engine's fp32 route."""
    report, traces = probe
    model = ReferenceModel.load(MINI)
    K = model.config.num_experts_per_tok
    for tr in traces:
        taps: dict = {}
        model.forward(torch.tensor(tr["tokens"]), torch.arange(len(tr["tokens"])), model.new_cache(), taps)
        assert sorted(tr["layers"]) == [int(i) for i in report["layers"]]
        for i, layer in tr["layers"].items():
            router = model.w[layer_prefix(i) + "mlp.router.weight"].float()
            _, experts, _ = TorchOps.route_on(taps[f"layer{i}.mlp_in"].float(), router, K)
            assert torch.equal(layer["actual"], experts), i
            assert torch.equal(layer["now"][:, :K], experts)  # the router's ranking starts with its choice


def test_temporal_coverage_matches_a_count_by_hand(probe):
    """P3 at k' = K is the overlap of consecutive positions' actual experts, pooled over positions t >= 1."""
    report, traces = probe
    K = report["top_k"]
    for i in report["layers"]:
        overlap, n = 0.0, 0
        for tr in traces:
            got = tr["layers"][int(i)]["actual"].tolist()
            overlap += sum(len(set(a) & set(b)) / K for a, b in zip(got, got[1:]))
            n += len(got) - 1
        assert report["figures"]["all"]["coverage"]["P3"][i][str(K)] == pytest.approx(overlap / n, abs=1e-12)


def test_merge_and_block_union_by_hand():
    assert merged(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[2, 3, 0, 1]])).tolist() == [[0, 2, 1, 3]]
    assert merged(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[0, 1, 2, 3]])).tolist() == [[0, 1, 2, 3]]
    # 4 positions, E = 4, K = 1: actual 0, 1, 1, 2; P1 ranks the actual expert second from position 1 on
    actual = torch.tensor([[0], [1], [1], [2]])
    now = torch.tensor([[0, 1, 2, 3], [1, 0, 2, 3], [1, 0, 2, 3], [2, 0, 1, 3]])
    p1 = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 1, 3]])
    st = block_stats({"now": now, "actual": actual, "P1": p1}, actual, rows=2, k=1, first=2)
    # one block, rows 2..3: needs {1, 2}; P1 warms {0}; P3 (rows 0..1) warms {0, 1}; P4 = P1 first: {0}
    assert st["needed"].tolist() == [2]
    assert st["P1"].tolist() == [[0], [1]] and st["P3"].tolist() == [[1], [2]] and st["P4"].tolist() == [[0], [1]]
    st = block_stats({"now": now, "actual": actual, "P1": p1}, actual, rows=1, k=2, first=1)
    assert st["needed"].tolist() == [1, 1, 1]
    assert st["P1"][0].tolist() == [1, 1, 1]  # P1's top-2 hold every actual expert
    assert st["P3"][0].tolist() == [1, 1, 0] and st["P3"][1].tolist() == [2, 2, 2]  # position 2's top-2 lack 2
