"""IQuest-Q1 configuration: the frozen contract both engines are built from (docs/model.md, "Config").

`Config.from_dir(path)` reads the target's `config.json` and the draft's `mtp/config.json` (its own Config, held
as `config.mtp`) as the published model writes them. Every check names the key it is about, so a bad or foreign
checkpoint fails with one line a user can act on. Unknown keys are kept out and ignored (Hugging Face configs
carry many keys this contract does not use).
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")
TP_DEGREES = (1, 2, 4, 8)
TARGET_TYPE, DRAFT_TYPE = "iquest_q1", "iquest_q1_mtp"
MTP_DIR = "mtp"  # the draft's own checkpoint folder inside the model folder

# The published draft's values where its config may leave a key out (docs/model.md, "Draft config": SGLang's
# newest defaults are null/null/false, every published example uses these; the file decides).
DRAFT_DEFAULTS = {"num_hidden_layers": 1, "mlp_only_layers": [], "no_rope_layers": [], "sliding_window": 512,
                  "swa_rope_theta": 1e4, "fp32_residual_connection": True}


class ConfigError(ValueError):
    """A config value that the model contract does not allow (the message names the key)."""


@dataclass(frozen=True)
class Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int                    # each expert's width
    num_experts: int
    num_experts_per_tok: int
    dense_intermediate_size: int = 12288      # the dense MLP layers' width
    mlp_only_layers: tuple[int, ...] = (0,)   # layers with a dense MLP instead of the MoE
    moe_router_dtype: str = "fp32"
    hidden_act: str = "silu"
    max_position_embeddings: int = 524288
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6                   # full-attention layers
    swa_rope_theta: float = 1e4               # sliding-window layers
    rotary_dim: int = 32                      # partial RoPE: dims 0..rotary_dim-1 rotate (NeoX halves)
    no_rope_layers: tuple[int, ...] = ()
    sliding_window: int | None = 4096         # W keys, the query's own position counted
    use_sliding_window: bool = True
    use_hybrid_layers: bool = True
    first_layers_types: tuple[str, ...] = ("full_attention",)
    hybrid_layers_types_block: tuple[str, ...] = ("full_attention", "sliding_attention", "sliding_attention",
                                                  "sliding_attention")
    num_hybrid_layers_block: int = 21
    last_layers_types: tuple[str, ...] = ("full_attention",) * 3
    enable_sink_attention: bool = True        # a learned zero-value sink key per KV head
    first_layer_attn_out_scale: float = 1.0   # layer 0 and the draft block
    first_layer_ffn_out_scale: float = 1.0
    attn_out_scale: float = 1.0               # layers >= 1
    ffn_out_scale: float = 0.53881590608
    softmax_scale: float | None = None        # None: head_dim ** -0.5
    logit_scale: float = 1.0                  # the target's logits only
    enable_lm_head_fp32: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: tuple[int, ...] = (0,)
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    num_mtp_layers: int = 0                   # training-time heads (mtp_layers.*): never loaded
    weight_block_size: tuple[int, int] | None = None  # block FP8 when set (quantization_config), BF16 when None
    # the draft's own keys (mtp/config.json)
    fp32_residual_connection: bool = False
    num_draft_slots: int = 7                  # informational: a round verifies at most 7 drafts (fast/state.py)
    num_target_layers: int | None = None
    model_type: str = TARGET_TYPE
    mtp: "Config | None" = field(default=None, compare=True)  # the draft's config, on a target's

    def __post_init__(self) -> None:
        if self.model_type == DRAFT_TYPE and isinstance(self.num_hidden_layers, int) and 0 < self.num_hidden_layers < 8:
            # The draft's layer type comes from its window alone: its block keys are rewritten to say so, so that its
            # config.json describes its one layer (the file's own block keys, written for the target, are ignored).
            kind = "sliding_attention" if self.sliding_window else "full_attention"
            for key, value in (("first_layers_types", (kind,) * self.num_hidden_layers),
                               ("hybrid_layers_types_block", ()), ("num_hybrid_layers_block", 0),
                               ("last_layers_types", ())):
                object.__setattr__(self, key, value)
        _validate(self)

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def is_draft(self) -> bool:
        return self.model_type == DRAFT_TYPE

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Each layer's attention type: first + block x count + last, all full when either switch is off; a draft's
        one layer is sliding when it has a window."""
        if self.is_draft:
            return ("sliding_attention" if self.sliding_window else "full_attention",) * self.num_hidden_layers
        if not (self.use_sliding_window and self.use_hybrid_layers):
            return ("full_attention",) * self.num_hidden_layers
        return (*self.first_layers_types, *self.hybrid_layers_types_block * self.num_hybrid_layers_block,
                *self.last_layers_types)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def scale(self) -> float:
        """The attention scores' scale."""
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5

    @property
    def quantized(self) -> bool:
        return self.weight_block_size is not None

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer]

    def window(self, layer: int) -> int | None:
        """Keys a query of `layer` sees (its own position counted), None for full attention."""
        return self.sliding_window if self.layer_type(layer) == "sliding_attention" else None

    def rope_theta_for(self, layer: int) -> float | None:
        """The layer's RoPE base (sliding: swa_rope_theta, full: rope_theta), None in a no-RoPE layer."""
        if layer in self.no_rope_layers:
            return None
        return self.swa_rope_theta if self.layer_type(layer) == "sliding_attention" else self.rope_theta

    def is_dense(self, layer: int) -> bool:
        """Whether the layer's MLP is the dense one (mlp_only_layers) instead of the MoE."""
        return layer in self.mlp_only_layers

    def out_scales(self, layer: int) -> tuple[float, float]:
        """(attention output scale, MLP output scale) of the layer: layer 0 (and the draft block) has its own."""
        if layer == 0:
            return self.first_layer_attn_out_scale, self.first_layer_ffn_out_scale
        return self.attn_out_scale, self.ffn_out_scale

    def first_layers(self, n: int) -> "Config":
        """This model cut to its first `n` layers (the draft kept): a shorter stack at full width, for benchmarks
        whose ranks must fit one GPU together."""
        if not 1 <= n <= self.num_hidden_layers:
            raise ConfigError(f"layers must be in 1..{self.num_hidden_layers}, got {n}")
        return replace(self, num_hidden_layers=n, first_layers_types=self.layer_types[:n],
                       hybrid_layers_types_block=(), num_hybrid_layers_block=0, last_layers_types=(),
                       mlp_only_layers=tuple(i for i in self.mlp_only_layers if i < n),
                       no_rope_layers=tuple(i for i in self.no_rope_layers if i < n))

    def check_tp(self, tp: int) -> None:
        """Raise ConfigError unless every tensor-parallel shard (docs/model.md, "Tensor parallelism") is whole at
        degree `tp`. FP8 scale blocks may straddle ranks: each rank keeps the scale rows it touches."""
        if tp not in TP_DEGREES:
            raise ConfigError(f"tensor-parallel degree {tp} is not one of {TP_DEGREES}")
        for c in (self, self.mtp) if self.mtp is not None else (self,):
            checks = [("vocab_size", c.vocab_size), ("num_attention_heads", c.num_attention_heads),
                      ("intermediate_size", c.intermediate_size), ("hidden_size", 2 * c.hidden_size)]
            if c.mlp_only_layers:
                checks.append(("dense_intermediate_size", c.dense_intermediate_size))
            for key, value in checks:
                if value % tp:
                    raise ConfigError(f"{_where(c)}{key}={value} is not divisible by the tensor-parallel degree {tp}")
            nkv = c.num_key_value_heads
            if (nkv % tp) if tp <= nkv else (tp % nkv):
                raise ConfigError(f"{_where(c)}num_key_value_heads={nkv} cannot be split or replicated over {tp} ranks")

    # ---- (de)serialisation --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any], mtp: dict[str, Any] | None = None) -> "Config":
        """A config from config.json's object (and the draft's, mtp/config.json's, for a target)."""
        if not isinstance(raw, dict):
            raise ConfigError("a config must be a JSON object")
        raw = dict(raw)
        model_type = raw.get("model_type", TARGET_TYPE)
        if model_type == DRAFT_TYPE:
            raw = {**DRAFT_DEFAULTS, **raw}
        if mtp is not None and model_type == DRAFT_TYPE:
            raise ConfigError("a draft config (model_type iquest_q1_mtp) has no draft of its own")
        raw.setdefault("head_dim", 128)  # the published default (SGLang's too), not hidden_size / heads
        kwargs: dict[str, Any] = _rope_keys(raw)
        quant = raw.pop("quantization_config", None)
        if quant is not None:
            kwargs["weight_block_size"] = _quantization(quant)
        known = {f.name for f in fields(cls)} - {"mtp", "weight_block_size"}
        for key, value in raw.items():
            if key not in known or key in kwargs:
                continue  # layer_types is derived from the block keys, never read
            kwargs[key] = _coerce(key, value)
        missing = [f.name for f in fields(cls)
                   if f.name not in kwargs and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ConfigError(f"config is missing required key(s): {', '.join(missing)}")
        if mtp is not None:
            kwargs["mtp"] = _draft_from_dict(cls, mtp)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """config.json's object as the published model writes it (the draft's separately: `self.mtp.to_dict()`)."""
        out: dict[str, Any] = {"model_type": self.model_type,
                               "architectures": ["IQuestQ1MTP" if self.is_draft else "IQuestQ1ForCausalLM"]}
        for f in fields(self):
            if f.name in ("mtp", "weight_block_size", "model_type"):
                continue
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["layer_types"] = list(self.layer_types)  # informational: readers derive it from the block keys
        if self.weight_block_size is not None:
            out["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                          "weight_block_size": list(self.weight_block_size)}
        return out

    @classmethod
    def from_file(cls, path: str | Path, mtp_path: str | Path | None = None) -> "Config":
        return cls.from_dict(_read_json(Path(path)), None if mtp_path is None else _read_json(Path(mtp_path)))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Config":
        """The target's config.json and the draft's mtp/config.json (a model folder without mtp/ is an error)."""
        model_dir = Path(model_dir)
        return cls.from_file(model_dir / "config.json", model_dir / MTP_DIR / "config.json")

    def write(self, model_dir: str | Path) -> None:
        """config.json (and mtp/config.json for the draft) into a model folder."""
        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        if self.mtp is not None:
            (model_dir / MTP_DIR).mkdir(exist_ok=True)
            (model_dir / MTP_DIR / "config.json").write_text(json.dumps(self.mtp.to_dict(), indent=2) + "\n")


def _draft_from_dict(cls: type[Config], raw: Any) -> Config:
    """The draft's Config from mtp/config.json's object; every error names that file."""
    where = "mtp/config.json: "
    if not isinstance(raw, dict):
        raise ConfigError(where + "a config must be a JSON object")
    model_type = raw.get("model_type", DRAFT_TYPE)
    if model_type != DRAFT_TYPE:
        raise ConfigError(f"{where}model_type={model_type!r} must be {DRAFT_TYPE!r}")
    nested = raw.get("target_config")  # SGLang's draft config may nest the target's keys; the draft's own win
    if nested is not None and not isinstance(nested, dict):
        raise ConfigError(where + "target_config must be an object")
    raw = {**(nested or {}), **{k: v for k, v in raw.items() if k != "target_config"}}
    try:
        return cls.from_dict({**raw, "model_type": DRAFT_TYPE})
    except ConfigError as exc:
        if str(exc).startswith(where):
            raise
        raise ConfigError(where + str(exc)) from None


def _where(c: Config) -> str:
    return "mtp/config.json: " if c.is_draft else ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config file at {path}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None


_TUPLES = {"mlp_only_layers", "no_rope_layers", "first_layers_types", "hybrid_layers_types_block",
           "last_layers_types"}


def _coerce(key: str, value: Any) -> Any:
    if key in _TUPLES:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return tuple(value)
    if key == "eos_token_id":
        return tuple(value) if isinstance(value, (list, tuple)) else (() if value is None else (value,))
    return value


def _rope_keys(raw: dict[str, Any]) -> dict[str, Any]:
    """rotary_dim (or rope_parameters.partial_rotary_factor), rope_theta from rope_parameters where the top level has
    none; a scaled RoPE is refused (the published model has none)."""
    out: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters"):
        params = raw.pop(key, None)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise ConfigError(f"{key} must be an object or null, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        if kind != "default":
            raise ConfigError(f"{key}.rope_type={kind!r} is not supported (only 'default': no scaling)")
        if "partial_rotary_factor" in params and "rotary_dim" not in raw:
            factor, head_dim = params["partial_rotary_factor"], raw.get("head_dim")
            if (not isinstance(factor, (int, float)) or isinstance(factor, bool) or not 0 < factor <= 1
                    or not isinstance(head_dim, int)):
                raise ConfigError(f"{key}.partial_rotary_factor={factor!r} must be in (0, 1] with head_dim given")
            dims = factor * head_dim
            if abs(dims - round(dims)) > 1e-6:
                raise ConfigError(f"{key}.partial_rotary_factor={factor!r} x head_dim {head_dim} = {dims:g} is not a "
                                  "whole number of rotary dims")
            out["rotary_dim"] = int(round(dims))
        if "rope_theta" in params and "rope_theta" not in raw:
            out["rope_theta"] = params["rope_theta"]
    return out


def _quantization(quant: Any) -> tuple[int, int]:
    if not isinstance(quant, dict):
        raise ConfigError("quantization_config must be an object")
    method, fmt = quant.get("quant_method", "fp8"), quant.get("fmt", "e4m3")
    if method != "fp8" or fmt != "e4m3":
        raise ConfigError(f"quantization_config ({method!r}, {fmt!r}) is not supported: need fp8/e4m3")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme={quant['activation_scheme']!r}: only 'dynamic'")
    block = quant.get("weight_block_size", [128, 128])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in block)):
        raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return int(block[0]), int(block[1])


def _positive_int(c: Config, key: str) -> None:
    value = getattr(c, key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{_where(c)}{key} must be a positive integer, got {value!r}")


def _validate(c: Config) -> None:
    w = _where(c)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "dense_intermediate_size", "num_experts", "num_experts_per_tok",
                "max_position_embeddings", "num_draft_slots"):
        _positive_int(c, key)
    if c.model_type not in (TARGET_TYPE, DRAFT_TYPE):
        raise ConfigError(f"model_type={c.model_type!r} is not {TARGET_TYPE!r} (or {DRAFT_TYPE!r} in mtp/)")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(f"{w}num_attention_heads={c.num_attention_heads} is not divisible by "
                          f"num_key_value_heads={c.num_key_value_heads}")
    if (not isinstance(c.rotary_dim, int) or isinstance(c.rotary_dim, bool) or c.rotary_dim <= 0
            or c.rotary_dim % 2 or c.rotary_dim > c.head_dim):
        raise ConfigError(f"{w}rotary_dim={c.rotary_dim!r} must be even and in 2..head_dim ({c.head_dim})")
    if c.sliding_window is not None:
        _positive_int(c, "sliding_window")
    types = c.layer_types
    if len(types) != c.num_hidden_layers:
        raise ConfigError(f"{w}the layer pattern (first_layers_types + hybrid_layers_types_block x "
                          f"num_hybrid_layers_block + last_layers_types) has {len(types)} layers but "
                          f"num_hidden_layers={c.num_hidden_layers}")
    for key in ("first_layers_types", "hybrid_layers_types_block", "last_layers_types"):
        for kind in getattr(c, key):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"{w}{key} holds {kind!r}, not one of {LAYER_TYPES}")
    if not isinstance(c.num_hybrid_layers_block, int) or c.num_hybrid_layers_block < 0:
        raise ConfigError(f"{w}num_hybrid_layers_block must be an integer >= 0, got {c.num_hybrid_layers_block!r}")
    if "sliding_attention" in types and c.sliding_window is None:
        raise ConfigError(f"{w}sliding_window is null but the layer pattern has sliding-window layers")
    for key in ("mlp_only_layers", "no_rope_layers"):
        for i in getattr(c, key):
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < c.num_hidden_layers:
                raise ConfigError(f"{w}{key} holds {i!r}, not a layer index in 0..{c.num_hidden_layers - 1}")
    if c.num_experts_per_tok > c.num_experts:
        raise ConfigError(f"{w}num_experts_per_tok={c.num_experts_per_tok} exceeds num_experts={c.num_experts}")
    if c.moe_router_dtype != "fp32":
        raise ConfigError(f"{w}moe_router_dtype={c.moe_router_dtype!r}: the router is computed in fp32 only")
    if c.hidden_act != "silu":
        raise ConfigError(f"{w}hidden_act={c.hidden_act!r}: only 'silu' is supported")
    if c.tie_word_embeddings:
        raise ConfigError(f"{w}tie_word_embeddings=true is not supported: IQuest-Q1 has its own lm_head")
    if c.attention_bias:
        raise ConfigError(f"{w}attention_bias=true is not supported: IQuest-Q1's projections have no bias")
    if not c.enable_lm_head_fp32:
        raise ConfigError(f"{w}enable_lm_head_fp32=false is not supported: the LM head is computed in fp32")
    for key in ("rms_norm_eps", "rope_theta", "swa_rope_theta", "logit_scale"):
        value = getattr(c, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{w}{key} must be a positive number, got {value!r}")
    for key in ("first_layer_attn_out_scale", "first_layer_ffn_out_scale", "attn_out_scale", "ffn_out_scale"):
        value = getattr(c, key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise ConfigError(f"{w}{key} must be a finite number, got {value!r}")
    if c.softmax_scale is not None and not (isinstance(c.softmax_scale, (int, float)) and c.softmax_scale > 0):
        raise ConfigError(f"{w}softmax_scale must be a positive number or null, got {c.softmax_scale!r}")
    for tok in c.eos_token_id:
        if not isinstance(tok, int) or not 0 <= tok < c.vocab_size:
            raise ConfigError(f"{w}eos_token_id {tok!r} is outside the vocabulary (vocab_size={c.vocab_size})")
    if c.is_draft:
        if c.num_hidden_layers != 1:
            raise ConfigError(f"{w}num_hidden_layers={c.num_hidden_layers}: the draft is one layer")
    if c.mtp is not None:
        d = c.mtp
        if c.is_draft or not d.is_draft:
            raise ConfigError("mtp/config.json: model_type must be 'iquest_q1_mtp'")
        for key in ("vocab_size", "hidden_size"):
            if getattr(d, key) != getattr(c, key):
                raise ConfigError(f"mtp/config.json: {key}={getattr(d, key)} differs from the target's "
                                  f"{getattr(c, key)}")
        if d.weight_block_size != c.weight_block_size:
            raise ConfigError("mtp/config.json: quantization_config differs from the target's")


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling defaults (`generation_config.json`): docs/round.md's dist() parameters."""

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
