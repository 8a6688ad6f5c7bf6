"""Expert prefetch (docs/round.md, "Expert prefetch"): an engine option (EngineOptions.expert_prefetch) that warms L2
with the Gate and Up weights of the experts a sliding layer's rows are predicted to choose, on a side branch that runs
beside the layer's attention. A cache hint: it writes nothing the round reads, so every token, value and acceptance
is the same with it and without it; only time changes.

The prediction: the router's selection over W' a, with a the layer's incoming normalized hidden (the attention's
input) and W' = router * w_ffn (the router fold's matrix, fast/router_fold.py). The MoE input is
b = ffn_norm(a + s * attn_out_norm(o)) and the selection is scale-free, so W' a differs from the router's logits only
by the attention's contribution, which the prediction cannot see; `iquest bench prefetch` reports how often it
guesses right (coverage: the share of the experts the block reads that were warmed).

Here: what a layer's branch reads (made once by TorchOps.prepare) and the prediction's torch form, the reference of
the kernel's test and what the CPU engine taps for the coverage report (it warms nothing: a CPU has no L2 to warm).
The kernel (kernels/expert_prefetch.py) predicts and warms only at the verification widths where the branch pays.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..reference.layers import route


class ExpertWarm(NamedTuple):
    """What one sliding MoE layer's branch reads besides `a`."""

    predictor: torch.Tensor  # W' = router * w_ffn, fp32 [E, H]
    top_k: int


def make(router: torch.Tensor, w_ffn: torch.Tensor, top_k: int, scaled: torch.Tensor | None = None) -> ExpertWarm:
    """A layer's branch from its fp32 router [E, H] and feed_forward_norm weight; `scaled`: the router fold's W' of
    the same layer where the engine holds one already (the same tensor, not a copy)."""
    w = scaled if scaled is not None else (router.float() * w_ffn.float()).contiguous()
    return ExpertWarm(w, top_k)


def predict(a: torch.Tensor, live: torch.Tensor, warm: ExpertWarm) -> torch.Tensor:
    """The experts [R, k] int64 the branch warms for each live row (-1 for padding rows): the router's selection
    (reference.layers.route) over the fp32 product of the widened a and W'."""
    experts = route(a.float() @ warm.predictor.T, warm.top_k)[1]
    return torch.where(live[:, None], experts, -1)


def coverage(predicted: torch.Tensor, experts: torch.Tensor, live: torch.Tensor) -> tuple[int, int, int, int]:
    """(row hits, row slots, block hits, block experts) of one layer call: a row's chosen experts that its prediction
    holds, and the block's distinct chosen experts that any row's prediction holds (what the MoE reads once)."""
    rows = live.nonzero().flatten()
    hits = sum(len(set(experts[r].tolist()) & set(predicted[r].tolist())) for r in rows.tolist())
    block = set(experts[rows].flatten().tolist())
    warmed = set(predicted[rows].flatten().tolist())
    return hits, int(rows.numel()) * experts.shape[1], len(block & warmed), len(block)
