"""A small random IQuest-Q1 (the published architecture, docs/model.md) for tests.

`random_weights(config, seed)` is the project's fixture generator (`iquest.fixtures.make`), re-exported so tests and
shipped fixtures share one definition: every logical tensor of `tensor_specs(config)` in checkpoint dtypes (E4M3 +
fp32 `*_scale_inv` where the config quantizes, bf16 elsewhere, fp32 routers), projections ~ N(0, 1/in_features),
norm weights ~ 1 + 0.1 N, `sink_k` ~ 2 N. `ReferenceModel(config, weights)` dequantizes the E4M3 tensors itself.
"""

from __future__ import annotations

from typing import Any

from iquest.fixtures.make import random_weights
from iquest.reference.config import Config

__all__ = ["random_weights", "small_config", "SMALL_WINDOW", "SMALL_DRAFT_WINDOW"]

SMALL_WINDOW = 8        # the target's sliding window (keys, the query's own position counted)
SMALL_DRAFT_WINDOW = 6  # the draft's: different from the target's, so a test cannot confuse them
_LAYOUT_KEYS = ("first_layers_types", "hybrid_layers_types_block", "num_hybrid_layers_block", "last_layers_types",
                "num_hidden_layers", "mlp_only_layers", "no_rope_layers")


def small_config(draft: dict[str, Any] | None = None, **overrides: Any) -> Config:
    """vocab 64, hidden 32, 4 layers (full, sliding, sliding, full; layer 0 dense, 1-3 MoE), 4 query heads over 2 KV
    heads of head_dim 16 with rotary_dim 4 (< head_dim / 2, so a doubled rotary_dim is still partial), thetas 1e6
    (full) / 1e4 (sliding), window 8, 8 experts top 2 of width 16, dense width 24, the sink key, FP8 blocks 8x8, and
    the draft (mtp/) with window 6.

    `overrides` are config.json keys applied to the target and (except the layer layout keys) to the draft; `draft`
    holds keys for the draft alone."""
    raw: dict[str, Any] = dict(
        model_type="iquest_q1", vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rotary_dim=4, rope_theta=1e6, swa_rope_theta=1e4,
        sliding_window=SMALL_WINDOW, first_layers_types=["full_attention"],
        hybrid_layers_types_block=["sliding_attention", "sliding_attention", "full_attention"],
        num_hybrid_layers_block=1, last_layers_types=[], mlp_only_layers=[0], num_experts=8, num_experts_per_tok=2,
        intermediate_size=16, dense_intermediate_size=24, max_position_embeddings=4096, eos_token_id=[0],
        ffn_out_scale=0.53881590608,
        quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [8, 8],
                             "activation_scheme": "dynamic"})
    raw.update(overrides)
    mtp = {k: v for k, v in raw.items() if k not in _LAYOUT_KEYS}
    mtp.update(model_type="iquest_q1_mtp", num_hidden_layers=1, mlp_only_layers=[], no_rope_layers=[],
               sliding_window=SMALL_DRAFT_WINDOW, num_target_layers=raw["num_hidden_layers"])
    mtp.update(draft or {})
    return Config.from_dict(raw, mtp)
