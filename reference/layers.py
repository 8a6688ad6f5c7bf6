"""Functional building blocks of IQuest-Q1 (MODEL.md, "Forward"), one function per formula.

Pure torch and dtype-agnostic: every function computes in the dtype of its inputs and is
autograd-friendly, so the float64 reference and a bf16/fp32 training script share one definition.
Shapes use R = rows (tokens being computed), T = key positions, D = head_dim, E = experts.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .config import RopeScaling


# ---- normalization ------------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dimension, in x's dtype."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.to(x.dtype)


# ---- rotary position embedding ------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] (float64) and the factor multiplied into cos/sin.

    Without scaling: theta^(-2i/D). With YaRN, transformers' `_compute_yarn_parameters`: dimensions
    that rotate fast (many turns within the original context) keep their frequency (extrapolation),
    slow ones are divided by `factor` (interpolation), with a linear ramp between the two correction
    dimensions; attention is sharpened by 0.1 * ln(factor) + 1.
    """
    dim = head_dim
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extrapolation = 1.0 / pos_freqs
    if scaling is None:
        return extrapolation, 1.0
    factor = scaling.factor
    interpolation = 1.0 / (factor * pos_freqs)
    attention_factor = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` turns into the original context.
        orig = scaling.original_max_position_embeddings
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(scaling.beta_fast)), 0)
    high = min(math.ceil(correction_dim(scaling.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, attention_factor


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [R, D] at absolute `positions` (rotate-half layout: the D/2 angles repeated twice).

    Angles are computed in float64 whatever `dtype` is, so large positions stay exact.
    """
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling)
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [R, heads, D] by its row's angles (cos/sin [R, D], shared by every head)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with GQA and per-head sinks: q [R, Nq, D], k/v [T, Nkv, D] -> [R, Nq, D].

    out_h = sum_j exp(s_j) v_j / (exp(sink_h) + sum_j exp(s_j)), s_j = q_h . k_{g,j} / sqrt(D),
    g = h // (Nq / Nkv). The sink is one extra logit whose value vector is zero: it only enlarges the
    denominator. The max subtracted for stability includes the sink.
    """
    R, Nq, D = q.shape
    group = Nq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads KV head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("rhd,thd->hrt", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(scores.dtype)[:, None, None].expand(Nq, R, 1)
        scores = torch.cat([scores, sink_col], dim=-1)
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    probs = probs / probs.sum(dim=-1, keepdim=True)
    probs = probs[..., : k.shape[0]]  # drop the sink column: its value is zero
    return torch.einsum("hrt,thd->rhd", probs, v)


# ---- mixture of experts -------------------------------------------------------------------------
def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, scaling: float,
          experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax routing: (weights [R, k], experts [R, k] long, scores [R, E]).

    Experts are ordered by descending score; equal scores go to the lower expert index (a stable
    sort keeps index order among ties, which torch.topk does not promise). `experts` [R, k], when given,
    replaces the selection (weights are still these experts' scores): qualification recomputes a row under
    another engine's choice at a router tie (qualify/router.py).
    """
    scores = torch.softmax(router_logits, dim=-1)
    if experts is None:
        experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    elif experts.shape != (scores.shape[0], top_k):
        raise ValueError(f"forced experts have shape {tuple(experts.shape)}, expected {(scores.shape[0], top_k)}")
    weights = scores.gather(-1, experts)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling, experts, scores


def expert_mlp(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: Down(silu(Gate x) * Up x)."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)
