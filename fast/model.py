"""The fast engine's IQuest-Q1 forward on one rank: fixed-shape blocks, static caches, TP collectives.

The same formulas as `reference/model.py` (docs/model.md, "Forward"), in the compute dtype with the published
rounding points, and every shape static so a block can be captured in a CUDA graph: a block has R rows with a `live`
mask; padding rows compute but write their KV to the trash slot and are never read. Collectives sit after the
row-parallel layers (o_proj, the MLPs' Down, the embeddings, eh_proj). Taps use the reference's names (see
reference/model.py) for `iquest debug diff`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..reference.config import Config
from ..reference.layers import rope_cos_sin
from .cache import LayerKV, StaticKV
from .parallel import Parallel
from .profiling import stage
from .router_fold import exact_input
from .state import VERIFY_ROWS
from .torch_ops import TorchOps
from .weights import Attention, DenseMLP, LayerWeights, ModelWeights, MoE


class Block(NamedTuple):
    """What every layer of one forward shares about its rows, computed once per forward."""

    positions: torch.Tensor  # [R] int64
    live: torch.Tensor       # [R] bool
    rope: dict               # RoPE base -> the rows' (cos, sin) [R, rotary_dim] fp32


class FastModel:
    def __init__(self, config: Config, weights: ModelWeights, cache: StaticKV, par: Parallel, dtype: torch.dtype,
                 ops: TorchOps | None = None):
        self.config, self.w, self.cache, self.par, self.dtype = config, weights, cache, par, dtype
        self.ops = ops or TorchOps()  # the torch forms, or the Triton kernels of the kernel plan (fast/triton_ops.py)
        self.ops.prepare(weights, config.num_experts_per_tok, par,
                         frozenset(i for i in range(config.num_hidden_layers) if config.window(i) is not None))
        self.vocab_local = config.vocab_size // par.world
        rows = cache.max_context + VERIFY_ROWS
        self.target_thetas = {t for i in range(config.num_hidden_layers)
                              if (t := config.rope_theta_for(i)) is not None}
        self.draft_thetas = {t for t in (config.mtp.rope_theta_for(0),) if t is not None}
        self.rope_thetas = tuple(sorted(self.target_thetas | self.draft_thetas))
        self.rope_table = rope_table(config.rotary_dim, self.rope_thetas, rows, par.device)

    # ---- embeddings and heads (vocabulary-parallel) ---------------------------------------------
    def embed(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return self.par.all_reduce(self.ops.embed(tokens, table, self.w.vocab_offset))

    @stage("lm_head")
    def logits(self, hidden: torch.Tensor, head: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """This rank's fp32 logits [R, V/tp] for its vocabulary rows: fp32 products of the post-norm rows."""
        logits = self.ops.lm_head(hidden, head)
        return logits if scale == 1.0 else logits * scale

    # ---- the target ---------------------------------------------------------------------------------
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
                taps: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target: (local logits [R, V/tp] fp32, post-norm final hidden [R, H])."""
        c = self.config
        layers, eps = self.w.layers, c.rms_norm_eps
        x = self.embed(tokens, self.w.embed)
        a = self.ops.norm(x, layers[0].attention_norm, eps, self.dtype)
        blk = self._block(positions, live, self.target_thetas)
        for i, lw in enumerate(layers):
            next_norm = layers[i + 1].attention_norm if i + 1 < len(layers) else self.w.norm
            x, a = self.decoder_layer(c, i, lw, self.cache[i], x, a, next_norm, blk, taps, f"layer{i}.")
        self.ops.join_branches()
        hidden = a  # the final norm of the last layer's output
        _tap(taps, "final_hidden", hidden)
        return self.logits(hidden, self.w.lm_head, c.logit_scale), hidden

    # ---- the recursive draft ----------------------------------------------------------------------
    def draft(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
              taps: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft rows at positions p from (post-norm hidden h_p, token x_{p+1}): (local logits for x_{p+2}, the
        output the next depth reads as its hidden)."""
        d, dw, H = self.config.mtp, self.w.draft, self.config.hidden_size
        eps = d.rms_norm_eps
        # [enorm(embedding), hnorm(hidden)], each norm writing its half; eh_proj is row-parallel over these 2H inputs
        cat = torch.empty(tokens.shape[0], 2 * H, dtype=self.dtype, device=tokens.device)
        self.ops.norm(self.embed(tokens, dw.embed), dw.enorm, eps, self.dtype, out=cat[:, :H])
        self.ops.norm(hidden, dw.hnorm, eps, self.dtype, out=cat[:, H:])
        width = cat.shape[-1] // self.par.world
        z = self.par.all_reduce(self.ops.linear(dw.eh_proj, cat[:, self.par.rank * width:(self.par.rank + 1) * width]))
        _tap(taps, "mtp.input", z)
        x = z.float() if d.fp32_residual_connection else z
        a = self.ops.norm(x, dw.block.attention_norm, eps, self.dtype)
        blk = self._block(positions, live, self.draft_thetas)
        _, out = self.decoder_layer(d, 0, dw.block, self.cache[self.config.num_hidden_layers], x, a,
                                    dw.final_layernorm, blk, taps, "mtp.")
        _tap(taps, "mtp.final_hidden", out)
        return self.logits(out, dw.lm_head), out

    def _block(self, positions: torch.Tensor, live: torch.Tensor, thetas: set) -> Block:
        return Block(positions, live, self.rope_rows(positions, thetas))

    def rope_rows(self, positions: torch.Tensor, thetas: set) -> dict:
        """Each base's rotary factors (cos, sin) [R, rotary_dim] at `positions`: views of one gather of every base's
        rows from the model's table (one gather a forward, whatever its bases)."""
        if not thetas:
            return {}
        rows = self.ops.rotary(self.rope_table, positions)  # [R, bases, 2, rotary_dim]
        return {t: (rows[:, i, 0], rows[:, i, 1]) for i, t in enumerate(self.rope_thetas) if t in thetas}

    # ---- one decoder layer ----------------------------------------------------------------------------
    def decoder_layer(self, c: Config, index: int, lw: LayerWeights, kv: LayerKV, x: torch.Tensor, a: torch.Tensor,
                      next_norm: torch.Tensor, blk: Block, taps: dict | None, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
        """docs/model.md's layer on its input x and a = attention_norm(x) (made by the op that made x): layer 0 (and
        the draft block) continues the residual from the raw input x and normalizes its MLP output; later layers
        continue it from a. Returns (the output, `next_norm` of it: the next layer's a, or the final hidden). The
        residual keeps x's dtype (the draft's is fp32); every norm rounds to the compute dtype. `add_norm` is a
        sandwich tail: the branch output (normalized when a weight is given) scaled onto the residual, and the sum
        normalized for what reads it next; `reduce_add_norm` first sums a branch's partial output over the ranks."""
        eps, dt = c.rms_norm_eps, self.dtype
        attn_scale, mlp_scale = c.out_scales(index)
        predicted = self.ops.warm_experts(lw.mlp, a, blk.live)  # a cache hint beside the attention (None: none)
        attn_partial = self.attention(c, index, lw.attn, kv, a, blk)
        attn_out, h, b = self.ops.reduce_add_norm(self.par, attn_partial, self.residual_of(index, x, a), attn_scale,
                                                  lw.attn_out_norm, lw.feed_forward_norm, eps, dt)
        mlp_partial = self.mlp(c, lw.mlp, b, blk.live, taps, tag)
        mlp_out, out, a_next = self.ops.reduce_add_norm(self.par, mlp_partial, h, mlp_scale,
                                                        lw.ffn_out_norm if index == 0 else None, next_norm, eps, dt)
        if taps is not None:
            for name, value in (("attn_out", attn_out), ("mlp_in", b), ("mlp_out", mlp_out), ("hidden", out),
                                ("predicted_experts", predicted)):
                if value is not None:
                    _tap(taps, tag + name, value)
            if self.ops.router_fold_for(lw.attn) is not None:  # what the folded logits evaluate
                exact, bound = exact_input(self.residual_of(index, x, a), attn_out, lw.attn_out_norm,
                                           lw.feed_forward_norm, attn_scale, eps)
                _tap(taps, tag + "router_in", exact)
                _tap(taps, tag + "router_in_bound", bound)
        return out, a_next

    @staticmethod
    def residual_of(index: int, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """What a layer's residual continues from (docs/model.md): layer 0 (and the draft block) its raw input x,
        later layers its normalized input a."""
        return x if index == 0 else a

    @stage("attention")
    def attention(self, c: Config, index: int, attn: Attention, kv: LayerKV, a: torch.Tensor,
                  blk: Block) -> torch.Tensor:
        """This rank's heads: q/k/v; q/k norm per head, then partial RoPE (the layer type's base), K/V stored; split
        attention with the sink key; o_proj's partial sum (row-parallel; with the router fold, left to the tail)."""
        R = a.shape[0]
        theta = c.rope_theta_for(index)
        cos, sin = blk.rope[theta] if theta is not None else (None, None)
        q = self.ops.qkv_rope_write(attn, a, kv, c.rms_norm_eps, cos, sin, blk.positions, blk.live)
        out = self.ops.attention(q, kv, blk.positions, c.scale, attn.sink_k)
        return self.ops.o_proj(attn, out.to(self.dtype).reshape(R, -1))

    @stage("mlp")
    def mlp(self, c: Config, mlp: DenseMLP | MoE, b: torch.Tensor, live: torch.Tensor, taps: dict | None,
            tag: str) -> torch.Tensor:
        """The dense MLP or the routed experts on this rank's slice of their intermediate dimension (a partial sum,
        row-parallel). Routing is an fp32 product of the bf16 input and the fp32 router."""
        if isinstance(mlp, DenseMLP):
            act = torch.nn.functional.silu(self.ops.linear(mlp.gate, b)) * self.ops.linear(mlp.up, b)
            return self.ops.linear(mlp.down, act)
        weights, experts, scores = self.ops.route(b, mlp.router, c.num_experts_per_tok)
        if taps is not None:
            _tap(taps, tag + "router_scores", scores)
            _tap(taps, tag + "experts", experts)
        return self.ops.moe(b, experts, weights, live, mlp)


def rope_table(rotary_dim: int, thetas: tuple[float, ...], rows: int, device: torch.device) -> torch.Tensor:
    """[rows, len(thetas), 2, rotary_dim] fp32: each base's cos and sin at positions 0..rows-1, as
    reference.layers.rope_cos_sin computes them (float64 angles): made once, so a forward gathers its rows' entries
    instead of recomputing them."""
    positions = torch.arange(rows, device=device)
    table = torch.empty(rows, len(thetas), 2, rotary_dim, dtype=torch.float32, device=device)
    for i, theta in enumerate(thetas):
        table[:, i, 0], table[:, i, 1] = rope_cos_sin(positions, rotary_dim, theta, torch.float32)
    return table


def _tap(taps: dict | None, name: str, value: torch.Tensor) -> None:
    if taps is not None:
        taps[name] = value.detach().cpu().clone() if value.dtype == torch.long else value.detach().double().cpu()
