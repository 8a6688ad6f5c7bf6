"""The IQuest-Q1 reference model: MODEL.md's forward and MTP draft layer, in float64, row by row exact.

Deliberately simple: weights are dequantized once to float64, every formula is the one in
`layers.py`, and the KV cache is a plain tensor per layer indexed by absolute position. The fast
engine is checked against this file, so clarity beats speed everywhere.

Rows: `forward` and `draft` take any number R of rows (tokens at distinct absolute positions): a
prefill, a verification block, one decode row. Each layer writes the block's K/V at its positions
first, then every row reads the written positions visible to it (`layers.visible`); a query at t
never reads past t, so rows beyond a rejected draft are simply overwritten later (rollback).

The draft layer's sequence starts at position 1 (ROUND.md: position 0 has no previous hidden
state), so the MTP layer never reads position 0 of its own cache.

Taps (a debugging contract shared with the fast engine). Pass `taps={}`; each call stores copies:
  layer{l}.attn_out       [R, H]  float64  o_proj output, before the residual add
  layer{l}.moe_in         [R, H]  float64  post-attention RMSNorm output: the MoE and router input
  layer{l}.router_scores  [R, E]  float64  softmax over all experts
  layer{l}.experts        [R, k]  int64    chosen experts, best first (ties: lower index)
  layer{l}.moe_out        [R, H]  float64  weighted sum of the chosen experts, before the residual add
  layer{l}.hidden         [R, H]  float64  residual stream after layer l
  final_hidden            [R, H]  float64  pre-norm output of the last layer (the MTP input)
  logits                  [R, V]  float64
The draft layer stores the same per-layer names with prefix "mtp." instead of "layer{l}."
(mtp.attn_out, mtp.moe_in, mtp.router_scores, mtp.experts, mtp.moe_out, mtp.hidden), plus mtp.input (u, the
eh_proj output) and mtp.logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import CheckpointReader, layer_prefix, tensor_specs
from .config import Config
from .fp8 import E4M3, dequantize
from .layers import apply_rope, attention, expert_mlp, rms_norm, rope_cos_sin, route, visible


class KVCache:
    """Per-layer K/V indexed by absolute position; entry `num_hidden_layers` is the MTP layer's.

    Storage grows on demand; `written[l][t]` records that position t of layer l holds a K/V.
    Writes overwrite, so a rollback needs no action: the next block rewrites those positions.
    """

    def __init__(self, config: Config, dtype: torch.dtype = torch.float64):
        self.layers = config.num_hidden_layers + 1
        self.shape = (config.num_key_value_heads, config.head_dim)
        self.dtype = dtype
        self.k = [torch.zeros(0, *self.shape, dtype=dtype) for _ in range(self.layers)]
        self.v = [torch.zeros(0, *self.shape, dtype=dtype) for _ in range(self.layers)]
        self.written = [torch.zeros(0, dtype=torch.bool) for _ in range(self.layers)]

    def _grow(self, layer: int, size: int) -> None:
        old = self.k[layer].shape[0]
        if size <= old:
            return
        size = max(size, 2 * old)  # amortized doubling
        for store, fill in ((self.k, 0.0), (self.v, 0.0)):
            grown = torch.full((size, *self.shape), fill, dtype=self.dtype)
            grown[:old] = store[layer]
            store[layer] = grown
        written = torch.zeros(size, dtype=torch.bool)
        written[:old] = self.written[layer]
        self.written[layer] = written

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self._grow(layer, int(positions.max()) + 1)
        self.k[layer][positions] = k.to(self.dtype)
        self.v[layer][positions] = v.to(self.dtype)
        self.written[layer][positions] = True

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V [end, Nkv, D] and the written mask [end] for positions 0..end-1."""
        self._grow(layer, end)
        return self.k[layer][:end], self.v[layer][:end], self.written[layer][:end]


