"""`iquest bench context`: the round across context lengths against the added KV's floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iquest.bench.context_sweep import growth, routing_moved
from iquest.cli.main import main

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"


def test_growth_by_hand():
    rows = [{"context": 1024, "median_round_us": 9200.0, "upper_bytes": 20e9, "bandwidth_bytes_per_s": 4e12,
             "floor_us": 5000.0},
            {"context": 196480, "median_round_us": 10681.0, "upper_bytes": 20e9 + 2.26e9,
             "bandwidth_bytes_per_s": 4e12, "floor_us": 5570.0}]
    g = growth(rows)
    assert g[0]["round_growth"] == 0 and g[0]["added_kv_floor_us"] == 0 and g[0]["added_cost_per_floor"] is None
    assert g[1]["round_growth"] == pytest.approx(1481 / 9200)
    assert g[1]["added_kv_floor_us"] == pytest.approx(565.0)       # 2.26 GB more at 4 TB/s
    assert g[1]["floor_growth"] == pytest.approx(565.0 / 5000)
    assert g[1]["added_cost_per_floor"] == pytest.approx(1481 / 565)


def test_growth_takes_one_rate_the_fastest():
    """A row whose own copy measured slow must not inflate its added floor: every row's added bytes at the sweep's
    fastest rate. At 9c6eda1 the 512K row measured 2.84 TB/s against 3.02 at 1K, which put the ratio at 1.28x; at one
    rate it is 1.36x."""
    rows = [{"context": 1024, "median_round_us": 5451.2, "upper_bytes": 9147553024, "bandwidth_bytes_per_s": 3.018e12,
             "floor_us": 1263.6},
            {"context": 524160, "median_round_us": 8522.2, "upper_bytes": 15942784256,
             "bandwidth_bytes_per_s": 2.8376e12, "floor_us": 4046.5}]
    g = growth(rows)
    assert g[1]["floor_rate_bytes_per_s"] == 3.018e12
    assert g[1]["added_kv_floor_us"] == pytest.approx((15942784256 - 9147553024) / 3.018e12 * 1e6)
    assert g[1]["added_cost_per_floor"] == pytest.approx(1.3638, abs=1e-3)
    rows[1]["bandwidth_bytes_per_s"] = None  # a row without a rate: no ratio rather than one at a mixed rate
    assert all("added_cost_per_floor" not in r for r in growth(rows))


def test_rescore_prints_and_writes(tmp_path, capsys):
    saved = tmp_path / "saved.json"
    rows = [{"context": c, "median_round_us": t, "upper_bytes": b, "bandwidth_bytes_per_s": bw, "floor_us": f,
             "distinct_experts_verify_mean": 13.0, "device": "cpu"}
            for c, t, b, bw, f in ((1024, 100.0, 1e9, 2e12, 500.0), (4096, 110.0, 1.01e9, 1e12, 510.0))]
    saved.write_text(json.dumps({"config": "c", "tp_slice": 8, "drafts": 5, "kernels": "triton", "repeats": 5,
                                 "commit": "abc", "rows": rows}))
    out = tmp_path / "rescored.json"
    assert main(["bench", "context", "--rescore", str(saved), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "the added KV cost 2.00x its bytes" in text  # 10 us over 1e7 bytes at 2e12 B/s, not 1e12
    assert "the routing moved" not in text  # 13.0 distinct experts at both lengths
    r = json.loads(out.read_text())
    assert r["rescored_from"] == str(saved) and r["rows"][1]["added_kv_floor_us"] == pytest.approx(5.0)
    assert out.with_suffix(".png").stat().st_size > 1000
    saved.write_text("{}")
    assert main(["bench", "context", "--rescore", str(saved)]) == 2
    err = capsys.readouterr().err
    assert "--rescore" in err and "Traceback" not in err


def test_cpu_sweep_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "ctx.json"
    assert main(["bench", "context", "--config", str(TINY / "config.json"), "--tp-slice", "2", "--contexts", "48,96",
                 "--repeats", "1", "--chunk-tokens", "6", "--device", "cpu", "--kernels", "torch",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "[1/2] context 48" in text and "[2/2] context 96" in text
    r = json.loads(out.read_text())
    assert [g["context"] for g in r["rows"]] == [48, 96] and all(g["median_round_us"] > 0 for g in r["rows"])
    assert r["history"] == "synthetic" and out.with_suffix(".png").stat().st_size > 1000


@pytest.mark.parametrize("contexts", ["1024", "4096,1024", "1k,2k", "0,8"])
def test_bad_contexts_are_one_line_errors(contexts, capsys):
    assert main(["bench", "context", "--contexts", contexts, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "--contexts" in err and "Traceback" not in err


def test_a_moved_routing_is_said():
    """3d54963's H200 sweep: 13.9 distinct experts a main layer at 1K, 19.5 at 512K; within 5% is the same routing."""
    rows = [{"distinct_experts_verify_mean": 13.9}, {"distinct_experts_verify_mean": 16.0},
            {"distinct_experts_verify_mean": 19.5}]
    assert routing_moved(rows) == (13.9, 19.5)
    rows[-1]["distinct_experts_verify_mean"] = 14.5
    assert routing_moved(rows) is None
    rows[-1]["distinct_experts_verify_mean"] = None  # a saved sweep without the column
    assert routing_moved(rows) is None


def test_rescore_of_a_moved_routing_says_so(tmp_path, capsys):
    saved = tmp_path / "saved.json"
    rows = [{"context": c, "median_round_us": t, "upper_bytes": b, "bandwidth_bytes_per_s": 2e12, "floor_us": f,
             "distinct_experts_verify_mean": e, "device": "cpu"}
            for c, t, b, f, e in ((1024, 100.0, 1e9, 500.0, 13.9), (524160, 110.0, 1.01e9, 510.0, 19.5))]
    saved.write_text(json.dumps({"config": "c", "tp_slice": 8, "drafts": 5, "kernels": "triton", "repeats": 5,
                                 "commit": "abc", "rows": rows}))
    assert main(["bench", "context", "--rescore", str(saved)]) == 0
    assert "the routing moved with the history (13.9 -> 19.5 distinct experts" in capsys.readouterr().out


def test_a_bad_config_is_refused_before_any_length(capsys):
    assert main(["bench", "context", "--config", "/no/such/config.json", "--contexts", "48,96", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert "no config file" in captured.err and "Traceback" not in captured.err
    assert "[1/2]" not in captured.out  # no progress line for a sweep that cannot start
