"""Checkpoint contract (MODEL.md, "Checkpoint" and "Tensor parallelism"): layout, rank slices, rejections."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from iquest.fixtures.make import make_fixture, preset_config
from iquest.reference.checkpoint import (INDEX_FILE, CheckpointError, CheckpointReader, expected_dtypes_and_shapes,
                                         save_checkpoint, shard_range, tensor_specs)
from iquest.reference.config import Config
from iquest.reference.fp8 import E4M3, dequantize, scale_shape




@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_fixture("tiny", tmp_path_factory.mktemp("tiny"), seed=5)


@pytest.fixture(scope="module")
def tiny_tp8(tmp_path_factory) -> Path:
    return make_fixture("tiny-tp8", tmp_path_factory.mktemp("tiny_tp8"), seed=6)


@pytest.fixture(scope="module")
def tiny_tensors(tiny) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(tiny.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def write_raw(out: Path, config: Config, tensors: dict[str, torch.Tensor]) -> Path:
    """Write tensors without the writer's checks (one file + index), so broken checkpoints can be made."""
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model-00001-of-00001.safetensors"))
    (out / INDEX_FILE).write_text(json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors"
                                                             for n in tensors}}))
    (out / "config.json").write_text(json.dumps(config.to_dict()))
    return out


# ---- layout --------------------------------------------------------------------------------------

