"""Config contract (MODEL.md, "Config"): the shipped config, round trips, and every validation naming its key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iquest.reference.config import Config, ConfigError, GenerationConfig, check_sampling, default_layer_types

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "configs" / "iquest-q1.json"
TINY = ROOT / "fixtures" / "tiny"


def small() -> dict:
    """A valid small raw config (the `tiny` fixture's shape)."""
    return json.loads((TINY / "config.json").read_text())


def with_(**changes) -> dict:
    raw = small()
    raw.update(changes)
    return raw


# ---- the shipped config ---------------------------------------------------------------------------

def test_shipped_config_loads_with_full_size_values():
    c = Config.from_file(SHIPPED)
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (160000, 6144, 88)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.group_size) == (48, 8, 128, 6)
    assert c.layer_types == default_layer_types(88)
    assert c.layer_types.count("full_attention") == 22
    assert c.weight_block_size == (128, 128) and c.quant_method == "fp8" and c.quant_fmt == "e4m3"
    assert c.eos_token_id == (1,) and c.bos_token_id == 0
    assert c.layer_type(c.mtp_layer_index) == "sliding_attention"
    assert c.layer_type(3) == "full_attention" and c.layer_type(0) == "sliding_attention"


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shipped_config_shards_at_every_tp(tp):
    Config.from_file(SHIPPED).check_tp(tp)


@pytest.mark.parametrize("tp", [0, 3, 16])
def test_check_tp_rejects_unsupported_degrees(tp):
    with pytest.raises(ConfigError, match="tensor-parallel degree"):
        Config.from_file(SHIPPED).check_tp(tp)


def test_from_dir_reads_config_and_generation_config():
    c = Config.from_dir(TINY)
    g = GenerationConfig.from_dir(TINY, c)
    assert c.vocab_size == 512 and c.weight_block_size == (16, 16)
    assert (g.temperature, g.top_k, g.top_p, g.eos_token_id) == (1.0, 20, 0.95, (1,))


def test_from_dir_missing_or_broken_file(tmp_path):
    with pytest.raises(ConfigError, match="no config file"):
        Config.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.from_dir(tmp_path)


# ---- round trip and immutability --------------------------------------------------------------------

def test_round_trip_shipped_and_tiny():
    for c in (Config.from_file(SHIPPED), Config.from_dir(TINY)):
        d = c.to_dict()
        json.dumps(d)  # plain JSON types only
        assert Config.from_dict(d) == c
        assert Config.from_dict(json.loads(json.dumps(d))) == c


def test_round_trip_with_rope_scaling():
    c = Config.from_dict(with_(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 1024, "beta_fast": 16.0}))
    assert c.rope_scaling.factor == 4.0 and c.rope_scaling.beta_fast == 16.0 and c.rope_scaling.beta_slow == 1.0
    assert Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_derived_defaults_and_foreign_keys():
    raw = small()
    del raw["head_dim"], raw["layer_types"]
    raw["architectures"] = ["Whatever"]  # unknown Hugging Face keys are ignored
    c = Config.from_dict(raw)
    assert c.head_dim == 64 // 4
    assert c.layer_types == ("sliding_attention",) * 3 + ("full_attention",)
    assert Config.from_dict(with_(eos_token_id=1)).eos_token_id == (1,)
    assert Config.from_dict(with_(eos_token_id=None)).eos_token_id == ()


