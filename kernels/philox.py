"""Philox uniforms for a round's decisions in one launch: `fast.philox.uniforms(seed, fast.philox.offsets(...))`.

The torch path evaluates Philox4x32-10 with ~100 small integer kernels per call; this kernel computes the
same float32 uniforms with Triton's own `tl.rand(seed, offset)`, which `reference.rng` reproduces bit for
bit (tests/test_rng.py checks it against Triton on the interpreter and the GPU). Per element:

    slot   = rng.offset(0, purpose, depth)           (an int purpose/depth; checked by the reference)
           | offset(0, PURPOSE_DRAFT, 1) + depth - 1  (a per-element depth tensor, draft samples only)
    offset = int32(position * SLOTS_PER_POSITION + slot)   int64 arithmetic, then truncated to int32
    u      = tl.rand(seed, offset)                   seed loaded from a 0-dim int64 device tensor

Every step wraps exactly as `fast.philox.offsets` does (int64 multiply/add mod 2**64, then the low 32
bits), so out-of-range positions give the same (unused) stream as the torch path. The seed is read in
the kernel, nothing is read back to the host and the grid depends only on shapes: graph-capturable
(the slot is a kernel argument baked into a capture, as the torch path bakes it into its kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.rng import PURPOSE_ACCEPT, PURPOSE_COMMIT, PURPOSE_DRAFT, SLOTS_PER_POSITION, offset
from .launch import launch_options, wait_for_inputs

MAX_BLOCK = 1024
_DRAFT_SLOT_1 = offset(0, PURPOSE_DRAFT, 1)  # slot of the depth-1 draft sample; depth d is this + d - 1


@triton.jit
def _philox_uniforms_kernel(seed_ptr, pos_ptr, depth_ptr, out_ptr, n, slot, stride_pos, stride_depth, stride_out,
                            SLOTS: tl.constexpr, BLOCK: tl.constexpr, DEPTH_TENSOR: tl.constexpr,
                            PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    pos = tl.load(pos_ptr + i * stride_pos, mask=m, other=0).to(tl.int64)
    if DEPTH_TENSOR:  # slot + depth, slot = offset(0, PURPOSE_DRAFT, 1) - 1
        s = slot + tl.load(depth_ptr + i * stride_depth, mask=m, other=1).to(tl.int64)
    else:
        s = slot
    off = (pos * SLOTS + s).to(tl.int32)  # int64 -> int32 keeps the low 32 bits, as torch's .to(torch.int32)
    tl.store(out_ptr + i * stride_out, tl.rand(tl.load(seed_ptr), off), mask=m)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _is_int_tensor(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def _launch(seed: torch.Tensor, positions: torch.Tensor, slot: int, depth: torch.Tensor | None,
            out: torch.Tensor, num_warps: int, pdl: bool = False) -> torch.Tensor:
    """The launch itself, for an already-checked slot (the tests' negative control calls it with a wrong one)."""
    n = positions.shape[0]
    if n == 0:
        return out
    block = max(16, min(triton.next_power_of_2(n), MAX_BLOCK))
    _philox_uniforms_kernel[(triton.cdiv(n, block),)](
        seed, positions, positions if depth is None else depth, out, n, slot, positions.stride(0),
        0 if depth is None or depth.dim() == 0 else depth.stride(0), out.stride(0),
        SLOTS=SLOTS_PER_POSITION, BLOCK=block, DEPTH_TENSOR=depth is not None, num_warps=num_warps,
        **launch_options(pdl, out.device))
    return out


def uniforms(seed: torch.Tensor, positions: torch.Tensor, purpose: int, depth: int | torch.Tensor = 0, *,
             out: torch.Tensor | None = None, num_warps: int = 1, pdl: bool = False) -> torch.Tensor:
    """float32 [N] = `fast.philox.uniforms(seed, fast.philox.offsets(positions, purpose, depth))`, bit for bit.

    seed: 0-dim int64 tensor holding the request seed's 64 bits (`rng.int64_bits(seed)`), on the positions'
    device. positions: int64 [N]; not range-checked (a host sync), wrapping as the torch path does.
    depth: an int (checked by `rng.offset`), or, for PURPOSE_DRAFT only, an integer tensor [N] (or one
    element, broadcast) of per-element depths, not range-checked. out: float32 [N] to write, else allocated.
    """
    if seed.dim() != 0 or seed.dtype != torch.int64:
        raise ValueError(f"seed must be a 0-dim int64 tensor, got {seed.dtype} {tuple(seed.shape)}")
    _check(positions.dtype == torch.int64, f"positions must be an int64 tensor, got {positions.dtype}")
    _check(positions.dim() == 1, f"positions must be 1-dimensional [N], got shape {tuple(positions.shape)}")
    _check(seed.device == positions.device,
           f"seed and positions must share a device, got {seed.device} and {positions.device}")
    n = positions.shape[0]
    depth_t = None
    if isinstance(depth, torch.Tensor):
        _check(purpose == PURPOSE_DRAFT and not isinstance(purpose, bool),
               f"a depth tensor is only meaningful for PURPOSE_DRAFT, got purpose={purpose!r}")
        _check(_is_int_tensor(depth), f"depth must be an integer tensor, got {depth.dtype}")
        _check(depth.device == positions.device,
               f"depth and positions must share a device, got {depth.device} and {positions.device}")
        _check(depth.numel() == 1 and depth.dim() <= 1 or tuple(depth.shape) == (n,),
               f"depth must be [{n}] like positions (or one element), got shape {tuple(depth.shape)}")
        depth_t = depth.reshape(()) if depth.numel() == 1 else depth
        slot = _DRAFT_SLOT_1 - 1  # + depth in the kernel
    else:
        _check(purpose in (PURPOSE_COMMIT, PURPOSE_ACCEPT, PURPOSE_DRAFT), f"unknown purpose {purpose!r}")
        slot = offset(0, purpose, depth)  # the reference validates purpose and depth
    if out is None:
        out = torch.empty(n, dtype=torch.float32, device=positions.device)
    _check(tuple(out.shape) == (n,) and out.dtype == torch.float32,
           f"out must be float32 [{n}], got {out.dtype} {tuple(out.shape)}")
    _check(out.device == positions.device, f"out is on {out.device}, positions on {positions.device}")
    return _launch(seed, positions, slot, depth_t, out, num_warps, pdl)