def test_layout_names_and_counts():
    c = preset_config("tiny")
    specs = tensor_specs(c)
    layers = c.num_hidden_layers + 1
    per_layer = 2 + 4 + 1 + 1 + 3 * c.n_routed_experts  # norms, q/k/v/o, router, sinks, experts
    assert len(specs) == 3 + layers * per_layer + 4     # + embed/lm_head/norm, + MTP extras
    mtp = f"model.layers.{c.num_hidden_layers}."
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
        assert mtp + name in specs
    assert specs[mtp + "eh_proj.weight"].shape == (c.hidden_size, 2 * c.hidden_size)
    assert "model.layers.0.enorm.weight" not in specs
    exp = expected_dtypes_and_shapes(c)
    quantized = [s for s in specs.values() if s.quantized]
    assert len(exp) == len(specs) + len(quantized)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert exp[q] == ((c.num_attention_heads * c.head_dim, c.hidden_size), E4M3)
    assert exp[q + "_scale_inv"] == ((64 // 16, 64 // 16), torch.float32)
    assert exp["model.layers.0.self_attn.sinks"] == ((c.num_attention_heads,), torch.float32)
    assert exp["model.layers.0.mlp.gate.weight"][1] == torch.bfloat16


def test_qk_norm_adds_tensors_and_sinks_can_be_absent():
    raw = preset_config("tiny").to_dict()
    with_qk = tensor_specs(Config.from_dict(dict(raw, qk_norm=True)))
    assert with_qk["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    no_sinks = tensor_specs(Config.from_dict(dict(raw, attention_sinks=False)))
    assert "model.layers.0.self_attn.sinks" not in no_sinks


def test_reader_accepts_fixture_and_reads_every_tensor(tiny, tiny_tensors):
    r = CheckpointReader(tiny)
    assert r.config == preset_config("tiny")
    exp = expected_dtypes_and_shapes(r.config)
    assert set(tiny_tensors) == set(exp)
    for name in exp:
        t = r.read(name)
        assert (tuple(t.shape), t.dtype) == exp[name]
        assert torch.equal(t.view(torch.uint8), tiny_tensors[name].contiguous().view(torch.uint8))


def test_shipped_fixtures_are_readable():
    root = Path(__file__).resolve().parent.parent / "fixtures"
    for name in ("tiny", "tiny-tp8"):
        r = CheckpointReader(root / name)
        assert r.config == preset_config(name)


# ---- tensor-parallel slices ------------------------------------------------------------------------

def _check_rank_slices(model_dir: Path, tp: int) -> int:
    r = CheckpointReader(model_dir)
    c = r.config
    c.check_tp(tp)
    block = c.weight_block_size
    nkv = c.num_key_value_heads
    split_count = 0
    for name, spec in r.specs.items():
        full_w, full_s = r.read_weight(name)
        parts = [r.read_weight(name, tp, rank) for rank in range(tp)]
        if spec.split is None:
            for w, s in parts:  # replicated: every rank holds the whole tensor
                assert torch.equal(w.view(torch.uint8) if w.dtype == E4M3 else w,
                                   full_w.view(torch.uint8) if w.dtype == E4M3 else full_w)
            continue
        split_count += 1
        dim = 1 if spec.split[0] == "cols" else 0
        if spec.split[0] == "kv_rows" and tp > nkv:
            per_head = tp // nkv
            for head in range(nkv):
                group = parts[head * per_head:(head + 1) * per_head]
                for w, s in group[1:]:  # ranks sharing a KV head hold identical slices
                    assert torch.equal(w.view(torch.uint8), group[0][0].view(torch.uint8))
                    assert torch.equal(s, group[0][1])
                assert group[0][0].shape[0] == c.head_dim
            parts = parts[::per_head]
        else:
            assert all(p[0].shape[dim] == spec.shape[dim] // tp for p in parts)
        as_bytes = (lambda t: t.view(torch.uint8)) if spec.quantized else (lambda t: t)
        cat_w = torch.cat([as_bytes(w) for w, _ in parts], dim)
        assert torch.equal(cat_w, as_bytes(full_w)), name
        if spec.quantized:
            cat_s = torch.cat([s for _, s in parts], dim)
            assert torch.equal(cat_s, full_s), name
            full_real = dequantize(full_w, full_s, block)
            offset = 0
            for w, s in parts:
                n = w.shape[dim]
                assert s.shape == scale_shape(tuple(w.shape), block)
                want = full_real.narrow(dim, offset, n)
                assert torch.equal(dequantize(w, s, block), want), name
                offset += n
        else:
            assert all(s is None for _, s in parts)
    return split_count


def test_rank_slices_tiny_tp2(tiny):
    assert _check_rank_slices(tiny, 2) > 100


def test_rank_slices_tiny_tp8_with_replicated_kv_heads(tiny_tp8):
    c = preset_config("tiny-tp8")
    assert 8 > c.num_key_value_heads  # the case under test: 2 ranks per KV head
    assert _check_rank_slices(tiny_tp8, 8) > 100


def test_shard_range_by_hand():
    c = preset_config("tiny-tp8")  # Nq 16, Nkv 4, D 16, H 128, I 64, V 512
    s = tensor_specs(c)
    L = "model.layers.0."
    assert shard_range(s[L + "self_attn.q_proj.weight"], c, 8, 3) == (0, 3 * 32, 4 * 32)
    assert shard_range(s[L + "self_attn.o_proj.weight"], c, 8, 3) == (1, 3 * 32, 4 * 32)
    assert shard_range(s[L + "self_attn.k_proj.weight"], c, 8, 5) == (0, 2 * 16, 3 * 16)  # head 5 // 2
    assert shard_range(s[L + "self_attn.k_proj.weight"], c, 4, 3) == (0, 3 * 16, 4 * 16)
    assert shard_range(s[L + "self_attn.k_proj.weight"], c, 2, 1) == (0, 32, 64)
    assert shard_range(s[L + "mlp.experts.0.down_proj.weight"], c, 8, 7) == (1, 56, 64)
    assert shard_range(s["model.embed_tokens.weight"], c, 8, 1) == (0, 64, 128)
    assert shard_range(s[L + "self_attn.sinks"], c, 8, 2) == (0, 4, 6)
    assert shard_range(s["model.layers.4.eh_proj.weight"], c, 8, 1) == (1, 32, 64)
    assert shard_range(s[L + "mlp.gate.weight"], c, 8, 1) is None
    assert shard_range(s[L + "self_attn.q_proj.weight"], c, 1, 0) is None


def test_misaligned_rank_slice_is_rejected(tiny):
    r = CheckpointReader(tiny)  # tiny: I=32 with 16x16 blocks, so TP 4 would cut blocks in half
    with pytest.raises(CheckpointError, match="mlp.experts.0.gate_proj.weight.*aligned"):
        r.read_weight("model.layers.0.mlp.experts.0.gate_proj.weight", 4, 1)


# ---- slices are read from the file, not cut from a loaded tensor -----------------------------------

def test_read_slice_returns_the_right_part_and_only_that(tiny, tiny_tensors, monkeypatch):
    r = CheckpointReader(tiny)
    name = "model.embed_tokens.weight"
    full = tiny_tensors[name]
    part = r.read(name, 0, 100, 164)
    assert torch.equal(part, full[100:164])
    cols = r.read(name, 1, 8, 24)
    assert torch.equal(cols, full[:, 8:24])

    # Every read goes through safe_open(...).get_slice(name)[index]: record the index requested, and
    # make any whole-tensor load an error.
    requested = []
    handle = r._open(r._files[name])

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def get_slice(self, n):
            sl = self.inner.get_slice(n)

            class SliceSpy:
                def get_shape(self):
                    return sl.get_shape()

                def __getitem__(self, index):
                    requested.append(index)
                    return sl[index]
            return SliceSpy()

        def get_tensor(self, n):
            raise AssertionError("the whole tensor was loaded")

        def keys(self):
            return self.inner.keys()

    monkeypatch.setitem(r._handles, str(r._files[name]), Spy(handle))
    w, _ = r.read_weight(name, 2, 1)
    assert torch.equal(w, full[256:])
    assert requested == [(slice(256, 512, None), slice(None))]


def _resident_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_read_slice_does_not_materialize_the_tensor(tmp_path, tiny):
    """A 64 MiB tensor: reading (and value-checking) a 64-row slice must not make it resident."""
    r = CheckpointReader(tiny)
    name = "model.embed_tokens.weight"
    big = tmp_path / "big.safetensors"
    save_file({name: torch.zeros(32768, 1024, dtype=torch.bfloat16)}, str(big))
    r._files[name] = big  # point the reader at the big file; read() itself is unchanged
    before = _resident_mib()
    part = r.read(name, 0, 4096, 4160)
    grown = _resident_mib() - before
    assert part.shape == (64, 1024) and not part.any()
    assert grown < 24, f"reading a 128 KiB slice made {grown:.0f} MiB resident"


# ---- rejections name the tensor ---------------------------------------------------------------------

def _mutated(tmp_path, tiny_tensors, mutate) -> Path:
    tensors = dict(tiny_tensors)
    mutate(tensors)
    return write_raw(tmp_path / "ckpt", preset_config("tiny"), tensors)


Q = "model.layers.1.self_attn.q_proj.weight"
NORM = "model.layers.2.input_layernorm.weight"
DOWN = "model.layers.4.mlp.experts.3.down_proj.weight"


def _nan_bf16(t):
    t[NORM] = t[NORM].clone()
    t[NORM][5] = float("nan")


def _inf_bf16(t):
    t["lm_head.weight"] = t["lm_head.weight"].clone()
    t["lm_head.weight"][300, 7] = float("inf")


def _nan_scale(t):
    t[DOWN + "_scale_inv"] = t[DOWN + "_scale_inv"].clone()
    t[DOWN + "_scale_inv"][1, 0] = float("nan")


def _inf_scale(t):
    t[Q + "_scale_inv"] = t[Q + "_scale_inv"].clone()
    t[Q + "_scale_inv"][0, 0] = float("inf")


def _zero_scale(t):
    t[Q + "_scale_inv"] = torch.zeros_like(t[Q + "_scale_inv"])


def _nan_sink(t):
    name = "model.layers.0.self_attn.sinks"
    t[name] = t[name].clone()
    t[name][3] = float("nan")


HEADER_CASES = [
    ("missing", lambda t: t.pop(Q), f"missing tensor {Q}"),
    ("missing_scale", lambda t: t.pop(DOWN + "_scale_inv"), f"missing tensor {DOWN}_scale_inv"),
    ("extra", lambda t: t.update({"model.layers.0.mlp.shared_experts.weight": torch.zeros(2)}),
     "unexpected tensor model.layers.0.mlp.shared_experts.weight"),
    ("wrong_shape", lambda t: t.update({NORM: torch.ones(63, dtype=torch.bfloat16)}), f"tensor {NORM}: shape"),
    ("wrong_shape_fp8", lambda t: t.update({Q: t[Q][:, :48].contiguous()}), f"tensor {Q}: shape"),
    ("wrong_dtype", lambda t: t.update({NORM: t[NORM].float()}), f"tensor {NORM}: dtype"),
    ("wrong_dtype_fp8", lambda t: t.update({Q: t[Q].to(torch.bfloat16)}), f"tensor {Q}: dtype"),
    ("wrong_dtype_scale", lambda t: t.update({Q + "_scale_inv": t[Q + "_scale_inv"].to(torch.bfloat16)}),
     f"tensor {Q}_scale_inv: dtype"),
    ("scale_shape", lambda t: t.update({Q + "_scale_inv": torch.ones(4, 8)}),
     f"tensor {Q}_scale_inv: scale shape"),
    ("scale_shape_transposed", lambda t: t.update({DOWN + "_scale_inv": t[DOWN + "_scale_inv"].T.contiguous()}),
     f"tensor {DOWN}_scale_inv: scale shape"),
]


@pytest.mark.parametrize("mutate,message", [(m, msg) for _, m, msg in HEADER_CASES],
                         ids=[n for n, _, _ in HEADER_CASES])
def test_layout_errors_rejected_at_open(tmp_path, tiny_tensors, mutate, message):
    d = _mutated(tmp_path, tiny_tensors, mutate)
    with pytest.raises(CheckpointError, match=message.replace(".", r"\.")):
        CheckpointReader(d)


VALUE_CASES = [
    ("nan_bf16", _nan_bf16, NORM, "non-finite"),
    ("inf_bf16", _inf_bf16, "lm_head.weight", "non-finite"),
    ("nan_scale", _nan_scale, DOWN + "_scale_inv", "non-finite"),
    ("inf_scale", _inf_scale, Q + "_scale_inv", "non-finite"),
    ("zero_scale", _zero_scale, Q + "_scale_inv", "non-positive"),
    ("nan_fp32_sink", _nan_sink, "model.layers.0.self_attn.sinks", "non-finite"),
]


@pytest.mark.parametrize("mutate,bad,kind", [(m, b, k) for _, m, b, k in VALUE_CASES],
                         ids=[n for n, _, _, _ in VALUE_CASES])
def test_bad_values_found_when_read(tmp_path, tiny_tensors, mutate, bad, kind):
    d = _mutated(tmp_path, tiny_tensors, mutate)
    r = CheckpointReader(d)  # headers are fine: values are checked as tensors are read
    r.read("model.norm.weight")
    with pytest.raises(CheckpointError, match=f"tensor {bad.replace('.', '[.]')} holds {kind}"):
        r.read(bad)
    weight = bad.removesuffix("_scale_inv")
    with pytest.raises(CheckpointError, match=bad.replace(".", "[.]")):
        for rank in range(2):  # the bad element is in some rank's slice
            r.read_weight(weight, 2, rank)


def test_bad_value_outside_a_rank_slice_does_not_stop_that_rank(tmp_path, tiny_tensors):
    r = CheckpointReader(_mutated(tmp_path, tiny_tensors, _inf_bf16))  # lm_head row 300: rank 1 of 2
    r.read_weight("lm_head.weight", 2, 0)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        r.read_weight("lm_head.weight", 2, 1)


def test_missing_shard_file(tmp_path, tiny_tensors):
    out = tmp_path / "sharded"
    save_checkpoint(out, preset_config("tiny"), tiny_tensors, max_shard_bytes=64 << 10)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) > 2
    index = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    victim = files[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"its file {victim.name} is missing") as info:
        CheckpointReader(out)
    named = str(info.value).split("tensor ", 1)[1].split(":", 1)[0]
    assert index[named] == victim.name  # the message names a tensor that lived in the lost file


def test_index_naming_the_wrong_file(tmp_path, tiny_tensors):
    out = tmp_path / "sharded"
    save_checkpoint(out, preset_config("tiny"), tiny_tensors, max_shard_bytes=64 << 10)
    index = json.loads((out / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in index["weight_map"].items() if f == files[0])
    index["weight_map"][name] = files[-1]
    (out / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"tensor {name.replace('.', '[.]')}: the index names"):
        CheckpointReader(out)


@pytest.mark.parametrize("text", ["{not json", json.dumps({"metadata": {}}), json.dumps({"weight_map": ["a"]}),
                                  json.dumps([1, 2]), json.dumps({"weight_map": {"model.norm.weight": 3}})],
                         ids=["bad_json", "no_weight_map", "weight_map_list", "top_level_list", "file_not_str"])
def test_malformed_index(tmp_path, tiny, text):
    out = tmp_path / "ckpt"
    shutil.copytree(tiny, out)
    (out / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE} is malformed"):
        CheckpointReader(out)


def test_no_weights_and_no_folder(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps(preset_config("tiny").to_dict()))
    with pytest.raises(CheckpointError, match="no .*safetensors"):
        CheckpointReader(tmp_path)


def test_reader_without_index_globs_files(tmp_path, tiny_tensors):
    d = write_raw(tmp_path / "ckpt", preset_config("tiny"), tiny_tensors)
    (d / INDEX_FILE).unlink()
    r = CheckpointReader(d)
    assert torch.equal(r.read(NORM), tiny_tensors[NORM])


def test_config_mismatch_is_a_layout_error(tiny):
    other = Config.from_dict(dict(preset_config("tiny").to_dict(), n_routed_experts=4))
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.0.mlp.experts.4"):
        CheckpointReader(tiny, other)


# ---- writer -------------------------------------------------------------------------------------------

def test_sharded_write_reads_back_identically(tmp_path, tiny_tensors):
    c = preset_config("tiny")
    out = tmp_path / "sharded"
    save_checkpoint(out, c, tiny_tensors, max_shard_bytes=50_000)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(files)
    assert n >= 5
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / INDEX_FILE).read_text())
    assert set(index["weight_map"]) == set(tiny_tensors)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tiny_tensors.values())
    for f in files:  # no shard over the limit unless it holds a single tensor
        held = load_file(out / f)
        size = sum(t.numel() * t.element_size() for t in held.values())
        assert size <= 50_000 or len(held) == 1
    r = CheckpointReader(out)
    assert r.config == c
    for name, t in tiny_tensors.items():
        got = r.read(name)
        assert got.dtype == t.dtype
        assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), name


