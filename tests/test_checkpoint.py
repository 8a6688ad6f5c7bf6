"""Checkpoint contract (docs/model.md, "Checkpoint" and "Tensor parallelism"): the published layout (target + mtp/, packed
or per-expert experts, BF16 or block FP8), what is skipped, rank slices with scale blocks that straddle ranks, and
every rejection one line naming the tensor."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from iquest.fixtures.make import make_fixture, preset_config, random_weights
from iquest.reference.checkpoint import (INDEX_FILE, CheckpointError, CheckpointReader, Shard, save_checkpoint,
                                         shard_range, stored_tensors, tensor_specs)
from iquest.reference.config import Config
from iquest.reference.fp8 import E4M3, E4M3_MAX, act_quant, dequantize, expand_scales, quantize, scale_shape

ROOT = Path(__file__).resolve().parent.parent
SEED = 5
ONE_FILE = "model-00001-of-00001.safetensors"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: dtype, shape and bytes."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


@pytest.fixture(scope="module")
def logical() -> dict[str, torch.Tensor]:
    """What make_fixture("tiny", seed=SEED) writes, as logical tensors."""
    return random_weights(preset_config("tiny"), SEED)


@pytest.fixture(scope="module")
def logical_bf16() -> dict[str, torch.Tensor]:
    return random_weights(preset_config("tiny", "bf16"), SEED)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[tuple[str, bool], Path]:
    """tiny at SEED in every form: (weights, packed) -> folder."""
    root = tmp_path_factory.mktemp("tiny")
    return {(w, p): make_fixture("tiny", root / f"{w}-{'packed' if p else 'unpacked'}", SEED, packed=p, weights=w)
            for w in ("fp8", "bf16") for p in (True, False)}


@pytest.fixture(scope="module")
def tiny(folders) -> Path:
    return folders[("fp8", True)]


@pytest.fixture(scope="module")
def tiny_tp8(tmp_path_factory) -> Path:
    return make_fixture("tiny-tp8", tmp_path_factory.mktemp("tiny_tp8"), seed=6)


def write_raw(out: Path, config: Config, stored: dict[str, torch.Tensor], index: bool = True) -> Path:
    """Write stored tensors (names as `stored_tensors` gives them: the draft's under `mtp/`) without the writer's
    checks, one file per folder, so that broken checkpoints can be made."""
    config.write(out)
    for folder, prefix in ((out, ""), (out / "mtp", "mtp/")):
        part = {n[len(prefix):]: t.contiguous() for n, t in stored.items()
                if n.startswith(prefix) and (prefix or not n.startswith("mtp/"))}
        folder.mkdir(parents=True, exist_ok=True)
        save_file(part, str(folder / ONE_FILE))
        if index:
            (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {n: ONE_FILE for n in part}}))
    return out


def one_line(exc: pytest.ExceptionInfo, *needles: str) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, message
    return message


# ---- the layout ------------------------------------------------------------------------------------------

def test_layout_names_and_shapes():
    c = preset_config("tiny")  # H 64, 4 q heads and 2 KV heads of 16, I 32, dense 96, 8 experts, V 512
    specs = tensor_specs(c)
    dense = 4 + 4 + 2 + 1 + 3   # norms (with ffn_out_norm), q/k/v/o, q/k norms, sink_k, gate/up/down
    moe = 3 + 4 + 2 + 1 + 1 + 3 * c.num_experts
    draft = 6 + 4 + 4 + 2 + 1 + 1 + 3 * c.mtp.num_experts  # + embed, lm_head, enorm, hnorm, eh_proj, final norm
    assert len(specs) == 3 + dense + 3 * moe + draft
    assert specs["model.layers.0.self_attn.sink_k"].shape == (2, 16)
    assert specs["model.layers.0.mlp.gate_proj.weight"].shape == (96, 64)
    assert specs["model.layers.0.mlp.down_proj.weight"].shape == (64, 96)
    assert "model.layers.1.ffn_out_norm.weight" not in specs and "model.layers.0.ffn_out_norm.weight" in specs
    assert specs["model.layers.1.mlp.experts.7.gate_proj.weight"].shape == (32, 64)
    assert specs["model.layers.1.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert specs["model.layers.1.mlp.router.weight"].shape == (8, 64)
    assert specs["mtp/mtp.eh_proj.weight"].shape == (64, 128) and specs["mtp/mtp.eh_proj.weight"].quantized
    for name in ("embed_tokens.weight", "lm_head.weight", "mtp.enorm.weight", "mtp.hnorm.weight",
                 "mtp.final_layernorm.weight", "mtp.mtp_model_layer.ffn_out_norm.weight",
                 "mtp.mtp_model_layer.self_attn.sink_k", "mtp.mtp_model_layer.mlp.experts.0.up_proj.weight"):
        assert "mtp/" + name in specs, name
    quantized = {n for n, s in specs.items() if s.quantized}
    assert all(("proj" in n and "norm" not in n) for n in quantized)
    assert not any(n.endswith(("norm.weight", "sink_k", "router.weight", "embed_tokens.weight", "lm_head.weight"))
                   for n in quantized)


def test_no_sink_tensor_when_sinks_are_off():
    c = preset_config("tiny")
    raw, draft = c.to_dict(), c.mtp.to_dict()
    off = Config.from_dict(dict(raw, enable_sink_attention=False), dict(draft, enable_sink_attention=False))
    assert not any(n.endswith("sink_k") for n in tensor_specs(off))


# ---- both storage forms and both weight formats read identically ---------------------------------------------

@pytest.mark.parametrize("weights", ["fp8", "bf16"])
def test_packed_and_per_expert_folders_read_identically(folders, logical, logical_bf16, weights):
    want = logical if weights == "fp8" else logical_bf16
    packed, unpacked = CheckpointReader(folders[(weights, True)]), CheckpointReader(folders[(weights, False)])
    assert packed.config == unpacked.config == preset_config("tiny", weights)
    prefixes = ["model.layers.1.", "model.layers.2.", "model.layers.3.", "mtp/mtp.mtp_model_layer."]
    assert all(packed.is_packed(p) and not unpacked.is_packed(p) for p in prefixes)
    stored = load_file(next(folders[(weights, True)].glob("*.safetensors")))
    assert stored["model.layers.1.mlp.experts.fc"].shape == (8, 64, 64)  # [E, 2I, H]
    assert stored["model.layers.1.mlp.experts.proj"].shape == (8, 64, 32)  # [E, H, I]
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" not in stored
    assert set(want) == {n for n in packed._where}
    for name, t in want.items():
        a, b = packed.read(name), unpacked.read(name)
        assert same(a, t) and same(b, t), name


def test_the_packed_rows_are_gate_then_up(tiny, logical):
    fc = load_file(tiny / ONE_FILE)["model.layers.2.mlp.experts.fc"]
    for e in (0, 5):
        assert same(fc[e, :32], logical[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"])
        assert same(fc[e, 32:], logical[f"model.layers.2.mlp.experts.{e}.up_proj.weight"])


def test_fp8_and_bf16_forms(folders):
    fp8, bf16 = CheckpointReader(folders[("fp8", True)]), CheckpointReader(folders[("bf16", True)])
    assert fp8.block == (16, 16) and bf16.block is None and not bf16.config.quantized
    assert "quantization_config" not in json.loads((folders[("bf16", True)] / "config.json").read_text())
    q = "model.layers.1.self_attn.q_proj.weight"
    s8, s16 = fp8.read_weight(q), bf16.read_weight(q)
    assert s8.weight.dtype == E4M3 and s8.scale.shape == (4, 4) and s8.scale.dtype == torch.float32
    assert s16.weight.dtype == torch.bfloat16 and s16.scale is None and s16.offset == (0, 0)
    assert not any(n.endswith("_scale_inv") for n in bf16._where)
    # the same seed draws the same real weights: BF16 holds what FP8 quantized
    real8 = dequantize(s8.weight, s8.scale, fp8.block)
    assert (real8 - s16.weight.double()).abs().max() <= 2.0 ** -4 * s16.weight.double().abs().max() + 1e-2
    assert fp8.read("model.layers.1.mlp.router.weight").dtype == torch.float32
    assert same(fp8.read("model.norm.weight"), bf16.read("model.norm.weight"))


def test_shipped_config_layout_is_consistent():
    """The published layout at full size, from the config alone (no weights): counts the spec states."""
    c = Config.from_file(ROOT / "configs" / "iquest-q1.json", ROOT / "configs" / "iquest-q1-mtp.json")
    specs = tensor_specs(c)
    assert specs["model.layers.5.mlp.experts.255.gate_proj.weight"].shape == (1536, 3072)
    assert specs["model.layers.0.mlp.gate_proj.weight"].shape == (12288, 3072)
    assert specs["model.layers.87.self_attn.q_proj.weight"].shape == (6144, 3072)
    assert specs["mtp/mtp.mtp_model_layer.mlp.experts.255.down_proj.weight"].shape == (3072, 1536)
    assert "model.layers.88.attention_norm.weight" not in specs
    assert sum(1 for n in specs if n.startswith("model.layers.") and n.endswith("router.weight")) == 87


# ---- what the reader skips or accepts ------------------------------------------------------------------------

def test_training_heads_in_the_main_folder_are_skipped(tmp_path, logical):
    c = preset_config("tiny")
    stored = stored_tensors(c, logical, packed=True)
    stored["mtp_layers.0.enorm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    stored["mtp_layers.0.eh_proj.weight"] = torch.full((3, 3), float("nan"), dtype=torch.float16)  # never read
    d = write_raw(tmp_path / "m", c, stored)
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["mtp_layers.1.enorm.weight"] = "model-mtp-heads.safetensors"  # a file not shipped
    (d / INDEX_FILE).write_text(json.dumps(index))
    r = CheckpointReader(d)
    assert not any("mtp_layers" in n for n in r.names())
    assert same(r.read("model.layers.1.self_attn.q_proj.weight"), logical["model.layers.1.self_attn.q_proj.weight"])


def test_target_final_norm_in_mtp_is_ignored_but_not_in_the_main_folder(tmp_path, logical):
    c = preset_config("tiny")
    stored = stored_tensors(c, logical, packed=True)
    stored["mtp/target_final_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    CheckpointReader(write_raw(tmp_path / "a", c, stored))
    del stored["mtp/target_final_norm.weight"]
    stored["target_final_norm.weight"] = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(write_raw(tmp_path / "b", c, stored))
    one_line(info, "unexpected tensor target_final_norm.weight")


def test_an_fp8_folder_may_keep_a_quantizable_weight_plain(tmp_path, logical):
    """SGLang builds the draft's eh_proj unquantized, so an FP8 folder may store it bf16 without a _scale_inv: read as
    plain; a plain weight that keeps its scale, or an E4M3 weight without one, is still refused."""
    c = preset_config("tiny")
    name = "mtp/mtp.eh_proj.weight"
    real = dequantize(logical[name], logical[name + "_scale_inv"], c.weight_block_size, torch.float32)
    stored = stored_tensors(c, logical, packed=True)
    stored[name] = real.to(torch.bfloat16)
    del stored[name + "_scale_inv"]
    r = CheckpointReader(write_raw(tmp_path / "plain", c, stored))
    assert not r.is_quantized(name) and r.is_quantized("model.layers.1.self_attn.q_proj.weight")
    s = r.read_weight(name, 2, 1)
    assert s.scale is None and same(s.weight, real.to(torch.bfloat16)[:, real.shape[1] // 2:])
    stored[name + "_scale_inv"] = logical[name + "_scale_inv"]
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(write_raw(tmp_path / "scaled", c, stored))
    one_line(info, name, "F8_E4M3")
    stored[name] = logical[name]
    del stored[name + "_scale_inv"]
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(write_raw(tmp_path / "unscaled", c, stored))
    one_line(info, "missing tensor", name + "_scale_inv")


def test_sink_k_with_a_leading_one(tmp_path, logical):
    c = preset_config("tiny")
    stored = stored_tensors(c, logical, packed=True)
    sinks = [n for n in stored if n.endswith("sink_k")]
    assert len(sinks) == 5
    for n in sinks:
        stored[n] = stored[n].unsqueeze(0)  # [1, Nkv, D], as some published files keep it
    r = CheckpointReader(write_raw(tmp_path / "m", c, stored))
    for n in sinks:
        assert same(r.read(n), logical[n]), n
        parts = [r.read_weight(n, 2, rank).weight for rank in range(2)]
        assert all(p.shape == (1, 16) for p in parts) and same(torch.cat(parts), logical[n])
    stored[sinks[0]] = torch.cat([stored[sinks[0]]] * 2)  # [2, Nkv, D]: no
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(write_raw(tmp_path / "bad", c, stored))
    one_line(info, f"tensor {sinks[0]}: shape (2, 2, 16)")


def test_reader_without_an_index_reads_the_files(tmp_path, logical):
    c = preset_config("tiny")
    r = CheckpointReader(write_raw(tmp_path / "m", c, stored_tensors(c, logical, packed=False), index=False))
    assert same(r.read("mtp/mtp.enorm.weight"), logical["mtp/mtp.enorm.weight"])


def test_a_config_that_does_not_match_the_files(folders):
    tiny, bf16 = folders[("fp8", True)], folders[("bf16", True)]
    c = preset_config("tiny")
    more = Config.from_dict(dict(c.to_dict(), num_experts=9), dict(c.mtp.to_dict(), num_experts=9))
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(tiny, more)
    one_line(info, "missing tensor model.layers.1.mlp.experts.8.gate_proj.weight_scale_inv")
    c = preset_config("tiny", "bf16")  # no scales: the first shape that differs is named
    more = Config.from_dict(dict(c.to_dict(), num_experts=9), dict(c.mtp.to_dict(), num_experts=9))
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(bf16, more)
    one_line(info, "tensor model.layers.1.mlp.router.weight: shape (8, 64), expected (9, 64)")


# ---- rejections at open: one line naming the tensor ------------------------------------------------------------

Q = "model.layers.1.self_attn.q_proj.weight"
NORM = "model.layers.2.attention_norm.weight"
FC = "model.layers.3.mlp.experts.fc"
PROJ = "model.layers.3.mlp.experts.proj"
DOWN = "model.layers.3.mlp.experts.3.down_proj.weight"
SINK = "model.layers.1.self_attn.sink_k"
ROUTER = "model.layers.2.mlp.router.weight"
EH = "mtp/mtp.eh_proj.weight"
ENORM = "mtp/mtp.enorm.weight"
DRAFT_Q = "mtp/mtp.mtp_model_layer.self_attn.q_proj.weight"


def _set(name, value):
    return lambda t: t.update({name: value(t[name]) if callable(value) else value})


HEADER_CASES = [
    ("missing", lambda t: t.pop(Q), f"missing tensor {Q}"),
    ("missing_in_mtp", lambda t: t.pop(ENORM), f"missing tensor {ENORM}"),
    ("missing_scale", lambda t: t.pop(DOWN + "_scale_inv"), f"missing tensor {DOWN}_scale_inv"),
    ("missing_packed_proj", lambda t: t.pop(PROJ), f"missing tensor {PROJ}"),
    ("extra", _set("model.layers.0.mlp.shared_experts.weight", torch.zeros(2)),
     "unexpected tensor model.layers.0.mlp.shared_experts.weight"),
    ("extra_in_mtp", _set("mtp/mtp.shared_head.norm.weight", torch.zeros(2)),
     "unexpected tensor mtp/mtp.shared_head.norm.weight"),
    ("extra_scale_of_a_norm", _set(NORM + "_scale_inv", torch.ones(1, 1)), f"unexpected tensor {NORM}_scale_inv"),
    ("wrong_shape", _set(NORM, torch.ones(63, dtype=torch.bfloat16)), f"tensor {NORM}: shape (63,), expected (64,)"),
    ("wrong_shape_fp8", _set(Q, lambda w: w[:, :48]), f"tensor {Q}: shape (64, 48)"),
    ("wrong_shape_packed", _set(FC, lambda w: w[:, :48]), f"tensor {FC} (holding"),
    ("wrong_shape_in_mtp", _set(EH, lambda w: w[:, :64]), f"tensor {EH}: shape (64, 64)"),
    ("wrong_dtype", _set(NORM, lambda w: w.half()), f"tensor {NORM}: dtype F16"),
    ("wrong_dtype_fp8", _set(Q, lambda w: w.to(torch.bfloat16)), f"tensor {Q}: dtype BF16, expected F8_E4M3"),
    ("wrong_dtype_packed", _set(PROJ, lambda w: w.to(torch.bfloat16)), f"tensor {PROJ} (holding"),
    ("wrong_dtype_scale", _set(Q + "_scale_inv", lambda s: s.to(torch.bfloat16)), f"tensor {Q}_scale_inv: dtype"),
    ("wrong_dtype_embedding", _set("model.embed_tokens.weight", lambda w: w.to(E4M3)),
     "tensor model.embed_tokens.weight: dtype F8_E4M3"),
    ("scale_grid", _set(Q + "_scale_inv", torch.ones(4, 8)), f"tensor {Q}_scale_inv: scale shape (4, 8)"),
    ("scale_grid_transposed", _set(DOWN + "_scale_inv", lambda s: s.T), f"tensor {DOWN}_scale_inv: scale shape"),
    ("scale_grid_in_mtp", _set(EH + "_scale_inv", lambda s: s[:, :4]), f"tensor {EH}_scale_inv: scale shape"),
]


@pytest.mark.parametrize("mutate,message", [(m, msg) for _, m, msg in HEADER_CASES],
                         ids=[n for n, _, _ in HEADER_CASES])
def test_layout_errors_are_rejected_at_open(tmp_path, logical, mutate, message):
    c = preset_config("tiny")
    stored = stored_tensors(c, logical, packed=True)
    mutate(stored)
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(write_raw(tmp_path / "m", c, stored))
    one_line(info, message)


def test_bf16_checkpoint_rejects_fp8_projections(tmp_path, logical_bf16, logical):
    c = preset_config("tiny", "bf16")
    stored = stored_tensors(c, logical_bf16, packed=False)
    stored[Q] = logical[Q]  # E4M3 where the config says BF16
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(write_raw(tmp_path / "a", c, stored))
    one_line(info, f"tensor {Q}: dtype F8_E4M3, expected BF16 or F32")
    stored[Q] = logical_bf16[Q]
    stored[Q + "_scale_inv"] = logical[Q + "_scale_inv"]
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(write_raw(tmp_path / "b", c, stored))
    one_line(info, f"unexpected tensor {Q}_scale_inv")


def test_a_mixed_expert_layer_is_rejected(tmp_path, logical):
    c = preset_config("tiny")
    stored = stored_tensors(c, logical, packed=True)
    stored["model.layers.3.mlp.experts.0.gate_proj.weight"] = logical["model.layers.3.mlp.experts.0.gate_proj.weight"]
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(write_raw(tmp_path / "m", c, stored))
    one_line(info, "unexpected tensor model.layers.3.mlp.experts.0.gate_proj.weight")


def test_no_draft_folder(tmp_path, tiny):
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    shutil.rmtree(d / "mtp")
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(d)
    one_line(info, "no draft folder", str(d / "mtp"))
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(d, preset_config("tiny"))
    one_line(info, "no draft folder")


def test_no_folder_and_no_weights(tmp_path):
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(tmp_path / "nope")
    one_line(info, "does not exist")
    preset_config("tiny").write(tmp_path)
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(tmp_path)
    one_line(info, "no model.safetensors.index.json and no *.safetensors file")


@pytest.mark.parametrize("folder", ["", "mtp"])
def test_a_file_named_by_the_index_is_missing(tmp_path, logical, folder):
    out = tmp_path / "sharded"
    save_checkpoint(out, preset_config("tiny"), logical, max_shard_bytes=16 << 10)
    where = out / folder
    files = sorted(where.glob("*.safetensors"))
    assert len(files) > 2
    files[1].unlink()
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(out)
    message = one_line(info, f"its file {files[1].name} is missing")
    named = message.split("tensor ", 1)[1].split(":", 1)[0]
    assert json.loads((where / INDEX_FILE).read_text())["weight_map"][named] == files[1].name


def test_an_index_naming_the_wrong_file(tmp_path, logical):
    out = tmp_path / "sharded"
    save_checkpoint(out, preset_config("tiny"), logical, max_shard_bytes=16 << 10)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0] and not n.startswith("model.layers.3"))
    index["weight_map"][name] = files[-1]
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(out)
    one_line(info, f"tensor {name}", f"{files[-1]} does not hold {name}")


@pytest.mark.parametrize("text", ["{not json", json.dumps({"metadata": {}}), json.dumps({"weight_map": ["a"]}),
                                  json.dumps([1, 2]), json.dumps({"weight_map": {"model.norm.weight": 3}})],
                         ids=["bad_json", "no_weight_map", "weight_map_list", "top_level_list", "file_not_str"])
@pytest.mark.parametrize("folder", ["", "mtp"])
def test_a_malformed_index(tmp_path, tiny, text, folder):
    out = tmp_path / "m"
    shutil.copytree(tiny, out)
    (out / folder / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(out)
    one_line(info, f"{INDEX_FILE} is malformed")


@pytest.mark.parametrize("folder", ["", "mtp"])
@pytest.mark.parametrize("damage", ["data_cut", "header_cut", "not_safetensors", "bad_header"])
def test_a_damaged_safetensors_file(tmp_path, tiny, folder, damage):
    out = tmp_path / "m"
    shutil.copytree(tiny, out)
    f = out / folder / ONE_FILE
    data = f.read_bytes()
    f.write_bytes({"data_cut": data[: len(data) // 2], "header_cut": data[:100],
                   "not_safetensors": b"not a checkpoint at all",
                   "bad_header": (20).to_bytes(8, "little") + b"{this is not json!!}" + data[28:]}[damage])
    with pytest.raises(CheckpointError) as info:
        CheckpointReader(out)
    message = one_line(info, str(f))
    if damage in ("data_cut", "header_cut"):
        assert "truncated" in message and str(f.stat().st_size) in message


# ---- rejections at read: values -------------------------------------------------------------------------------

def _poke(name, index, value):
    def mutate(t):
        t[name] = t[name].clone()
        t[name][index] = value
    return mutate


VALUE_CASES = [
    ("nan_bf16_norm", NORM, (5,), float("nan"), NORM, "non-finite"),
    ("inf_lm_head", "lm_head.weight", (300, 7), float("inf"), "lm_head.weight", "non-finite"),
    ("nan_fp32_router", ROUTER, (3, 1), float("nan"), ROUTER, "non-finite"),
    ("nan_sink", SINK, (1, 3), float("nan"), SINK, "non-finite"),
    ("nan_scale", DOWN + "_scale_inv", (1, 0), float("nan"), DOWN + "_scale_inv", "non-finite"),
    ("inf_scale", Q + "_scale_inv", (0, 0), float("inf"), Q + "_scale_inv", "non-finite"),
    ("zero_scale", Q + "_scale_inv", (2, 1), 0.0, Q + "_scale_inv", "non-positive"),
    ("negative_scale", Q + "_scale_inv", (3, 3), -1.0, Q + "_scale_inv", "non-positive"),
    ("nan_in_mtp", ENORM, (0,), float("nan"), ENORM, "non-finite"),
    ("zero_scale_in_mtp", DRAFT_Q + "_scale_inv", (0, 0), 0.0, DRAFT_Q + "_scale_inv", "non-positive"),
]


@pytest.mark.parametrize("name,index,value,bad,kind", [c[1:] for c in VALUE_CASES], ids=[c[0] for c in VALUE_CASES])
def test_bad_values_are_found_when_read(tmp_path, logical, name, index, value, bad, kind):
    c = preset_config("tiny")
    stored = stored_tensors(c, logical, packed=True)
    _poke(name, index, value)(stored)
    r = CheckpointReader(write_raw(tmp_path / "m", c, stored))  # headers are fine: values are checked when read
    r.read("model.norm.weight")
    with pytest.raises(CheckpointError) as info:
        r.read(bad)
    one_line(info, f"tensor {bad} holds {kind}")
    weight = bad.removesuffix("_scale_inv")
    with pytest.raises(CheckpointError) as info:
        r.read_weight(weight)
    one_line(info, bad)


def test_non_finite_values_in_a_bf16_checkpoints_projection_and_packed_experts(tmp_path, logical_bf16):
    c = preset_config("tiny", "bf16")
    stored = stored_tensors(c, logical_bf16, packed=True)
    _poke(FC, (2, 40, 3), float("inf"))(stored)  # expert 2, up rows (32..63)
    r = CheckpointReader(write_raw(tmp_path / "m", c, stored))
    r.read_weight("model.layers.3.mlp.experts.2.gate_proj.weight")
    r.read_weight("model.layers.3.mlp.experts.1.up_proj.weight")
    with pytest.raises(CheckpointError) as info:
        r.read_weight("model.layers.3.mlp.experts.2.up_proj.weight")
    one_line(info, "tensor model.layers.3.mlp.experts.2.up_proj.weight holds non-finite")


def test_a_bad_value_outside_a_rank_slice_does_not_stop_that_rank(tmp_path, logical):
    c = preset_config("tiny")
    stored = stored_tensors(c, logical, packed=True)
    _poke("lm_head.weight", (300, 7), float("inf"))(stored)  # row 300: rank 1 of 2
    r = CheckpointReader(write_raw(tmp_path / "m", c, stored))
    r.read_weight("lm_head.weight", 2, 0)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        r.read_weight("lm_head.weight", 2, 1)


# ---- tensor-parallel slices --------------------------------------------------------------------------------

def expected_part(spec, c: Config, tp: int, rank: int) -> tuple[int, int, int] | None:
    """docs/model.md's split written out: (dim, start, stop) of a rank's part, None when it holds the whole tensor."""
    if spec.split is None or tp == 1:
        return None
    kind, unit = spec.split
    dim = 1 if kind == "cols" else 0
    size = spec.shape[dim]
    if kind == "kv_rows" and tp > c.num_key_value_heads:
        head = rank // (tp // c.num_key_value_heads)
        return (0, head * unit, (head + 1) * unit)
    return (dim, rank * size // tp, (rank + 1) * size // tp)


def check_rank_slices(r: CheckpointReader, tp: int) -> dict[str, int]:
    """Every tensor's slice on every rank against the full tensor: shapes, bytes, scale blocks and the dequantized
    values (with Shard.offset) equal to the full dequantized tensor's slice. Returns counts of what was seen."""
    block = r.block
    seen = {"split": 0, "straddling": 0}
    for name, spec in r.specs.items():
        c = r.config.mtp if name.startswith("mtp/") else r.config
        full = r.read_weight(name)
        quantized = full.scale is not None
        full_real = dequantize(full.weight, full.scale, block) if quantized else full.weight.double()
        for rank in range(tp):
            part = expected_part(spec, c, tp, rank)
            assert shard_range(spec, c, tp, rank) == part, name
            s = r.read_weight(name, tp, rank)
            assert isinstance(s, Shard)
            if part is None:
                assert same(s.weight, full.weight) and s.offset == (0, 0), name
                assert (s.scale is None) == (not quantized) and (s.scale is None or same(s.scale, full.scale))
                continue
            dim, start, stop = part
            seen["split"] += 1
            want_shape = list(full.weight.shape)
            want_shape[dim] = stop - start
            assert list(s.weight.shape) == want_shape, name  # the rank read its part only
            assert same(s.weight, full.weight.narrow(dim, start, stop - start)), (name, rank)
            if not quantized:
                assert s.scale is None and s.offset == (0, 0)
                continue
            b = block[dim]
            offset = [0, 0]
            offset[dim] = start % b
            assert s.offset == tuple(offset), (name, rank)
            assert s.scale.shape[dim] == math.ceil(stop / b) - start // b
            assert s.scale.shape[1 - dim] == full.scale.shape[1 - dim]
            seen["straddling"] += start % b != 0 or stop % b != 0
            real = dequantize(s.weight, s.scale, block, offset=s.offset)
            assert torch.equal(real, full_real.narrow(dim, start, stop - start)), (name, rank)
    return seen


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_rank_slices_tiny_tp8(tiny_tp8, tp):
    r = CheckpointReader(tiny_tp8)
    r.config.check_tp(tp)
    seen = check_rank_slices(r, tp)
    if tp > 1:
        assert seen["split"] > 100
    if tp == 8:  # experts: 48 rows = 6 a rank, 16-row blocks: most ranks start or end inside a block
        assert seen["straddling"] > 100
        s = r.read_weight("model.layers.1.mlp.experts.5.gate_proj.weight", 8, 3)  # rows 18..24: block 1 at 2
        assert s.weight.shape == (6, 128) and s.offset == (2, 0) and s.scale.shape == (1, 8)
        s = r.read_weight("model.layers.1.mlp.experts.5.up_proj.weight", 8, 2)  # rows 12..18: blocks 0, 1
        assert s.offset == (12, 0) and s.scale.shape == (2, 8)
        s = r.read_weight("mtp/mtp.mtp_model_layer.mlp.experts.0.down_proj.weight", 8, 5)  # cols 30..36
        assert s.weight.shape == (128, 6) and s.offset == (0, 14) and s.scale.shape == (8, 2)


def test_kv_heads_replicated_past_their_count(tiny_tp8):
    r = CheckpointReader(tiny_tp8)  # 4 KV heads over 8 ranks: ranks 2h and 2h+1 hold head h
    for name in ("model.layers.2.self_attn.k_proj.weight", "model.layers.2.self_attn.sink_k",
                 "mtp/mtp.mtp_model_layer.self_attn.v_proj.weight"):
        parts = [r.read_weight(name, 8, rank) for rank in range(8)]
        for h in range(4):
            assert same(parts[2 * h].weight, parts[2 * h + 1].weight)
        assert all(p.weight.shape[0] == (1 if name.endswith("sink_k") else 16) for p in parts)


@pytest.mark.parametrize("weights,packed", [("fp8", False), ("bf16", True), ("bf16", False)])
def test_rank_slices_in_every_form(tmp_path, weights, packed):
    r = CheckpointReader(make_fixture("tiny-tp8", tmp_path / "m", 6, packed=packed, weights=weights))
    assert check_rank_slices(r, 8)["split"] > 100


def published_like(weights: str = "fp8") -> Config:
    """The published dimensions where scale blocks straddle ranks (experts 1536 wide, 128x128 blocks: 192 rows a
    rank at TP 8), with small column counts so it is fast: hidden 256, 4 q / 4 KV heads of 64."""
    raw = dict(model_type="iquest_q1", vocab_size=64, hidden_size=256, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=8, head_dim=32, rotary_dim=16, intermediate_size=1536,
               dense_intermediate_size=1536, num_experts=2, num_experts_per_tok=1, mlp_only_layers=[0],
               first_layers_types=["full_attention"], hybrid_layers_types_block=["sliding_attention"],
               num_hybrid_layers_block=1, last_layers_types=[])
    if weights == "fp8":
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                      "activation_scheme": "dynamic"}
    draft = {k: v for k, v in raw.items() if k not in ("num_hidden_layers", "mlp_only_layers")}
    draft["model_type"] = "iquest_q1_mtp"
    return Config.from_dict(raw, draft)


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory) -> Path:
    c = published_like()
    out = tmp_path_factory.mktemp("published_like")
    save_checkpoint(out, c, random_weights(c, 11), packed=True)
    return out


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_rank_slices_at_published_expert_dimensions(published_dir, tp):
    r = CheckpointReader(published_dir)
    seen = check_rank_slices(r, tp)
    assert seen["split"] > 0
    if tp == 8:
        assert seen["straddling"] > 0
        gate = "model.layers.1.mlp.experts.1.gate_proj.weight"
        for rank in range(8):  # 192 rows a rank of 128-row blocks: odd ranks start mid-block
            s = r.read_weight(gate, 8, rank)
            assert s.weight.shape == (192, 256) and s.offset == (192 * rank % 128, 0) and s.scale.shape == (2, 2)
        s = r.read_weight("mtp/mtp.mtp_model_layer.mlp.experts.0.down_proj.weight", 8, 3)  # cols 576..768
        assert s.weight.shape == (256, 192) and s.offset == (0, 64) and s.scale.shape == (2, 2)
        s = r.read_weight("model.layers.0.mlp.down_proj.weight", 8, 5)  # the dense MLP alike
        assert s.offset == (0, 64) and s.weight.shape == (256, 192)


