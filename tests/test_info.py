"""`iquest info`: parameter count from the layout, bytes per round, memory per rank; works on the
full-size config without materializing it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from iquest.cli.info_cmd import kv_read_bytes
from iquest.cli.main import main
from iquest.fast.memory import rank_bytes, rank_tensor_bytes, rank_weight_bytes
from iquest.reference.checkpoint import CheckpointReader, tensor_specs
from iquest.reference.config import Config
from iquest.tests.helpers import TINY, fixture_dir

ROOT = Path(__file__).resolve().parent.parent
FULL = ROOT / "configs" / "iquest-q1.json"
FULL_DRAFT = ROOT / "configs" / "iquest-q1-mtp.json"


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
    cfg = Config.from_dir(TINY)
    assert out["parameters"]["total"] == sum(numel(s.shape) for s in reader.specs.values())
    assert out["parameters"]["draft"] == sum(numel(s.shape) for n, s in reader.specs.items() if n.startswith("mtp/"))
    c = out["config"]
    assert (c["full_layers"], c["sliding_layers"], c["dense_layers"], c["moe_layers"]) == (2, 2, [0], 3)
    assert (c["num_experts"], c["intermediate_size"], c["dense_intermediate_size"], c["rotary_dim"]) == (8, 32, 96, 8)
    assert c["draft_window"] == 16 and c["checkpoint_weights"] == "fp8"
    assert out["weights"] == {"format": "fp8", "quantized_at_load": False,
                              "description": "fp8 (E4M3, 16x16 blocks, as stored)"}
    assert out["memory_per_rank"]["total"] == rank_bytes(cfg, 1, 100)
    assert out["memory_per_rank"]["weights"] == rank_weight_bytes(cfg, 1)
    r = out["round_bytes"]
    # tiny: 8 experts, top-2: 8 rows x top-2 = 16 >= 8, so the distinct bound is every expert of the target's 3 MoE
    # layers and of the draft's depth-0 pass; its 6 single-row passes read top-2 experts each
    assert r["distinct_experts_per_layer"] == 8 and r["target"]["experts_distinct"] == r["target"]["experts_all"]
    tb = rank_tensor_bytes(cfg, 1)
    one_draft_expert = sum(b for n, b in tb.items() if n.startswith("mtp/") and ".experts." in n) // 8
    assert r["draft"]["experts_distinct"] == (8 + 6 * 2) * one_draft_expert
    assert r["experts_all"] == r["target"]["experts_all"] + 7 * r["draft"]["experts_all_per_pass"]
    assert r["total_all_experts"] == r["dense"] + r["experts_all"] + r["kv"]
    # the LM heads, held bf16: the target's once, the draft's on every one of the 7 passes
    head = cfg.vocab_size * cfg.hidden_size * 2
    assert r["target"]["dense"] > head and r["draft"]["dense_per_pass"] > head
    assert r["dense"] == r["target"]["dense"] + 7 * r["draft"]["dense_per_pass"] + 14 * cfg.hidden_size * 2
    # window 32: 2 sliding target layers read 32 positions, 2 full ones 100; the draft (window 16) 16, 7 times
    assert r["kv"] == 2 * (2 * 32 + 2 * 100 + 7 * 16) * cfg.num_key_value_heads * cfg.head_dim * 2


def test_a_bf16_checkpoint_is_counted_as_it_runs(capsys):
    """--weights: a BF16 checkpoint runs as FP8 on a GPU by default (quantized at load: 1 byte a weight and the block
    scales), as BF16 when asked; an FP8 checkpoint cannot run as BF16."""
    bf16 = fixture_dir("tiny", "bf16")
    cfg = Config.from_dir(bf16)
    auto, as_bf16 = info(capsys, "--model", str(bf16)), info(capsys, "--model", str(bf16), "--weights", "bf16")
    assert auto["weights"]["format"] == "fp8" and auto["weights"]["quantized_at_load"]
    assert "quantized at load" in auto["weights"]["description"]
    assert as_bf16["weights"] == {"format": "bf16", "quantized_at_load": False, "description": "bf16 (as stored)"}
    assert auto["memory_per_rank"]["weights"] == sum(rank_tensor_bytes(cfg, 1, 0, "fp8").values())
    assert as_bf16["memory_per_rank"]["weights"] == sum(rank_tensor_bytes(cfg, 1, 0, "bf16").values())
    assert auto["memory_per_rank"]["weights"] < as_bf16["memory_per_rank"]["weights"]
    assert auto["parameters"] == as_bf16["parameters"] == info(capsys, "--model", str(TINY))["parameters"]
    assert main(["info", "--model", str(TINY), "--weights", "bf16"]) == 2
    assert "--weights bf16" in capsys.readouterr().err


def test_full_config_is_never_materialized(capsys):
    out = info(capsys, "--config", str(FULL), "--tp", "8", "--context", "131072")
    cfg = Config.from_file(FULL, FULL_DRAFT)
    assert out["parameters"]["total"] == sum(numel(s.shape) for s in tensor_specs(cfg).values())
    # the published model: about 320B parameters, 15B active a token (docs/model.md)
    assert 3.1e11 < out["parameters"]["target"] < 3.3e11 and 1.3e10 < out["parameters"]["active_per_token"] < 1.6e10
    c = out["config"]
    assert (c["num_hidden_layers"], c["full_layers"], c["sliding_layers"], c["moe_layers"]) == (88, 25, 63, 87)
    assert (c["sliding_window"], c["draft_window"], c["rotary_dim"], c["head_dim"]) == (4096, 512, 32, 128)
    r = out["round_bytes"]
    assert r["distinct_experts_per_layer"] == 64
    assert r["target"]["experts_distinct"] * 4 == r["target"]["experts_all"]  # 64 of 256 experts per layer
    assert r["total_distinct_experts"] < r["total_all_experts"]
    assert r["kv"] == kv_read_bytes(cfg, 8, 131072)
    assert out["memory_per_rank"]["total"] == rank_bytes(cfg, 8, 131072)
    # a longer context reads more KV only through the 25 full layers (one KV head a rank at TP 8)
    short = kv_read_bytes(cfg, 8, 4096)
    assert kv_read_bytes(cfg, 8, 8192) - short == 2 * 4096 * 25 * 1 * 128 * 2
    # the draft's window caps what each of its passes reads
    assert kv_read_bytes(cfg, 8, 4096) - kv_read_bytes(cfg, 8, 4096, draft_passes=0) == 7 * 2 * 512 * 1 * 128 * 2


def test_table_output_and_errors(capsys):
    assert main(["info", "--model", str(TINY)]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out and "all experts" in out and "memory per rank" in out
    for argv, needle in ([["--model", str(TINY), "--tp", "3"], "tensor-parallel"],
                         [["--model", str(TINY), "--context", "0"], "--context"],
                         [["--config", "/no/such.json"], "no config file"],
                         [["--config", str(TINY / "mtp" / "config.json")], "no draft config"]):
        assert main(["info", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err


def test_help_explains_each_flag(capsys):
    assert main(["info", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--model", "--config", "--tp", "--context", "--weights", "--bandwidth", "--json"):
        assert flag in out


UNITS = {"tensors", "safetensors", "B", "KiB", "MiB", "GiB", "tokens", "target", "sliding", "full", "MTP", "dims",
         "heads", "KV", "routed", "thousand", "million", "billion", "verify", "distinct", "rows", "us", "ms", "s",
         "TB/s", "%", "layers", "drafts", "draft", "blocks"}


@pytest.mark.parametrize("argv", [["--model", str(TINY)], ["--config", str(FULL), "--tp", "8"]], ids=["tiny", "full"])
def test_every_figure_has_its_unit(capsys, argv):
    """Each number in the table is followed by what it counts or measures (or is a tp=N / top-N label)."""
    assert main(["info", *argv]) == 0
    bare = []
    for line in capsys.readouterr().out.splitlines()[1:]:  # the first line is the source path
        line = re.sub(r"dense MLP in layer [\d, ]+|\d+x\d+ blocks", "", line)  # layer indices, a block's shape
        for m in re.finditer(r"(?<![\w.=-])\d+(?:\.\d+)?(?![\w.])(%|\s+([^\s,;:()|]+))?", line):
            if (m.group(1) or "").strip().rstrip(",;:)") not in UNITS:
                bare.append(f"{m.group(0)!r} in {line.strip()!r}")
    assert not bare, bare
