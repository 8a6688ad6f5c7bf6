"""`iquest bench depth` (bench/depth.py): a short paired run on the mini model on CPU (every arm on every unit, the
same prompt and seed in each, the order rotated; A and A' emit the same tokens and every arm the same first token,
which a fresh engine reproduces), the statistics on made-up units, and one-line errors for bad flags."""

from __future__ import annotations

import json

import pytest

from iquest.bench.depth import arms, best_fixed, order, ratio_stats, sign_test, verdict
from iquest.cli.main import main
from iquest.tests.helpers import MINI


def test_the_order_rotates_and_every_arm_runs_once_a_unit():
    assert [order(u, 3) for u in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert [a["arm"] for a in arms(4)] == ["A", "auto", "A'"] and arms(4)[0]["drafts"] == arms(4)[2]["drafts"] == 4


def test_the_fixed_depth_comes_from_the_fit():
    assert best_fixed(MINI)[0] == int(json.loads((MINI / "depth_controller.json").read_text())
                                      ["fit"]["cross_validation"]["best_fixed"].split()[-1])
    assert best_fixed(MINI.parent / "tiny")[0] == 3  # no fit beside it: the fallback


def _unit(a: tuple[float, int], b: tuple[float, int]) -> dict:
    return {"arms": {"x": {"seconds": a[0], "tokens": a[1]}, "y": {"seconds": b[0], "tokens": b[1]}}}


def test_the_statistics_on_made_up_units():
    assert sign_test(0, 0) == 1.0 and sign_test(5, 5) == 1.0 and sign_test(0, 6) == pytest.approx(2 / 64)
    same = [_unit((1.0 + 0.01 * i, 10), (1.0 + 0.01 * i, 10)) for i in range(8)]
    s = ratio_stats(same, "x", "y")
    assert s["ratio"] == pytest.approx(1) and s["ci95"] == pytest.approx([1, 1]) and s["faster"] == s["slower"] == 0
    fast = [_unit((0.8, 10), (1.0, 10)) for _ in range(8)] + [_unit((0.0, 0), (1.0, 10))]  # last: nothing decoded
    g = ratio_stats(fast, "x", "y")
    assert g["ratio"] == g["pooled_ratio"] == pytest.approx(0.8) and g["ci95"] == pytest.approx([0.8, 0.8])
    assert g["faster"] == 8 and g["units"] == 8 and g["units_left_out"] == 1
    burst = ratio_stats([*fast[:8], _unit((30.0, 10), (1.0, 10))], "x", "y")  # another process's burst hits one unit
    assert burst["ratio"] == pytest.approx(0.8) and burst["pooled_ratio"] > 4  # the median stands, the pooled does not
    assert verdict(g, s)["beyond_noise"] and not verdict(s, s)["beyond_noise"]
    noisy = {**s, "ci95": [0.7, 1.3]}
    assert not verdict(g, noisy)["beyond_noise"]  # a 20% gain inside a 30% noise floor counts for nothing
    with pytest.raises(ValueError, match="no unit"):
        ratio_stats([_unit((0.0, 0), (1.0, 3))], "x", "y")


def test_a_short_paired_run_on_the_mini_model(tmp_path, capsys, monkeypatch):
    out = tmp_path / "depth.json"
    argv = ["bench", "depth", "--model", str(MINI), "--device", "cpu", "--prompts", "2", "--tokens", "6",
            "--repeats", "2", "--seed", "5", "--out", str(out)]
    monkeypatch.setattr("sys.argv", ["iquest", *argv])
    assert main(argv) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "depth" and r["commit"] and r["machine"]["cpus"]
    assert len(r["machine"]["load_average_1_5_15_min"]["end"]) == 3  # what else loaded the machine: noise to read
    assert r["command"].startswith("iquest bench depth")
    assert r["device"] == "cpu" and r["fixed"] == best_fixed(MINI)[0] and any("not the target" in n for n in r["notes"])
    assert [a["arm"] for a in r["arms"]] == ["A", "auto", "A'"] and set(r["per_arm"]) == {"A", "auto", "A'"}
    fitted = set(json.loads((MINI / "depth_controller.json").read_text())["fit"]["replay"]["prompts"])
    assert not fitted & {u["source"] for u in r["units"]} and len({u["source"] for u in r["units"]}) == 2
    assert [(u["repeat"], u["prompt"], u["seed"]) for u in r["units"]] == [(0, 0, 5), (0, 1, 6), (1, 0, 7), (1, 1, 8)]
    assert [u["order"][0] for u in r["units"]] == ["A", "auto", "A'", "A"]  # rotated per unit
    for u in r["units"]:
        a, auto, a2 = (u["arms"][k] for k in ("A", "auto", "A'"))
        assert a["ids"] == a2["ids"]  # same mode, same seed: the same tokens, so A'/A is timing alone
        assert a["first"] == auto["first"] == a2["first"]  # one post-prefill state: the same first token, bit for bit
        for v in (a, auto, a2):
            assert v["tokens"] == len(v["ids"]) - 1 and v["seconds"] > 0 and (v["rounds"] >= 1) == (v["tokens"] > 0)
            assert 1 <= len(v["ids"]) <= 6  # tokens past the budget are dropped (docs/round.md)
        assert a["drafts"] == 3 * a["rounds"] and 3 * auto["rounds"] <= auto["drafts"] <= 7 * auto["rounds"]
    assert r["checks"]["same_first_token_all_arms"] and r["checks"]["a_equals_a_prime_tokens"]
    for key in ("auto_over_A", "A_prime_over_A"):
        g = r[key]
        assert g["ci95"][0] <= g["ratio"] <= g["ci95"][1] and g["units"] + g["units_left_out"] == 4
        assert g["pooled_ci95"][0] <= g["pooled_ratio"] <= g["pooled_ci95"][1]
    out_text = capsys.readouterr()
    assert "auto/A:" in out_text.out and "A'/A:" in out_text.out and "noise floor" in out_text.out
    assert out_text.err.count("repeat ") == 4

    # the pairing is on prompt and seed: a fresh engine given a unit's prompt and seed emits what the run recorded
    from tokenizers import Tokenizer

    from iquest.fast.engine import FastEngine
    from iquest.bench.depth import held_out
    from iquest.reference.sampling import SamplingParams

    prompts, passed_over = held_out(MINI, Tokenizer.from_file(str(MINI / "tokenizer.json")), 2)
    assert passed_over == len(fitted) and r["prompts_passed_over"].startswith(f"{passed_over} ")
    prompt = prompts[1][2]
    engine = FastEngine.load(MINI, device="cpu")
    try:
        gen = engine.generation
        params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)
        for arm, drafts in (("A", r["fixed"]), ("auto", "auto")):
            ids = [t for s in engine.generate(prompt, seed=8, params=params, max_new_tokens=6, drafts=drafts,
                                              stop_ids=tuple(gen.eos_token_id)) for t in s.tokens]
            assert ids == r["units"][3]["arms"][arm]["ids"], arm
    finally:
        engine.close()


@pytest.mark.parametrize("argv,needle", [
    (["--fixed", "2"], "--fixed"),
    (["--fixed", "8"], "--fixed"),
    (["--prompts", "0"], "--prompts"),
    (["--tokens", "0"], "--tokens"),
    (["--repeats", "0"], "--repeats"),
    (["--seed", "-1"], "--seed"),
    (["--model", "/no/such/model"], "does not exist"),
    (["--model", str(MINI.parent / "tiny")], "corpus.json"),
])
def test_bad_flags_are_one_line_errors(capsys, argv, needle):
    assert main(["bench", "depth", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err