def test_shard_range_by_hand():
    c = preset_config("tiny-tp8")  # Nq 16, Nkv 4, D 16, H 128, I 48, dense 128, V 512
    s = tensor_specs(c)
    L = "model.layers.1."
    assert shard_range(s[L + "self_attn.q_proj.weight"], c, 8, 3) == (0, 3 * 32, 4 * 32)
    assert shard_range(s[L + "self_attn.o_proj.weight"], c, 8, 3) == (1, 3 * 32, 4 * 32)
    assert shard_range(s[L + "self_attn.k_proj.weight"], c, 8, 5) == (0, 2 * 16, 3 * 16)  # head 5 // 2
    assert shard_range(s[L + "self_attn.k_proj.weight"], c, 4, 3) == (0, 3 * 16, 4 * 16)
    assert shard_range(s[L + "self_attn.k_proj.weight"], c, 2, 1) == (0, 32, 64)
    assert shard_range(s[L + "self_attn.sink_k"], c, 8, 5) == (0, 2, 3)
    assert shard_range(s[L + "self_attn.sink_k"], c, 2, 1) == (0, 2, 4)
    assert shard_range(s[L + "mlp.experts.0.gate_proj.weight"], c, 8, 7) == (0, 42, 48)
    assert shard_range(s[L + "mlp.experts.0.down_proj.weight"], c, 8, 7) == (1, 42, 48)
    assert shard_range(s["model.embed_tokens.weight"], c, 8, 1) == (0, 64, 128)
    assert shard_range(s["mtp/lm_head.weight"], c, 4, 3) == (0, 384, 512)
    assert shard_range(s["mtp/mtp.eh_proj.weight"], c, 8, 1) == (1, 32, 64)
    assert shard_range(s[L + "mlp.router.weight"], c, 8, 1) is None
    assert shard_range(s["model.layers.0.mlp.gate_proj.weight"], c, 8, 2) == (0, 32, 48)
    assert shard_range(s[L + "self_attn.q_proj.weight"], c, 1, 0) is None
    full = Config.from_file(ROOT / "configs" / "iquest-q1.json", ROOT / "configs" / "iquest-q1-mtp.json")
    fs = tensor_specs(full)
    assert shard_range(fs["model.layers.7.mlp.experts.9.up_proj.weight"], full, 8, 3) == (0, 576, 768)
    assert shard_range(fs["model.layers.7.self_attn.k_proj.weight"], full, 8, 3) == (0, 384, 512)
    assert shard_range(fs["model.layers.0.mlp.down_proj.weight"], full, 8, 1) == (1, 1536, 3072)


