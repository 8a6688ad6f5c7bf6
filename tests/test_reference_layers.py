"""reference/layers.py and fp8 dequantization against implementations this project did not write.

transformers 5.x supplies the independent twins: Llama's RMSNorm and rotary embedding, its YaRN
init function, gpt-oss's eager attention with sinks, and Qwen3-MoE's softmax top-k router and experts.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock, Qwen3MoeTopKRouter

from iquest.reference.config import RopeScaling
from iquest.reference.fp8 import dequantize, quantize
from iquest.reference.layers import (apply_rope, attention, expert_mlp, rms_norm, rope_cos_sin, rope_inv_freq,
                                     route, visible)

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


# ---- rotary embedding ---------------------------------------------------------------------------
def llama_config(head_dim, theta, scaling):
    params = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": scaling.factor,
                  "original_max_position_embeddings": scaling.original_max_position_embeddings,
                  "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow}
    return LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim,
                       max_position_embeddings=1 << 18, rope_parameters=params)


SCALINGS = [None, RopeScaling(factor=4.0, original_max_position_embeddings=1024),
            RopeScaling(factor=32.0, original_max_position_embeddings=4096, beta_fast=16.0, beta_slow=2.0)]


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("head_dim,theta", [(8, 10000.0), (128, 1e6)])
def test_rope_inv_freq_matches_transformers_init(scaling, head_dim, theta):
    cfg = llama_config(head_dim, theta, scaling)
    if scaling is None:
        hf_inv, hf_factor = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    inv, factor = rope_inv_freq(head_dim, theta, scaling)
    torch.testing.assert_close(inv, hf_inv.to(F64), rtol=1e-6, atol=0)  # transformers computes in fp32
    assert factor == pytest.approx(hf_factor, rel=1e-15)


@pytest.mark.parametrize("scaling", SCALINGS)
def test_rope_cos_sin_matches_llama_rotary_embedding(scaling):
    # LlamaRotaryEmbedding works in float32: angles up to ~300 rad carry ~3e-5 absolute error.
    cfg = llama_config(16, 10000.0, scaling)
    positions = torch.tensor([0, 1, 2, 7, 63, 100, 300])
    hf_cos, hf_sin = LlamaRotaryEmbedding(cfg)(torch.zeros(1, dtype=F64), positions[None])
    cos, sin = rope_cos_sin(positions, 16, 10000.0, scaling, F64)
    torch.testing.assert_close(cos, hf_cos[0], rtol=0, atol=1e-4)
    torch.testing.assert_close(sin, hf_sin[0], rtol=0, atol=1e-4)


def test_apply_rope_matches_apply_rotary_pos_emb():
    R, heads, D = 6, 3, 16
    cos, sin = rope_cos_sin(torch.arange(100, 100 + R), D, 1e6, SCALINGS[1], F64)
    q, k = rand(R, heads, D, seed=4), rand(R, 2, D, seed=5)
    # transformers wants [batch, heads, seq, D] with cos [batch, seq, D].
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1), rtol=0, atol=1e-15)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1), rtol=0, atol=1e-15)


def test_rope_scores_depend_only_on_relative_position():
    q, k = rand(1, 1, 32, seed=6), rand(1, 1, 32, seed=7)

    def score(m, n):
        cq, sq = rope_cos_sin(torch.tensor([m]), 32, 1e6, None, F64)
        ck, sk = rope_cos_sin(torch.tensor([n]), 32, 1e6, None, F64)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()  # a float: approx takes no 0-d tensor

    assert score(10, 3) == pytest.approx(score(190_007, 190_000), rel=1e-9)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-9)  # and the score does move with the distance


# ---- attention with sinks and windows -----------------------------------------------------------
def gpt_oss_attention(q, k, v, mask, sinks):
    """transformers' gpt-oss eager attention, with our bool mask made additive."""
    module = SimpleNamespace(num_key_value_groups=q.shape[1] // k.shape[1], sinks=sinks, training=False)
    additive = torch.zeros(mask.shape, dtype=F64).masked_fill(~mask, torch.finfo(F64).min)
    out, _ = eager_attention_forward(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                     v.transpose(0, 1)[None], additive[None, None], scaling=q.shape[-1] ** -0.5)
    return out[0]  # [R, Nq, D]


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
@pytest.mark.parametrize("nq,nkv", [(4, 2), (6, 1), (4, 4)])
@pytest.mark.parametrize("rows", [1, 8, 30])
def test_attention_matches_gpt_oss_eager(layer_type, nq, nkv, rows):
    T, D, window = 30, 8, 8
    q_pos = torch.arange(T - rows, T)
    q, k, v = rand(rows, nq, D, seed=8, scale=2.0), rand(T, nkv, D, seed=9), rand(T, nkv, D, seed=10)
    sinks = rand(nq, seed=11)
    mask = visible(q_pos, torch.arange(T), layer_type, window)
    torch.testing.assert_close(attention(q, k, v, mask, sinks), gpt_oss_attention(q, k, v, mask, sinks),
                               rtol=1e-12, atol=1e-13)


def test_visible_windows():
    mask = visible(torch.tensor([0, 5, 20]), torch.arange(25), "sliding_attention", 8)
    assert mask[0].nonzero().flatten().tolist() == [0]
    assert mask[1].nonzero().flatten().tolist() == list(range(0, 6))
    assert mask[2].nonzero().flatten().tolist() == list(range(13, 21))  # t-W+1 .. t
    full = visible(torch.tensor([20]), torch.arange(25), "full_attention", 8)
    assert full[0].nonzero().flatten().tolist() == list(range(21))
    with pytest.raises(ValueError):
        visible(torch.tensor([0]), torch.arange(1), "chunked_attention", 8)


def test_sink_is_an_extra_denominator_term():
    R, T, nq, D = 3, 10, 4, 8
    q, k, v = rand(R, nq, D, seed=12), rand(T, 2, D, seed=13), rand(T, 2, D, seed=14)
    mask = visible(torch.arange(T - R, T), torch.arange(T), "full_attention", 8)
    plain = torch.softmax((torch.einsum("rhd,thd->hrt", q, k.repeat_interleave(2, 1)) / math.sqrt(D))
                          .masked_fill(~mask[None], float("-inf")), dim=-1)
    plain = torch.einsum("hrt,thd->rhd", plain, v.repeat_interleave(2, 1))
    torch.testing.assert_close(attention(q, k, v, mask, None), plain, rtol=1e-13, atol=1e-14)
    torch.testing.assert_close(attention(q, k, v, mask, torch.full((nq,), -1e4, dtype=F64)), plain,
                               rtol=1e-13, atol=1e-14)
    with_sink = attention(q, k, v, mask, torch.zeros(nq, dtype=F64))
    assert (with_sink - plain).abs().max() > 1e-3
    # A huge sink drowns every key: output -> 0 without overflow (the max includes the sink).
    assert attention(q, k, v, mask, torch.full((nq,), 1e4, dtype=F64)).abs().max() < 1e-300


# ---- routing and experts ------------------------------------------------------------------------
def qwen3_moe(E=8, k=2, H=32, inter=16, norm=True):
    cfg = Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=inter,
                         norm_topk_prob=norm)
    return cfg, Qwen3MoeSparseMoeBlock(cfg).to(F64)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("E,k", [(8, 2), (16, 8), (5, 1)])
