"""Fixture checkpoints (fixtures/make.py, fixtures/tokenizer.py): determinism, layout, tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from iquest.fixtures.make import PRESETS, make_fixture, preset_config, random_weights
from iquest.fixtures.tokenizer import BOS_ID, EOS_ID, SPECIAL_TOKENS
from iquest.reference.checkpoint import CheckpointReader, expected_dtypes_and_shapes
from iquest.reference.config import GenerationConfig
from iquest.reference.fp8 import E4M3

ROOT = Path(__file__).resolve().parent.parent




def _file_bytes(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny_seed1(tmp_path_factory) -> Path:
    return make_fixture("tiny", tmp_path_factory.mktemp("a"), seed=1)


def test_same_seed_gives_byte_identical_files(tiny_seed1, tmp_path):
    again = make_fixture("tiny", tmp_path / "again", seed=1)
    a, b = _file_bytes(tiny_seed1), _file_bytes(again)
    assert any(name.endswith(".safetensors") for name in a)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


def test_different_seed_gives_different_weights(tiny_seed1, tmp_path):
    other = make_fixture("tiny", tmp_path / "other", seed=2)
    a, b = _file_bytes(tiny_seed1), _file_bytes(other)
    weights = [n for n in a if n.endswith(".safetensors")]
    assert weights and all(a[n] != b[n] for n in weights)
    assert a["config.json"] == b["config.json"]  # same preset, same config
    ra, rb = CheckpointReader(tiny_seed1), CheckpointReader(other)
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert not torch.equal(ra.read(name).view(torch.uint8), rb.read(name).view(torch.uint8))


def test_shipped_fixtures_are_seed_zero_of_their_presets(tmp_path):
    for name in ("tiny", "tiny-tp8"):
        made = make_fixture(name, tmp_path / name, seed=0)
        shipped = ROOT / "fixtures" / name
        for f in sorted(made.glob("*.safetensors")):
            assert f.read_bytes() == (shipped / f.name).read_bytes(), f"{name}/{f.name}"
        assert json.loads((made / "config.json").read_text()) == json.loads((shipped / "config.json").read_text())


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_random_weights_follow_the_layout(preset):
    c = preset_config(preset)
    w = random_weights(c, seed=3)
    assert {n: (tuple(t.shape), t.dtype) for n, t in w.items()} == expected_dtypes_and_shapes(c)
    for name, t in w.items():
        if t.dtype != E4M3:
            assert torch.isfinite(t).all(), name
        if name.endswith("_scale_inv"):
            assert (t > 0).all(), name
    w2 = random_weights(c, seed=3)
    assert all(torch.equal(w[n].view(torch.uint8) if w[n].dtype == E4M3 else w[n],
                           w2[n].view(torch.uint8) if w2[n].dtype == E4M3 else w2[n]) for n in w)


def test_presets_shard_as_documented():
    preset_config("tiny").check_tp(2)
    for tp in (1, 2, 4, 8):
        preset_config("tiny-tp8").check_tp(tp)
    assert preset_config("micro").vocab_size == 8
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("huge")


def test_micro_has_no_tokenizer_but_a_valid_checkpoint(tmp_path):
    out = make_fixture("micro", tmp_path / "micro", seed=0)
    assert not (out / "tokenizer.json").exists()
    r = CheckpointReader(out)
    assert r.config.vocab_size == 8 and r.config.layer_types == ("sliding_attention", "full_attention")
    g = GenerationConfig.from_dir(out, r.config)
    assert g.eos_token_id == (EOS_ID,)


# ---- tokenizer --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tokenizer(tiny_seed1):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(tiny_seed1))


def test_tokenizer_vocab_matches_config(hf_tokenizer, tiny_seed1):
    c = CheckpointReader(tiny_seed1).config
    assert len(hf_tokenizer) == c.vocab_size == 512
    assert hf_tokenizer.bos_token_id == BOS_ID == c.bos_token_id
    assert hf_tokenizer.eos_token_id == EOS_ID and (EOS_ID,) == c.eos_token_id
    assert hf_tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    ids = hf_tokenizer("def f(x):\n    return x", add_special_tokens=False)["input_ids"]
    assert ids and max(ids) < c.vocab_size


@pytest.mark.parametrize("text", ["def fibonacci(n):\n    if n < 2:\n        return n\n",
                                  "for index in range(len(data)):\n\tprint(data[index])",
                                  "unicode: \u00e9\u00e8 \u4e2d\u6587 \U0001f600 and symbols ~`|\\"])
def test_tokenizer_round_trips_text(hf_tokenizer, text):
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert hf_tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges were learned: fewer tokens than bytes


def test_tokenizer_compresses_code_it_was_trained_on(hf_tokenizer):
    text = "        return self.value + count\n"
    ids = hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) <= len(text) // 2


def test_chat_template_renders(hf_tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>be brief<|end|><|user|>hi<|end|><|assistant|>"
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ids[0] == BOS_ID
    assert ids.count(hf_tokenizer.convert_tokens_to_ids("<|end|>")) == 2
    assert hf_tokenizer.convert_tokens_to_ids("<|assistant|>") not in ids
