"""Fixture checkpoints (fixtures/make.py): every preset in the published layout, loadable by the reader and the
reference model, deterministic, in both weight formats and both expert storage forms; the shipped folders are what
make_fixture writes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from iquest.fixtures.make import PRESETS, make_fixture, preset_config, random_weights
from iquest.fixtures.tokenizer import EOS_ID, SPECIAL_TOKENS
from iquest.reference.checkpoint import CheckpointReader, tensor_specs
from iquest.reference.config import Config, GenerationConfig
from iquest.reference.fp8 import E4M3
from iquest.reference.model import ReferenceModel

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = {"tiny": ROOT / "fixtures" / "tiny", "tiny-tp8": ROOT / "fixtures" / "tiny-tp8"}
SHIPPED_SEED = 0
PUBLISHED = Config.from_file(ROOT / "configs" / "iquest-q1.json", ROOT / "configs" / "iquest-q1-mtp.json")


def files(d: Path) -> dict[str, bytes]:
    """Every file under a model folder, by relative path."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def stored(d: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor of a model folder (the draft's under mtp/)."""
    out = {}
    for f in sorted(d.rglob("*.safetensors")):
        prefix = "mtp/" if f.parent.name == "mtp" else ""
        with safe_open(f, framework="pt") as h:
            out.update({prefix + n: h.get_tensor(n) for n in h.keys()})
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """Every preset at seed 0 (published-small once: it is ~400 MB, removed after this module)."""
    root = tmp_path_factory.mktemp("presets")
    yield {name: make_fixture(name, root / name, seed=0) for name in PRESETS}
    shutil.rmtree(root / "published-small", ignore_errors=True)


# ---- every preset loads ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_loads_in_the_reader_and_the_reference_model(made, preset):
    d = made[preset]
    r = CheckpointReader(d)
    assert r.config == preset_config(preset) and r.config.mtp is not None
    assert all(r.is_packed(p) for p in r.packed)
    # published-small is ~400 MB of FP8: held in float32 rather than float64 (the same code path)
    dtype = torch.float32 if preset == "published-small" else torch.float64
    model = ReferenceModel.load(d, dtype)
    assert model.config == r.config
    cache = model.new_cache()
    tokens = torch.tensor([1, 5, 7] if r.config.vocab_size > 7 else [1, 5, 3])
    logits, hidden = model.forward(tokens, torch.arange(3), cache)
    assert logits.shape == (3, r.config.vocab_size) and torch.isfinite(logits).all()
    draft_logits, out = model.draft(tokens[1:], hidden[:2], torch.arange(2), cache)
    assert draft_logits.shape == (2, r.config.vocab_size) and torch.isfinite(draft_logits).all()
    assert GenerationConfig.from_dir(d, r.config).eos_token_id == (EOS_ID,)


@pytest.mark.parametrize("weights", ["fp8", "bf16"])
@pytest.mark.parametrize("packed", [True, False])
def test_both_formats_and_both_expert_forms_load(tmp_path, weights, packed):
    d = make_fixture("tiny", tmp_path / "m", seed=0, packed=packed, weights=weights)
    config = json.loads((d / "config.json").read_text())
    assert ("quantization_config" in config) == (weights == "fp8")
    names = stored(d)
    assert ("model.layers.1.mlp.experts.fc" in names) == packed
    assert ("model.layers.1.mlp.experts.0.up_proj.weight" in names) == (not packed)
    assert any(n.endswith("_scale_inv") for n in names) == (weights == "fp8")
    q = names["model.layers.1.self_attn.q_proj.weight"]
    assert q.dtype == (E4M3 if weights == "fp8" else torch.bfloat16)
    model = ReferenceModel.load(d)
    logits, _ = model.forward(torch.tensor([3, 4]), torch.arange(2), model.new_cache())
    assert torch.isfinite(logits).all()


def test_bf16_and_fp8_of_one_seed_are_the_same_model(tmp_path):
    """The same draws: the FP8 fixture is the BF16 one block-quantized, so their outputs are close."""
    a = ReferenceModel.load(make_fixture("tiny", tmp_path / "a", seed=3, weights="fp8"))
    b = ReferenceModel.load(make_fixture("tiny", tmp_path / "b", seed=3, weights="bf16"))
    tokens, pos = torch.tensor([3, 40, 41, 300]), torch.arange(4)
    la, _ = a.forward(tokens, pos, a.new_cache())
    lb, _ = b.forward(tokens, pos, b.new_cache())
    assert (la.softmax(-1) - lb.softmax(-1)).abs().sum(-1).max() < 0.5  # E4M3 rounding, not another model
    c = ReferenceModel.load(make_fixture("tiny", tmp_path / "c", seed=4, weights="bf16"))
    lc, _ = c.forward(tokens, pos, c.new_cache())
    assert (lb.softmax(-1) - lc.softmax(-1)).abs().sum(-1).max() > (la.softmax(-1) - lb.softmax(-1)).abs().sum(-1).max()


# ---- the shipped folders ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", sorted(SHIPPED))
def test_shipped_folders_are_a_fresh_make_fixture(made, preset):
    shipped, fresh = SHIPPED[preset], made[preset]
    a, b = stored(shipped), stored(fresh)
    assert a.keys() == b.keys()
    for name in a:
        assert same(a[name], b[name]), f"{preset}: {name}"
    for f in ("config.json", "mtp/config.json", "generation_config.json", "tokenizer_config.json",
              "special_tokens_map.json", "model.safetensors.index.json", "mtp/model.safetensors.index.json"):
        assert json.loads((shipped / f).read_text()) == json.loads((fresh / f).read_text()), f"{preset}: {f}"
    assert (shipped / "tokenizer.json").read_bytes() == (fresh / "tokenizer.json").read_bytes()
    assert files(shipped).keys() == files(fresh).keys()
    CheckpointReader(shipped)


