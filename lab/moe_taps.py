"""One float64 reference forward with its taps, walked MoE layer by MoE layer: what the lab's routing probes
(lab/expert_prediction.py, lab/router_fold.py) start from."""

from __future__ import annotations

from typing import Iterator

import torch


def moe_layers(model, tokens: list[int], taps: dict) -> Iterator[tuple[int, str, torch.Tensor, torch.Tensor]]:
    """Run `model` (reference.model.ReferenceModel) over `tokens` at positions 0..T-1, filling `taps`; then, per MoE
    layer i: (i, its tensor-name prefix, its input x [T, H] (the embedding at layer 0, else the previous layer's
    output), a = attention_norm(x))."""
    from ..reference.checkpoint import layer_prefix
    from ..reference.layers import rms_norm

    c, w = model.config, model.w
    ids = torch.tensor(tokens)
    model.forward(ids, torch.arange(len(tokens)), model.new_cache(), taps)
    for i in range(c.num_hidden_layers):
        if c.is_dense(i):
            continue
        p = layer_prefix(i)
        x = w["model.embed_tokens.weight"][ids] if i == 0 else taps[f"layer{i - 1}.hidden"]
        yield i, p, x, rms_norm(x, w[p + "attention_norm.weight"], c.rms_norm_eps)