def test_config_is_frozen():
    c = Config.from_dir(TINY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 7  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerationConfig().top_k = 3  # type: ignore[misc]
    assert c.vocab_size == 512


# ---- every validation names its key ------------------------------------------------------------------

BAD = [
    ("heads_not_divisible", dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    ("layer_types_short", dict(layer_types=["sliding_attention"] * 3), "layer_types"),
    ("layer_types_long", dict(layer_types=["full_attention"] * 5), "layer_types"),
    ("layer_types_unknown", dict(layer_types=["sliding_attention", "linear_attention", "full_attention",
                                              "full_attention"]), r"layer_types\[1\]"),
    ("layer_types_not_list", dict(layer_types="full_attention"), "layer_types"),
    ("mtp_layer_type", dict(mtp_layer_type="dense"), "mtp_layer_type"),
    ("vocab_zero", dict(vocab_size=0), "vocab_size"),
    ("hidden_negative", dict(hidden_size=-64), "hidden_size"),
    ("layers_zero", dict(num_hidden_layers=0, layer_types=[]), "num_hidden_layers"),
    ("head_dim_zero", dict(head_dim=0), "head_dim"),
    ("head_dim_odd", dict(head_dim=15), "head_dim"),
    ("window_zero", dict(sliding_window=0), "sliding_window"),
    ("moe_intermediate_negative", dict(moe_intermediate_size=-32), "moe_intermediate_size"),
    ("experts_zero", dict(n_routed_experts=0), "n_routed_experts"),
    ("topk_zero", dict(num_experts_per_tok=0), "num_experts_per_tok"),
    ("topk_gt_experts", dict(num_experts_per_tok=9), "num_experts_per_tok"),
    ("context_zero", dict(max_position_embeddings=0), "max_position_embeddings"),
    ("vocab_string", dict(vocab_size="512"), "vocab_size"),
    ("vocab_float", dict(vocab_size=512.0), "vocab_size"),
    ("vocab_bool", dict(num_key_value_heads=True), "num_key_value_heads"),
    ("eps_zero", dict(rms_norm_eps=0.0), "rms_norm_eps"),
    ("theta_negative", dict(rope_theta=-1.0), "rope_theta"),
    ("routed_scaling_zero", dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    ("rope_type", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
    ("rope_legacy_type", dict(rope_scaling={"type": "dynamic", "factor": 2.0,
                                            "original_max_position_embeddings": 1024}), "rope_scaling"),
    ("rope_missing_factor", dict(rope_scaling={"rope_type": "yarn", "original_max_position_embeddings": 8}),
     "rope_scaling.*factor"),
    ("rope_missing_original", dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}),
     "rope_scaling.*original_max_position_embeddings"),
    ("rope_factor_zero", dict(rope_scaling={"rope_type": "yarn", "factor": 0.0,
                                            "original_max_position_embeddings": 1024}), "rope_scaling.factor"),
    ("rope_factor_nan", dict(rope_scaling={"rope_type": "yarn", "factor": float("nan"),
                                           "original_max_position_embeddings": 1024}), "rope_scaling.factor"),
    ("rope_not_object", dict(rope_scaling="yarn"), "rope_scaling"),
    ("quant_method", dict(quantization_config={"quant_method": "int8", "fmt": "e4m3",
                                               "weight_block_size": [16, 16]}), "quantization_config"),
    ("quant_fmt", dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2",
                                            "weight_block_size": [16, 16]}), "quantization_config"),
    ("quant_not_object", dict(quantization_config="fp8"), "quantization_config"),
    ("quant_block_one_int", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [16]}),
     "weight_block_size"),
    ("quant_block_zero", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [0, 16]}),
     "weight_block_size"),
    ("shared_experts", dict(n_shared_experts=1), "n_shared_experts"),
    ("scoring_func", dict(scoring_func="sigmoid"), "scoring_func"),
    ("nextn_layers", dict(num_nextn_predict_layers=2), "num_nextn_predict_layers"),
    ("tied_embeddings", dict(tie_word_embeddings=True), "tie_word_embeddings"),
    ("model_type", dict(model_type="llama"), "model_type"),
    ("eos_too_big", dict(eos_token_id=[1, 512]), "eos_token_id"),
    ("eos_negative", dict(eos_token_id=-1), "eos_token_id"),
]


