"""reference/layers.py and fp8 dequantization against implementations this project did not write, and against
docs/model.md's formulas written out.

Independent twins from transformers 5.x: Llama's RMSNorm; GLM-4-MoE's partial rotary embedding (NeoX halves on the
first rotary_dim dims, the rest passed through: IQuest-Q1's RoPE); Qwen3-MoE's softmax top-k router (renormalized)
and sparse MoE block. IQuest-Q1's sink is a KEY (zero value, query-dependent logit), which no transformers model has:
attention is checked against torch's scaled_dot_product_attention over the keys plus the sink key with a zero value,
and against the equivalent form out = O * sigmoid(LSE - s_sink) that docs/model.md states.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import Glm4MoeConfig, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from iquest.reference.fp8 import dequantize, quantize
from iquest.reference.layers import apply_rope, attention, expert_mlp, rms_norm, rope_cos_sin, route, visible

F64 = torch.float64


def rand(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


# ---- RMSNorm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rms_norm_matches_llama(eps):
    # LlamaRMSNorm always normalizes in float32, so compare in float32 (and float64 to fp32 accuracy).
    x, w = rand(5, 3, 32, seed=1), 1 + 0.1 * rand(32, seed=2)
    hf = LlamaRMSNorm(32, eps=eps)
    hf.weight.data.copy_(w)
    torch.testing.assert_close(rms_norm(x.float(), w.float(), eps), hf(x.float()), rtol=2e-7, atol=2e-7)
    torch.testing.assert_close(rms_norm(x, w, eps), hf(x.float()).to(F64), rtol=1e-6, atol=1e-6)


def test_rms_norm_keeps_dtype_and_differentiates():
    x = rand(4, 16, seed=3).float().requires_grad_()
    y = rms_norm(x, torch.ones(16, dtype=torch.bfloat16), 1e-6)
    assert y.dtype == torch.float32
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


# ---- partial rotary embedding -------------------------------------------------------------------
def glm_config(head_dim: int, rotary_dim: int, theta: float) -> Glm4MoeConfig:
    return Glm4MoeConfig(hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=4, head_dim=head_dim,
                         max_position_embeddings=1 << 20,
                         rope_parameters={"rope_type": "default", "rope_theta": theta,
                                          "partial_rotary_factor": rotary_dim / head_dim})


@pytest.mark.parametrize("head_dim,rotary_dim,theta", [(128, 32, 1e6), (128, 32, 1e4), (16, 4, 1e4), (8, 8, 1e6)])
def test_rope_cos_sin_matches_glm4_moe_partial_rotary(head_dim, rotary_dim, theta):
    cfg = glm_config(head_dim, rotary_dim, theta)
    hf_inv, _ = Glm4MoeRotaryEmbedding.compute_default_rope_parameters(cfg)
    assert hf_inv.numel() == rotary_dim // 2
    # GLM computes in float32: angles up to ~300 rad carry ~3e-5 absolute error.
    positions = torch.tensor([0, 1, 2, 7, 63, 100, 300])
    hf_cos, hf_sin = Glm4MoeRotaryEmbedding(cfg)(torch.zeros(1, dtype=F64), positions[None])
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, F64)
    assert cos.shape == (7, rotary_dim)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-4)


def test_rope_angles_are_exact_at_large_positions():
    """Pair j turns by t * theta^(-2j / rotary_dim), computed in float64 even for a float32 result (docs/model.md)."""
    t = 524_287
    cos, sin = rope_cos_sin(torch.tensor([t]), 32, 1e6, torch.float32)
    for j in range(16):
        angle = t * 1e6 ** (-2 * j / 32)
        for col in (j, j + 16):  # NeoX layout: the 16 angles appear twice
            assert cos[0, col].item() == pytest.approx(math.cos(angle), abs=1e-6)
            assert sin[0, col].item() == pytest.approx(math.sin(angle), abs=1e-6)


@pytest.mark.parametrize("head_dim,rotary_dim", [(16, 4), (128, 32), (8, 8)])
def test_apply_rope_matches_glm4_moe_apply_rotary_pos_emb(head_dim, rotary_dim):
    R = 6
    cos, sin = rope_cos_sin(torch.arange(100, 100 + R), rotary_dim, 1e4, F64)
    q, k = rand(R, 3, head_dim, seed=4), rand(R, 2, head_dim, seed=5)
    # transformers wants [batch, heads, seq, D] with cos [batch, seq, rotary_dim].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1), rtol=0, atol=1e-15)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1), rtol=0, atol=1e-15)


def test_apply_rope_rotates_only_the_first_rotary_dims():
    """docs/model.md step 3 written out: u = x[0:n/2], w = x[n/2:n]: (u cos - w sin, w cos + u sin); x[n:] passes."""
    D, n, t, theta = 16, 4, 37, 1e4
    x = rand(1, 2, D, seed=6)
    out = apply_rope(x, *rope_cos_sin(torch.tensor([t]), n, theta, F64))
    assert torch.equal(out[..., n:], x[..., n:])
    for j in range(n // 2):
        a = t * theta ** (-2 * j / n)
        u, w = x[0, :, j], x[0, :, j + n // 2]
        torch.testing.assert_close(out[0, :, j], u * math.cos(a) - w * math.sin(a), rtol=0, atol=1e-15)
        torch.testing.assert_close(out[0, :, j + n // 2], w * math.cos(a) + u * math.sin(a), rtol=0, atol=1e-15)


def test_rope_scores_depend_only_on_relative_position():
    q, k = rand(1, 1, 128, seed=6), rand(1, 1, 128, seed=7)

    def score(m, n):
        cq, sq = rope_cos_sin(torch.tensor([m]), 32, 1e6, F64)
        ck, sk = rope_cos_sin(torch.tensor([n]), 32, 1e6, F64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()  # a float: approx takes no 0-d tensor

    assert score(10, 3) == pytest.approx(score(190_007, 190_000), rel=1e-9)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-9)  # and the score does move with the distance


# ---- attention with the sink key and windows ----------------------------------------------------
def sdpa_with_sink_key(q, k, v, mask, scale, sink_k):
    """torch's SDPA over the keys plus one extra key per KV head (sink_k) whose value is zero, visible to all."""
    R, Nq, D = q.shape
    group = Nq // k.shape[1]
    if sink_k is not None:
        k = torch.cat([k, sink_k[None]], dim=0)
        v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)
        mask = torch.cat([mask, torch.ones(R, 1, dtype=torch.bool)], dim=1)
    kk = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [Nq, T, D]
    vv = v.repeat_interleave(group, dim=1).transpose(0, 1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask[None], scale=scale)
    return out.transpose(0, 1)


