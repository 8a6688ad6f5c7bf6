"""`iquest bench context`: the round across context lengths against the added KV's floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iquest.bench.context_sweep import growth
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
