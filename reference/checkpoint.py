"""IQuest-Q1 checkpoints: the published folder layout (docs/model.md, "Checkpoint"), its tensor-parallel slicing, a
reader and a writer.

A model folder holds the target (`config.json`, `model*.safetensors`, usually `model.safetensors.index.json`) and the
draft in `mtp/` (its own config, safetensors and index). Tensors have LOGICAL names: the target's as stored, the
draft's as stored with a leading `mtp/` (e.g. `mtp/embed_tokens.weight`), and every expert's three matrices as
`{layer}mlp.experts.{e}.{gate,up,down}_proj.weight`, whether the file packs them (`experts.fc` [E, 2I, H] with the
gate in rows 0..I-1, `experts.proj` [E, H, I]) or stores them one by one. Block-FP8 weights come with
`<name>_scale_inv` (experts: per expert, under the logical name, in both storage forms).

The reader checks a folder against `tensor_specs(config)` from the safetensors headers alone (names, shapes, dtypes:
no weight bytes read) and each tensor's values as it is read (finite bf16/fp32 values, positive finite scales), so a
rank of the full-size model memory-maps and reads only its own slices. Every rejection names the tensor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .config import MTP_DIR, Config, GenerationConfig
from .fp8 import E4M3, scale_shape

INDEX_FILE = "model.safetensors.index.json"
DRAFT = MTP_DIR + "/"               # logical names of the draft's tensors start with this
DRAFT_LAYER = "mtp.mtp_model_layer."  # the draft block's prefix inside mtp/
PLAIN = (torch.bfloat16, torch.float32)  # what an unquantized tensor may be stored as
SKIPPED = ("mtp_layers.",)           # training-time heads in the target's folder: never read
SKIPPED_DRAFT = ("target_final_norm.weight",)
EXPERT_MATRICES = ("gate_proj", "up_proj", "down_proj")


class CheckpointError(ValueError):
    """A checkpoint that does not match the contract (the message names the tensor)."""


@dataclass(frozen=True)
class TensorSpec:
    """One logical tensor of the layout.

    quantized: block FP8 in an FP8 checkpoint (E4M3 + fp32 `_scale_inv`), bf16 in a BF16 one; otherwise bf16 or fp32.
    split: how ranks share it. None = replicated; ("rows", unit) / ("cols", unit) = split along that dimension into
    TP equal parts of whole units; ("kv_rows", rows_per_head) = split by KV heads, replicated when TP > Nkv.
    """

    name: str
    shape: tuple[int, ...]
    quantized: bool = False
    split: tuple[str, int] | None = None

    @property
    def scale_name(self) -> str:
        return self.name + "_scale_inv"


@dataclass
class Shard:
    """A rank's part of one tensor: the weight, its scale rows/columns (None when unquantized), and where the slice
    starts inside its first scale block along each dimension (a 192-row shard of 128-row blocks starts mid-block)."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    offset: tuple[int, int] = (0, 0)


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def draft_prefix() -> str:
    """The draft block's logical prefix: its tensors' names continue as a target layer's do."""
    return DRAFT + DRAFT_LAYER


