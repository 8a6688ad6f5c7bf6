"""Philox uniforms on the device, bit-identical to `reference.rng.rand` (hence to Triton's `tl.rand`).

The generator (`rng.philox_words`, `rng.word_to_uniform`), its constants and the counter layout are
the reference's; this file only feeds them device tensors, so that uniforms can be drawn inside a
CUDA graph: the seed is a 0-dim device tensor (a request changes it without recapture), nothing is
read back to the host, and no shape depends on a value.
"""

from __future__ import annotations

import torch

from iquest.reference import rng
from iquest.reference.rng import PURPOSE_ACCEPT, PURPOSE_COMMIT, PURPOSE_DRAFT, SLOTS_PER_POSITION, offset

_MASK32 = 0xFFFFFFFF
_DRAFT_SLOT_1 = offset(0, PURPOSE_DRAFT, 1)  # slot of the depth-1 draft sample; depth d is this + d - 1


def uniforms(seed: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1), shaped like `offsets`: `tl.rand(seed, offsets)` = `rng.rand(seed, offsets)`.

    seed: 0-dim int64 tensor on the offsets' device, holding the request seed's 64 bits
    (`rng.int64_bits(seed)`). offsets: integer tensor of int32 values (see `offsets()`); values outside
    int32 are not checked (that would need a host sync) and give a stream Triton does not produce.
    """
    if seed.dim() != 0 or seed.dtype != torch.int64:
        raise ValueError(f"seed must be a 0-dim int64 tensor, got {seed.dtype} {tuple(seed.shape)}")
    if offsets.dtype.is_floating_point or offsets.dtype.is_complex or offsets.dtype == torch.bool:
        raise ValueError(f"offsets must be an integer tensor, got {offsets.dtype}")
    if seed.device != offsets.device:
        raise ValueError(f"seed and offsets must share a device, got {seed.device} and {offsets.device}")
    c0 = offsets.to(torch.int64) & _MASK32  # int32 -> uint32 bits, as Triton's offset.to(tl.uint32)
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32  # arithmetic shift, then mask: the high word of the uint64 seed
    return rng.word_to_uniform(rng.philox_words(c0, k0, k1)[0])


def offsets(positions: torch.Tensor, purpose: int, depth: int | torch.Tensor = 0) -> torch.Tensor:
    """int32 Philox counters for decisions at `positions` (int64 tensor): `rng.offset` elementwise.

    An int `depth` is checked by `rng.offset` itself; a tensor `depth` (draft samples only, broadcast
    against positions) and the positions (0..rng.MAX_POSITION) are not checked: that needs a host sync.
    """
    if positions.dtype != torch.int64:
        raise ValueError(f"positions must be an int64 tensor, got {positions.dtype}")
    if isinstance(depth, torch.Tensor):
        if purpose != PURPOSE_DRAFT or isinstance(purpose, bool):
            raise ValueError(f"a depth tensor is only meaningful for PURPOSE_DRAFT, got purpose={purpose!r}")
        slot = _DRAFT_SLOT_1 + (depth.to(torch.int64) - 1)
    else:
        if purpose not in (PURPOSE_COMMIT, PURPOSE_ACCEPT, PURPOSE_DRAFT):
            raise ValueError(f"unknown purpose {purpose!r}")
        slot = offset(0, purpose, depth)  # the reference validates purpose and depth
    return (positions * SLOTS_PER_POSITION + slot).to(torch.int32)