class ReferenceModel:
    """IQuest-Q1 with weights held dequantized in `dtype` (float64 by default)."""

    def __init__(self, config: Config, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64):
        """`weights`: checkpoint form (E4M3 + `*_scale_inv`, bf16, fp32) or already-real tensors."""
        self.config = config
        self.dtype = dtype
        self.model_dir: Path | None = None  # set by load(): where the depth controller's file lives
        self.w: dict[str, torch.Tensor] = {}
        for name, spec in tensor_specs(config).items():
            if name not in weights:
                raise ValueError(f"missing weight {name}")
            t = weights[name]
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"weight {name}: shape {tuple(t.shape)}, expected {spec.shape}")
            if t.dtype == E4M3:
                if spec.scale_name not in weights:
                    raise ValueError(f"weight {name} is E4M3 but {spec.scale_name} is missing")
                t = dequantize(t, weights[spec.scale_name], config.weight_block_size, dtype)
            self.w[name] = t.to(dtype)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float64) -> "ReferenceModel":
        reader = CheckpointReader(model_dir)
        weights: dict[str, torch.Tensor] = {}
        names = list(reader.names())
        for name in tqdm(names, desc="loading reference weights", disable=not sys.stderr.isatty()):
            w, scale = reader.read_weight(name)
            weights[name] = w if scale is None else dequantize(w, scale, reader.config.weight_block_size, dtype)
        model = cls(reader.config, weights, dtype)
        model.model_dir = Path(model_dir)
        return model

    def new_cache(self) -> KVCache:
        return KVCache(self.config, self.dtype)

    # ---- the main model -------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                taps: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Main model over R rows: (logits [R, V], pre-norm final hidden [R, H])."""
        c = self.config
        self._check_rows(tokens, positions, first_position=0)
        x = self.w["model.embed_tokens.weight"][tokens]
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling, self.dtype)
        for layer in range(c.num_hidden_layers):
            x = self._decoder_layer(layer, x, positions, cos, sin, cache, taps, f"layer{layer}.", 0)
        logits = self._lm_head(x, "model.norm.weight")
        _tap(taps, "final_hidden", x)
        _tap(taps, "logits", logits)
        return logits, x

    __call__ = forward

    # ---- the MTP draft layer --------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, tokens: torch.Tensor, prev_hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache,
              taps: dict | None = None, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft rows at positions p >= 1 from (token x_p, hidden for p-1): (logits for p+1, h').
        `experts` [R, k]: the MTP layer's experts chosen by the caller instead of by its router (qualify)."""
        c = self.config
        self._check_rows(tokens, positions, first_position=1)
        if prev_hidden.shape != (tokens.shape[0], c.hidden_size):
            raise ValueError(f"prev_hidden has shape {tuple(prev_hidden.shape)}, expected "
                             f"{(tokens.shape[0], c.hidden_size)}")
        m, eps = layer_prefix(c.mtp_layer_index), c.rms_norm_eps
        e = rms_norm(self.w["model.embed_tokens.weight"][tokens], self.w[m + "enorm.weight"], eps)
        h = rms_norm(prev_hidden.to(self.dtype), self.w[m + "hnorm.weight"], eps)
        u = torch.cat([e, h], dim=-1) @ self.w[m + "eh_proj.weight"].T  # embedding first
        _tap(taps, "mtp.input", u)
        cos, sin = rope_cos_sin(positions, c.head_dim, c.rope_theta, c.rope_scaling, self.dtype)
        h_out = self._decoder_layer(c.mtp_layer_index, u, positions, cos, sin, cache, taps, "mtp.", 1, experts)
        logits = self._lm_head(h_out, m + "shared_head.norm.weight")
        _tap(taps, "mtp.logits", logits)
        return logits, h_out

    # ---- one decoder layer (main layers and the MTP layer) ----------------------------------------
    def _decoder_layer(self, layer: int, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, cache: KVCache, taps: dict | None, tag: str,
                       first_position: int, experts: torch.Tensor | None = None) -> torch.Tensor:
        p, eps = layer_prefix(layer), self.config.rms_norm_eps
        a = rms_norm(x, self.w[p + "input_layernorm.weight"], eps)
        attn_out = self._attention(layer, a, positions, cos, sin, cache, first_position)
        x = x + attn_out
        b = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], eps)
        moe_out, scores, experts = self._moe(p, b, experts)
        x = x + moe_out
        _tap(taps, tag + "attn_out", attn_out)
        _tap(taps, tag + "moe_in", b)
        _tap(taps, tag + "router_scores", scores)
        _tap(taps, tag + "experts", experts)
        _tap(taps, tag + "moe_out", moe_out)
        _tap(taps, tag + "hidden", x)
        return x

    def _attention(self, layer: int, a: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, cache: KVCache, first_position: int) -> torch.Tensor:
        c, p, R = self.config, layer_prefix(layer), a.shape[0]
        q = (a @ self.w[p + "self_attn.q_proj.weight"].T).view(R, c.num_attention_heads, c.head_dim)
        k = (a @ self.w[p + "self_attn.k_proj.weight"].T).view(R, c.num_key_value_heads, c.head_dim)
        v = (a @ self.w[p + "self_attn.v_proj.weight"].T).view(R, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:  # per-head RMSNorm, before rotation
            q = rms_norm(q, self.w[p + "self_attn.q_norm.weight"], c.rms_norm_eps)
            k = rms_norm(k, self.w[p + "self_attn.k_norm.weight"], c.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Write this block's K/V first: rows then see each other causally, by position.
        cache.write(layer, positions, k, v)
        end = int(positions.max()) + 1
        keys, values, written = cache.read(layer, end)
        k_pos = torch.arange(end)
        mask = visible(positions, k_pos, c.layer_type(layer), c.sliding_window) & (k_pos >= first_position)
        unwritten = mask & ~written[None, :]
        if unwritten.any():
            row, col = unwritten.nonzero()[0].tolist()
            raise ValueError(f"layer {layer}: the row at position {int(positions[row])} attends to position "
                             f"{col}, which was never written to the KV cache")
        sinks = self.w[p + "self_attn.sinks"] if c.attention_sinks else None
        out = attention(q, keys, values, mask, sinks)
        return out.reshape(R, -1) @ self.w[p + "self_attn.o_proj.weight"].T

    def _moe(self, p: str, b: torch.Tensor,
             experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        weights, experts, scores = route(b @ self.w[p + "mlp.gate.weight"].T, c.num_experts_per_tok,
                                         c.norm_topk_prob, c.routed_scaling_factor, experts)
        out = torch.zeros_like(b)
        for e in experts.unique().tolist():  # ascending expert id: a fixed summation order per row
            rows, slot = (experts == e).nonzero(as_tuple=True)
            q = f"{p}mlp.experts.{e}."
            y = expert_mlp(b[rows], self.w[q + "gate_proj.weight"], self.w[q + "up_proj.weight"],
                           self.w[q + "down_proj.weight"])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out, scores, experts

    def _lm_head(self, x: torch.Tensor, norm_name: str) -> torch.Tensor:
        return rms_norm(x, self.w[norm_name], self.config.rms_norm_eps) @ self.w["lm_head.weight"].T

    def _check_rows(self, tokens: torch.Tensor, positions: torch.Tensor, first_position: int) -> None:
        if tokens.dim() != 1 or positions.shape != tokens.shape or tokens.numel() == 0:
            raise ValueError(f"tokens {tuple(tokens.shape)} and positions {tuple(positions.shape)} must be "
                             "equal-length, non-empty 1-D tensors")
        if positions.unique().numel() != positions.numel():
            raise ValueError(f"positions must be distinct within a block, got {positions.tolist()}")
        if int(positions.min()) < first_position:
            raise ValueError(f"positions must be >= {first_position} here, got {int(positions.min())}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")


def _tap(taps: dict | None, name: str, value: torch.Tensor) -> None:
    if taps is not None:
        taps[name] = value.detach().clone() if value.dtype == torch.long else value.detach().to(torch.float64).clone()
