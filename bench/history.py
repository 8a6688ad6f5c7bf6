"""Synthetic KV history for decode benchmarks at long context (e.g. 192K tokens).

A real prefill of 192K tokens at full size takes longer than a benchmark call may run, and a decode
round's cost depends only on how much history each layer reads, not on its values. `fill_history`
writes random K/V with correct position labels for positions [0, history) of every cache, the target's layers and
the draft's (a draft row at position p writes its KV at p), rings keeping their last `slots` positions as a real
prefill leaves them; `RankEngine.start(req, runner, history=...)` then prefills only the prompt's tail.
"""

from __future__ import annotations

import torch

from ..fast.rank import PREFILL_BLOCK, RankEngine

SYNTHETIC_ABOVE = 8192  # contexts longer than this get synthetic history by default


def synthetic_history(mode: str, context: int) -> int:
    """Positions to fill for `--history auto|synthetic|prefill` (auto: synthetic above SYNTHETIC_ABOVE tokens)."""
    if mode not in ("auto", "synthetic", "prefill"):
        raise ValueError(f"history must be auto, synthetic or prefill, got {mode!r}")
    if mode == "prefill" or (mode == "auto" and context <= SYNTHETIC_ABOVE):
        return 0
    return history_for(context)


def history_for(context: int) -> int:
    """Positions to fill synthetically: all but the last prefill block (aligned, so block shapes stay real)."""
    return max(0, (context - 1) // PREFILL_BLOCK * PREFILL_BLOCK)


@torch.no_grad()
def fill_history(engine: RankEngine, history: int, seed: int = 0) -> None:
    cache = engine.cache
    cache.reset()
    gen = torch.Generator(device=engine.par.device).manual_seed(seed)
    for index, kv in enumerate(cache.layers):  # the target's layers 0..L-1, then the draft's cache at index L
        if kv.window is None and history > kv.slots:
            raise ValueError(f"history of {history} positions exceeds cache {index}'s {kv.slots} slots")
        pos = torch.arange(max(0, history - kv.slots), history, device=engine.par.device)
        slot = pos % kv.slots
        for t in (kv.k, kv.v):
            t[slot] = torch.randn((pos.numel(), *t.shape[1:]), generator=gen, device=t.device).to(t.dtype)
        kv.slot_pos[slot] = pos
