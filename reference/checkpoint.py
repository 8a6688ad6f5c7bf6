"""IQuest-Q1 checkpoints: the tensor layout of MODEL.md, its tensor-parallel slicing, a reader and a writer.

The layout is the contract: `tensor_specs(config)` lists every tensor with shape, dtype and how it is
split over tensor-parallel ranks. The reader checks a checkpoint against it from the safetensors
headers alone (names, shapes, dtypes: no weight bytes read), and checks values (finite scales and
bf16/fp32 tensors) as each tensor or rank slice is read, so a rank of the ~850 GB full-size model
reads only its own slices.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import Config, GenerationConfig
from .fp8 import E4M3, scale_shape

INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint that does not match the contract (the message names the tensor)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the layout.

    split: how ranks share it. None = replicated; ("rows", unit) / ("cols", unit) = split along that
    dimension into TP equal parts; ("kv_rows", head_dim) = split by KV heads, replicated when TP > Nkv.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quantized: bool = False
    split: tuple[str, int] | None = None

    @property
    def scale_name(self) -> str:
        return self.name + "_scale_inv"


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def tensor_specs(config: Config) -> dict[str, TensorSpec]:
    """Every tensor of an IQuest-Q1 checkpoint (scales are implied by `quantized`)."""
    c = config
    H, D, V = c.hidden_size, c.head_dim, c.vocab_size
    specs: list[TensorSpec] = [
        TensorSpec("model.embed_tokens.weight", (V, H), torch.bfloat16, split=("rows", 1)),
        TensorSpec("lm_head.weight", (V, H), torch.bfloat16, split=("rows", 1)),
        TensorSpec("model.norm.weight", (H,), torch.bfloat16),
    ]
    for layer in range(c.num_hidden_layers + c.num_nextn_predict_layers):
        p = layer_prefix(layer)
        specs += [
            TensorSpec(p + "input_layernorm.weight", (H,), torch.bfloat16),
            TensorSpec(p + "post_attention_layernorm.weight", (H,), torch.bfloat16),
            TensorSpec(p + "self_attn.q_proj.weight", (c.num_attention_heads * D, H), E4M3, True, ("rows", D)),
            TensorSpec(p + "self_attn.k_proj.weight", (c.num_key_value_heads * D, H), E4M3, True, ("kv_rows", D)),
            TensorSpec(p + "self_attn.v_proj.weight", (c.num_key_value_heads * D, H), E4M3, True, ("kv_rows", D)),
            TensorSpec(p + "self_attn.o_proj.weight", (H, c.num_attention_heads * D), E4M3, True, ("cols", D)),
            TensorSpec(p + "mlp.gate.weight", (c.n_routed_experts, H), torch.bfloat16),
        ]
        if c.attention_sinks:
            specs.append(TensorSpec(p + "self_attn.sinks", (c.num_attention_heads,), torch.float32, split=("rows", 1)))
        if c.qk_norm:
            specs += [TensorSpec(p + "self_attn.q_norm.weight", (D,), torch.bfloat16),
                      TensorSpec(p + "self_attn.k_norm.weight", (D,), torch.bfloat16)]
        for e in range(c.n_routed_experts):
            q = f"{p}mlp.experts.{e}."
            specs += [
                TensorSpec(q + "gate_proj.weight", (c.moe_intermediate_size, H), E4M3, True, ("rows", 1)),
                TensorSpec(q + "up_proj.weight", (c.moe_intermediate_size, H), E4M3, True, ("rows", 1)),
                TensorSpec(q + "down_proj.weight", (H, c.moe_intermediate_size), E4M3, True, ("cols", 1)),
            ]
        if layer == c.mtp_layer_index:
            specs += [
                TensorSpec(p + "enorm.weight", (H,), torch.bfloat16),
                TensorSpec(p + "hnorm.weight", (H,), torch.bfloat16),
                TensorSpec(p + "eh_proj.weight", (H, 2 * H), E4M3, True, ("cols", 1)),
                TensorSpec(p + "shared_head.norm.weight", (H,), torch.bfloat16),
            ]
    return {s.name: s for s in specs}


def expected_dtypes_and_shapes(config: Config) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Every stored tensor name (weights and scales) with its shape and dtype."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    block = config.weight_block_size
    for spec in tensor_specs(config).values():
        out[spec.name] = (spec.shape, spec.dtype)
        if spec.quantized:
            out[spec.scale_name] = (scale_shape(spec.shape, block), torch.float32)  # type: ignore[arg-type]
    return out


def shard_range(spec: TensorSpec, config: Config, tp: int, rank: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of `rank`'s part of `spec` at degree `tp`, or None when replicated."""
    if spec.split is None or tp == 1:
        return None
    kind, unit = spec.split
    dim = 1 if kind == "cols" else 0
    size = spec.shape[dim]
    if kind == "kv_rows":
        nkv = config.num_key_value_heads
        if tp > nkv:  # each KV head is replicated over tp // nkv consecutive ranks
            head = rank // (tp // nkv)
            return (0, head * unit, (head + 1) * unit)
    if size % (tp * unit):
        raise CheckpointError(f"{spec.name}: dimension {dim} of size {size} does not split into {tp} parts")
    part = size // tp
    return (dim, rank * part, (rank + 1) * part)


