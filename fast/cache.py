"""Static KV caches: allocated once, addressed by position, rolled back by a length change (docs/round.md).

Sliding-window layers (and the MTP layer) keep a ring of `W + 64` slots, slot = position mod ring.
With exactly W slots, a verification block that writes up to 8 rows before reading would evict
history still inside an earlier row's window: the 64 spare slots (one attention tile) prevent that.
Full-attention layers keep one slot per position up to the maximum context.

Every slot records the position it holds (`slot_pos`, -1 when empty), so a query at position t
reads exactly the slots whose position lies in its window and is <= t; KV left behind by rejected
drafts sits at positions past the settled length and is rewritten before any query can reach it.
Padding rows of a fixed-width block write to one extra trash slot that is never visible.

`RingSnapshot` copies the rings as one request's prefill left them, so that the next request can take up the
prefix they share (prefix reuse, fast/rank.py): decode keeps writing the rings after prefill and evicts what the
next prompt's first new rows must read; full layers need no copy, decode writes only past the prompt there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..reference.config import Config

RING_SLACK = 64


@dataclass
class LayerKV:
    k: torch.Tensor          # [slots + 1, Nkv_rank, D]; the last slot is the trash slot
    v: torch.Tensor
    slot_pos: torch.Tensor   # [slots + 1] int64 position held by each slot, -1 = empty
    slots: int
    window: int | None       # None for full attention
    causal = True            # queries read no later position (a class attribute: the kernels take it too)

    def write(self, positions: torch.Tensor, live: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows' K/V at their positions; rows with live=False go to the trash slot."""
        slot = torch.where(live, positions % self.slots, torch.full_like(positions, self.slots))
        self.k.index_copy_(0, slot, k.to(self.k.dtype))
        self.v.index_copy_(0, slot, v.to(self.v.dtype))
        self.slot_pos.index_copy_(0, slot, torch.where(live, positions, torch.full_like(positions, -1)))

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [R, slots + 1]: may the query at positions[r] read slot s?"""
        sp, q = self.slot_pos[None, :], positions[:, None]
        mask = (sp >= 0) & (q >= 0)
        if self.causal:
            mask = mask & (sp <= q)
        if self.window is not None:
            mask = mask & (sp > q - self.window)
        return mask


def layer_slots(window: int | None, max_context: int, ring_slack: int = RING_SLACK) -> int:
    """Slots of a layer's cache: a ring of its window + `ring_slack`, or one per position."""
    return max_context if window is None else min(window + ring_slack, max_context)


def windows(config: Config) -> list[int | None]:
    """Each cache's window: the target's layers 0..L-1, then the draft layer's (its own window) at index L."""
    return [config.window(i) for i in range(config.num_hidden_layers)] + [config.mtp.window(0)]


class StaticKV:
    """One rank's caches: the target's layers 0..L-1 and the draft layer at index L."""

    ring_slack = RING_SLACK  # spare ring slots of a sliding-window layer
    layer_kv = LayerKV

    def __init__(self, config: Config, kv_heads: int, max_context: int, dtype: torch.dtype, device: torch.device):
        self.max_context = max_context
        self.epoch = 0  # counts resets: KV kept for a later request is stale once anyone resets and refills
        self.layers: list[LayerKV] = []
        for window in windows(config):
            slots = layer_slots(window, max_context, self.ring_slack)
            shape = (slots + 1, kv_heads, config.head_dim)
            self.layers.append(self.layer_kv(
                k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device),
                slot_pos=torch.full((slots + 1,), -1, dtype=torch.int64, device=device), slots=slots, window=window))

    def reset(self) -> None:
        self.epoch += 1
        for kv in self.layers:
            kv.slot_pos.fill_(-1)

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    def rings(self) -> list[int]:
        """Indices of the layers whose cache is a ring (a window with fewer slots than positions)."""
        return [i for i, kv in enumerate(self.layers) if kv.window is not None and kv.slots < self.max_context]

    @staticmethod
    def bytes_needed(config: Config, kv_heads: int, max_context: int, dtype_bytes: int) -> int:
        total = 0
        for window in windows(config):
            slots = layer_slots(window, max_context) + 1
            total += 2 * slots * kv_heads * config.head_dim * dtype_bytes + 8 * slots
        return total


class RingSnapshot:
    """A copy of some ring layers' K, V and slot_pos, taken and restored by plain copies into buffers made once (the
    caches keep their addresses: captured graphs stay valid). A host copy of slot_pos says which positions it holds."""

    def __init__(self, cache: StaticKV, layers: list[int]):
        self.layers = layers
        self.k = {i: torch.empty_like(cache[i].k) for i in layers}
        self.v = {i: torch.empty_like(cache[i].v) for i in layers}
        self.slot_pos = {i: torch.empty_like(cache[i].slot_pos) for i in layers}
        self.held = {i: np.full(cache[i].slot_pos.shape[0], -1, dtype=np.int64) for i in layers}

    @staticmethod
    def bytes_for(cache: StaticKV, layers: list[int]) -> int:
        return sum(2 * kv.k.numel() * kv.k.element_size() + kv.slot_pos.numel() * 8
                   for kv in (cache[i] for i in layers))

    def take(self, cache: StaticKV, layers: list[int]) -> None:
        for i in layers:
            kv = cache[i]
            self.k[i].copy_(kv.k)
            self.v[i].copy_(kv.v)
            self.slot_pos[i].copy_(kv.slot_pos)
        # the host record in one transfer (one sync), not one a layer
        host = torch.cat([self.slot_pos[i] for i in layers]).cpu().numpy()
        sizes = np.cumsum([self.slot_pos[i].numel() for i in layers])[:-1]
        self.held.update(zip(layers, np.split(host, sizes)))

    def restore(self, cache: StaticKV, layers: list[int]) -> None:
        for i in layers:
            kv = cache[i]
            kv.k.copy_(self.k[i])
            kv.v.copy_(self.v[i])
            kv.slot_pos.copy_(self.slot_pos[i])

    def holds(self, layer: int, lo: int, hi: int) -> bool:
        """Does the copy of `layer` hold every position in [lo, hi)?"""
        held = self.held[layer]
        want = np.arange(max(lo, 0), hi, dtype=np.int64)
        return bool((held[want % (held.shape[0] - 1)] == want).all())