def test_a_dimension_that_does_not_split_is_named(tiny):
    r = CheckpointReader(tiny)  # tiny: 4 query heads
    with pytest.raises(CheckpointError) as info:
        r.read_weight("model.layers.1.self_attn.q_proj.weight", 8, 1)
    one_line(info, "model.layers.1.self_attn.q_proj.weight", "does not split into 8 parts")


# ---- a rank reads its part only ---------------------------------------------------------------------------

class _Recorder:
    """Wraps a safe_open handle: records every slice index read, and refuses whole-tensor loads."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, name):
        raise AssertionError(f"the whole tensor {name} was loaded")

    def get_slice(self, name):
        sl, log = self.inner.get_slice(name), self.log

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def get_dtype(self):
                return sl.get_dtype()

            def __getitem__(self, index):
                log.append((name, index))
                return sl[index]
        return Slice()


def test_each_rank_reads_its_own_rows_only(tiny_tp8):
    r = CheckpointReader(tiny_tp8)
    log: list = []
    for key, handle in list(r._handles.items()):
        r._handles[key] = _Recorder(handle, log)
    s = r.read_weight("model.layers.2.mlp.experts.4.up_proj.weight", 8, 3)
    assert s.weight.shape == (6, 128)
    assert log == [("model.layers.2.mlp.experts.fc", (4, slice(48 + 18, 48 + 24), slice(None))),
                   ("model.layers.2.mlp.experts.4.up_proj.weight_scale_inv", (slice(1, 2), slice(None)))]
    log.clear()
    s = r.read_weight("model.layers.2.mlp.experts.4.down_proj.weight", 8, 3)
    assert s.weight.shape == (128, 6) and log[0] == ("model.layers.2.mlp.experts.proj",
                                                     (4, slice(None), slice(18, 24)))
    log.clear()
    s = r.read_weight("model.embed_tokens.weight", 8, 7)
    assert s.weight.shape == (64, 128) and log == [("model.embed_tokens.weight", (slice(448, 512), slice(None)))]


def _resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_a_rank_slice_is_memory_mapped_not_materialized(tmp_path, tiny):
    """A 64 MiB packed expert tensor: reading (and value-checking) one rank's rows of one expert must not make the
    tensor resident."""
    from iquest.reference.checkpoint import _Stored

    r = CheckpointReader(tiny)
    big = tmp_path / "big.safetensors"
    save_file({"fc": torch.zeros(64, 1024, 512, dtype=torch.bfloat16)}, str(big))  # [E, 2I, H]
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    r._where[name] = _Stored(big, "fc", expert=40, rows=(512, 1024))  # the reader pointed at the big file
    before = _resident_mib()
    part = r.read(name, 0, 64, 128)
    grown = _resident_mib() - before
    assert part.shape == (64, 512) and not part.any()
    assert grown < 24, f"reading a 64 KiB slice made {grown:.0f} MiB resident"


# ---- the writer ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("packed", [True, False])
def test_a_sharded_write_reads_back_identically(tmp_path, logical, packed):
    c = preset_config("tiny")
    out = tmp_path / "sharded"
    save_checkpoint(out, c, logical, max_shard_bytes=50_000, packed=packed)
    for folder in (out, out / "mtp"):
        files = sorted(p.name for p in folder.glob("*.safetensors"))
        n = len(files)
        assert n >= 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        index = json.loads((folder / INDEX_FILE).read_text())
        assert set(index["weight_map"].values()) == set(files)
        held = {name: t for f in files for name, t in load_file(folder / f).items()}
        assert set(index["weight_map"]) == set(held)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in held.values())
        for f in files:  # no shard over the limit unless it holds a single tensor
            part = load_file(folder / f)
            assert sum(t.numel() * t.element_size() for t in part.values()) <= 50_000 or len(part) == 1
    assert not any(n.startswith("mtp") for n in json.loads((out / INDEX_FILE).read_text())["weight_map"])
    r = CheckpointReader(out)
    assert r.config == c and r.is_packed("model.layers.1.") == packed
    for name, t in logical.items():
        assert same(r.read(name), t), name
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [0]


def test_the_writer_refuses_a_bad_layout(tmp_path, logical):
    c = preset_config("tiny")
    t = dict(logical)
    t.pop(Q)
    with pytest.raises(CheckpointError, match="missing"):
        save_checkpoint(tmp_path / "a", c, t)
    t = dict(logical, **{NORM: logical[NORM].half()})
    with pytest.raises(CheckpointError, match=NORM.replace(".", "[.]")):
        save_checkpoint(tmp_path / "b", c, t)
    t = dict(logical, **{Q + "_scale_inv": logical[Q + "_scale_inv"][:2]})
    with pytest.raises(CheckpointError, match=Q.replace(".", "[.]")):
        save_checkpoint(tmp_path / "c", c, t)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists() and not (tmp_path / "c").exists()


# ---- FP8 E4M3 block quantization (reference/fp8.py) ------------------------------------------------------
#
# Bound used: E4M3 has 3 mantissa bits, so round-to-nearest of a normal value x/s (|x/s| >= 2^-6) is off by
# at most 2^-4 * |x/s|; below 2^-6 (subnormals) the spacing is 2^-9, so the error is at most 2^-10.
# Hence |dequant - w| <= 2^-4 * |w| + 2^-10 * s with s = block amax / 448, and in particular
# <= 2^-4 * block amax for every element. A 1e-6 relative slack covers the fp32 division w / s.

def _e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 value, as float64."""
    vals = torch.arange(256, dtype=torch.uint8).view(E4M3).to(torch.float64)
    return vals[torch.isfinite(vals)]


