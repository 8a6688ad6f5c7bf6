"""Counter-based uniforms, bit-identical to Triton 3.6's `tl.randint` / `tl.rand` (docs/round.md, "Random numbers").

The fast engine draws its uniforms inside the kernels with `tl.rand(seed, offset)`; the reference
draws them here. Both are pure functions of (request seed, int32 offset), so the two engines see the
same uniform for the same decision without sharing any state.

Generator: Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11).
- counter  (c0, c1, c2, c3) = (offset as uint32, 0, 0, 0). The offset must be int32: an int64 offset
  switches Triton to Philox4x64, a different stream.
- key      (k0, k1) = (seed & 0xFFFFFFFF, seed >> 32), the seed read as a uint64. Triton's `philox()`
  casts the seed to uint64 and splits it this way, so a kernel that receives the request seed as an
  int64 scalar (or loads it from an int64 tensor) holds the same 64 bits: seeds >= 2**63 travel as
  their two's complement (`int64_bits(seed)`). Beware an int32 seed argument: Triton sign-extends it
  to 64 bits, and a Python int seed < 2**31 passed without annotation is specialised as int32 (same
  value, so harmless for seeds in [0, 2**31)).
- 10 rounds, each:  c0' = hi(B*c2) ^ c1 ^ k0;  c2' = hi(A*c0) ^ c3 ^ k1;  c1' = lo(B*c2);  c3' = lo(A*c0)
  with round multipliers A = 0xD2511F53, B = 0xCD9E8D57, then the key is bumped by
  (0x9E3779B9, 0xBB67AE85) mod 2**32.
- `tl.randint` returns word c0; `tl.rand` maps it to [0, 1) as: x = int32(c0); x = -x-1 if x < 0;
  float32(x) * float32(4.6566127342e-10), a float32 multiply (2**31 - 1 times the scale rounds below 1).

Offset layout: offset = position * 16 + slot, where `position` is the absolute position of the token
being decided and slot 0 = the commit draw (first token, replacement, bonus, plain autoregressive
token), slot 1 = the acceptance test, slot 1 + depth = the draft sample at depth 1..7 (slots 2..8);
slots 9..15 are unused spares. docs/round.md guarantees no (position, purpose, depth) is used twice per
request, so no uniform is ever reused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PURPOSE_COMMIT = 0
PURPOSE_ACCEPT = 1
PURPOSE_DRAFT = 2
MAX_DRAFT_DEPTH = 7
SLOTS_PER_POSITION = 16
# Largest position whose 16 slots all fit in a non-negative int32 (offset <= 2**31 - 1).
MAX_POSITION = (2**31 - 1) // SLOTS_PER_POSITION

PHILOX_ROUND_A = 0xD2511F53
PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_KEY_A = 0x9E3779B9
PHILOX_KEY_B = 0xBB67AE85
PHILOX_ROUNDS = 10
# tl.rand's scale, rounded to float32 exactly as Triton's frontend does with the Python constant.
RAND_SCALE = torch.tensor(4.6566127342e-10, dtype=torch.float32)
_SCALE = float(RAND_SCALE)

_MASK32 = 0xFFFFFFFF
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def offset(position: int, purpose: int, depth: int = 0) -> int:
    """The int32 Philox counter for one decision (layout in the module docstring)."""
    if not isinstance(position, int) or isinstance(position, bool) or not 0 <= position <= MAX_POSITION:
        raise ValueError(f"position must be an int in [0, {MAX_POSITION}] (offset stays int32), got {position!r}")
    if purpose not in (PURPOSE_COMMIT, PURPOSE_ACCEPT, PURPOSE_DRAFT) or isinstance(purpose, bool):
        raise ValueError(f"purpose must be PURPOSE_COMMIT, PURPOSE_ACCEPT or PURPOSE_DRAFT, got {purpose!r}")
    if purpose == PURPOSE_DRAFT:
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DRAFT_DEPTH:
            raise ValueError(f"depth must be an int in [1, {MAX_DRAFT_DEPTH}] for a draft sample, got {depth!r}")
        slot = 1 + depth
    else:
        if depth != 0:
            raise ValueError(f"depth is only meaningful for PURPOSE_DRAFT, got depth={depth!r}")
        slot = purpose  # commit -> 0, accept -> 1
    return position * SLOTS_PER_POSITION + slot


def int64_bits(seed: int) -> int:
    """The int64 whose bits are the uint64 `seed`: what to hand a kernel's int64 seed argument."""
    _check_seed(seed)
    return seed - 2**64 if seed >= 2**63 else seed


def _check_seed(seed: int) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")