def test_shipped_folders_are_seed_zero():
    for preset, d in SHIPPED.items():
        r = CheckpointReader(d)
        w = random_weights(r.config, SHIPPED_SEED)
        assert same(r.read("model.layers.1.self_attn.q_proj.weight"), w["model.layers.1.self_attn.q_proj.weight"])


# ---- determinism -----------------------------------------------------------------------------------------------

def test_same_arguments_give_byte_identical_files(made, tmp_path):
    again = make_fixture("tiny", tmp_path / "again", seed=0)
    a, b = files(made["tiny"]), files(again)
    assert any(n.startswith("mtp/") and n.endswith(".safetensors") for n in a)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name] == b[name], name


def test_a_different_seed_gives_different_weights(made, tmp_path):
    other = make_fixture("tiny", tmp_path / "other", seed=2)
    a, b = files(made["tiny"]), files(other)
    weights = [n for n in a if n.endswith(".safetensors")]
    assert len(weights) == 2 and all(a[n] != b[n] for n in weights)
    assert a["config.json"] == b["config.json"] and a["mtp/config.json"] == b["mtp/config.json"]


@pytest.mark.parametrize("preset", sorted(set(PRESETS) - {"published-small"}))  # its weights: drawn once, above
@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_random_weights_follow_the_layout(preset, weights):
    c = preset_config(preset, weights)
    assert c.quantized == (weights == "fp8")
    w = random_weights(c, seed=3)
    specs = tensor_specs(c)
    want = {n for n, s in specs.items()} | {s.scale_name for s in specs.values() if s.quantized and c.quantized}
    assert set(w) == want
    for name, t in w.items():
        if name.endswith("_scale_inv"):
            assert t.dtype == torch.float32 and (t > 0).all(), name
            continue
        spec = specs[name]
        assert tuple(t.shape) == spec.shape, name
        if spec.quantized and c.quantized:
            assert t.dtype == E4M3, name
        else:
            assert t.dtype == (torch.float32 if name.endswith("router.weight") else torch.bfloat16), name
            assert torch.isfinite(t).all(), name
    w2 = random_weights(c, seed=3)
    assert all(same(w[n], w2[n]) for n in w)


# ---- what each preset is for -----------------------------------------------------------------------------------

def test_presets_shard_as_documented():
    preset_config("tiny").check_tp(2)
    for tp in (1, 2, 4, 8):
        preset_config("tiny-tp8").check_tp(tp)
        preset_config("published-small").check_tp(tp)
    c = preset_config("tiny-tp8")
    assert c.intermediate_size // 8 == 6 and c.weight_block_size == (16, 16)  # expert shards start mid-block
    assert preset_config("micro").vocab_size == 8
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("huge")
    with pytest.raises(ValueError, match="unknown weight format"):
        preset_config("tiny", "int4")


def test_published_small_has_the_published_dimensions(made):
    c, p = preset_config("published-small"), PUBLISHED
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rotary_dim",
                "intermediate_size", "dense_intermediate_size", "rope_theta", "swa_rope_theta", "sliding_window",
                "weight_block_size", "mlp_only_layers", "ffn_out_scale", "eos_token_id", "max_position_embeddings"):
        assert getattr(c, key) == getattr(p, key), key
        assert getattr(c.mtp, key) == getattr(p.mtp, key), key
    assert c.layer_types == ("full_attention", "sliding_attention") and c.is_dense(0) and not c.is_dense(1)
    assert (c.num_experts, c.num_experts_per_tok, c.vocab_size) == (4, 2, 1024)
    assert c.mtp.sliding_window == 512 and c.mtp.layer_types == ("sliding_attention",)
    assert c.intermediate_size // 8 == 192 and 192 % 128 == 64  # the straddling TP-8 expert shard
    size = sum(f.stat().st_size for f in made["published-small"].rglob("*") if f.is_file())
    assert size < 450 << 20, f"{size / 2**20:.0f} MiB"
    r = CheckpointReader(made["published-small"])
    s = r.read_weight("model.layers.1.mlp.experts.3.gate_proj.weight", 8, 1)
    assert s.weight.shape == (192, 3072) and s.offset == (64, 0) and s.scale.shape == (2, 24)


def test_micro_has_no_tokenizer_but_a_valid_checkpoint(made):
    out = made["micro"]
    assert not (out / "tokenizer.json").exists()
    r = CheckpointReader(out)
    assert r.config.vocab_size == 8 and r.config.layer_types == ("sliding_attention", "full_attention")


# ---- the tokenizer a fixture carries --------------------------------------------------------------------------

@pytest.mark.parametrize("preset", ["tiny", "published-small"])
def test_the_tokenizer_matches_the_config(made, preset):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(str(made[preset]))
    c = CheckpointReader(made[preset]).config
    assert len(tok) == c.vocab_size
    assert tok.eos_token_id == EOS_ID == c.eos_token_id[0] == c.pad_token_id and tok.bos_token_id is None
    assert tok.convert_tokens_to_ids(SPECIAL_TOKENS) == list(range(len(SPECIAL_TOKENS)))
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text and max(ids) < c.vocab_size and len(ids) < len(text)
    assert tok.chat_template
