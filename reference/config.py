"""IQuest-Q1 configuration: the frozen contract both engines are built from (MODEL.md, "Config").

`Config.from_dir(path)` reads `config.json` (+ `generation_config.json`); every check names the key
it is about, so a bad or foreign checkpoint fails with a message a user can act on.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")
TP_DEGREES = (1, 2, 4, 8)


class ConfigError(ValueError):
    """A config value that the model contract does not allow (the message names the key)."""


@dataclass(frozen=True)
class RopeScaling:
    """YaRN context extension (optional; `rope_scaling` in config.json)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    rope_type: str = "yarn"


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    attention_sinks: bool = True
    rope_theta: float = 1e6
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 196608
    rms_norm_eps: float = 1e-6
    qk_norm: bool = False
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_nextn_predict_layers: int = 1
    mtp_layer_type: str = "sliding_attention"
    tie_word_embeddings: bool = False
    weight_block_size: tuple[int, int] = (128, 128)
    quant_method: str = "fp8"
    quant_fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    model_type: str = "iquest_q1"

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def mtp_layer_index(self) -> int:
        return self.num_hidden_layers

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    def layer_type(self, layer: int) -> str:
        """Attention type of main layer `layer`, or of the MTP layer at index num_hidden_layers."""
        if layer == self.mtp_layer_index:
            return self.mtp_layer_type
        return self.layer_types[layer]

    def first_layers(self, n: int) -> "Config":
        """This model cut to its first `n` main layers, the MTP layer kept: a shorter stack at full width, for
        benchmarks whose ranks must fit one GPU together."""
        if not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(f"layers must be in 1..{self.num_hidden_layers}, got {n}")
        return replace(self, num_hidden_layers=n, layer_types=self.layer_types[:n])

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless every tensor-parallel shard of MODEL.md is whole at degree `tp`."""
        if tp not in TP_DEGREES:
            raise ConfigError(f"tensor-parallel degree {tp} is not one of {TP_DEGREES}")
        if tp == 1:
            return  # nothing is sliced: partial edge blocks (ceil-shaped scales, MODEL.md) are fine
        checks = [
            ("vocab_size", self.vocab_size),
            ("num_attention_heads", self.num_attention_heads),
            ("moe_intermediate_size", self.moe_intermediate_size),
        ]
        for key, value in checks:
            if value % tp:
                raise ConfigError(f"{key}={value} is not divisible by the tensor-parallel degree {tp}")
        nkv = self.num_key_value_heads
        if tp <= nkv and nkv % tp:
            raise ConfigError(f"num_key_value_heads={nkv} is not divisible by the tensor-parallel degree {tp}")
        if tp > nkv and tp % nkv:
            raise ConfigError(
                f"num_key_value_heads={nkv} cannot be replicated over {tp} ranks ({tp} % {nkv} != 0)"
            )
        b0, b1 = self.weight_block_size
        shard_i = self.moe_intermediate_size // tp
        if shard_i % b0 or shard_i % b1:
            raise ConfigError(
                f"weight_block_size={list(self.weight_block_size)} does not divide the per-rank "
                f"moe_intermediate_size shard {shard_i} at tensor-parallel degree {tp}"
            )
        q_shard = self.num_attention_heads // tp * self.head_dim
        if q_shard % b0 or q_shard % b1:
            raise ConfigError(
                f"weight_block_size={list(self.weight_block_size)} does not divide the per-rank query "
                f"projection shard {q_shard} (num_attention_heads/tp * head_dim) at degree {tp}"
            )
        kv_shard = max(nkv // tp, 1) * self.head_dim
        if kv_shard % b0:
            raise ConfigError(
                f"weight_block_size[0]={b0} does not divide the per-rank KV projection shard {kv_shard}"
            )
        if (2 * self.hidden_size) % tp or (2 * self.hidden_size // tp) % b1:
            raise ConfigError(
                f"hidden_size={self.hidden_size}: the eh_proj row-parallel input shard (2*hidden/tp) "
                f"must be a whole number of weight blocks at degree {tp}"
            )

    # ---- (de)serialisation --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Config":
        raw = dict(raw)
        known = {f.name for f in fields(cls)}
        quant = raw.pop("quantization_config", None)
        kwargs: dict[str, Any] = {}
        if quant is not None:
            if not isinstance(quant, dict):
                raise ConfigError("quantization_config must be an object")
            kwargs["quant_method"] = quant.get("quant_method", "fp8")
            kwargs["quant_fmt"] = quant.get("fmt", "e4m3")
            kwargs["activation_scheme"] = quant.get("activation_scheme", "dynamic")
            if "weight_block_size" in quant:
                kwargs["weight_block_size"] = _int_pair("quantization_config.weight_block_size",
                                                        quant["weight_block_size"])
        if "head_dim" not in raw and "hidden_size" in raw and "num_attention_heads" in raw:
            raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        if "layer_types" not in raw and "num_hidden_layers" in raw:
            raw["layer_types"] = default_layer_types(int(raw["num_hidden_layers"]))
        for key, value in raw.items():
            if key not in known:
                continue  # Hugging Face configs carry many keys this contract does not use
            if key == "layer_types":
                if not isinstance(value, (list, tuple)):
                    raise ConfigError("layer_types must be a list of layer type names")
                value = tuple(value)
            elif key == "rope_scaling" and value is not None:
                value = _rope_scaling(value)
            elif key == "eos_token_id":
                value = tuple(value) if isinstance(value, (list, tuple)) else (() if value is None else (value,))
            elif key == "weight_block_size":
                value = _int_pair("weight_block_size", value)
            kwargs[key] = value
        missing = [f.name for f in fields(cls)
                   if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ConfigError(f"config.json is missing required key(s): {', '.join(missing)}")
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("quant_method", "quant_fmt", "activation_scheme", "weight_block_size"):
            out.pop(key)
        out["layer_types"] = list(self.layer_types)
        out["eos_token_id"] = list(self.eos_token_id)
        out["quantization_config"] = {
            "quant_method": self.quant_method,
            "fmt": self.quant_fmt,
            "weight_block_size": list(self.weight_block_size),
            "activation_scheme": self.activation_scheme,
        }
        return out

    @classmethod
    def from_file(cls, path: str | Path) -> "Config":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config file at {path}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Config":
        return cls.from_file(Path(model_dir) / "config.json")


def _int_pair(key: str, value: Any) -> tuple[int, int]:
    if not isinstance(value, (list, tuple)) or len(value) != 2 or not all(isinstance(v, int) and v > 0 for v in value):
        raise ConfigError(f"{key} must be two positive integers, got {value!r}")
    return (int(value[0]), int(value[1]))


def _rope_scaling(value: Any) -> RopeScaling:
    if not isinstance(value, dict):
        raise ConfigError("rope_scaling must be an object or null")
    kind = value.get("rope_type", value.get("type", "yarn"))
    if kind != "yarn":
        raise ConfigError(f"rope_scaling.rope_type={kind!r} is not supported (only 'yarn')")
    try:
        rs = RopeScaling(
            factor=float(value["factor"]),
            original_max_position_embeddings=int(value["original_max_position_embeddings"]),
            beta_fast=float(value.get("beta_fast", 32.0)),
            beta_slow=float(value.get("beta_slow", 1.0)),
        )
    except KeyError as exc:
        raise ConfigError(f"rope_scaling is missing key {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"rope_scaling has a non-numeric value: {exc}") from None
    if not rs.factor > 0 or rs.original_max_position_embeddings <= 0:
        raise ConfigError(f"rope_scaling.factor and rope_scaling.original_max_position_embeddings must be "
                          f"positive, got {rs.factor!r} and {rs.original_max_position_embeddings!r}")
    return rs


def default_layer_types(num_layers: int) -> tuple[str, ...]:
    """MODEL.md's default pattern: three sliding-window layers, then one full-attention layer."""
    return tuple("full_attention" if i % 4 == 3 else "sliding_attention" for i in range(num_layers))


