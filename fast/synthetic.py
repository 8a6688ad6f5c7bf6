"""One rank's weights at full dimensions without a checkpoint: random weights made on the device.

Shapes come from the checkpoint layout (`tensor_specs` + `shard_range`) and follow fast/weights.WeightLoader
exactly, so a synthetic rank slice has the tensors, shapes, dtypes, scale grids and scale-block offsets that
`load_weights` gives for that rank and weight format: the dense MLP of `mlp_only_layers`, the MoE layers' fp32
router and expert stacks, the draft with its own embedding and bf16 LM head (as stored), and FP8 slices that start
inside a scale block (the published experts' 192-row shards of 128-row blocks at TP 8). Tensors are made layer by layer,
and expert stacks in chunks, so the peak is the weights' own size plus one small fp32 chunk.

Values keep activations O(1): an FP8 weight is E4M3 (about N(0, 64^2), clipped at 448) times a block scale of
about 1/(64 sqrt(in)), a BF16 one N(0, 1/in), so each projection has unit gain; the routers, embeddings and LM heads
get N(0, 1/H) entries (near-uniform routing over the experts, soft next-token distributions).
"""

from __future__ import annotations

import math

import torch

from ..reference.checkpoint import TensorSpec, draft_prefix, expert_name, layer_prefix, shard_range, tensor_specs
from ..reference.config import Config
from ..reference.fp8 import E4M3, E4M3_MAX
from .parallel import Parallel
from .weights import (LOAD_BLOCK, Attention, DenseMLP, DraftWeights, LayerWeights, ModelWeights, MoE, Weight,
                      weight_format)

Q_STD = 64.0              # spread of the stored E4M3 values
CHUNK_ELEMENTS = 1 << 26  # fp32 elements generated at once (256 MB)


