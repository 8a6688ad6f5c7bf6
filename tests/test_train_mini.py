"""The mini-model trainer: smoke run end to end, and its training forward against the reference model."""

from __future__ import annotations

import json

import pytest
import torch

from iquest.fixtures import train_mini
from iquest.reference.checkpoint import CheckpointReader
from iquest.reference.fp8 import dequantize


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("mini")
    record = train_mini.main(["--out", str(out), "--smoke", "--seed", "0", "--cpu"])
    return out, record


def test_smoke_run_writes_a_loadable_checkpoint(smoke):
    out, record = smoke
    reader = CheckpointReader(out)  # checks every name, shape, dtype and scale shape against MODEL.md
    for name in reader.names():
        reader.read_weight(name)
    for f in ("tokenizer.json", "tokenizer_config.json", "training.json", "corpus.json", "config.json"):
        assert (out / f).is_file(), f
    corpus = json.loads((out / "corpus.json").read_text())
    assert corpus["held_out"] and not set(corpus["held_out"]) - set(corpus["files"])
    assert json.loads((out / "training.json").read_text())["steps"] == record["steps"] == 5


def test_smoke_main_loss_goes_down(smoke):
    curve = smoke[1]["loss_curve"]
    assert curve[-1]["train_main"] < curve[0]["train_main"]
    assert curve[-1]["held_out_main"] < curve[0]["held_out_main"]


def test_tokenizer_loads_with_special_tokens_first(smoke):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(smoke[0]))
    assert tok.convert_tokens_to_ids(["<|bos|>", "<|eos|>"]) == [0, 1]
    assert tok.decode(tok("def f(x):\n    return x\n")["input_ids"]) == "def f(x):\n    return x\n"


def test_training_forward_matches_reference_model(smoke):
    """Main logits, MTP depth 1 and MTP depth 2 of the training model equal ReferenceModel's."""
    model_mod = pytest.importorskip("iquest.reference.model")
    out, _ = smoke
    ref = model_mod.ReferenceModel.load(out)
    reader = CheckpointReader(out)
    c = reader.config
    real = {}
    for name, spec in reader.specs.items():
        w, s = reader.read_weight(name)
        real[name] = dequantize(w, s, c.weight_block_size, torch.float64) if s is not None else w.double()
    mini = train_mini.MiniModel(c, seed=1).double()
    mini.load_named(real)
    T = 3 * c.sliding_window  # the window wraps
    tokens = torch.randint(0, c.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = mini(tokens)
    x, pos = tokens[0, :T], torch.arange(T)
    cache = ref.new_cache()
    logits, hidden = ref.forward(x, pos, cache)
    torch.testing.assert_close(got["logits"][0], logits, rtol=1e-7, atol=1e-7)
    # Depth 1: rows p = 1..T-1 read the main hidden at p-1.
    d1_logits, h1 = ref.draft(x[1:], hidden[:-1], pos[1:], cache)
    torch.testing.assert_close(got["mtp1_logits"][0], d1_logits, rtol=1e-7, atol=1e-7)
    # Depth 2 at a few positions: the draft cache holds depth-1 rows; row p reads h1 at p-1.
    for p in (2, c.sliding_window + 3, T - 1):
        d2_logits, _ = ref.draft(x[p:p + 1], h1[p - 2:p - 1], pos[p:p + 1], cache)
        torch.testing.assert_close(got["mtp2_logits"][0, p - 1], d2_logits[0], rtol=1e-7, atol=1e-7)
        ref.draft(x[p:p + 1], hidden[p - 1:p], pos[p:p + 1], cache)  # restore the depth-1 row


def test_mini_config_shards_to_8_ranks():
    c = train_mini.Config.from_dict(train_mini.MINI)
    for tp in (1, 2, 4, 8):
        c.check_tp(tp)