@pytest.mark.parametrize("changes,key", [(c, k) for _, c, k in BAD], ids=[n for n, _, _ in BAD])
def test_invalid_value_is_rejected_naming_the_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        Config.from_dict(with_(**changes))


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "sliding_window", "moe_intermediate_size",
                                 "n_routed_experts", "num_experts_per_tok"])
def test_missing_required_key_is_named(key):
    raw = small()
    del raw[key]
    with pytest.raises(ConfigError, match=f"missing required key.*{key}"):
        Config.from_dict(raw)


def test_direct_construction_is_validated_too():
    base = Config.from_dir(TINY)
    with pytest.raises(ConfigError, match="n_shared_experts"):
        dataclasses.replace(base, n_shared_experts=2)
    with pytest.raises(ConfigError, match="eos_token_id"):
        dataclasses.replace(base, eos_token_id=(base.vocab_size,))


def test_check_tp_names_the_dimension_that_does_not_shard():
    tiny = Config.from_dir(TINY)
    tiny.check_tp(1)
    tiny.check_tp(2)
    # I/tp = 32/4 = 8 is not a multiple of the 16x16 weight block
    with pytest.raises(ConfigError, match="weight_block_size.*moe_intermediate_size"):
        tiny.check_tp(4)
    # heads 4 do not split 8 ways
    with pytest.raises(ConfigError, match="num_attention_heads"):
        tiny.check_tp(8)
    big = dict(vocab_size=1024, hidden_size=256, num_attention_heads=16, num_key_value_heads=4, head_dim=16,
               moe_intermediate_size=128, quantization_config={"quant_method": "fp8",
                                                               "weight_block_size": [16, 16]})
    ok = Config.from_dict(with_(**big))
    for tp in (1, 2, 4, 8):
        ok.check_tp(tp)
    with pytest.raises(ConfigError, match="vocab_size"):
        Config.from_dict(with_(**dict(big, vocab_size=1020))).check_tp(8)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        Config.from_dict(with_(**dict(big, num_attention_heads=12, num_key_value_heads=3))).check_tp(2)
    with pytest.raises(ConfigError, match="num_key_value_heads"):  # 3 KV heads cannot be replicated over 4
        Config.from_dict(with_(**dict(big, num_attention_heads=12, num_key_value_heads=3))).check_tp(4)
    # query shard 8/8 heads * 16 = 16 rows is not a whole 32-row block
    with pytest.raises(ConfigError, match="query projection"):
        Config.from_dict(with_(**dict(big, num_attention_heads=8, moe_intermediate_size=256, hidden_size=512,
                                      quantization_config={"quant_method": "fp8",
                                                           "weight_block_size": [32, 32]}))).check_tp(8)
    # KV shard of 1 head * head_dim 16 rows against a 32-row block
    with pytest.raises(ConfigError, match="KV projection"):
        Config.from_dict(with_(**dict(big, num_attention_heads=32, moe_intermediate_size=256, hidden_size=512,
                                      quantization_config={"quant_method": "fp8",
                                                           "weight_block_size": [32, 16]}))).check_tp(8)
    # eh_proj's 2H input split 8 ways: 2*64/8 = 16 columns, not a multiple of 32
    with pytest.raises(ConfigError, match="eh_proj"):
        Config.from_dict(with_(**dict(big, hidden_size=64, moe_intermediate_size=256, quantization_config={
            "quant_method": "fp8", "weight_block_size": [16, 32]}))).check_tp(8)