def test_writer_refuses_a_bad_layout(tmp_path, tiny_tensors):
    c = preset_config("tiny")
    t = dict(tiny_tensors)
    t.pop(Q)
    with pytest.raises(CheckpointError, match="missing"):
        save_checkpoint(tmp_path / "a", c, t)
    t = dict(tiny_tensors, **{NORM: tiny_tensors[NORM].float()})
    with pytest.raises(CheckpointError, match=NORM.replace(".", "[.]")):
        save_checkpoint(tmp_path / "b", c, t)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- FP8 E4M3 block quantization (reference/fp8.py) ------------------------------------------------------
#
# Bound used: E4M3 has 3 mantissa bits, so round-to-nearest of a normal value x/s (|x/s| >= 2^-6) is off by
# at most 2^-4 * |x/s|; below 2^-6 (subnormals) the spacing is 2^-9, so the error is at most 2^-10.
# Hence |dequant - w| <= 2^-4 * |w| + 2^-10 * s with s = block amax / 448, and in particular
# <= 2^-4 * block amax for every element. A 1e-6 relative slack covers the fp32 division w / s.

from iquest.reference.fp8 import E4M3_MAX, act_quant, expand_scales, quantize  # noqa: E402


def _e4m3_grid() -> torch.Tensor:
    """Every finite E4M3 value, as float64."""
    vals = torch.arange(256, dtype=torch.uint8).view(E4M3).to(torch.float64)
    return vals[torch.isfinite(vals)]


