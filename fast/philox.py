"""Philox uniforms on the device, bit-identical to `reference.rng.rand` (hence to Triton's `tl.rand`).

The generator, its constants and the counter layout are the reference's (`iquest.reference.rng`); this
file only re-expresses them as fixed-shape int64 tensor math, so that uniforms can be drawn on the
device inside a CUDA graph: the seed is a 0-dim device tensor (a request changes it without
recapture), nothing is read back to the host, and no shape depends on a value.

Words are held as non-negative int64 values below 2**32. A 32x32-bit product needs 64 unsigned bits,
so the multiplier is applied to the 16-bit halves of the other word (each partial product < 2**48).
"""

from __future__ import annotations

import torch

from iquest.reference.rng import (
    PHILOX_KEY_A,
    PHILOX_KEY_B,
    PHILOX_ROUND_A,
    PHILOX_ROUND_B,
    PHILOX_ROUNDS,
    PURPOSE_ACCEPT,
    PURPOSE_COMMIT,
    PURPOSE_DRAFT,
    RAND_SCALE,
    SLOTS_PER_POSITION,
    offset,
)

_MASK32 = 0xFFFFFFFF
# RAND_SCALE as a Python float (exactly the float32 value): a tensor constant would need a host-to-device
# copy, which a CUDA graph cannot capture. float32 tensor * Python float multiplies in float32.
_SCALE = float(RAND_SCALE)
_DRAFT_SLOT_1 = offset(0, PURPOSE_DRAFT, 1)  # slot of the depth-1 draft sample; depth d is this + d - 1


def _mul32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of a * b for a 32-bit constant `a` and words `b` (int64 in [0, 2**32))."""
    p_lo = a * (b & 0xFFFF)
    t = a * (b >> 16) + (p_lo >> 16)  # a*b = t * 2**16 + (p_lo & 0xFFFF)
    return t >> 16, ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)


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
    c1 = torch.zeros_like(c0)
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32  # arithmetic shift, then mask: the high word of the uint64 seed
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul32(PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul32(PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + PHILOX_KEY_A) & _MASK32
        k1 = (k1 + PHILOX_KEY_B) & _MASK32
    x = torch.where(c0 >= 2**31, c0 - 2**32, c0)  # bitcast uint32 -> int32
    x = torch.where(x < 0, -x - 1, x)  # tl.rand folds the sign away
    return x.to(torch.float32) * _SCALE  # int -> float32 rounds to nearest even, then a float32 multiply


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
