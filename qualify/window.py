"""`cache.window`: does every row's attention window still sit in the engine's KV cache when the block has run?

A sliding layer attends to the keys at positions (p - W, p] (docs/model.md, "Attention": W keys, the query's own
position counted; the target's layers use `sliding_window`, the draft layer its own, smaller window from mtp/). The
fast engine keeps them in a ring of slots (fast/cache.py); a block writes all its rows' keys before any row reads, so
the ring must be large enough that no row's write evicts a key still inside an earlier row's window. This check
reads the ring's `slot_pos` after each recorded forward and counts, for each live row, the positions of its window
that no slot holds, at the worst sliding layer of the block's kind (the target's layers for prefill and verification
blocks, the draft layer for draft blocks). The window is the *config's* (the contract), never the cache's own idea of
it, so a cache that claims a different window is still held to the model's.

It is structural, not numerical: a missing key is a defect whatever its weight in the softmax, so the tolerance is 0.
The numerical checks see the same defect only as far as the evicted keys' attention weight moves the logits, which
can lie inside the bf16 tolerance.
"""

from __future__ import annotations

from ..reference.config import Config


def sliding_layers(config: Config, draft: bool) -> list[tuple[int, int]]:
    """(cache index, window) of the sliding layers a target forward (draft=False) or a draft forward (True) reads;
    the draft layer's cache is entry num_hidden_layers."""
    if draft:
        w = config.mtp.window(0)
        return [(config.num_hidden_layers, w)] if w is not None else []
    return [(i, config.window(i)) for i in range(config.num_hidden_layers) if config.window(i) is not None]


def window_missing(cache, layers: list[tuple[int, int]], positions: list[int],
                   live: list[bool]) -> list[tuple[int, str]]:
    """Per row: (window positions missing at the worst layer, a description; empty for none). Padding rows: (0, "")."""
    held = {i: set(cache[i].slot_pos.tolist()) for i, _ in layers}
    out: list[tuple[int, str]] = []
    for p, ok in zip(positions, live):
        worst, why = 0, ""
        for i, window in layers if ok else ():
            first = max(0, p - window + 1)
            gone = [q for q in range(first, p + 1) if q not in held[i]]
            if len(gone) > worst:
                worst = len(gone)
                why = (f"{len(gone)} of the {p + 1 - first} positions in its window are in no slot of layer {i}'s "
                       f"{cache[i].slots}-slot ring (first {gone[0]}, last {gone[-1]})")
        out.append((worst, why))
    return out


def record_window(block, cache, layers: list[tuple[int, int]]) -> None:
    """Attach `window_missing` to a recorded Block from the cache as the forward left it (`layers`: the sliding ones
    of the block's kind, `sliding_layers`)."""
    if layers:
        block.window_missing = window_missing(cache, layers, block.positions, block.live)
