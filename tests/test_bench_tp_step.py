"""`iquest bench step --config FILE --tp N`: real tensor parallelism over processes (gloo on CPU here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from iquest.bench.allreduce import round_allreduces
from iquest.cli.main import main
from iquest.reference.config import Config

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"
TINY8 = TINY.parent / "tiny-tp8"


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
    # At a fixed depth every round is one verify pass plus a full depth-5 redraft, whatever was accepted (random
    # weights accept a draft now and then); the counted all-reduces must match the formula the all-reduce benchmark
    # uses for its per-round estimate.
    assert 1.0 <= s["tokens_per_round"] <= 6.0
    assert s["collectives_per_round"]["all_reduce"] == round_allreduces(Config.from_dir(TINY), drafts=5)
    # sampling candidates (verify + each depth), and the model's logprobs of the verification rows
    assert s["collectives_per_round"]["all_gather_last"] == 1 + 5 + 1
    # TPOT on the mini model's profile: the round divided by the card's tokens per round at depth 5 (where the default
    # model has a card: bench/acceptance.py).
    p = s["tpot_mini_profile"]
    if p is not None:
        assert p["tokens_per_round"] > 1.0 and abs(p["tpot_us"] * p["tokens_per_round"] - s["median_round_us"]) < 1e-6


def test_tp_rejects_one_rank_and_several_variants(capsys):
    base = ["bench", "step", "--config", str(TINY / "config.json"), "--device", "cpu"]
    assert main(base + ["--tp", "1"]) != 0
    assert main(base + ["--tp", "2", "--kernels", "torch,triton"]) != 0
    assert main(base + ["--tp-slice", "4", "--ranks", "5"]) != 0
    err = capsys.readouterr().err
    assert "--tp needs at least 2 ranks" in err and "one kernel variant" in err and "--ranks must be in 2..4" in err


def test_two_ranks_of_a_wider_layout(tmp_path, capsys):
    """Ranks 0 and 1 of the TP8 layout as two processes: TP8 slices, collectives between the two, lockstep."""
    out = tmp_path / "tp.json"
    rc = main(["bench", "step", "--config", str(TINY8 / "config.json"), "--tp-slice", "8", "--ranks", "2",
               "--device", "cpu", "--repeats", "1", "--context", "40", "--chunk-tokens", "4", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ranks 0..1 of the tp=8 layout" in text and "tiles 2 parts to 8" in text
    r = json.loads(out.read_text())
    assert r["tp"] == 8 and r["ranks"] == 2 and r["partial"]
    s = r["summary"]
    assert s["ranks_emitted_same_tokens"] and s["tokens_per_round"] == 1.0
    # The same collectives as a full TP8 round (drafts default to 5), each among the two processes.
    assert s["collectives_per_round"]["all_reduce"] == round_allreduces(Config.from_dir(TINY8), drafts=5)


@pytest.mark.gpu
def test_two_gpu_ranks_with_nccl(tmp_path):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    out = tmp_path / "tp.json"
    assert main(["bench", "step", "--config", str(TINY8 / "config.json"), "--tp-slice", "8", "--ranks", "2",
                 "--device", "cuda", "--repeats", "2", "--context", "40", "--chunk-tokens", "6", "--kernels", "triton",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["backend"].startswith("peer-memory") and r["summary"]["ranks_emitted_same_tokens"]


def test_real_collective_flags_need_a_config_and_repeats(capsys):
    assert main(["bench", "step", "--tp", "2"]) != 0
    assert main(["bench", "step", "--config", str(TINY / "config.json"), "--tp", "2", "--repeats", "0"]) != 0
    err = capsys.readouterr().err
    assert "need --config" in err and "--repeats must be at least 1" in err


def test_the_counter_counts_all_reduces_ending_in_a_tail():
    """With peer collectives the layer's reductions go to the peers directly (fast/triton_ops.py reduce_add_norm): the
    counter counts them as all-reduces, and leaves the peers as they were."""
    import torch

    from iquest.bench.tp_step import CollectiveCounter
    from iquest.fast.parallel import Parallel

    class Peers:
        def all_reduce_add_norm(self, *args):
            return args

    peers = Peers()
    par = Parallel(0, 2, torch.device("cpu"), peers=peers)
    with CollectiveCounter(par) as counter:
        par.peers.all_reduce_add_norm(1, 2)
        par.peers.all_reduce_add_norm(3)
    assert counter.calls["all_reduce"] == 2
    assert "all_reduce_add_norm" not in vars(peers) and peers.all_reduce_add_norm(5) == (5,)
