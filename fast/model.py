"""The fast engine's IQuest-Q1 forward on one rank: fixed-shape blocks, static caches, TP collectives.

Same math as `reference/model.py` (and the same building blocks from `reference/layers.py` in the
torch fallback), but every shape is static so a block can be captured in a CUDA graph: a block has
R rows with a `live` mask; padding rows compute but write their KV to the trash slot and are never
read. Collectives sit inside the row-parallel layers (o_proj, Down, embedding, eh_proj).
Taps use the reference's names (see reference/model.py) for `iquest debug diff`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..reference.config import Config
from ..reference.layers import rms_norm, rope_cos_sin
from .cache import LayerKV, StaticKV
from .residual import PendingNorm, Residual
from .torch_ops import TorchOps
from .profiling import stage
from .parallel import Parallel
from .state import VERIFY_ROWS
from .weights import LayerWeights, ModelWeights


class Block(NamedTuple):
    """What every layer of one forward shares about its rows, computed once per forward."""

    positions: torch.Tensor  # [R] int64
    live: torch.Tensor       # [R] bool
    cos: torch.Tensor        # the rows' rotary factors as ops.rope_write takes them (ops.rotary): gathered rows
    sin: torch.Tensor        # [R, D], or the model's tables [T, D] with the rows' table rows (their positions)
    rope_rows: torch.Tensor | None


class FastModel:
    def __init__(self, config: Config, weights: ModelWeights, cache: StaticKV, par: Parallel, dtype: torch.dtype,
                 ops: TorchOps | None = None):
        self.config, self.w, self.cache, self.par, self.dtype = config, weights, cache, par, dtype
        self.ops = ops or TorchOps()  # the torch forms, or the Triton kernels of the kernel plan (fast/triton_ops.py)
        self.ops.prepare(weights)
        tp = par.world
        self.q_heads = config.num_attention_heads // tp
        self.kv_heads = max(config.num_key_value_heads // tp, 1)
        self.vocab_local = config.vocab_size // tp
        self.rope_cos, self.rope_sin = rope_tables(config, cache.max_context + VERIFY_ROWS, dtype, par.device)

    # ---- embedding and head (vocabulary-parallel) ----------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.par.all_reduce(self.ops.embed(tokens, self.w))

    @stage("lm_head")
    def logits(self, a: torch.Tensor) -> torch.Tensor:
        """This rank's fp32 logits [R, V/tp] for its vocabulary rows, from the normalized rows `a`."""
        return self.ops.lm_head(a, self.w)

    # ---- blocks -------------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
                taps: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Main model: (local logits [R, V/tp] fp32, pre-norm final hidden [R, H])."""
        x, pending = self.embed(tokens), None
        blk = self._block(positions, live)
        last = len(self.w.layers) - 1
        for i, lw in enumerate(self.w.layers):
            x, pending = self.decoder_layer(lw, self.cache[i], x, pending, blk, taps, f"layer{i}.",
                                            next_norm=self.w.layers[i + 1].input_norm if i < last else None)
        x, a = self.residual_norm(x, pending, self.w.norm)
        _tap(taps, "final_hidden", x)
        return self.logits(a), x

    def draft(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
              taps: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MTP layer: rows at positions p from (x_p, hidden for p-1) -> (local logits for p+1, h')."""
        m, eps, H = self.w.mtp, self.config.rms_norm_eps, self.config.hidden_size
        # [norm(embedding), norm(hidden)], each norm writing its half; eh_proj is row-parallel over these 2H inputs
        cat = torch.empty(tokens.shape[0], 2 * H, dtype=self.dtype, device=tokens.device)
        self.ops.norm(self.embed(tokens), m.enorm, eps, out=cat[:, :H])
        self.ops.norm(prev_hidden.to(self.dtype), m.hnorm, eps, out=cat[:, H:])
        width = cat.shape[-1] // self.par.world
        u = self.par.all_reduce(self.ops.linear(m.eh_proj, cat[:, self.par.rank * width:(self.par.rank + 1) * width]))
        _tap(taps, "mtp.input", u)
        x, pending = self.decoder_layer(m.block, self.cache[self.config.mtp_layer_index], u, None,
                                        self._block(positions, live), taps, "mtp.")
        h_out, a = self.residual_norm(x, pending, m.head_norm)
        return self.logits(a), h_out

    def _block(self, positions: torch.Tensor, live: torch.Tensor) -> Block:
        return Block(positions, live, *self.ops.rotary(self.rope_cos, self.rope_sin, positions))

    def decoder_layer(self, lw: LayerWeights, kv: LayerKV, x: torch.Tensor, pending: torch.Tensor | Residual | None,
                      blk: Block, taps: dict | None, tag: str,
                      next_norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | Residual]:
        """One layer on the residual stream x + pending, where `pending` is the previous layer's MoE output not
        yet added (None for the first layer), or a `Residual`: the stream with it added. Returns (x, this layer's MoE
        output): the caller folds the add into the next norm (one launch fewer per layer; the sum is rounded to the
        compute dtype either way). Given `next_norm` (the next layer's input norm weight) the ops may instead add it in
        the MoE's combine and return a Residual, whose norm the next layer's q/k/v projection takes as a row scaling
        (stage norm_qkv): one launch fewer again. Only where the collectives are local: at TP > 1 the MoE output's
        all-reduce comes between the combine and the add."""
        eps = self.config.rms_norm_eps
        if isinstance(pending, Residual):
            assert pending.weight is lw.input_norm, "a Residual prepared for another norm"
            x, a = pending.h, PendingNorm(pending, eps)
        elif pending is None:
            a = self.ops.norm(x, lw.input_norm, eps)
        else:
            x, a = self.residual_norm(x, pending, lw.input_norm)
        partial = self.attention(lw, kv, a, blk)
        # Routing reads the fp32 normalized input (the rounded bf16 activation would route differently).
        attn_out, x, b32, b16 = self.reduce_add_norm(x, partial, lw.post_norm, lw.gate.block)
        moe_out, scores, experts = self.moe(lw, b32, blk.live, f16_input=b16,
                                            residual=None if next_norm is None or self.par.active else (x, next_norm))
        if taps is not None:
            _tap(taps, tag + "attn_out", attn_out)
            for name, value in (("moe_in", b32), ("router_scores", scores), ("experts", experts)):
                _tap(taps, tag + name, value)
            if not self.par.fuses_add_norm:  # the layer's output as the next norm will form it (the same rounded sum)
                out, hidden = ((moe_out.moe_out, moe_out.h) if isinstance(moe_out, Residual)
                               else (moe_out, x + moe_out))
                _tap(taps, tag + "moe_out", out)
                _tap(taps, tag + "hidden", hidden)
        return x, moe_out

    def reduce_add_norm(self, x: torch.Tensor, partial: torch.Tensor, weight: torch.Tensor,
                        moe_block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
        """A layer's post-attention point: (the attention output summed over ranks, h = x + it, rmsnorm(h) * weight in
        fp32, the MoE's operand tiles or None), in one launch where the collectives fuse the reduction and the norm
        (the peer kernels: the MoE then forms its operands itself, the same values)."""
        eps = self.config.rms_norm_eps
        fused = self.par.all_reduce_add_norm(partial, x, weight, eps, torch.float32)
        if fused is not None:
            return (*fused, None)
        attn_out = self.par.all_reduce(partial)
        return (attn_out, *self.ops.add_norm(x, attn_out, weight, eps, moe_block=moe_block))

    def residual_norm(self, x: torch.Tensor, pending: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(h = x + pending, rmsnorm(h) * weight): `pending` is a layer's MoE output, this rank's partial where the
        collectives fuse its reduction into this norm (moe() leaves it unreduced then)."""
        eps = self.config.rms_norm_eps
        fused = self.par.all_reduce_add_norm(pending, x, weight, eps, self.dtype)
        if fused is not None:
            return fused[1], fused[2]
        return self.ops.residual_norm(x, pending, weight, eps)

    @stage("attention")
    def attention(self, lw: LayerWeights, kv: LayerKV, a: torch.Tensor | PendingNorm, blk: Block) -> torch.Tensor:
        c, R = self.config, blk.positions.shape[0]
        if c.qk_norm:
            q, k, v = (t.view(R, -1, c.head_dim) for t in self.ops.qkv(lw, self.ops.normed(a)))
            q, k = rms_norm(q, lw.q_norm, c.rms_norm_eps), rms_norm(k, lw.k_norm, c.rms_norm_eps)
            q = self.ops.rope_write(kv, q, k, v, blk.cos, blk.sin, blk.rope_rows, blk.positions, blk.live)
        else:  # K/V stored first: causal block
            q = self.ops.qkv_rope(lw, kv, a, c.head_dim, blk.cos, blk.sin, blk.rope_rows, blk.positions, blk.live)
        out = self.ops.attention(q, kv, blk.positions, lw.sinks)
        return self.ops.linear(lw.wo, out.to(self.dtype).reshape(R, -1))  # row-parallel: this rank's partial

    @stage("moe")
    def moe(self, lw: LayerWeights, b32: torch.Tensor, live: torch.Tensor, f16_input: object = None,
            residual: tuple | None = None) -> tuple[torch.Tensor | Residual, torch.Tensor, torch.Tensor]:
        """Routed experts on this rank's slice of every expert's intermediate dimension (padding rows'
        experts are not read by the kernel path). `f16_input`: b32's Gate/Up operand form, from the norm that
        made it (ops.add_norm), or None. `residual`: (the stream, the next norm's weight), for the ops to add the output
        to (decoder_layer)."""
        c = self.config
        weights, experts, scores = self.ops.route(b32, lw, c.num_experts_per_tok, c.norm_topk_prob,
                                                  c.routed_scaling_factor)
        out = self.ops.moe(b32, experts, weights, live, lw.gate, lw.up, lw.down, compute_dtype=self.dtype,
                           f16_input=f16_input, residual=residual)
        if isinstance(out, Residual):  # added to the stream already (no all-reduce between: the caller's contract)
            return out, scores, experts
        out = out.to(self.dtype)  # row-parallel: reduced here, or with the next norm where the collectives fuse them
        return (out if self.par.fuses_add_norm else self.par.all_reduce(out)), scores, experts


def rope_tables(config: Config, rows: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, D] at positions 0..rows-1, as reference.layers.rope_cos_sin computes them (float64 angles,
    then the compute dtype): made once, so a forward gathers its rows' entries instead of recomputing them (nine
    small kernels a forward, six forwards a round). Elementwise, so row p is bit for bit what rope_cos_sin gives
    for position p in any block."""
    return rope_cos_sin(torch.arange(rows, device=device), config.head_dim, config.rope_theta, config.rope_scaling,
                        dtype)


def _tap(taps: dict | None, name: str, value: torch.Tensor) -> None:
    if taps is not None:
        taps[name] = value.detach().cpu().clone() if value.dtype == torch.long else value.detach().double().cpu()
