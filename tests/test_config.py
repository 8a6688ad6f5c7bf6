"""Config contract (docs/model.md, "Config" and "Draft config"): the shipped published configs, the layer pattern, partial
RoPE, round trips, and every validation a one-line ConfigError naming its key."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iquest.reference.config import Config, ConfigError, GenerationConfig, check_sampling

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "configs" / "iquest-q1.json"
SHIPPED_MTP = ROOT / "configs" / "iquest-q1-mtp.json"
PUBLISHED_FULL = (0, 1, *range(5, 85, 4), 85, 86, 87)


def target() -> dict:
    return json.loads(SHIPPED.read_text())


def draft() -> dict:
    return json.loads(SHIPPED_MTP.read_text())


def load(t: dict | None = None, d: dict | None = None) -> Config:
    return Config.from_dict(target() if t is None else t, draft() if d is None else d)


def with_(**changes) -> dict:
    return {**target(), **changes}


def without(raw: dict, *keys: str) -> dict:
    return {k: v for k, v in raw.items() if k not in keys}


def one_line_error(call, key: str) -> str:
    """The ConfigError `call()` raises: one line, naming `key`."""
    with pytest.raises(ConfigError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and key in message, message
    return message


# ---- the shipped (published) config ------------------------------------------------------------------------

def test_shipped_configs_load_with_the_published_values():
    c = Config.from_file(SHIPPED, SHIPPED_MTP)
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers) == (160000, 3072, 88)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.group_size) == (48, 8, 128, 6)
    assert (c.intermediate_size, c.dense_intermediate_size, c.num_experts, c.num_experts_per_tok) == (1536, 12288,
                                                                                                        256, 8)
    assert c.mlp_only_layers == (0,) and c.is_dense(0) and not c.is_dense(1)
    assert c.rotary_dim == 32 and c.rope_theta == 1e6 and c.swa_rope_theta == 1e4 and c.sliding_window == 4096
    assert c.weight_block_size == (128, 128) and c.quantized
    assert c.eos_token_id == (0,) and c.pad_token_id == 0 and c.bos_token_id is None
    assert c.scale == 128 ** -0.5 and c.ffn_out_scale == 0.53881590608 and c.logit_scale == 1.0
    assert c.out_scales(0) == (1.0, 1.0) and c.out_scales(1) == (1.0, 0.53881590608)
    assert not c.is_draft and c.mtp is not None


def test_the_published_layer_pattern():
    c = Config.from_file(SHIPPED, SHIPPED_MTP)
    full = tuple(i for i, t in enumerate(c.layer_types) if t == "full_attention")
    assert len(c.layer_types) == 88 and full == PUBLISHED_FULL and len(full) == 25
    assert c.layer_types.count("sliding_attention") == 63
    assert c.window(0) is None and c.window(2) == 4096 and c.window(5) is None and c.window(87) is None
    assert c.rope_theta_for(0) == 1e6 and c.rope_theta_for(2) == 1e4


def test_the_shipped_draft():
    d = Config.from_file(SHIPPED, SHIPPED_MTP).mtp
    assert d.is_draft and d.num_hidden_layers == 1 and d.layer_types == ("sliding_attention",)
    assert d.sliding_window == 512 and d.window(0) == 512 and d.rope_theta_for(0) == 1e4
    assert d.mlp_only_layers == () and not d.is_dense(0) and d.num_experts == 256
    assert d.fp32_residual_connection and d.num_draft_slots == 7 and d.num_target_layers == 88
    assert d.weight_block_size == (128, 128)


def test_draft_defaults_where_its_file_is_silent():
    d = load(d=without(draft(), "sliding_window", "swa_rope_theta", "fp32_residual_connection", "num_hidden_layers",
                       "mlp_only_layers")).mtp
    assert (d.sliding_window, d.swa_rope_theta, d.fp32_residual_connection) == (512, 1e4, True)
    assert d.num_hidden_layers == 1 and d.mlp_only_layers == ()
    full = load(d=dict(draft(), sliding_window=None)).mtp
    assert full.layer_types == ("full_attention",) and full.window(0) is None and full.rope_theta_for(0) == 1e6


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_shipped_config_shards_at_every_tp(tp):
    Config.from_file(SHIPPED, SHIPPED_MTP).check_tp(tp)


@pytest.mark.parametrize("tp", [0, 3, 16])
def test_check_tp_rejects_unsupported_degrees(tp):
    one_line_error(lambda: load().check_tp(tp), "tensor-parallel degree")


def test_from_dir_reads_both_configs_and_the_generation_config(tmp_path):
    c = load()
    c.write(tmp_path)
    assert (tmp_path / "mtp" / "config.json").exists()
    assert Config.from_dir(tmp_path) == c
    g = GenerationConfig.from_dir(tmp_path, c)  # no generation_config.json: the defaults, EOS from the config
    assert (g.temperature, g.top_k, g.top_p, g.eos_token_id) == (1.0, 20, 0.95, (0,))
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_k": 5, "top_p": 0.9,
                                                                 "eos_token_id": 0}))
    g = GenerationConfig.from_dir(tmp_path, c)
    assert (g.temperature, g.top_k, g.top_p, g.eos_token_id) == (0.7, 5, 0.9, (0,))


def test_from_dir_missing_or_broken_files(tmp_path):
    one_line_error(lambda: Config.from_dir(tmp_path), "config.json")
    (tmp_path / "config.json").write_text(json.dumps(target()))
    message = one_line_error(lambda: Config.from_dir(tmp_path), "mtp/config.json")  # no draft folder
    assert "no config file" in message
    (tmp_path / "mtp").mkdir()
    (tmp_path / "mtp" / "config.json").write_text("{not json")
    one_line_error(lambda: Config.from_dir(tmp_path), "not valid JSON")
    (tmp_path / "config.json").write_text("[1, 2]")
    (tmp_path / "mtp" / "config.json").write_text(json.dumps(draft()))
    one_line_error(lambda: Config.from_dir(tmp_path), "JSON object")


# ---- the layer pattern -----------------------------------------------------------------------------------

def test_layer_types_come_from_the_block_keys_and_a_layer_types_list_is_ignored():
    listed = ["sliding_attention"] * 88  # what a file may carry: never read
    c = load(with_(layer_types=listed))
    assert tuple(i for i, t in enumerate(c.layer_types) if t == "full_attention") == PUBLISHED_FULL
    small = with_(num_hidden_layers=7, first_layers_types=["sliding_attention"],
                  hybrid_layers_types_block=["full_attention", "sliding_attention"], num_hybrid_layers_block=2,
                  last_layers_types=["full_attention", "sliding_attention"], layer_types=["full_attention"] * 7)
    assert load(small).layer_types == ("sliding_attention", "full_attention", "sliding_attention", "full_attention",
                                       "sliding_attention", "full_attention", "sliding_attention")


@pytest.mark.parametrize("switch", ["use_sliding_window", "use_hybrid_layers"])
def test_either_switch_off_makes_every_layer_full(switch):
    c = load(with_(**{switch: False}))
    assert c.layer_types == ("full_attention",) * 88
    assert all(c.window(i) is None and c.rope_theta_for(i) == 1e6 for i in range(88))
    # the pattern's length is not checked then: there is no pattern
    assert load(with_(**{switch: False}, num_hybrid_layers_block=3)).layer_types == ("full_attention",) * 88
    # and a null window is fine
    assert load(with_(**{switch: False}, sliding_window=None)).sliding_window is None


def test_no_rope_layers_and_first_layers():
    c = load(with_(no_rope_layers=[3, 7]))
    assert c.rope_theta_for(3) is None and c.rope_theta_for(7) is None and c.rope_theta_for(2) == 1e4
    cut = c.first_layers(6)
    assert cut.num_hidden_layers == 6 and cut.layer_types == c.layer_types[:6] and cut.no_rope_layers == (3,)
    assert cut.mtp == c.mtp and cut.mlp_only_layers == (0,)
    one_line_error(lambda: c.first_layers(89), "layers")


# ---- partial RoPE ----------------------------------------------------------------------------------------

def test_rotary_dim_or_partial_rotary_factor():
    assert load(without(target(), "rotary_dim")).rotary_dim == 32  # the published default
    via_factor = with_(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.25})
    assert load(without(via_factor, "rotary_dim")).rotary_dim == 32
    half = with_(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5})
    assert load(without(half, "rotary_dim")).rotary_dim == 64
    assert load(half).rotary_dim == 32  # a top-level rotary_dim wins
    # a missing head_dim is the published 128 (SGLang's default), not hidden_size / heads, before the factor applies
    derived = without(dict(half, hidden_size=6144, num_attention_heads=24), "rotary_dim", "head_dim")
    c = load(derived, dict(draft(), hidden_size=6144, num_attention_heads=24))
    assert c.head_dim == 128 and c.rotary_dim == 64
    theta = load(without(with_(rope_parameters={"rope_type": "default", "rope_theta": 5e5}), "rope_theta"))
    assert theta.rope_theta == 5e5
    assert load(with_(rope_parameters=None, rope_scaling=None)).rotary_dim == 32


# ---- every invalid value: one line naming the key -----------------------------------------------------------

BAD_TARGET = [
    ("rotary_odd", dict(rotary_dim=31), "rotary_dim"),
    ("rotary_too_large", dict(rotary_dim=130), "rotary_dim"),
    ("rotary_zero", dict(rotary_dim=0), "rotary_dim"),
    ("rotary_string", dict(rotary_dim="32"), "rotary_dim"),
    ("factor_zero", dict(rotary_dim=None, rope_parameters={"partial_rotary_factor": 0}), "partial_rotary_factor"),
    ("factor_not_whole", dict(rotary_dim=None, rope_parameters={"partial_rotary_factor": 0.3}),
     "partial_rotary_factor"),
    ("pattern_short", dict(num_hybrid_layers_block=20), "num_hidden_layers"),
    ("pattern_long", dict(last_layers_types=["full_attention"] * 4), "num_hybrid_layers_block"),
    ("pattern_unknown_type", dict(hybrid_layers_types_block=["full_attention", "linear_attention",
                                                             "sliding_attention", "sliding_attention"]),
     "hybrid_layers_types_block"),
    ("pattern_not_list", dict(first_layers_types="full_attention"), "first_layers_types"),
    ("block_count_negative", dict(num_hybrid_layers_block=-1, first_layers_types=["full_attention"] * 88,
                                  last_layers_types=[], hybrid_layers_types_block=[]), "num_hybrid_layers_block"),
    ("router_dtype", dict(moe_router_dtype="bf16"), "moe_router_dtype"),
    ("hidden_act", dict(hidden_act="gelu"), "hidden_act"),
    ("rope_type", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_parameters.rope_type"),
    ("rope_scaling_type", dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.rope_type"),
    ("rope_not_object", dict(rope_parameters="default"), "rope_parameters"),
    ("window_null_with_sliding_layers", dict(sliding_window=None), "sliding_window"),
    ("window_zero", dict(sliding_window=0), "sliding_window"),
    ("heads_not_divisible", dict(num_attention_heads=44, num_key_value_heads=8), "num_key_value_heads"),
    ("experts_per_tok", dict(num_experts_per_tok=257), "num_experts_per_tok"),
    ("experts_zero", dict(num_experts=0), "num_experts"),
    ("vocab_float", dict(vocab_size=160000.0), "vocab_size"),
    ("vocab_bool", dict(num_key_value_heads=True), "num_key_value_heads"),
    ("mlp_only_out_of_range", dict(mlp_only_layers=[88]), "mlp_only_layers"),
    ("no_rope_negative", dict(no_rope_layers=[-1]), "no_rope_layers"),
    ("eps_zero", dict(rms_norm_eps=0.0), "rms_norm_eps"),
    ("theta_negative", dict(swa_rope_theta=-1.0), "swa_rope_theta"),
    ("out_scale_nan", dict(ffn_out_scale=float("nan")), "ffn_out_scale"),
    ("softmax_scale_zero", dict(softmax_scale=0.0), "softmax_scale"),
    ("tied", dict(tie_word_embeddings=True), "tie_word_embeddings"),
    ("bias", dict(attention_bias=True), "attention_bias"),
    ("lm_head_not_fp32", dict(enable_lm_head_fp32=False), "enable_lm_head_fp32"),
    ("eos_outside_vocab", dict(eos_token_id=[0, 160000]), "eos_token_id"),
    ("model_type", dict(model_type="llama"), "model_type"),
    ("quant_method", dict(quantization_config={"quant_method": "int8"}), "quantization_config"),
    ("quant_fmt", dict(quantization_config={"quant_method": "fp8", "fmt": "e5m2"}), "quantization_config"),
    ("quant_activation", dict(quantization_config={"quant_method": "fp8", "activation_scheme": "static"}),
     "activation_scheme"),
    ("quant_block", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128]}),
     "weight_block_size"),
]


@pytest.mark.parametrize("changes,key", [(c, k) for _, c, k in BAD_TARGET], ids=[n for n, _, _ in BAD_TARGET])
def test_an_invalid_target_value_is_one_line_naming_the_key(changes, key):
    raw = {k: v for k, v in with_(**changes).items() if v is not None or k not in ("rotary_dim",)}
    draft_raw = draft()
    if "quantization_config" in changes:  # the draft must agree, or that is the first error
        draft_raw["quantization_config"] = changes["quantization_config"]
    one_line_error(lambda: Config.from_dict(raw, draft_raw), key)


BAD_DRAFT = [
    ("hidden_differs", dict(hidden_size=4096, num_attention_heads=32), "hidden_size"),
    ("vocab_differs", dict(vocab_size=151936), "vocab_size"),
    ("quantization_differs", dict(quantization_config=None), "quantization_config"),
    ("two_layers", dict(num_hidden_layers=2), "num_hidden_layers"),
    ("draft_slots", dict(num_draft_slots=0), "num_draft_slots"),
    ("router_dtype", dict(moe_router_dtype="bf16"), "moe_router_dtype"),
    ("rotary_odd", dict(rotary_dim=33), "rotary_dim"),
    ("model_type", dict(model_type="iquest_q1"), "model_type"),
]


@pytest.mark.parametrize("changes,key", [(c, k) for _, c, k in BAD_DRAFT], ids=[n for n, _, _ in BAD_DRAFT])
def test_an_invalid_draft_is_one_line_naming_the_file_and_key(changes, key):
    raw = {k: v for k, v in {**draft(), **changes}.items() if v is not None}
    message = one_line_error(lambda: Config.from_dict(target(), raw), key)
    assert "mtp/config.json" in message


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "num_key_value_heads", "intermediate_size", "num_experts", "num_experts_per_tok"])
def test_a_missing_required_key_is_named(key):
    one_line_error(lambda: Config.from_dict(without(target(), key), draft()), key)


def test_a_draft_cannot_have_a_draft():
    one_line_error(lambda: Config.from_dict(draft(), draft()), "iquest_q1_mtp")


def test_direct_construction_is_validated_too():
    c = load()
    one_line_error(lambda: dataclasses.replace(c, rotary_dim=7), "rotary_dim")
    one_line_error(lambda: dataclasses.replace(c, moe_router_dtype="fp16"), "moe_router_dtype")


# ---- tensor-parallel divisibility names the key ----------------------------------------------------------

NOT_SHARDABLE = [
    ("vocab", dict(vocab_size=160004), dict(vocab_size=160004), 8, "vocab_size"),
    ("heads", dict(num_attention_heads=44, num_key_value_heads=4), {}, 8, "num_attention_heads"),
    ("expert_width", dict(intermediate_size=1540), {}, 8, "intermediate_size"),
    ("dense_width", dict(dense_intermediate_size=12290), {}, 4, "dense_intermediate_size"),
    ("hidden", dict(hidden_size=3071), dict(hidden_size=3071), 4, "hidden_size"),
    ("kv_split", dict(num_attention_heads=12, num_key_value_heads=3), {}, 2, "num_key_value_heads"),
    ("kv_replicate", dict(num_attention_heads=24, num_key_value_heads=6), {}, 8, "num_key_value_heads"),
    ("draft_width", {}, dict(intermediate_size=1540), 8, "mtp/config.json: intermediate_size"),
]


@pytest.mark.parametrize("t,d,tp,key", [(t, d, tp, k) for _, t, d, tp, k in NOT_SHARDABLE],
                         ids=[n for n, *_ in NOT_SHARDABLE])
def test_a_dimension_that_does_not_shard_is_named(t, d, tp, key):
    c = load(with_(**t), {**draft(), **d})
    c.check_tp(1)
    one_line_error(lambda: c.check_tp(tp), key)


def test_kv_heads_replicate_past_their_count():
    c = load(with_(num_attention_heads=16, num_key_value_heads=4), dict(draft(), num_attention_heads=16,
                                                                         num_key_value_heads=4))
    for tp in (1, 2, 4, 8):
        c.check_tp(tp)  # 4 KV heads over 8 ranks: each replicated twice


# ---- unknown keys, round trips -------------------------------------------------------------------------------

def test_unknown_keys_are_ignored():
    c = load(with_(some_future_key={"x": 1}, torch_dtype="bfloat16", transformers_version="9.9",
                   architectures=["Whatever"], n_shared_experts=1),
             dict(draft(), another_key=[1, 2]))
    assert c == load()


def test_round_trip_target_and_draft():
    for c in (load(), load(without(with_(use_hybrid_layers=False), "quantization_config"),
                           without(draft(), "quantization_config")),
              load(with_(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5}, rotary_dim=64,
                         no_rope_layers=[4], softmax_scale=0.1, eos_token_id=[0, 3]))):
        t, d = c.to_dict(), c.mtp.to_dict()
        json.dumps(t), json.dumps(d)  # plain JSON types only
        assert t["model_type"] == "iquest_q1" and d["model_type"] == "iquest_q1_mtp"
        assert t["architectures"] == ["IQuestQ1ForCausalLM"] and d["architectures"] == ["IQuestQ1MTP"]
        assert Config.from_dict(t, d) == c
        assert Config.from_dict(json.loads(json.dumps(t)), json.loads(json.dumps(d))) == c
        assert Config.from_dict(d) == c.mtp
        assert ("quantization_config" in t) == c.quantized


def test_the_draft_writes_its_one_layer_pattern():
    d = load().mtp.to_dict()
    assert d["first_layers_types"] == ["sliding_attention"] and d["num_hybrid_layers_block"] == 0
    assert d["hybrid_layers_types_block"] == [] and d["last_layers_types"] == [] and d["layer_types"] == \
        ["sliding_attention"]


def test_config_is_frozen():
    c = load()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 7  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        GenerationConfig().top_k = 3  # type: ignore[misc]


# ---- GenerationConfig --------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,key", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"),
])
def test_generation_config_validates_sampling(kwargs, key):
    one_line_error(lambda: GenerationConfig(**kwargs), key)


def test_generation_config_bounds_are_inclusive_where_allowed():
    check_sampling(0.0, 1, 1.0)
    assert GenerationConfig(temperature=0.0, top_k=1, top_p=1.0).to_dict()["top_p"] == 1.0


# ---- hypothesis: random layer patterns and shapes ------------------------------------------------------------

TYPES = st.sampled_from(["sliding_attention", "full_attention"])


@st.composite
def pattern(draw) -> dict:
    first = draw(st.lists(TYPES, max_size=3))
    block = draw(st.lists(TYPES, min_size=1, max_size=4))
    count = draw(st.integers(0, 6))
    last = draw(st.lists(TYPES, max_size=3))
    layers = len(first) + len(block) * count + len(last)
    if layers == 0:
        first = ["full_attention"]
        layers = 1
    nkv = draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([8, 16, 64, 128]))
    return dict(num_hidden_layers=layers, first_layers_types=first, hybrid_layers_types_block=block,
                num_hybrid_layers_block=count, last_layers_types=last,
                use_sliding_window=draw(st.booleans()), use_hybrid_layers=draw(st.booleans()),
                num_key_value_heads=nkv, num_attention_heads=nkv * draw(st.sampled_from([1, 2, 6])),
                head_dim=head_dim, rotary_dim=2 * draw(st.integers(1, head_dim // 2)),
                mlp_only_layers=sorted(draw(st.sets(st.integers(0, layers - 1), max_size=2))),
                sliding_window=draw(st.integers(1, 8192)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pattern())
def test_random_patterns_derive_and_round_trip(changes):
    c = load(with_(**changes), dict(draft(), num_attention_heads=changes["num_attention_heads"],
                                    num_key_value_heads=changes["num_key_value_heads"],
                                    head_dim=changes["head_dim"], rotary_dim=changes["rotary_dim"]))
    if changes["use_sliding_window"] and changes["use_hybrid_layers"]:
        want = (*changes["first_layers_types"], *changes["hybrid_layers_types_block"] *
                changes["num_hybrid_layers_block"], *changes["last_layers_types"])
    else:
        want = ("full_attention",) * changes["num_hidden_layers"]
    assert c.layer_types == want and len(want) == c.num_hidden_layers
    assert Config.from_dict(json.loads(json.dumps(c.to_dict())), json.loads(json.dumps(c.mtp.to_dict()))) == c
    assert c.group_size * c.num_key_value_heads == c.num_attention_heads


def test_draft_config_may_nest_the_targets_keys():
    """SGLang's draft config form: the target's keys under target_config, the draft's own keys beside them (and
    winning); a draft slot count above 7 loads (the engine verifies at most 7 drafts a round)."""
    own = {k: v for k, v in draft().items() if k in ("model_type", "architectures", "num_hidden_layers",
                                                      "mlp_only_layers", "sliding_window", "swa_rope_theta",
                                                      "fp32_residual_connection", "num_draft_slots",
                                                      "num_target_layers")}
    nested = load(target(), dict(own, target_config=target(), num_draft_slots=8))
    flat = load(target(), draft())
    assert nested.mtp.sliding_window == flat.mtp.sliding_window == 512
    assert nested.mtp.hidden_size == flat.mtp.hidden_size and nested.mtp.layer_types == flat.mtp.layer_types
    assert nested.mtp.num_draft_slots == 8
    with pytest.raises(ConfigError, match="mtp/config.json: target_config"):
        load(target(), dict(own, target_config=[1]))