def test_route_matches_qwen3_moe_router(norm, E, k):
    cfg, _ = qwen3_moe(E, k, norm=norm)
    router = Qwen3MoeTopKRouter(cfg).to(F64)
    router.weight.data.copy_(rand(E, 32, seed=15))
    x = rand(40, 32, seed=16)
    _, hf_weights, hf_experts = router(x)  # softmax in fp32 inside transformers
    weights, experts, scores = route(x @ router.weight.data.T, k, norm, 1.0)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(scores.sum(-1), torch.ones(40, dtype=F64))
    scaled, _, _ = route(x @ router.weight.data.T, k, norm, 2.5)
    torch.testing.assert_close(scaled, 2.5 * weights, rtol=1e-15, atol=0)


def test_route_ties_go_to_lower_expert_index():
    logits = torch.tensor([[0.0] * 8, [1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 2.0, 0.0], [5.0, 0, 0, 0, 0, 0, 0, 5.0]],
                          dtype=F64)
    _, experts, _ = route(logits, 4, True, 1.0)
    assert experts.tolist() == [[0, 1, 2, 3], [1, 2, 4, 5], [0, 7, 1, 2]]


def test_moe_block_matches_qwen3_moe_sparse_block():
    E, k, H, inter = 8, 2, 32, 16
    _, block = qwen3_moe(E, k, H, inter)
    gate, up, down = rand(E, inter, H, seed=17, scale=H ** -0.5), rand(E, inter, H, seed=18, scale=H ** -0.5), \
        rand(E, H, inter, seed=19, scale=inter ** -0.5)
    router = rand(E, H, seed=20, scale=H ** -0.5)
    block.gate.weight.data.copy_(router)
    block.experts.gate_up_proj.data.copy_(torch.cat([gate, up], dim=1))
    block.experts.down_proj.data.copy_(down)
    x = rand(12, H, seed=21)
    weights, experts, _ = route(x @ router.T, k, True, 1.0)
    ours = torch.stack([sum(weights[r, j] * expert_mlp(x[r], gate[e], up[e], down[e])
                            for j, e in enumerate(experts[r].tolist())) for r in range(12)])
    torch.testing.assert_close(ours, block(x[None])[0], rtol=1e-6, atol=1e-7)


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
