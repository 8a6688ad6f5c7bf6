"""`iquest bench step --config FILE --tp N`: real tensor parallelism over processes (gloo on CPU here)."""

from __future__ import annotations

import json
from pathlib import Path

from iquest.bench.allreduce import round_allreduces
from iquest.cli.main import main
from iquest.reference.config import Config

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"


def test_tp2_round_runs_in_lockstep_and_counts_its_collectives(tmp_path, capsys):
    out = tmp_path / "tp.json"
    rc = main(["bench", "step", "--config", str(TINY / "config.json"), "--tp", "2", "--device", "cpu",
               "--repeats", "2", "--context", "40", "--chunk-tokens", "6", "--drafts", "5", "--out", str(out)])
    assert rc == 0
    assert "real collectives" in capsys.readouterr().out
    r = json.loads(out.read_text())
    s = r["summary"]
    assert r["tp"] == 2 and r["backend"] == "gloo" and len(r["runs"]) == 2
    assert s["ranks_emitted_same_tokens"] and s["median_round_us"] > 0
    # Random weights: drafts are rejected, so every round is one verify pass plus a full depth-5 redraft; the
    # counted all-reduces must match the formula the all-reduce benchmark uses for its per-round estimate.
    assert s["tokens_per_round"] == 1.0
    assert s["collectives_per_round"]["all_reduce"] == round_allreduces(Config.from_dir(TINY), drafts=5)
    assert s["collectives_per_round"]["all_gather_last"] == 1 + 5  # sampling candidates: verify + each depth


def test_tp_rejects_one_rank_and_several_variants(capsys):
    base = ["bench", "step", "--config", str(TINY / "config.json"), "--device", "cpu"]
    assert main(base + ["--tp", "1"]) != 0
    assert main(base + ["--tp", "2", "--kernels", "torch,triton"]) != 0
    err = capsys.readouterr().err
    assert "--tp needs at least 2 ranks" in err and "one kernel variant" in err
