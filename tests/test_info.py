"""`iquest info`: parameter count from the layout, bytes per round, memory per rank; works on the
full-size config without materializing it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from iquest.cli.info_cmd import kv_read_bytes
from iquest.cli.main import main
from iquest.fast.memory import rank_bytes, rank_weight_bytes
from iquest.reference.checkpoint import CheckpointReader, tensor_specs
from iquest.reference.config import Config

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "fixtures" / "tiny"
FULL = ROOT / "configs" / "iquest-q1.json"


def info(capsys, *argv) -> dict:
    assert main(["info", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_tiny_counts_match_the_checkpoint(capsys):
    out = info(capsys, "--model", str(TINY), "--context", "100")
    reader = CheckpointReader(TINY)
    assert out["parameters"]["total"] == sum(numel(s.shape) for s in reader.specs.values())
    cfg = Config.from_dir(TINY)
    assert out["memory_per_rank"]["total"] == rank_bytes(cfg, 1, 100)
    assert out["memory_per_rank"]["weights"] == rank_weight_bytes(cfg, 1)
    r = out["round_bytes"]
    # tiny: 8 experts, top-2: 8 rows x top-2 = 16 >= 8, so the distinct bound is every expert
    assert r["distinct_experts_per_layer"] == 8 and r["experts_distinct"] == r["experts_all"]
    assert r["total_all_experts"] == r["dense"] + r["experts_all"] + r["kv"]
    # window 32: 4 sliding layers (3 main + MTP) read 32 positions, 1 full layer reads 100
    assert r["kv"] == 2 * (4 * 32 + 100) * cfg.num_key_value_heads * cfg.head_dim * 2


def test_full_config_is_never_materialized(capsys):
    out = info(capsys, "--config", str(FULL), "--tp", "8", "--context", "131072")
    cfg = Config.from_file(FULL)
    assert out["parameters"]["total"] == sum(numel(s.shape) for s in tensor_specs(cfg).values())
    assert 8e11 < out["parameters"]["total"] < 9e11
    assert out["parameters"]["active_per_token"] < out["parameters"]["total"] / 10
    r = out["round_bytes"]
    assert r["distinct_experts_per_layer"] == 64
    assert r["experts_distinct"] * 4 == r["experts_all"]  # 64 of 256 experts per layer
    assert r["total_distinct_experts"] < r["total_all_experts"]
    assert r["kv"] == kv_read_bytes(cfg, 8, 131072)
    assert out["memory_per_rank"]["total"] == rank_bytes(cfg, 8, 131072)
    # a longer context reads more KV only through the full layers
    short = kv_read_bytes(cfg, 8, 4096)
    assert kv_read_bytes(cfg, 8, 8192) - short == 2 * 4096 * 22 * 1 * 128 * 2


def test_table_output_and_errors(capsys):
    assert main(["info", "--model", str(TINY)]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "all experts" in out and "memory per rank" in out
    for argv, needle in ([["--model", str(TINY), "--tp", "3"], "tensor-parallel"],
                         [["--model", str(TINY), "--context", "0"], "--context"],
                         [["--config", "/no/such.json"], "no config file"]):
        assert main(["info", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err


def test_help_explains_each_flag(capsys):
    assert main(["info", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--config", "--tp", "--context", "--bandwidth", "--json"):
        assert flag in out


UNITS = {"tensors", "safetensors", "B", "KiB", "MiB", "GiB", "tokens", "main", "sliding", "full", "MTP", "dims",
         "heads", "KV", "routed", "thousand", "million", "billion", "verify", "distinct", "rows", "us", "ms", "s",
         "TB/s", "%"}


@pytest.mark.parametrize("argv", [["--model", str(TINY)], ["--config", str(FULL), "--tp", "8"]], ids=["tiny", "full"])
def test_every_figure_has_its_unit(capsys, argv):
    """Each number in the table is followed by what it counts or measures (or is a tp=N / top-N label)."""
    assert main(["info", *argv]) == 0
    bare = []
    for line in capsys.readouterr().out.splitlines()[1:]:  # the first line is the source path
        for m in re.finditer(r"(?<![\w.=-])\d+(?:\.\d+)?(?![\w.])(%|\s+([^\s,;:()|]+))?", line):
            if (m.group(1) or "").strip().rstrip(",;:)") not in UNITS:
                bare.append(f"{m.group(0)!r} in {line.strip()!r}")
    assert not bare, bare