def sigmoid_form(q, k, v, mask, scale, sink_k):
    """out_h = O_h * sigmoid(LSE_h - s_sink) (docs/model.md step 5), O the plain softmax output."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = (torch.einsum("rhd,thd->hrt", q, kk) * scale).masked_fill(~mask[None], float("-inf"))
    o = torch.einsum("hrt,thd->rhd", torch.softmax(s, dim=-1), vv)
    lse = torch.logsumexp(s, dim=-1).T  # [R, Nq]
    s_sink = torch.einsum("rhd,hd->rh", q, sink_k.repeat_interleave(group, dim=0)) * scale
    return o * torch.sigmoid(lse - s_sink)[..., None]


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
@pytest.mark.parametrize("nq,nkv", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("rows", [1, 8, 30])
def test_attention_matches_sdpa_with_a_zero_value_sink_key(layer_type, nq, nkv, rows):
    T, D, window, scale = 30, 8, 8, 8 ** -0.5
    q_pos = torch.arange(T - rows, T)
    q, k, v = rand(rows, nq, D, seed=8, scale=2.0), rand(T, nkv, D, seed=9), rand(T, nkv, D, seed=10)
    sink_k = rand(nkv, D, seed=11, scale=2.0)
    mask = visible(q_pos, torch.arange(T), layer_type, window)
    ours = attention(q, k, v, mask, scale, sink_k)
    torch.testing.assert_close(ours, sdpa_with_sink_key(q, k, v, mask, scale, sink_k), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(ours, sigmoid_form(q, k, v, mask, scale, sink_k), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(attention(q, k, v, mask, scale, None), sdpa_with_sink_key(q, k, v, mask, scale, None),
                               rtol=1e-12, atol=1e-13)


def test_visible_windows():
    mask = visible(torch.tensor([0, 5, 20]), torch.arange(25), "sliding_attention", 8)
    assert mask[0].nonzero().flatten().tolist() == [0]
    assert mask[1].nonzero().flatten().tolist() == list(range(0, 6))
    assert mask[2].nonzero().flatten().tolist() == list(range(13, 21))  # t-W+1 .. t: W keys, its own counted
    full = visible(torch.tensor([20]), torch.arange(25), "full_attention", 8)
    assert full[0].nonzero().flatten().tolist() == list(range(21))
    with pytest.raises(ValueError):
        visible(torch.tensor([0]), torch.arange(1), "chunked_attention", 8)


def plain_attention(q, k, v, mask, scale):
    group = q.shape[1] // k.shape[1]
    s = (torch.einsum("rhd,thd->hrt", q, k.repeat_interleave(group, 1)) * scale).masked_fill(~mask[None],
                                                                                              float("-inf"))
    return torch.einsum("hrt,thd->rhd", torch.softmax(s, dim=-1), v.repeat_interleave(group, 1))


def test_sink_key_is_a_query_dependent_extra_denominator_term():
    R, T, nq, D, scale = 3, 10, 4, 8, 8 ** -0.5
    q, k, v = rand(R, nq, D, seed=12), rand(T, 2, D, seed=13), rand(T, 2, D, seed=14)
    mask = visible(torch.arange(T - R, T), torch.arange(T), "full_attention", 8)
    plain = plain_attention(q, k, v, mask, scale)
    torch.testing.assert_close(attention(q, k, v, mask, scale, None), plain, rtol=1e-13, atol=1e-14)
    # A zero sink key gives s_sink = 0 for every query: a denominator term of exactly 1.
    zero = attention(q, k, v, mask, scale, torch.zeros(2, D, dtype=F64))
    s = (torch.einsum("rhd,thd->hrt", q, k.repeat_interleave(2, 1)) * scale).masked_fill(~mask[None], float("-inf"))
    denom = torch.exp(s).sum(-1).T  # [R, nq]
    torch.testing.assert_close(zero, plain * (denom / (1 + denom))[..., None], rtol=1e-12, atol=1e-14)
    # The sink's logit depends on the query: the same sink key shrinks different queries' outputs by different
    # factors (a per-head scalar sink would give one factor per head for all rows of equal LSE).
    sink_k = rand(2, D, seed=15, scale=3.0)
    factor = attention(q, k, v, mask, scale, sink_k) / plain
    s_sink = torch.einsum("rhd,hd->rh", q, sink_k.repeat_interleave(2, 0)) * scale
    torch.testing.assert_close(factor, (denom / (torch.exp(s_sink) + denom))[..., None].expand_as(factor),
                               rtol=1e-10, atol=1e-12)
    # A sink key anti-aligned with every query vanishes; a huge aligned one drowns every key without overflow.
    far = -1e4 * q.mean(dim=(0,))[::2]  # [2, D]: per KV head, minus its first query head's mean direction
    assert attention(q[:, :1], k[:, :1], v[:, :1], mask, scale, far[:1]).sub(plain[:, :1]).abs().max() < 1e-12
    drown = attention(q[:, :1], k[:, :1], v[:, :1], mask, scale, -far[:1])
    assert torch.isfinite(drown).all() and drown.abs().max() < 1e-200


# ---- routing and experts ------------------------------------------------------------------------
def qwen3_moe(E=8, k=2, H=32, inter=16):
    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=inter,
                         norm_topk_prob=True)
    return cfg, Qwen3MoeSparseMoeBlock(cfg).to(F64)


@pytest.mark.parametrize("E,k", [(8, 2), (16, 8), (5, 1), (256, 8)])
def test_route_matches_qwen3_moe_router(E, k):
    cfg, _ = qwen3_moe(E, k)
    router = Qwen3MoeTopKRouter(cfg).to(F64)
    router.weight.data.copy_(rand(E, 32, seed=15))
    x = rand(40, 32, seed=16)
    _, hf_weights, hf_experts = router(x)  # softmax in fp32 inside transformers
    weights, experts, scores = route(x @ router.weight.data.T, k)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(scores.sum(-1), torch.ones(40, dtype=F64))
    torch.testing.assert_close(weights.sum(-1), torch.ones(40, dtype=F64))


def test_route_ties_go_to_lower_expert_index():
    logits = torch.tensor([[0.0] * 8, [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, 0.0], [5.0, 0, 0, 0, 0, 0, 0, 5.0]],
                          dtype=F64)
    _, experts, _ = route(logits, 4)
    assert experts.tolist() == [[0, 1, 2, 3], [1, 2, 4, 5], [0, 7, 1, 2]]


def test_route_with_forced_experts_weighs_them_by_their_scores():
    logits = rand(3, 8, seed=17)
    forced = torch.tensor([[7, 0], [1, 2], [3, 3]])
    weights, experts, scores = route(logits, 2, forced)
    assert torch.equal(experts, forced)
    p = torch.softmax(logits, -1).gather(-1, forced)
    torch.testing.assert_close(weights, p / p.sum(-1, keepdim=True), rtol=1e-15, atol=0)
    with pytest.raises(ValueError, match="forced experts"):
        route(logits, 2, forced[:, :1])


def test_moe_block_matches_qwen3_moe_sparse_block():
    E, k, H, inter = 8, 2, 32, 16
    _, block = qwen3_moe(E, k, H, inter)
    gate, up, down = rand(E, inter, H, seed=17, scale=H ** -0.5), rand(E, inter, H, seed=18, scale=H ** -0.5), \
        rand(E, H, inter, seed=19, scale=inter ** -0.5)
    router = rand(E, H, seed=20, scale=H ** -0.5)
    block.gate.weight.data.copy_(router)
    block.experts.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))  # the published experts.fc layout
    block.experts.down_proj.data.copy_(down)
    x = rand(12, H, seed=21)
    weights, experts, _ = route(x @ router.T, k)
    ours = torch.stack([sum(weights[r, j] * expert_mlp(x[r], gate[e], up[e], down[e])
                            for j, e in enumerate(experts[r].tolist())) for r in range(12)])
    torch.testing.assert_close(ours, block(x[None])[0], rtol=1e-6, atol=1e-7)


def test_expert_mlp_is_swiglu_written_out():
    x, g, u, d = rand(5, seed=22), rand(3, 5, seed=23), rand(3, 5, seed=24), rand(5, 3, seed=25)
    a, b = g @ x, u @ x
    want = d @ (a / (1 + torch.exp(-a)) * b)
    torch.testing.assert_close(expert_mlp(x, g, u, d), want, rtol=1e-14, atol=1e-15)


# ---- FP8 block dequantization -------------------------------------------------------------------
@pytest.mark.parametrize("shape,block", [((13, 10), (4, 4)), ((8, 8), (8, 8)), ((5, 19), (2, 8))])
def test_dequantize_matches_per_element_math(shape, block):
    w = rand(*shape, seed=22)
    q, s = quantize(w, block)
    assert s.shape == (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))
    real = dequantize(q, s, block)
    for r in range(shape[0]):
        for c in range(shape[1]):
            assert real[r, c].item() == float(q[r, c].float()) * float(s[r // block[0], c // block[1]])
    # E4M3 keeps 3 mantissa bits: every element within 1/16 relative of its block's max (half an ulp).
    torch.testing.assert_close(real, w, rtol=0.0625, atol=float(s.max()) * 2 ** -6)