def _mul32(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product a * b, for uint32 `a` and `b` held in int64.

    The full product needs 64 unsigned bits and would overflow int64, so b is split into 16-bit halves:
    each partial product stays below 2**48.
    """
    p_lo = a * (b & 0xFFFF)
    t = a * (b >> 16) + (p_lo >> 16)  # a*b = t * 2**16 + (p_lo & 0xFFFF)
    return t >> 16, ((t & 0xFFFF) << 16) | (p_lo & 0xFFFF)


def _pair(first, second, like: torch.Tensor) -> torch.Tensor:
    """[2, 1, ...] int64 on like's device, broadcasting against `like`: two Python ints (filled, not copied from the
    host, so a CUDA graph can capture it) or two 0-dim tensors."""
    shape = (2,) + (1,) * like.dim()
    if isinstance(first, torch.Tensor):
        return torch.stack((first, second)).view(shape)
    out = torch.empty(shape, dtype=torch.int64, device=like.device)
    out[0].fill_(first)
    out[1].fill_(second)
    return out


def philox_words(c0: torch.Tensor, k0, k1) -> tuple[torch.Tensor, ...]:
    """The 10 Philox4x32 rounds on counter (c0, 0, 0, 0) and key (k0, k1): four uint32 words in int64.

    `c0` holds uint32 values in an int64 tensor; the key words are Python ints or int64 tensors (the
    fast engine keeps the request seed on the device). One implementation for both engines.

    A round's two products are one tensor op: `mul` holds (c2, c0) against the multipliers (B, A), `keep`
    holds (c1, c3), so a round is (c0', c2') = hi ^ (c1, c3) ^ (k0, k1) and (c1', c3') = lo, then (c0', c2')
    turned back into (c2', c0') for the next products: half the tensor ops of the two lanes apart, and a draw's
    time is its count of small ops.
    """
    multipliers = _pair(PHILOX_ROUND_B, PHILOX_ROUND_A, c0)
    bump = _pair(PHILOX_KEY_A, PHILOX_KEY_B, c0)
    key = _pair(k0, k1, c0)
    mul = torch.stack((torch.zeros_like(c0), c0))
    keep = torch.zeros_like(mul)
    for _ in range(PHILOX_ROUNDS):
        hi, lo = _mul32(multipliers, mul)
        mul = (hi ^ keep ^ key).flip(0)
        keep = lo
        key = (key + bump) & _MASK32
    return mul[1], keep[0], mul[0], keep[1]


def word_to_uniform(word: torch.Tensor) -> torch.Tensor:
    """tl.rand's map from the first Philox word (uint32 in int64) to a float32 in [0, 1)."""
    x = torch.where(word >= 2**31, word - 2**32, word)  # bitcast uint32 -> int32
    # Fold the sign away: -x-1 maps [-2**31, -1] onto [0, 2**31 - 1], so every value has a twin.
    x = torch.where(x < 0, -x - 1, x)
    # int32 -> float32 rounds to nearest even, then a float32 multiply: both as in the kernel. The
    # scale is a Python float (exactly RAND_SCALE): a tensor constant would need a host-to-device
    # copy, which a CUDA graph cannot capture.
    return x.to(torch.float32) * _SCALE


def philox4x32(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """Philox4x32-10 of counter (offset, 0, 0, 0) under key (seed_lo, seed_hi): int64 [..., 4] uint32 words.

    Word 0 is `tl.randint(seed, offset)` read as unsigned. `offsets` holds int32 values (any integer
    dtype); they are reinterpreted as uint32, as Triton's `offset.to(tl.uint32)` does.
    """
    _check_seed(seed)
    if offsets.dtype.is_floating_point or offsets.dtype.is_complex or offsets.dtype == torch.bool:
        raise ValueError(f"offsets must be an integer tensor, got {offsets.dtype}")
    c0 = offsets.to(device="cpu", dtype=torch.int64)
    if c0.numel() and (int(c0.min()) < _INT32_MIN or int(c0.max()) > _INT32_MAX):
        raise ValueError("offsets must be int32 values (an int64 offset is a different Triton stream)")
    return torch.stack(philox_words(c0 & _MASK32, seed & _MASK32, seed >> 32), dim=-1)


def rand(seed: int, offsets: torch.Tensor) -> torch.Tensor:
    """float32 uniforms in [0, 1), bit-identical to `tl.rand(seed, offsets)` for int32 offsets."""
    return word_to_uniform(philox4x32(seed, offsets)[..., 0])


@dataclass(frozen=True)
class RequestRNG:
    """The uniforms of one request: a pure function of (seed, position, purpose, depth)."""

    seed: int

    def __post_init__(self) -> None:
        _check_seed(self.seed)

    def uniform(self, position: int, purpose: int, depth: int = 0) -> float:
        """The float32 uniform for this decision, as a Python float (exactly representable)."""
        off = torch.tensor([offset(position, purpose, depth)], dtype=torch.int32)
        return float(rand(self.seed, off)[0])
