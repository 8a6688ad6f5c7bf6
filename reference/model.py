"""The IQuest-Q1 reference model: docs/model.md's forward and recursive MTP draft, in float64, row by row exact.

Deliberately simple: weights are dequantized once to float64, every formula is the one in `layers.py`, and the KV
cache is a plain tensor per layer indexed by absolute position. The fast engine is checked against this file, so
clarity beats speed everywhere.

Rows: `forward` and `draft` take any number R of rows (tokens at distinct absolute positions): a prefill, a
verification block, one decode row. Each layer writes the block's K/V at its positions first, then every row reads
the written positions visible to it (`layers.visible`); a query at t never reads past t, so rows beyond a rejected
draft are simply overwritten later (rollback).

Taps (a debugging contract shared with the fast engine). Pass `taps={}`; each call stores copies:
  layer{l}.attn_out       [R, H]  o_proj output, before its norm (attn_out_norm)
  layer{l}.mlp_in         [R, H]  feed_forward_norm's output: the MLP's (and router's) input
  layer{l}.router_scores  [R, E]  softmax over all experts (MoE layers)
  layer{l}.experts        [R, k]  int64 chosen experts, best first (ties: lower index) (MoE layers)
  layer{l}.mlp_out        [R, H]  the dense MLP's or the MoE's output, before its norm and scale
  layer{l}.hidden         [R, H]  residual stream after layer l
  final_hidden            [R, H]  model.norm's output: the post-norm hidden the draft reads
  logits                  [R, V]
The draft stores the same per-layer names with prefix "mtp." (mtp.attn_out, ..., mtp.hidden: its fp32 residual
stream after the block), plus mtp.input (z, the eh_proj output), mtp.final_hidden (final_layernorm's output, fed to
the next depth) and mtp.logits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from tqdm import tqdm

from .checkpoint import DRAFT, CheckpointReader, draft_prefix, layer_prefix, tensor_specs
from .config import Config
from .fp8 import E4M3, dequantize
from .layers import apply_rope, attention, expert_mlp, rms_norm, rope_cos_sin, route, visible


class KVCache:
    """Per-layer K/V indexed by absolute position; entry `num_hidden_layers` is the draft layer's.

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
        for store in (self.k, self.v):
            grown = torch.zeros((size, *self.shape), dtype=self.dtype)
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
    """IQuest-Q1 (target and draft) with weights held real in `dtype` (float64 by default)."""

    def __init__(self, config: Config, weights: dict[str, torch.Tensor], dtype: torch.dtype = torch.float64):
        """`weights`: every logical tensor of `tensor_specs(config)`, real-valued (any float dtype), or as a checkpoint
        stores it: an E4M3 tensor is dequantized with its `<name>_scale_inv` from `weights` (never read as if it were
        real: that would drop its scales)."""
        self.config = config
        self.dtype = dtype
        self.model_dir: Path | None = None  # set by load(): where the depth controller's file lives
        self.w: dict[str, torch.Tensor] = {}
        for name, spec in tensor_specs(config).items():
            if name not in weights:
                raise ValueError(f"missing weight {name}")
            t = weights[name]
            if t.dtype == E4M3:
                if spec.scale_name not in weights or config.weight_block_size is None:
                    raise ValueError(f"weight {name} is E4M3 but no {spec.scale_name} (and block size) is given")
                t = dequantize(t, weights[spec.scale_name], config.weight_block_size, dtype)
            if name.endswith("sink_k"):
                t = t.reshape(spec.shape)
            if tuple(t.shape) != spec.shape:
                raise ValueError(f"weight {name}: shape {tuple(t.shape)}, expected {spec.shape}")
            self.w[name] = t.to(dtype)

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float64) -> "ReferenceModel":
        reader = CheckpointReader(model_dir)
        weights: dict[str, torch.Tensor] = {}
        names = list(reader.names())
        for name in tqdm(names, desc="loading reference weights", disable=not sys.stderr.isatty()):
            s = reader.read_weight(name)
            weights[name] = s.weight if s.scale is None else dequantize(s.weight, s.scale, reader.block, dtype)
        model = cls(reader.config, weights, dtype)
        model.model_dir = Path(model_dir)
        return model

    def new_cache(self) -> KVCache:
        return KVCache(self.config, self.dtype)

    # ---- the target -----------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                taps: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over R rows: (logits [R, V], post-norm final hidden [R, H])."""
        c = self.config
        self._check_rows(tokens, positions)
        x = self.w["model.embed_tokens.weight"][tokens]
        for layer in range(c.num_hidden_layers):
            x = self._decoder_layer(c, layer, layer_prefix(layer), layer, x, positions, cache, taps, f"layer{layer}.")
        hidden = rms_norm(x, self.w["model.norm.weight"], c.rms_norm_eps)
        logits = hidden @ self.w["lm_head.weight"].T * c.logit_scale
        _tap(taps, "final_hidden", hidden)
        _tap(taps, "logits", logits)
        return logits, hidden

    __call__ = forward

    # ---- the recursive MTP draft ----------------------------------------------------------------
    @torch.no_grad()
    def draft(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache,
              taps: dict | None = None, experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft rows at positions p from (the post-norm hidden h_p, the token x_{p+1}): (logits for x_{p+2}, the
        output fed to the next depth as its hidden). `experts` [R, k]: the draft block's experts chosen by the caller
        instead of by its router (qualify)."""
        d = self.config.mtp
        self._check_rows(tokens, positions)
        if hidden.shape != (tokens.shape[0], d.hidden_size):
            raise ValueError(f"hidden has shape {tuple(hidden.shape)}, expected {(tokens.shape[0], d.hidden_size)}")
        eps = d.rms_norm_eps
        e = rms_norm(self.w[DRAFT + "embed_tokens.weight"][tokens], self.w[DRAFT + "mtp.enorm.weight"], eps)
        g = rms_norm(hidden.to(self.dtype), self.w[DRAFT + "mtp.hnorm.weight"], eps)
        z = torch.cat([e, g], dim=-1) @ self.w[DRAFT + "mtp.eh_proj.weight"].T  # embedding first
        _tap(taps, "mtp.input", z)
        r = self._decoder_layer(d, 0, draft_prefix(), self.config.num_hidden_layers, z, positions, cache, taps,
                                "mtp.", experts)
        out = rms_norm(r, self.w[DRAFT + "mtp.final_layernorm.weight"], eps)
        logits = out @ self.w[DRAFT + "lm_head.weight"].T  # no logit_scale
        _tap(taps, "mtp.final_hidden", out)
        _tap(taps, "mtp.logits", logits)
        return logits, out

    # ---- one decoder layer (target layers and the draft block) ----------------------------------
    def _decoder_layer(self, c: Config, layer: int, p: str, kv_layer: int, x: torch.Tensor, positions: torch.Tensor,
                       cache: KVCache, taps: dict | None, tag: str,
                       experts: torch.Tensor | None = None) -> torch.Tensor:
        """Layer 0 (and the draft block, its one layer) continues the residual from its raw input x and normalizes
        its MLP output; every later layer continues it from the normalized input a (docs/model.md, "Forward")."""
        w, eps = self.w, c.rms_norm_eps
        attn_scale, mlp_scale = c.out_scales(layer)
        a = rms_norm(x, w[p + "attention_norm.weight"], eps)
        attn_out = self._attention(c, layer, p, kv_layer, a, positions, cache)
        h = (x if layer == 0 else a) + rms_norm(attn_out, w[p + "attn_out_norm.weight"], eps) * attn_scale
        b = rms_norm(h, w[p + "feed_forward_norm.weight"], eps)
        if c.is_dense(layer):
            mlp_out = expert_mlp(b, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                                 w[p + "mlp.down_proj.weight"])
        else:
            mlp_out, scores, chosen = self._moe(c, p, b, experts)
            _tap(taps, tag + "router_scores", scores)
            _tap(taps, tag + "experts", chosen)
        y = rms_norm(mlp_out, w[p + "ffn_out_norm.weight"], eps) if layer == 0 else mlp_out
        out = h + y * mlp_scale
        _tap(taps, tag + "attn_out", attn_out)
        _tap(taps, tag + "mlp_in", b)
        _tap(taps, tag + "mlp_out", mlp_out)
        _tap(taps, tag + "hidden", out)
        return out

    def _attention(self, c: Config, layer: int, p: str, kv_layer: int, a: torch.Tensor, positions: torch.Tensor,
                   cache: KVCache) -> torch.Tensor:
        R, D, eps = a.shape[0], c.head_dim, c.rms_norm_eps
        q = (a @ self.w[p + "self_attn.q_proj.weight"].T).view(R, c.num_attention_heads, D)
        k = (a @ self.w[p + "self_attn.k_proj.weight"].T).view(R, c.num_key_value_heads, D)
        v = (a @ self.w[p + "self_attn.v_proj.weight"].T).view(R, c.num_key_value_heads, D)
        # q/k norm per head BEFORE the rotation; only the first rotary_dim dims rotate
        q = rms_norm(q, self.w[p + "self_attn.q_norm.weight"], eps)
        k = rms_norm(k, self.w[p + "self_attn.k_norm.weight"], eps)
        theta = c.rope_theta_for(layer)
        if theta is not None:
            cos, sin = rope_cos_sin(positions, c.rotary_dim, theta, self.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Write this block's K/V first: rows then see each other causally, by position.
        cache.write(kv_layer, positions, k, v)
        end = int(positions.max()) + 1
        keys, values, written = cache.read(kv_layer, end)
        mask = visible(positions, torch.arange(end), c.layer_type(layer), c.sliding_window)
        unwritten = mask & ~written[None, :]
        if unwritten.any():
            row, col = unwritten.nonzero()[0].tolist()
            raise ValueError(f"{p}: the row at position {int(positions[row])} attends to position {col}, which was "
                             "never written to the KV cache")
        sink_k = self.w[p + "self_attn.sink_k"] if c.enable_sink_attention else None
        out = attention(q, keys, values, mask, c.scale, sink_k)
        return out.reshape(R, -1) @ self.w[p + "self_attn.o_proj.weight"].T

    def _moe(self, c: Config, p: str, b: torch.Tensor,
             experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        weights, experts, scores = route(b @ self.w[p + "mlp.router.weight"].T, c.num_experts_per_tok, experts)
        out = torch.zeros_like(b)
        for e in experts.unique().tolist():  # ascending expert id: a fixed summation order per row
            rows, slot = (experts == e).nonzero(as_tuple=True)
            q = f"{p}mlp.experts.{e}."
            y = expert_mlp(b[rows], self.w[q + "gate_proj.weight"], self.w[q + "up_proj.weight"],
                           self.w[q + "down_proj.weight"])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out, scores, experts

    def _check_rows(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        if tokens.dim() != 1 or positions.shape != tokens.shape or tokens.numel() == 0:
            raise ValueError(f"tokens {tuple(tokens.shape)} and positions {tuple(positions.shape)} must be "
                             "equal-length, non-empty 1-D tensors")
        if positions.unique().numel() != positions.numel():
            raise ValueError(f"positions must be distinct within a block, got {positions.tolist()}")
        if int(positions.min()) < 0:
            raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")


def _tap(taps: dict | None, name: str, value: torch.Tensor) -> None:
    if taps is not None:
        taps[name] = value.detach().clone() if value.dtype == torch.long else value.detach().to(torch.float64).clone()