def _assert_within_e4m3_bound(w: torch.Tensor, block: tuple[int, int]) -> None:
    q, s = quantize(w, block)
    assert q.dtype == E4M3 and s.dtype == torch.float32
    assert tuple(q.shape) == tuple(w.shape) and tuple(s.shape) == scale_shape(tuple(w.shape), block)
    real = dequantize(q, s, block)
    w64 = w.double()
    per_elem = expand_scales(s.double(), tuple(w.shape), block)
    err = (real - w64).abs()
    bound = (2.0**-4 * w64.abs() + 2.0**-10 * per_elem) * (1 + 1e-6)
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"
    amax = per_elem * E4M3_MAX
    assert (err <= 2.0**-4 * amax * (1 + 1e-6)).all()
    assert q.to(torch.float64).abs().max() <= E4M3_MAX


@pytest.mark.parametrize("shape,block", [((64, 64), (16, 16)), ((37, 53), (16, 16)), ((1, 5), (128, 128)),
                                         ((130, 7), (128, 8)), ((8, 8), (8, 8))])
def test_quantize_error_within_e4m3_precision(shape, block):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[1])  # magnitudes across the range
    _assert_within_e4m3_bound(w, block)


def test_partial_blocks_scale_from_their_own_elements_only():
    block = (16, 16)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(37, 53, generator=gen)
    w[32:, 48:] *= 1e-3  # the corner partial block is small: padding zeros must not matter, others must not leak
    q, s = quantize(w, block)
    assert s.shape == (3, 4)
    for i in range(3):
        for j in range(4):
            tile = w[i * 16:(i + 1) * 16, j * 16:(j + 1) * 16]
            assert s[i, j].item() == pytest.approx(tile.abs().max().item() / E4M3_MAX, rel=1e-6)
    corner = q[32:, 48:].float().abs().max().item()
    assert corner == E4M3_MAX  # the corner's own amax maps to 448
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(q, s[:, :3], block)
    with pytest.raises(ValueError, match="scale shape"):
        dequantize(q, torch.ones(4, 4), block)


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
    torch.testing.assert_close(dequantize(q, s, (16, 16))[:, 16:], torch.full((16, 16), 3.0, dtype=torch.float64),
                               rtol=1e-6, atol=0)  # 448 * fp32(3/448)