def _layer(c: Config, p: str, dense: bool) -> list[TensorSpec]:
    """One decoder layer's tensors (a target layer, or the draft block with p = draft_prefix())."""
    H, D = c.hidden_size, c.head_dim
    specs = [TensorSpec(p + n, (H,)) for n in ("attention_norm.weight", "attn_out_norm.weight",
                                               "feed_forward_norm.weight")]
    if p == layer_prefix(0) or p == draft_prefix():
        specs.append(TensorSpec(p + "ffn_out_norm.weight", (H,)))
    a = p + "self_attn."
    specs += [
        TensorSpec(a + "q_proj.weight", (c.num_attention_heads * D, H), True, ("rows", D)),
        TensorSpec(a + "k_proj.weight", (c.num_key_value_heads * D, H), True, ("kv_rows", D)),
        TensorSpec(a + "v_proj.weight", (c.num_key_value_heads * D, H), True, ("kv_rows", D)),
        TensorSpec(a + "o_proj.weight", (H, c.num_attention_heads * D), True, ("cols", D)),
        TensorSpec(a + "q_norm.weight", (D,)),
        TensorSpec(a + "k_norm.weight", (D,)),
    ]
    if c.enable_sink_attention:
        specs.append(TensorSpec(a + "sink_k", (c.num_key_value_heads, D), split=("kv_rows", 1)))
    if dense:
        F = c.dense_intermediate_size
        return specs + [TensorSpec(p + "mlp.gate_proj.weight", (F, H), True, ("rows", 1)),
                        TensorSpec(p + "mlp.up_proj.weight", (F, H), True, ("rows", 1)),
                        TensorSpec(p + "mlp.down_proj.weight", (H, F), True, ("cols", 1))]
    specs.append(TensorSpec(p + "mlp.router.weight", (c.num_experts, H)))
    I = c.intermediate_size
    for e in range(c.num_experts):
        q = f"{p}mlp.experts.{e}."
        specs += [TensorSpec(q + "gate_proj.weight", (I, H), True, ("rows", 1)),
                  TensorSpec(q + "up_proj.weight", (I, H), True, ("rows", 1)),
                  TensorSpec(q + "down_proj.weight", (H, I), True, ("cols", 1))]
    return specs