# ---- GenerationConfig ------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,key", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
])
def test_generation_config_validates_sampling(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        GenerationConfig(**kwargs)


def test_generation_config_bounds_are_inclusive_where_allowed():
    check_sampling(0.0, 1, 1.0)
    assert GenerationConfig(temperature=0.0, top_k=1, top_p=1.0).to_dict()["top_p"] == 1.0


# ---- hypothesis: random valid small configs -----------------------------------------------------------

@st.composite
def valid_raw(draw) -> dict:
    nkv = draw(st.sampled_from([1, 2, 3, 4, 8]))
    nq = nkv * draw(st.sampled_from([1, 2, 3, 4]))
    head_dim = draw(st.sampled_from([2, 4, 8, 16, 24, 32]))
    layers = draw(st.integers(1, 6))
    experts = draw(st.integers(1, 16))
    vocab = draw(st.integers(1, 64)) * draw(st.sampled_from([1, 2, 4, 8]))
    block = [draw(st.sampled_from([1, 2, 4, 8, 16, 32])), draw(st.sampled_from([1, 2, 4, 8, 16, 32]))]
    raw = {
        "model_type": "iquest_q1",
        "vocab_size": vocab,
        "hidden_size": draw(st.integers(1, 40)) * draw(st.sampled_from([1, 4, 8, 16])),
        "num_hidden_layers": layers,
        "num_attention_heads": nq,
        "num_key_value_heads": nkv,
        "head_dim": head_dim,
        "layer_types": draw(st.lists(st.sampled_from(["sliding_attention", "full_attention"]),
                                     min_size=layers, max_size=layers)),
        "sliding_window": draw(st.integers(1, 4096)),
        "moe_intermediate_size": draw(st.integers(1, 32)) * draw(st.sampled_from([1, 8, 16])),
        "n_routed_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, experts)),
        "attention_sinks": draw(st.booleans()),
        "qk_norm": draw(st.booleans()),
        "rope_theta": draw(st.floats(1.0, 1e7)),
        "max_position_embeddings": draw(st.integers(1, 1 << 18)),
        "rms_norm_eps": draw(st.floats(1e-8, 1e-3)),
        "mtp_layer_type": draw(st.sampled_from(["sliding_attention", "full_attention"])),
        "eos_token_id": draw(st.lists(st.integers(0, vocab - 1), max_size=3)),
        "bos_token_id": draw(st.none() | st.integers(0, vocab - 1)),
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block,
                                "activation_scheme": "dynamic"},
    }
    if draw(st.booleans()):
        raw["rope_scaling"] = {"rope_type": "yarn", "factor": draw(st.floats(1.0, 64.0)),
                               "original_max_position_embeddings": draw(st.integers(1, 1 << 16))}
    return raw


def shards_directly(raw: dict, tp: int) -> bool:
    """MODEL.md's TP rules written out: every split dimension divides, every quantized shard is whole blocks
    (at TP=1 nothing is split, so any config shards)."""
    if tp == 1:
        return True
    V, H, Nq, Nkv, D, I = (raw[k] for k in ("vocab_size", "hidden_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim", "moe_intermediate_size"))
    b0, b1 = raw["quantization_config"]["weight_block_size"]
    if V % tp or Nq % tp or I % tp or (2 * H) % tp:
        return False
    kv_heads = Nkv // tp if tp <= Nkv else 1
    if (Nkv % tp if tp <= Nkv else tp % Nkv):
        return False
    q_rows = Nq // tp * D                       # q_proj rows, o_proj columns, sinks
    i_part = I // tp                            # gate/up rows, down columns
    return (q_rows % b0 == 0 and q_rows % b1 == 0 and (kv_heads * D) % b0 == 0
            and i_part % b0 == 0 and i_part % b1 == 0 and (2 * H // tp) % b1 == 0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_raw())
def test_random_valid_configs_round_trip(raw):
    c = Config.from_dict(raw)
    assert Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.layer_types == tuple(raw["layer_types"])
    assert list(c.weight_block_size) == raw["quantization_config"]["weight_block_size"]
    assert c.group_size * c.num_key_value_heads == c.num_attention_heads


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_raw(), st.sampled_from([1, 2, 4, 8]))
def test_check_tp_agrees_with_direct_divisibility(raw, tp):
    c = Config.from_dict(raw)
    try:
        c.check_tp(tp)
        accepted = True
    except ConfigError:
        accepted = False
    assert accepted == shards_directly(raw, tp)
