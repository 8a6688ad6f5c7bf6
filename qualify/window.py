"""`cache.window`: does every row's attention window still sit in the engine's KV cache when the block has run?

A sliding layer attends to the keys at positions (p - W, p] (MODEL.md; from the MTP layer's first position on). The
fast engine keeps them in a ring of slots (fast/cache.py); a block writes all its rows' keys before any row reads, so
the ring must be large enough that no row's write evicts a key still inside an earlier row's window. This check
reads the ring's `slot_pos` after each recorded forward and counts, for each live row, the positions of its window
that no slot holds, at the worst sliding layer of the block's kind (main layers for prefill and verification
blocks, the MTP layer for draft blocks).

It is structural, not numerical: a missing key is a defect whatever its weight in the softmax, so the tolerance is 0.
The numerical checks see the same defect only as far as the evicted keys' attention weight moves the logits, which
on the mini model is below the bf16 tolerance (docs/PERF.md, `ring_exact_w`).
"""

from __future__ import annotations

from ..reference.config import Config


def sliding_layers(config: Config, draft: bool) -> list[int]:
    """Cache indices of the sliding layers a main forward (draft=False) or a draft forward (True) reads."""
    if draft:
        mtp = config.mtp_layer_index
        return [mtp] if config.layer_type(mtp) == "sliding_attention" else []
    return [i for i in range(config.num_hidden_layers) if config.layer_type(i) == "sliding_attention"]


def window_missing(cache, layers: list[int], positions: list[int], live: list[bool]) -> list[tuple[int, str]]:
    """Per row: (window positions missing at the worst layer, a description; empty for none). Padding rows: (0, "")."""
    held = {i: set(cache[i].slot_pos.tolist()) for i in layers}
    out: list[tuple[int, str]] = []
    for p, ok in zip(positions, live):
        worst, why = 0, ""
        for i in layers if ok else ():
            kv = cache[i]
            first = max(kv.first_position, p - kv.window + 1)
            gone = [q for q in range(first, p + 1) if q not in held[i]]
            if len(gone) > worst:
                worst = len(gone)
                why = (f"{len(gone)} of the {p + 1 - first} positions in its window are in no slot of layer {i}'s "
                       f"{kv.slots}-slot ring (first {gone[0]}, last {gone[-1]})")
        out.append((worst, why))
    return out


def record_window(block, cache, layers: list[int]) -> None:
    """Attach `window_missing` to a recorded Block from the cache as the forward left it (`layers`: the sliding ones
    of the block's kind, `sliding_layers`)."""
    if layers:
        block.window_missing = window_missing(cache, layers, block.positions, block.live)