class _Maker:
    def __init__(self, config: Config, tp: int, rank: int, device: torch.device, dtype: torch.dtype, seed: int,
                 fmt: str):
        self.c, self.tp, self.rank, self.device, self.dtype = config, tp, rank, torch.device(device), dtype
        self.fp8 = fmt == "fp8"
        self.specs = tensor_specs(config)
        self.block = config.weight_block_size or LOAD_BLOCK  # a BF16 checkpoint run as FP8 takes LOAD_BLOCK blocks
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def local(self, name: str) -> tuple[TensorSpec, tuple[int, ...], tuple[int, ...] | None, tuple[int, int]]:
        """(spec, this rank's shape, its scale grid (None: not run as FP8), where it starts in its first scale block),
        as CheckpointReader.read_weight and WeightLoader slice."""
        spec = self.specs[name]
        shape = list(spec.shape)
        quantized = spec.quantized and self.fp8
        scale = [-(-d // b) for d, b in zip(spec.shape, self.block)] if quantized else None
        offset = [0, 0]
        part = shard_range(spec, self.c.mtp if name.startswith("mtp/") else self.c, self.tp, self.rank)
        if part is not None:
            dim, start, stop = part
            shape[dim] = stop - start
            if scale is not None:
                b = self.block[dim]
                scale[dim] = -(-stop // b) - start // b
                offset[dim] = start % b
        return spec, tuple(shape), tuple(scale) if scale is not None else None, (offset[0], offset[1])

    def _randn(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen, device=self.device, dtype=torch.float32)

    def _fill(self, out: torch.Tensor, std: float, clip: float | None = None) -> torch.Tensor:
        """N(0, std^2) entries (clipped at +-clip) written chunk by chunk: never an fp32 copy of the whole tensor."""
        flat = out.view(-1, out.shape[-1]) if out.dim() > 1 else out.view(1, -1)
        step = max(1, CHUNK_ELEMENTS // flat.shape[-1])
        for s in range(0, flat.shape[0], step):
            part = flat[s:s + step]
            values = self._randn(tuple(part.shape)).mul_(std)
            part.copy_(values.clamp_(-clip, clip) if clip is not None else values)
        return out

    def norm(self, name: str) -> torch.Tensor:
        """A norm weight (RMSNorm gains around 1), in the compute dtype as loaded."""
        _, shape, _, _ = self.local(name)
        return (1.0 + 0.1 * self._randn(shape)).to(self.dtype)

    def rows(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Embedding, LM head or router rows: N(0, 1/H) entries."""
        _, shape, _, _ = self.local(name)
        out = torch.empty(shape, dtype=dtype or self.dtype, device=self.device)
        return self._fill(out, 1.0 / math.sqrt(shape[-1]))

    def sink_k(self, name: str) -> torch.Tensor:
        _, shape, _, _ = self.local(name)
        return self._randn(shape).reshape(-1, self.c.head_dim)  # fp32, as loaded

    def _fan_in(self, name: str, cols: int) -> int:
        split = self.specs[name].split
        return cols * self.tp if split is not None and split[0] == "cols" else cols  # row-parallel: a slice of the sum

    def _scales(self, shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
        base = 1.0 / (Q_STD * math.sqrt(fan_in))
        return (torch.rand(shape, generator=self.gen, device=self.device) + 0.5).mul_(base)

    def linear(self, name: str, experts: int | None = None) -> Weight:
        """A linear weight as the loader holds it: E4M3 with its scale grid and offset, or bf16; `experts`: the stack
        of that many experts' matrices of the same shape (name: expert 0's)."""
        _, shape, scale, offset = self.local(name)
        lead = (experts,) if experts is not None else ()
        fan_in = self._fan_in(name, shape[-1])
        if scale is None:
            q = self._fill(torch.empty((*lead, *shape), dtype=torch.bfloat16, device=self.device),
                           1.0 / math.sqrt(fan_in))
            return Weight(q, None, None, self.dtype)
        q = self._fill(torch.empty((*lead, *shape), dtype=E4M3, device=self.device), Q_STD, E4M3_MAX)
        return Weight(q, self._scales((*lead, *scale), fan_in), tuple(self.block), self.dtype, offset)

    def layer(self, c: Config, index: int, p: str) -> LayerWeights:
        """A target layer (or the draft block: c = config.mtp, index 0, p = draft_prefix()), as WeightLoader.layer."""
        a = p + "self_attn."
        attn = Attention(wq=self.linear(a + "q_proj.weight"), wk=self.linear(a + "k_proj.weight"),
                         wv=self.linear(a + "v_proj.weight"), wo=self.linear(a + "o_proj.weight"),
                         q_norm=self.norm(a + "q_norm.weight"), k_norm=self.norm(a + "k_norm.weight"),
                         sink_k=self.sink_k(a + "sink_k") if c.enable_sink_attention else None)
        if c.is_dense(index):
            mlp = DenseMLP(self.linear(p + "mlp.gate_proj.weight"), self.linear(p + "mlp.up_proj.weight"),
                           self.linear(p + "mlp.down_proj.weight"))
        else:
            n = c.num_experts
            mlp = MoE(self.rows(p + "mlp.router.weight", torch.float32),
                      *(self.linear(expert_name(p, 0, w), experts=n) for w in ("gate_proj", "up_proj", "down_proj")))
        return LayerWeights(attention_norm=self.norm(p + "attention_norm.weight"),
                            attn_out_norm=self.norm(p + "attn_out_norm.weight"),
                            feed_forward_norm=self.norm(p + "feed_forward_norm.weight"),
                            ffn_out_norm=self.norm(p + "ffn_out_norm.weight") if index == 0 else None,
                            attn=attn, mlp=mlp)


def synthetic_weights(config: Config, tp: int, rank: int, device: torch.device | str, dtype: torch.dtype,
                      seed: int = 0, progress=None, fmt: str = "auto") -> ModelWeights:
    """Rank `rank`'s weights at TP degree `tp`, random, on `device`, shaped as `load_weights(..., fmt=fmt)` would load
    a checkpoint of `config` (`fmt`: fast/weights.weight_format's choice). `progress(done, total)` is called after
    each layer."""
    config.check_tp(tp)
    fmt = weight_format(fmt, config, torch.device(device))
    mk = _Maker(config, tp, rank, device, dtype, seed, fmt)
    total = config.num_hidden_layers + 1
    layers = []
    for i in range(config.num_hidden_layers):
        layers.append(mk.layer(config, i, layer_prefix(i)))
        if progress:
            progress(i + 1, total)
    d = "mtp/"
    draft = DraftWeights(embed=mk.rows(d + "embed_tokens.weight"),
                         lm_head=mk.rows(d + "lm_head.weight", torch.bfloat16),
                         enorm=mk.norm(d + "mtp.enorm.weight"), hnorm=mk.norm(d + "mtp.hnorm.weight"),
                         eh_proj=mk.linear(d + "mtp.eh_proj.weight"), block=mk.layer(config.mtp, 0, draft_prefix()),
                         final_layernorm=mk.norm(d + "mtp.final_layernorm.weight"))
    if progress:
        progress(total, total)
    return ModelWeights(embed=mk.rows("model.embed_tokens.weight"), lm_head=mk.rows("lm_head.weight", torch.bfloat16),
                        norm=mk.norm("model.norm.weight"), layers=layers, draft=draft,
                        vocab_offset=rank * (config.vocab_size // tp), format=fmt)


def synthetic_parallel(tp: int, rank: int, device: torch.device | str) -> Parallel:
    """A rank-slice context: rank `rank` of `tp`, its collectives replaced by local no-ops."""
    return Parallel(rank, tp, torch.device(device), local_collectives=True)