@pytest.mark.parametrize("shape,block", [((64, 64), (16, 16)), ((37, 53), (16, 16)), ((1, 5), (128, 128)),
                                         ((130, 7), (128, 8)), ((8, 8), (8, 8))])
def test_quantize_error_within_e4m3_precision(shape, block):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[1])  # magnitudes across the range
    q, s = quantize(w, block)
    assert q.dtype == E4M3 and s.dtype == torch.float32
    assert tuple(q.shape) == tuple(w.shape) and tuple(s.shape) == scale_shape(tuple(w.shape), block)
    real = dequantize(q, s, block)
    w64 = w.double()
    per_elem = expand_scales(s.double(), tuple(w.shape), block)
    err = (real - w64).abs()
    assert (err <= (2.0**-4 * w64.abs() + 2.0**-10 * per_elem) * (1 + 1e-6)).all()
    assert (err <= 2.0**-4 * per_elem * E4M3_MAX * (1 + 1e-6)).all()
    assert q.to(torch.float64).abs().max() <= E4M3_MAX


def test_partial_blocks_scale_from_their_own_elements_only():
    block = (16, 16)
    w = torch.randn(37, 53, generator=torch.Generator().manual_seed(0))
    w[32:, 48:] *= 1e-3  # the corner partial block is small: padding zeros must not matter, others must not leak
    q, s = quantize(w, block)
    assert s.shape == (3, 4)
    for i in range(3):
        for j in range(4):
            tile = w[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16]
            assert s[i, j].item() == pytest.approx(tile.abs().max().item() / E4M3_MAX, rel=1e-6)
    assert q[32:, 48:].float().abs().max().item() == E4M3_MAX  # the corner's own amax maps to 448
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(q, s[:, :3], block)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(q, torch.ones(4, 4), block)


