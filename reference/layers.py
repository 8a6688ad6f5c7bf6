"""Functional building blocks of IQuest-Q1 (docs/model.md, "Forward"), one function per formula.

Pure torch and dtype-agnostic: every function computes in the dtype of its inputs and is
autograd-friendly, so the float64 reference and a bf16/fp32 training script share one definition.
Shapes use R = rows (tokens being computed), T = key positions, D = head_dim, E = experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


# ---- normalization ------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dimension, in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(x.dtype)


# ---- rotary position embedding ------------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R, rotary_dim] at absolute `positions`: pair j turns by t * theta^(-2j / rotary_dim), in the NeoX
    (rotate-half) layout, so the rotary_dim / 2 angles appear twice. Angles are computed in float64 whatever `dtype`
    is, so large positions stay exact."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=positions.device) / rotary_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim = cos.shape[-1] dims of x [R, heads, D] by its row's angles (cos/sin [R, rotary_dim],
    shared by every head): with u, w the two halves of those dims, (u cos - w sin, w cos + u sin). The other dims
    pass through."""
    n = cos.shape[-1]
    rot, rest = x[..., :n], x[..., n:]
    u, w = rot[..., : n // 2], rot[..., n // 2:]
    rotated = rot * cos[:, None, :] + torch.cat([-w, u], dim=-1) * sin[:, None, :]
    return torch.cat([rotated, rest], dim=-1)


# ---- attention ----------------------------------------------------------------------------------
def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, layer_type: str, window: int) -> torch.Tensor:
    """bool [R, T]: may the query at q_pos read the key at k_pos? full: k <= q; sliding: q - W < k <= q."""
    q, k = q_pos[:, None], k_pos[None, :]
    mask = k <= q
    if layer_type == "sliding_attention":
        mask = mask & (k > q - window)
    elif layer_type != "full_attention":
        raise ValueError(f"unknown layer type {layer_type!r}")
    return mask


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
              sink_k: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with GQA and a zero-value sink key: q [R, Nq, D], k/v [T, Nkv, D] -> [R, Nq, D].

    out_h = sum_j e^{s_j} v_j / (e^{s_sink} + sum_j e^{s_j}), s_j = scale * q_h . k_{g,j}, s_sink = scale * q_h .
    sink_k[g], g = h // (Nq / Nkv): the sink is a key every query sees, with a zero value, so it only enlarges the
    denominator, by an amount that depends on the query. The max subtracted for stability includes the sink.
    """
    R, Nq, D = q.shape
    kv_head = torch.arange(Nq, device=q.device) // (Nq // k.shape[1])  # query head h reads KV head h // group
    k, v = k.index_select(1, kv_head), v.index_select(1, kv_head)
    scores = torch.einsum("rhd,thd->hrt", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if sink_k is not None:
        sink = torch.einsum("rhd,hd->hr", q, sink_k.to(q.dtype).index_select(0, kv_head)) * scale
        scores = torch.cat([scores, sink[..., None]], dim=-1)
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    probs = probs / probs.sum(dim=-1, keepdim=True)
    probs = probs[..., : k.shape[0]]  # drop the sink column: its value is zero
    return torch.einsum("hrt,thd->rhd", probs, v)


# ---- mixture of experts -------------------------------------------------------------------------
def route(router_logits: torch.Tensor, top_k: int,
          experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax routing over all experts, top-k, renormalized: (weights [R, k], experts [R, k] long, scores [R, E]).

    Experts are ordered by descending score; equal scores go to the lower expert index (a stable sort keeps index
    order among ties, which torch.topk does not promise). `experts` [R, k], when given, replaces the selection
    (weights are still these experts' scores): qualification recomputes a row under another engine's choice at a
    router tie (qualify/router.py).
    """
    scores = torch.softmax(router_logits, dim=-1)
    if experts is None:
        experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    elif experts.shape != (scores.shape[0], top_k):
        raise ValueError(f"forced experts have shape {tuple(experts.shape)}, expected {(scores.shape[0], top_k)}")
    weights = scores.gather(-1, experts)
    return weights / weights.sum(dim=-1, keepdim=True), experts, scores


def expert_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """One SwiGLU MLP (an expert, or the dense MLP of mlp_only_layers): Down(silu(Gate x) * Up x)."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
