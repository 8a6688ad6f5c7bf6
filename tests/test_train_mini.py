"""The mini-model trainer: a smoke run end to end, its training forward against the float64 reference model, and the
held-out loss the trainer records against the reference's on the saved checkpoint."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from iquest.fixtures import train_mini
from iquest.reference.checkpoint import CheckpointReader, tensor_specs
from iquest.reference.fp8 import dequantize
from iquest.reference.model import ReferenceModel


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("mini")
    record = train_mini.main(["--out", str(out), "--smoke", "--seed", "0", "--cpu"])
    return out, record


def test_smoke_run_writes_a_loadable_checkpoint(smoke):
    out, record = smoke
    reader = CheckpointReader(out)  # checks every name, shape, dtype and scale shape against the layout
    for name in reader.names():
        reader.read_weight(name)
    assert reader.config.mtp.sliding_window == train_mini.DRAFT_WINDOW["smoke"]
    assert reader.is_packed("model.layers.1.") and reader.is_packed("mtp/mtp.mtp_model_layer.")
    for f in ("tokenizer.json", "tokenizer_config.json", "training.json", "corpus.json", "config.json",
              "generation_config.json", "mtp/config.json", "mtp/model.safetensors.index.json"):
        assert (out / f).is_file(), f
    corpus = json.loads((out / "corpus.json").read_text())
    assert corpus["held_out"] and not set(corpus["held_out"]) - set(corpus["files"])
    saved = json.loads((out / "training.json").read_text())
    assert saved["steps"] == record["steps"] == 5
    assert set(saved["held_out_fp8"]) >= {"main", "mtp1", "mtp2"} and set(saved["held_out_fp32"]) >= {"main"}


def test_smoke_main_loss_goes_down(smoke):
    curve = smoke[1]["loss_curve"]
    assert curve[-1]["train_main"] < curve[0]["train_main"]
    assert curve[-1]["held_out_main"] < curve[0]["held_out_main"]
    assert curve[-1]["held_out_mtp1"] < curve[0]["held_out_mtp1"]


def test_tokenizer_and_packing(smoke):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(smoke[0]))
    assert tok.convert_tokens_to_ids(["<|iquest_end|>"]) == [train_mini.EOS_ID] == [0]
    assert tok.bos_token is None
    text = "def f(x):\n    return x\n"
    assert tok.decode(tok(text)["input_ids"]) == text
    from tokenizers import Tokenizer
    raw = Tokenizer.from_file(str(smoke[0] / "tokenizer.json"))
    a, b = raw.encode("x = 1\n").ids, raw.encode("y = 2\n").ids
    assert train_mini.pack(raw, ["x = 1\n", "y = 2\n"]).tolist() == [*a, 0, *b, 0]  # `text <|iquest_end|>`, no BOS


def _real_weights(out) -> tuple:
    reader = CheckpointReader(out)
    c = reader.config
    real = {}
    for name in reader.names():
        s = reader.read_weight(name)
        real[name] = s.weight.double() if s.scale is None else dequantize(s.weight, s.scale, c.weight_block_size)
    return c, real


def test_training_forward_matches_reference_model(smoke):
    """Main logits, draft depth 1 and draft depth 2 of the training model (float64) equal ReferenceModel's."""
    out, _ = smoke
    ref = ReferenceModel.load(out)
    c, real = _real_weights(out)
    mini = train_mini.MiniModel(c, seed=1).double()
    mini.load_named(real)
    W = max(c.sliding_window, c.mtp.sliding_window)
    T = 3 * W  # both windows wrap
    tokens = torch.randint(0, c.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = mini(tokens)
    x, pos = tokens[0], torch.arange(T)
    cache = ref.new_cache()
    logits, hidden = ref.forward(x[:T], pos, cache)
    torch.testing.assert_close(got["logits"][0], logits, rtol=1e-7, atol=1e-7)
    # Depth 1: rows p = 0..T-2 read (h_p, x_{p+1}).
    d1_logits, h1 = ref.draft(x[1:T], hidden[:T - 1], pos[:T - 1], cache)
    torch.testing.assert_close(got["mtp1_logits"][0], d1_logits, rtol=1e-7, atol=1e-7)
    # Depth 2 at a few positions: the draft cache holds depth-1 rows; row p reads (depth 1's output at p-1, x_{p+1}).
    for p in (1, 2, c.mtp.sliding_window + 3, T - 2):
        d2_logits, _ = ref.draft(x[p + 1:p + 2], h1[p - 1:p], pos[p:p + 1], cache)
        torch.testing.assert_close(got["mtp2_logits"][0, p - 1], d2_logits[0], rtol=1e-7, atol=1e-7)
        ref.draft(x[p + 1:p + 2], hidden[p:p + 1], pos[p:p + 1], cache)  # restore the depth-1 row


def test_recorded_held_out_loss_matches_the_reference(smoke):
    """The held-out losses training.json records for the saved (FP8) checkpoint are the float64 reference's on the
    same windows: main and both draft depths."""
    out, record = smoke
    from tokenizers import Tokenizer
    hp = record["hparams"]
    _, _, held = train_mini.load_corpus(True, record["seed"], hp["held_out_frac"])
    data = train_mini.pack(Tokenizer.from_file(str(out / "tokenizer.json")), held)
    assert len(data) == record["corpus"]["held_out_tokens"]
    windows = train_mini.eval_windows(len(data), hp)
    ref = ReferenceModel.load(out)
    T = hp["seq_len"]
    pos = torch.arange(T)
    sums = {"main": 0.0, "mtp1": 0.0, "mtp2": 0.0}
    for w in windows:
        x = data[w]
        cache = ref.new_cache()
        logits, hidden = ref.forward(x[:T], pos, cache)
        sums["main"] += F.cross_entropy(logits, x[1:]).item()
        d1, h1 = ref.draft(x[1:T], hidden[:-1], pos[:-1], cache)
        sums["mtp1"] += F.cross_entropy(d1, x[2:]).item()
        d2 = []
        for p in range(1, T - 1):
            d2.append(ref.draft(x[p + 1:p + 2], h1[p - 1:p], pos[p:p + 1], cache)[0])
            ref.draft(x[p + 1:p + 2], hidden[p:p + 1], pos[p:p + 1], cache)
        sums["mtp2"] += F.cross_entropy(torch.cat(d2), x[3:]).item()
    for k, v in sums.items():
        assert record["held_out_fp8"][k] == pytest.approx(v / len(windows), abs=2e-5), k


def test_mini_config_shards_to_8_ranks_and_fits_16_mb():
    c = train_mini.make_config(smoke=False)
    for tp in (1, 2, 4, 8):
        c.check_tp(tp)
    assert c.layer_types == ("full_attention", "sliding_attention", "sliding_attention", "full_attention")
    assert c.mlp_only_layers == (0,) and c.rotary_dim * 4 == c.head_dim and c.mtp.sliding_window == 64
    files = {"target": 0, "draft": 0}
    for name, spec in tensor_specs(c).items():
        n = torch.Size(spec.shape).numel()
        if spec.quantized:
            scales = 1
            for size, b in zip(spec.shape, c.weight_block_size):
                scales *= -(-size // b)
            size = n + 4 * scales
        else:
            size = n * (4 if name.endswith("router.weight") else 2)
        files["draft" if name.startswith("mtp/") else "target"] += size
    assert max(files.values()) < 16e6, files