def test_act_quant_formula_per_128_channels():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 384, generator=gen) * torch.tensor([1.0, 50.0, 1e-3]).repeat_interleave(128)
    x[1, 128:256] = 0.0  # an all-zero group: amax clamps to 1e-4
    x[2, 256:] = 1e-6    # a tiny group: clamps too
    q, s = act_quant(x)
    assert q.dtype == E4M3 and q.shape == x.shape and s.shape == (3, 3) and s.dtype == torch.float32
    want = x.view(3, 3, 128).abs().amax(-1).clamp(min=1e-4) / 448.0
    assert torch.equal(s, want)
    assert s[1, 1].item() == pytest.approx(1e-4 / 448) and s[2, 2].item() == pytest.approx(1e-4 / 448)
    back = (q.double().view(3, 3, 128) * s.double().unsqueeze(-1)).view(3, 384)
    bound = 2.0**-4 * x.double().abs() + 2.0**-10 * s.double().repeat_interleave(128, 1)
    assert ((back - x.double()).abs() <= bound * (1 + 1e-6)).all()
    # the group amax lands exactly on 448 unless clamped
    assert q.double().view(3, 3, 128).abs().amax(-1)[0, 0].item() == 448.0
    q3, s3 = act_quant(x.view(3, 1, 384))
    assert s3.shape == (3, 1, 3) and torch.equal(s3.view(3, 3), s)
    with pytest.raises(ValueError, match="multiple of the group"):
        act_quant(torch.ones(2, 100))
    _, s64 = act_quant(x[:, :128], group=64)
    assert s64.shape == (3, 2)