class CheckpointReader:
    """Reads an IQuest-Q1 checkpoint folder, checked against `tensor_specs(config)`."""

    def __init__(self, model_dir: str | Path, config: Config | None = None):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"model folder {self.dir} does not exist")
        self.config = config if config is not None else Config.from_dir(self.dir)
        self.specs = tensor_specs(self.config)
        self._files = self._weight_map()
        self._handles: dict[str, object] = {}
        self._check_headers()

    # ---- layout checks (headers only) ---------------------------------------------------------
    def _weight_map(self) -> dict[str, Path]:
        index = self.dir / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is malformed: {exc}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index} is malformed: weight_map must map tensor names to file names")
            files = {name: self.dir / fname for name, fname in weight_map.items()}
        else:
            singles = sorted(self.dir.glob("*.safetensors"))
            if not singles:
                raise CheckpointError(f"no {INDEX_FILE} and no *.safetensors file in {self.dir}")
            files = {}
            for path in singles:
                with _safe_open(path) as f:
                    files.update({name: path for name in f.keys()})
        for name, path in files.items():
            if not path.exists():
                raise CheckpointError(f"tensor {name}: its file {path.name} is missing")
        return files

    def _check_headers(self) -> None:
        expected = expected_dtypes_and_shapes(self.config)
        missing = sorted(set(expected) - set(self._files))
        extra = sorted(set(self._files) - set(expected))
        if missing:
            raise CheckpointError(f"missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        if extra:
            raise CheckpointError(f"unexpected tensor {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        by_file: dict[Path, list[str]] = {}
        for name, path in self._files.items():
            by_file.setdefault(path, []).append(name)
        for path, names in by_file.items():
            handle = self._open(path)
            present = set(handle.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"tensor {name}: the index names {path.name}, which does not hold it")
                sl = handle.get_slice(name)
                shape = tuple(sl.get_shape())
                dtype = _DTYPES.get(sl.get_dtype())
                want_shape, want_dtype = expected[name]
                if name.endswith("_scale_inv") and shape != want_shape:
                    raise CheckpointError(f"tensor {name}: scale shape {shape} does not match its weight "
                                          f"(expected {want_shape} for blocks {list(self.config.weight_block_size)})")
                if shape != want_shape:
                    raise CheckpointError(f"tensor {name}: shape {shape}, expected {want_shape}")
                if dtype != want_dtype:
                    raise CheckpointError(f"tensor {name}: dtype {sl.get_dtype()}, expected {want_dtype}")

    def _open(self, path: Path):
        key = str(path)
        if key not in self._handles:
            self._handles[key] = _safe_open(path)
        return self._handles[key]

    # ---- reading --------------------------------------------------------------------------------
    def names(self) -> Iterator[str]:
        return iter(self.specs)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """One stored tensor, or its [start:stop) slice along `dim`, values checked."""
        if name not in self._files:
            raise CheckpointError(f"tensor {name} is not in this checkpoint")
        sl = self._open(self._files[name]).get_slice(name)
        if dim is None:
            t = sl[:]
        else:
            index = [slice(None)] * len(sl.get_shape())
            index[dim] = slice(start, stop)
            t = sl[tuple(index)]
        if t.dtype != E4M3 and not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name} holds non-finite values")
        if name.endswith("_scale_inv") and not (t > 0).all():
            raise CheckpointError(f"tensor {name} holds non-positive scales")
        return t

    def read_weight(self, name: str, tp: int = 1, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`rank`'s slice of the tensor `name` and, when quantized, the matching slice of its scales."""
        spec = self.specs[name]
        part = shard_range(spec, self.config, tp, rank)
        if part is None:
            w = self.read(name)
            return w, (self.read(spec.scale_name) if spec.quantized else None)
        w = self.read(name, *part)
        if not spec.quantized:
            return w, None
        return w, self.read(spec.scale_name, *self.scale_part(name, tp, rank))

    def scale_part(self, name: str, tp: int, rank: int) -> tuple[int, int, int] | None:
        """(dim, start, stop) of `rank`'s rows or columns of the quantized tensor `name`'s scale grid, or None when
        the tensor is replicated."""
        spec = self.specs[name]
        part = shard_range(spec, self.config, tp, rank)
        if part is None:
            return None
        dim, start, stop = part
        b = self.config.weight_block_size[dim]
        if start % b or (stop % b and stop != spec.shape[dim]):
            raise CheckpointError(f"{name}: rank {rank} slice [{start}:{stop}) of dimension {dim} is not "
                                  f"aligned to the weight block {b}")
        return dim, start // b, -(-stop // b)


def _safe_open(path: Path):
    """safe_open, where a damaged file (truncated, or not safetensors at all) is a CheckpointError naming it."""
    try:
        return safe_open(path, framework="pt", device="cpu")
    except SafetensorError as exc:
        raise CheckpointError(f"{path}: {_damage(path)} (safetensors: {exc})") from None


def _damage(path: Path) -> str:
    """What is wrong with a file safe_open refused, from its size and header (8-byte length, JSON, offsets)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None or 8 + n > size:
            return f"{size} bytes, too short for the header it declares: truncated, or not a safetensors file"
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            return "its header is not a safetensors header: not a safetensors file, or damaged"
    if 8 + n + end > size:
        return f"{size} bytes of the {8 + n + end} its header describes: the file is truncated"
    return "not a readable safetensors file"


_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16, "F64": torch.float64,
           "F8_E4M3": E4M3, "I64": torch.int64, "I32": torch.int32}


def save_checkpoint(out_dir: str | Path, config: Config, tensors: dict[str, torch.Tensor],
                    generation: GenerationConfig | None = None, max_shard_bytes: int = 2 << 30) -> None:
    """Write `tensors` (weights and `*_scale_inv`) as a sharded checkpoint with index and configs.

    The tensors are checked against the layout first, so a writer bug cannot produce a checkpoint
    that the reader would reject.
    """
    expected = expected_dtypes_and_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(f"cannot write: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, t in tensors.items():
        shape, dtype = expected[name]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise CheckpointError(f"cannot write tensor {name}: {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in expected:  # layout order: a layer's tensors stay together
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=1, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(config.to_dict(), indent=2) + "\n")
    gen = generation or GenerationConfig(eos_token_id=config.eos_token_id)
    (out / "generation_config.json").write_text(json.dumps(gen.to_dict(), indent=2) + "\n")
