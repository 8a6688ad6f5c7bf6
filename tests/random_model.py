"""A small random IQuest-Q1 for tests.

`random_weights(config, seed)` is the project's fixture generator (`iquest.fixtures.make`), re-exported
so tests and shipped fixtures share one definition: every tensor of `tensor_specs(config)` in
checkpoint dtypes (E4M3 + fp32 `*_scale_inv`, bf16 norms/embeddings/router, fp32 sinks), linear
weights ~ N(0, 1/in_features), norm weights ~ 1 + 0.1 N, sinks ~ N(0, 1).
"""

from __future__ import annotations

from iquest.reference.config import Config

try:
    from iquest.fixtures import random_weights  # type: ignore[attr-defined]
except ImportError:
    from iquest.fixtures.make import random_weights

__all__ = ["random_weights", "small_config"]


def small_config(**overrides) -> Config:
    """vocab 64, hidden 32, 4 layers (s,s,s,f), heads 4/2, head_dim 8, window 8, 8 experts top 2, blocks 8x8."""
    kwargs = dict(
        vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, layer_types=("sliding_attention",) * 3 + ("full_attention",), sliding_window=8,
        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, weight_block_size=(8, 8),
        rope_theta=10000.0,
    )
    kwargs.update(overrides)
    return Config(**kwargs)