def _validate(c: Config) -> None:
    positive = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "sliding_window", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                "max_position_embeddings"]
    for key in positive:
        value = getattr(c, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if c.model_type != "iquest_q1":
        raise ConfigError(f"model_type={c.model_type!r} is not 'iquest_q1'")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(
            f"num_attention_heads={c.num_attention_heads} is not divisible by "
            f"num_key_value_heads={c.num_key_value_heads}"
        )
    if c.head_dim % 2:
        raise ConfigError(f"head_dim={c.head_dim} must be even (rotary embedding rotates halves)")
    if len(c.layer_types) != c.num_hidden_layers:
        raise ConfigError(
            f"layer_types has {len(c.layer_types)} entries but num_hidden_layers={c.num_hidden_layers}"
        )
    for i, kind in enumerate(c.layer_types):
        if kind not in LAYER_TYPES:
            raise ConfigError(f"layer_types[{i}]={kind!r} is not one of {LAYER_TYPES}")
    if c.mtp_layer_type not in LAYER_TYPES:
        raise ConfigError(f"mtp_layer_type={c.mtp_layer_type!r} is not one of {LAYER_TYPES}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(
            f"num_experts_per_tok={c.num_experts_per_tok} exceeds n_routed_experts={c.n_routed_experts}"
        )
    if c.n_shared_experts != 0:
        raise ConfigError(f"n_shared_experts={c.n_shared_experts}: only 0 is part of the IQuest-Q1 contract")
    if c.scoring_func != "softmax":
        raise ConfigError(f"scoring_func={c.scoring_func!r}: only 'softmax' is supported")
    if c.num_nextn_predict_layers != 1:
        raise ConfigError(f"num_nextn_predict_layers={c.num_nextn_predict_layers}: exactly one MTP layer is supported")
    if c.tie_word_embeddings:
        raise ConfigError("tie_word_embeddings=true is not supported: IQuest-Q1 has its own lm_head")
    if c.quant_method != "fp8" or c.quant_fmt != "e4m3":
        raise ConfigError(
            f"quantization_config ({c.quant_method!r}, {c.quant_fmt!r}) is not supported: need fp8/e4m3"
        )
    if not (c.rms_norm_eps > 0):
        raise ConfigError(f"rms_norm_eps must be positive, got {c.rms_norm_eps!r}")
    if not (c.rope_theta > 0):
        raise ConfigError(f"rope_theta must be positive, got {c.rope_theta!r}")
    if c.routed_scaling_factor <= 0:
        raise ConfigError(f"routed_scaling_factor must be positive, got {c.routed_scaling_factor!r}")
    for tok in c.eos_token_id:
        if not 0 <= tok < c.vocab_size:
            raise ConfigError(f"eos_token_id {tok} is outside the vocabulary (vocab_size={c.vocab_size})")


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling defaults (`generation_config.json`): ROUND.md's dist() parameters."""

    temperature: float = 1.0
    top_k: int = 20
    top_p: float = 0.95
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p)

    @classmethod
    def from_dir(cls, model_dir: str | Path, config: Config | None = None) -> "GenerationConfig":
        path = Path(model_dir) / "generation_config.json"
        raw: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        eos = raw.get("eos_token_id", list(config.eos_token_id) if config else [])
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        return cls(
            temperature=float(raw.get("temperature", 1.0)),
            top_k=int(raw.get("top_k", 20)),
            top_p=float(raw.get("top_p", 0.95)),
            eos_token_id=eos,
        )

    def to_dict(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "eos_token_id": list(self.eos_token_id)}


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if not (temperature >= 0) or temperature != temperature:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top_k must be an integer >= 1, got {top_k}")
    if not (0 < top_p <= 1):
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