def test_dequantize_with_an_offset_is_the_slice_of_the_whole():
    block = (16, 8)
    w = torch.randn(48, 40, generator=torch.Generator().manual_seed(4))
    q, s = quantize(w, block)
    whole = dequantize(q, s, block)
    for r0, r1 in ((6, 12), (12, 18), (18, 24), (0, 48), (30, 47)):
        part = dequantize(q[r0:r1], s[r0 // 16: -(-r1 // 16)], block, offset=(r0 % 16, 0))
        assert torch.equal(part, whole[r0:r1])
    for c0, c1 in ((3, 9), (7, 17), (16, 40)):
        part = dequantize(q[:, c0:c1], s[:, c0 // 8: -(-c1 // 8)], block, offset=(0, c0 % 8))
        assert torch.equal(part, whole[:, c0:c1])
    stacked = dequantize(q[:32].reshape(2, 16, 40)[:, :, 3:9], s[:2].reshape(2, 1, 5)[:, :, 0:2], block,
                         offset=(0, 3))  # leading dimensions (packed experts) pass through
    assert torch.equal(stacked, whole[:32].reshape(2, 16, 40)[:, :, 3:9])
    with pytest.raises(ValueError, match="scale shape"):  # one scale row is not enough past an offset of 12
        dequantize(q[12:18], s[0:1], block, offset=(12, 0))
    with pytest.raises(ValueError, match="starting at"):
        dequantize(q[0:6], s[0:1], block, offset=(16, 0))
    with pytest.raises(ValueError, match="2-D"):
        dequantize(q[0], s, block)


def test_values_on_the_grid_times_power_of_two_are_exact():
    grid = _e4m3_grid()
    block = (16, 16)
    rows, cols = 48, 64  # 3 x 4 blocks, one power-of-two scale each
    gen = torch.Generator().manual_seed(1)
    base = grid[torch.randint(len(grid), (rows, cols), generator=gen)]
    base[::16, ::16] = E4M3_MAX  # every block's amax is 448, so its scale is exactly its power of two
    exps = torch.randint(-20, 20, (3, 4), generator=gen).double()
    scale = expand_scales(torch.pow(2.0, exps), (rows, cols), block)
    w = (base * scale).float()
    assert torch.equal(w.double(), base * scale)  # exactly representable in fp32
    q, s = quantize(w, block)
    assert torch.equal(s.double(), torch.pow(2.0, exps))
    assert torch.equal(q.double(), base)
    assert torch.equal(dequantize(q, s, block), w.double())


def test_zero_block_gets_unit_scale():
    w = torch.zeros(16, 32)
    w[:, 16:] = 3.0
    q, s = quantize(w, (16, 16))
    assert s[0, 0].item() == 1.0 and not q[:, :16].float().any()
    assert s[0, 1].item() == pytest.approx(3.0 / 448)
    assert q[:, 16:].float().eq(448.0).all()


def test_act_quant_formula_per_128_channels():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 384, generator=gen) * torch.tensor([1.0, 50.0, 1e-3]).repeat_interleave(128)
    x[1, 128:256] = 0.0  # an all-zero group: amax clamps to 1e-4
    q, s = act_quant(x)
    assert q.dtype == E4M3 and q.shape == x.shape and s.shape == (3, 3) and s.dtype == torch.float32
    assert torch.equal(s, x.view(3, 3, 128).abs().amax(-1).clamp(min=1e-4) / 448.0)
    back = (q.double().view(3, 3, 128) * s.double().unsqueeze(-1)).view(3, 384)
    bound = 2.0**-4 * x.double().abs() + 2.0**-10 * s.double().repeat_interleave(128, 1)
    assert ((back - x.double()).abs() <= bound * (1 + 1e-6)).all()
    with pytest.raises(ValueError, match="multiple of the group"):
        act_quant(torch.ones(2, 100))
