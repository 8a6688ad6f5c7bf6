"""One rank's weights at full dimensions without a checkpoint: random E4M3 weights made on the device.

Shapes come from the checkpoint layout (`tensor_specs` + `shard_range`), so a synthetic rank slice has
exactly the tensors, shapes and dtypes that `fast/weights.load_weights` gives for that rank. Tensors
are made layer by layer, and expert stacks a few experts at a time, so the peak is the weights' own
size plus one small fp32 chunk (the full-size TP8 rank is ~109 GB on a ~139 GB H200).

Values keep activations O(1): a real weight is E4M3 (about N(0, 64^2), clipped at 448) times a block
scale of about 1/(64 sqrt(in)), so each projection has unit gain; the router and LM head get
N(0, 1/H) rows (near-uniform routing over the experts, soft next-token distributions).
"""

from __future__ import annotations

import math

import torch

from ..reference.checkpoint import TensorSpec, layer_prefix, shard_range, tensor_specs
from ..reference.config import Config
from ..reference.fp8 import E4M3, E4M3_MAX
from .parallel import Parallel
from .weights import FP8Weight, LayerWeights, ModelWeights, MTPWeights

Q_STD = 64.0            # spread of the stored E4M3 values
CHUNK_ELEMENTS = 1 << 26  # fp32 elements generated at once (256 MB)


class _Maker:
    def __init__(self, config: Config, tp: int, rank: int, device: torch.device, dtype: torch.dtype, seed: int):
        self.c, self.tp, self.rank, self.device, self.dtype = config, tp, rank, torch.device(device), dtype
        self.specs = tensor_specs(config)
        self.block = config.weight_block_size
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def local(self, name: str) -> tuple[TensorSpec, tuple[int, ...], tuple[int, ...] | None]:
        """(spec, this rank's weight shape, its scale shape) exactly as CheckpointReader.read_weight slices."""
        spec = self.specs[name]
        shape = list(spec.shape)
        scale = [-(-d // b) for d, b in zip(spec.shape, self.block)] if spec.quantized else None
        part = shard_range(spec, self.c, self.tp, self.rank)
        if part is not None:
            dim, start, stop = part
            shape[dim] = stop - start
            if scale is not None:
                b = self.block[dim]
                scale[dim] = -(-stop // b) - start // b
        return spec, tuple(shape), tuple(scale) if scale is not None else None

    def _randn(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=dtype)

    def plain(self, name: str, dtype: torch.dtype | None = None, kind: str = "norm") -> torch.Tensor:
        _, shape, _ = self.local(name)
        dtype = dtype or self.dtype
        if kind == "norm":      # RMSNorm gains around 1
            return (1.0 + 0.1 * self._randn(shape)).to(dtype)
        if kind == "rows":      # embedding, LM head, router: N(0, 1/H) entries, made in the target dtype
            out = torch.empty(shape, dtype=dtype, device=self.device)
            step = max(1, CHUNK_ELEMENTS // max(1, math.prod(shape[1:])))
            for s in range(0, shape[0], step):
                part = out[s:s + step]
                part.copy_(self._randn(tuple(part.shape)).mul_(1.0 / math.sqrt(shape[-1])))
            return out
        return self._randn(shape).to(dtype)  # "plain": N(0, 1), e.g. attention sinks

    def _fill_e4m3(self, out: torch.Tensor) -> None:
        flat = out.view(-1, out.shape[-1])
        step = max(1, CHUNK_ELEMENTS // out.shape[-1])
        for s in range(0, flat.shape[0], step):
            part = flat[s:s + step]
            part.copy_(self._randn(tuple(part.shape)).mul_(Q_STD).clamp_(-E4M3_MAX, E4M3_MAX))

    def _scales(self, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        base = 1.0 / (Q_STD * math.sqrt(fan_in))
        return (torch.rand(shape, generator=self.gen, device=self.device) + 0.5).mul_(base)

    def fp8(self, name: str) -> FP8Weight:
        _, shape, scale = self.local(name)
        q = torch.empty(shape, dtype=E4M3, device=self.device)
        self._fill_e4m3(q)
        return FP8Weight(q, self._scales(scale, shape[-1] * (self.tp if self._row_parallel(name) else 1)),
                         self.block, self.dtype)

    def _row_parallel(self, name: str) -> bool:
        split = self.specs[name].split
        return split is not None and split[0] == "cols"  # the full input is tp slices: the gain is per sum

    def experts(self, prefix: str, which: str) -> FP8Weight:
        n = self.c.n_routed_experts
        first = f"{prefix}mlp.experts.0.{which}.weight"
        _, shape, scale = self.local(first)
        q = torch.empty((n, *shape), dtype=E4M3, device=self.device)
        self._fill_e4m3(q)  # chunked: never an fp32 copy of the stack
        fan_in = shape[-1] * (self.tp if self._row_parallel(first) else 1)
        return FP8Weight(q, self._scales((n, *scale), fan_in), self.block, self.dtype)

    def layer(self, index: int) -> LayerWeights:
        c, p = self.c, layer_prefix(index)
        return LayerWeights(
            input_norm=self.plain(p + "input_layernorm.weight"),
            post_norm=self.plain(p + "post_attention_layernorm.weight"),
            wq=self.fp8(p + "self_attn.q_proj.weight"), wk=self.fp8(p + "self_attn.k_proj.weight"),
            wv=self.fp8(p + "self_attn.v_proj.weight"), wo=self.fp8(p + "self_attn.o_proj.weight"),
            sinks=self.plain(p + "self_attn.sinks", torch.float32, "plain") if c.attention_sinks else None,
            q_norm=self.plain(p + "self_attn.q_norm.weight") if c.qk_norm else None,
            k_norm=self.plain(p + "self_attn.k_norm.weight") if c.qk_norm else None,
            router=self.plain(p + "mlp.gate.weight", torch.bfloat16, "rows"),
            gate=self.experts(p, "gate_proj"), up=self.experts(p, "up_proj"), down=self.experts(p, "down_proj"),
        )


def synthetic_weights(config: Config, tp: int, rank: int, device: torch.device | str,
                      dtype: torch.dtype, seed: int = 0, progress=None) -> ModelWeights:
    """Rank `rank`'s weights at TP degree `tp`, random, on `device`, shaped as `load_weights` would load them.
    `progress(done, total)` is called after each layer."""
    config.check_tp(tp)
    mk = _Maker(config, tp, rank, device, dtype, seed)
    total = config.num_hidden_layers + 1
    layers = []
    for i in range(config.num_hidden_layers):
        layers.append(mk.layer(i))
        if progress:
            progress(i + 1, total)
    m = layer_prefix(config.mtp_layer_index)
    mtp = MTPWeights(mk.layer(config.mtp_layer_index), mk.plain(m + "enorm.weight"), mk.plain(m + "hnorm.weight"),
                     mk.fp8(m + "eh_proj.weight"), mk.plain(m + "shared_head.norm.weight"))
    if progress:
        progress(total, total)
    return ModelWeights(embed=mk.plain("model.embed_tokens.weight", kind="rows"),
                        lm_head=mk.plain("lm_head.weight", kind="rows"), norm=mk.plain("model.norm.weight"),
                        layers=layers, mtp=mtp, vocab_offset=rank * (config.vocab_size // tp))


def synthetic_parallel(tp: int, rank: int, device: torch.device | str) -> Parallel:
    """A rank-slice context: rank `rank` of `tp`, its collectives replaced by local no-ops."""
    return Parallel(rank, tp, torch.device(device), local_collectives=True)