def tensor_specs(config: Config) -> dict[str, TensorSpec]:
    """Every logical tensor of an IQuest-Q1 model folder, target then draft (scales are implied by `quantized`)."""
    c, d = config, config.mtp
    if d is None:
        raise CheckpointError("the config has no draft (mtp/config.json)")
    specs = [TensorSpec("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), split=("rows", 1)),
             TensorSpec("lm_head.weight", (c.vocab_size, c.hidden_size), split=("rows", 1)),
             TensorSpec("model.norm.weight", (c.hidden_size,))]
    for layer in range(c.num_hidden_layers):
        specs += _layer(c, layer_prefix(layer), c.is_dense(layer))
    H = d.hidden_size
    specs += [TensorSpec(DRAFT + "embed_tokens.weight", (d.vocab_size, H), split=("rows", 1)),
              TensorSpec(DRAFT + "lm_head.weight", (d.vocab_size, H), split=("rows", 1)),
              TensorSpec(DRAFT + "mtp.enorm.weight", (H,)), TensorSpec(DRAFT + "mtp.hnorm.weight", (H,)),
              TensorSpec(DRAFT + "mtp.eh_proj.weight", (H, 2 * H), True, ("cols", 1)),
              TensorSpec(DRAFT + "mtp.final_layernorm.weight", (H,))]
    specs += _layer(d, draft_prefix(), d.is_dense(0))
    return {s.name: s for s in specs}


def expert_name(prefix: str, e: int, which: str) -> str:
    return f"{prefix}mlp.experts.{e}.{which}.weight"


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


@dataclass(frozen=True)
class _Stored:
    """Where a logical tensor's bytes are: a stored tensor, and the rows of its expert dimension it occupies (packed
    experts: expert e, rows [r0, r1) of its second dimension), or the whole tensor."""

    file: Path
    name: str
    expert: int | None = None
    rows: tuple[int, int] | None = None


class CheckpointReader:
    """Reads an IQuest-Q1 model folder (target + mtp/), checked against `tensor_specs(config)`."""

    def __init__(self, model_dir: str | Path, config: Config | None = None):
        self.dir = Path(model_dir)
        if not self.dir.is_dir():
            raise CheckpointError(f"model folder {self.dir} does not exist")
        if not (self.dir / MTP_DIR).is_dir():
            raise CheckpointError(f"no draft folder {self.dir / MTP_DIR} (the published layout keeps the MTP draft "
                                  "there: its config.json and safetensors)")
        self.config = config if config is not None else Config.from_dir(self.dir)
        self.specs = tensor_specs(self.config)
        self.block = self.config.weight_block_size
        self._handles: dict[str, object] = {}
        self.packed: dict[str, bool] = {}  # layer prefix -> experts stored packed (fc/proj)
        self.unquantized: set[str] = set()  # quantizable weights an FP8 folder stores plain (no _scale_inv)
        self._where = self._locate()

    # ---- layout checks (headers only) ---------------------------------------------------------
    def _files(self, folder: Path, skipped: tuple[str, ...]) -> dict[str, Path]:
        """Stored tensor name -> file, from the folder's index (or its safetensors files' headers), without the names
        the layout skips (those starting with one of `skipped`, and any in SKIPPED_DRAFT inside mtp/)."""
        index = folder / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index} is malformed: {exc}") from None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index} is malformed: weight_map must map tensor names to file names")
            files = {name: folder / fname for name, fname in weight_map.items()}
        else:
            singles = sorted(folder.glob("*.safetensors"))
            if not singles:
                raise CheckpointError(f"no {INDEX_FILE} and no *.safetensors file in {folder}")
            files = {name: path for path in singles for name in self._open(path).keys()}
        ignored = SKIPPED_DRAFT if folder != self.dir else ()
        files = {n: p for n, p in files.items() if not n.startswith(skipped) and n not in ignored}
        for name, path in sorted(files.items()):
            if not path.is_file():
                raise CheckpointError(f"tensor {name}: its file {path.name} is missing (named by {index})")
        return files

    def _locate(self) -> dict[str, _Stored]:
        """Map every logical tensor (and scale) to its stored bytes, checking names, shapes and dtypes."""
        stored = self._files(self.dir, SKIPPED)
        stored.update({DRAFT + n: p for n, p in self._files(self.dir / MTP_DIR, ()).items()})
        where: dict[str, _Stored] = {}
        for name, spec in self.specs.items():
            scales = [spec.scale_name] if spec.quantized and self.block else []
            if scales and spec.scale_name not in stored and name in stored and self._plain_stored(name, stored[name]):
                # an FP8 folder may keep a quantizable weight unquantized (SGLang builds eh_proj unquantized):
                # bf16/fp32 with no scale, read as such
                self.unquantized.add(name)
                scales = []
            packed = self._packed_expert(name, stored)
            if packed is not None:
                where[name] = packed
                stored_scales = scales
            else:
                where[name] = _Stored(stored.get(name, Path()), _stored_name(name))
                stored_scales = scales + [name]
            for s in scales:
                where[s] = _Stored(stored.get(s, Path()), _stored_name(s))
            for n in stored_scales:
                if n not in stored:
                    raise CheckpointError(f"missing tensor {n}")
        used = {(w.file, w.name) for w in where.values()}
        extra = sorted(n for n, p in stored.items() if (p, _stored_name(n)) not in used)
        if extra:
            raise CheckpointError(f"unexpected tensor {extra[0]}" + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))
        for name, w in where.items():
            self._check_header(name, w)
        return where

    def _plain_stored(self, name: str, path: Path) -> bool:
        return _DTYPES.get(self._open(path).get_slice(_stored_name(name)).get_dtype()) in PLAIN

    def is_quantized(self, name: str) -> bool:
        """Whether the logical tensor `name` is stored block FP8 (E4M3 with its `_scale_inv`)."""
        return self.specs[name].quantized and self.block is not None and name not in self.unquantized

    def _packed_expert(self, name: str, stored: dict[str, Path]) -> _Stored | None:
        """The packed tensor holding expert matrix `name`, or None when the experts are stored one by one."""
        head, sep, tail = name.partition("mlp.experts.")
        if not sep:
            return None
        e, which = tail.split(".")[0:2]
        packed_name = head + "mlp.experts." + ("proj" if which == "down_proj" else "fc")
        self.packed.setdefault(head, packed_name in stored)
        if not self.packed[head]:
            return None
        if packed_name not in stored:
            raise CheckpointError(f"missing tensor {packed_name} (the layer's other experts are packed)")
        I = self.specs[name].shape[0 if which != "down_proj" else 1]
        rows = {"gate_proj": (0, I), "up_proj": (I, 2 * I), "down_proj": None}[which]
        return _Stored(stored[packed_name], _stored_name(packed_name), int(e), rows)

    def _slice(self, w: _Stored, name: str):
        """The stored tensor's lazy slice (nothing read yet); a file without it, or a damaged one, names the tensor."""
        handle = self._open(w.file)
        try:
            return handle.get_slice(w.name)
        except SafetensorError as exc:
            if w.name not in handle.keys():
                raise CheckpointError(f"tensor {name}: its file {w.file.name} does not hold {w.name} "
                                      "(the index names the wrong file)") from None
            raise CheckpointError(f"tensor {name}: {w.file}: {exc}") from None

    def _check_header(self, name: str, w: _Stored) -> None:
        sl = self._slice(w, name)
        shape, dtype = tuple(sl.get_shape()), _DTYPES.get(sl.get_dtype())
        where = DRAFT if name.startswith(DRAFT) else ""  # draft tensors are named with their folder
        label = where + w.name if w.expert is None else f"{where}{w.name} (holding {name})"
        if name.endswith("_scale_inv"):
            spec = self.specs[name[: -len("_scale_inv")]]
            want = scale_shape(spec.shape, self.block)
            if shape != want:
                raise CheckpointError(f"tensor {name}: scale shape {shape} does not match its weight "
                                      f"(expected {want} for blocks {list(self.block)})")
            if dtype != torch.float32:
                raise CheckpointError(f"tensor {name}: dtype {sl.get_dtype()}, expected F32")
            return
        spec = self.specs[name]
        want = spec.shape
        if w.expert is not None:
            E = self.config.num_experts if not name.startswith(DRAFT) else self.config.mtp.num_experts
            rows = spec.shape[0] * (2 if w.rows is not None else 1)
            want = (E, rows, spec.shape[1])
        if name.endswith("sink_k") and shape == (1, *want):
            want = shape  # the published files may keep a leading 1
        if shape != want:
            raise CheckpointError(f"tensor {label}: shape {shape}, expected {want}")
        quantized = self.is_quantized(name)
        if quantized and dtype != E4M3:
            raise CheckpointError(f"tensor {label}: dtype {sl.get_dtype()}, expected F8_E4M3 (quantization_config "
                                  "says block FP8)")
        if not quantized and dtype not in PLAIN:
            raise CheckpointError(f"tensor {label}: dtype {sl.get_dtype()}, expected BF16 or F32")

    def _open(self, path: Path):
        key = str(path)
        if key not in self._handles:
            self._handles[key] = _safe_open(path)
        return self._handles[key]

    # ---- reading --------------------------------------------------------------------------------
    def names(self) -> Iterator[str]:
        """Every logical weight name (scales are read with their weights)."""
        return iter(self.specs)

    def is_packed(self, prefix: str) -> bool:
        """Whether the layer (or draft block) at `prefix` stores its experts packed."""
        return self.packed.get(prefix, False)

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """One logical tensor (or scale), or its [start:stop) slice along `dim`, values checked."""
        if name not in self._where:
            raise CheckpointError(f"tensor {name} is not in this checkpoint")
        w = self._where[name]
        sl = self._slice(w, name)
        shape = sl.get_shape()
        index: list = [slice(0, n) for n in shape]
        lead = 0
        if w.expert is not None:
            index[0] = w.expert
            lead = 1
            if w.rows is not None:
                index[1] = slice(*w.rows)
        elif name.endswith("sink_k") and len(shape) == 3:
            index[0], lead = 0, 1
        if dim is not None:
            r = index[lead + dim]
            size = r.stop - r.start
            stop = size if stop is None else stop
            if not 0 <= start <= stop <= size:
                raise CheckpointError(f"tensor {name}: slice [{start}:{stop}) of dimension {dim} is outside its "
                                      f"size {size}")
            index[lead + dim] = slice(r.start + start, r.start + stop)
        index = [slice(None) if isinstance(i, slice) and (i.start, i.stop) == (0, n) else i
                 for i, n in zip(index, shape)]
        try:
            t = sl[tuple(index)]
        except SafetensorError as exc:
            raise CheckpointError(f"tensor {name}: {w.file}: {exc}") from None
        if lead and t.dim() == len(shape):
            t = t[0]  # some safetensors versions keep the indexed dimension
        if t.dtype != E4M3 and not torch.isfinite(t).all():
            raise CheckpointError(f"tensor {name} holds non-finite values")
        if name.endswith("_scale_inv") and not (t > 0).all():
            raise CheckpointError(f"tensor {name} holds non-positive scales")
        return t

    def read_weight(self, name: str, tp: int = 1, rank: int = 0) -> Shard:
        """`rank`'s slice of the logical tensor `name` and, when quantized, the scale rows/columns it touches."""
        spec = self.specs[name]
        part = shard_range(spec, self.config_of(name), tp, rank)
        quantized = self.is_quantized(name)
        if part is None:
            return Shard(self.read(name), self.read(spec.scale_name) if quantized else None)
        dim, start, stop = part
        w = self.read(name, dim, start, stop)
        if not quantized:
            return Shard(w)
        b = self.block[dim]
        scale = self.read(spec.scale_name, dim, start // b, -(-stop // b))
        offset = (start % b, 0) if dim == 0 else (0, start % b)
        return Shard(w, scale, offset)

    def config_of(self, name: str) -> Config:
        return self.config.mtp if name.startswith(DRAFT) else self.config


def _stored_name(logical: str) -> str:
    return logical[len(DRAFT):] if logical.startswith(DRAFT) else logical


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


# ---- writing --------------------------------------------------------------------------------------
def stored_tensors(config: Config, tensors: dict[str, torch.Tensor], packed: bool) -> dict[str, torch.Tensor]:
    """Logical tensors in their stored names (the draft's still under `mtp/`), experts packed into `experts.fc` /
    `experts.proj` when `packed`; checked against the layout first, so a writer bug cannot produce a folder the reader
    would reject."""
    expected = {}
    for spec in tensor_specs(config).values():
        expected[spec.name] = spec
        if spec.quantized and config.quantized:
            expected[spec.scale_name] = spec
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise CheckpointError(f"cannot write: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, t in tensors.items():
        spec = expected[name]
        if name.endswith("_scale_inv"):
            ok = tuple(t.shape) == scale_shape(spec.shape, config.weight_block_size) and t.dtype == torch.float32
        else:
            ok = tuple(t.shape) == spec.shape and (t.dtype == E4M3 if spec.quantized and config.quantized
                                                   else t.dtype in PLAIN)
        if not ok:
            raise CheckpointError(f"cannot write tensor {name}: {tuple(t.shape)} {t.dtype}")
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, list]] = {}
    for name, t in tensors.items():
        head, sep, tail = name.partition("mlp.experts.")
        if packed and sep and not name.endswith("_scale_inv"):
            e, which = int(tail.split(".")[0]), tail.split(".")[1]
            groups.setdefault(head, {}).setdefault(which, []).append((e, t))
        else:
            out[name] = t
    for head, parts in groups.items():
        stack = {w: torch.stack([t for _, t in sorted(parts[w], key=lambda p: p[0])]) for w in EXPERT_MATRICES}
        out[head + "mlp.experts.fc"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[head + "mlp.experts.proj"] = stack["down_proj"]
    return out


def _write_folder(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():  # layout order: a layer's tensors stay together
        t = t.contiguous()
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
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=1, sort_keys=True) + "\n")


def save_checkpoint(out_dir: str | Path, config: Config, tensors: dict[str, torch.Tensor],
                    generation: GenerationConfig | None = None, max_shard_bytes: int = 2 << 30,
                    packed: bool = True) -> None:
    """Write logical `tensors` (weights and `*_scale_inv`) as a model folder in the published layout: the target's
    sharded safetensors with index and configs, the draft's in `mtp/`."""
    stored = stored_tensors(config, tensors, packed)
    out = Path(out_dir)
    _write_folder(out, {n: t for n, t in stored.items() if not n.startswith(DRAFT)}, max_shard_bytes)
    _write_folder(out / MTP_DIR, {n[len(DRAFT):]: t for n, t in stored.items() if n.startswith(DRAFT)},
                  max_shard_bytes)
    config.write(out)
    gen = generation or GenerationConfig(eos_token_id=config.eos_token_id)
    (out / "generation_config.json").write_text(json.dumps(gen.to_dict(), indent=2) + "\n")
