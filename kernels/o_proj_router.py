"""The attention's o-projection whose output tiles also write the router's partial logits, in one launch (the "router
fold", issue 52; docs/model.md, "Forward"; the numerics measured in lab/router_fold.py, docs/PERF.md "The router
fold's numerics, before any kernel").

A MoE layer's router reads b = ffn_norm(h), h = r + s * t, t = attn_out_norm(o), o the o-projection's output. With
W' = router * w_ffn (the router's columns scaled by the ffn norm's weight, fp32 [E, H], made by the engine):

    logits = rstd_h * (W' r + s * rstd_o * W' (w_out * o))

so every output tile t of the projection (columns n of tile t) can write two partial vectors a row,

    parts[t, 0, m, e] = sum_{n in t} W'[e, n] * r[m, n]
    parts[t, 1, m, e] = sum_{n in t} W'[e, n] * (w_out[n] * y[m, n])

and a tail (kernels/route_tail.py) sums them over the tiles, makes rstd_o and rstd_h and selects the experts.

Why: the router's own logits pass is a launch of its own in the layer's chain, waiting for the norms before it and
reading the 3 MB router; here its weight read and its products move into the o-projection's epilogue, which has the
tile's values in registers already, and the chain loses that wait.

The projection is kernels/fp8_linear.py's, bit for bit: the same tiles, the same K split (`split_plan` under the same
settings when `locks` are given; without them K is not split), the same split sum (`serial_sum`), y rounded to x's
dtype once as the plain linear stores it. The partials are made by each tile's last split to arrive (the only split
when K is not split), for the tile's 16 rows, from y as stored (rounded to x's dtype, then widened: exact) and r and
w_out widened to fp32 (exact). Each product w_out[n] * y[m, n] is one fp32 rounding; the sums over the tile's columns
are IEEE fp32 (`tl.dot` with input_precision "ieee": no TF32, no tensor cores; on the GPU Triton lowers it to one
fused multiply-add chain per output over the tile's columns in index order, under the interpreter it is numpy's
matmul). The torch form (`o_proj_router_torch`) sums the same fp32 terms in its own order, so the two agree within
fp32's rounding bound of a block_n-term sum (tests/test_kernel_o_proj_router.py states it), not bit for bit.

Requirements (`fits`): any row count (rows in tiles of 16), E >= 1, the partials' offsets in int32. The router's
slab for a tile is read E/block_e chunks at a time ([block_e, block_n] fp32 in registers), after the wait; with PDL
and `PartsSettings.prefetch` the first split of each tile asks L2 for the slab before the wait (the router is a
constant weight: kernels/launch.py's contract), so the last split's reads hit L2.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from . import fp8_linear as fl
from .device import FLOATS as _FLOATS, is_pow2
from .launch import launch_options, prefetch_rows

_INT32 = 2 ** 31 - 1


@dataclass(frozen=True)
class PartsSettings:
    """Launch choices of the epilogue's partial logits. block_e moves no bit of the partials (every output is one
    sum over the tile's columns whatever the chunk); prefetch changes no value (an L2 hint)."""

    # Experts a chunk (at most the experts, rounded up to a power of two): each chunk's slab loads follow the previous
    # chunk's products, so a tile's last split pays one dependent slab read a chunk. In the captured round the fold's
    # o-projection took 49.4, 37.2, 22.7 and 12.9 us a call at 16, 32, 128 and 256 experts a chunk (256 experts: one
    # chunk, 226 registers, no spill: bench sass), and the fold's round 0.7395x at 256 against 32 (docs/PERF.md,
    # "Current state", the router fold's chunk)
    block_e: int = 256
    # With PDL, the tile's router slab asked of L2 before the wait by its first split (one request a 128-byte line),
    # so the last split's E x block_n fp32 reads (32 KB at 256 experts x 32 columns) overlap the previous kernel
    # instead of following the product (an L2 hint changes no value; timings: docs/PERF.md, "Current state", "the
    # router fold in the round").
    prefetch: bool = True

    def __post_init__(self):
        problems = [m for ok, m in (
            (is_pow2(self.block_e, 16), f"block_e {self.block_e!r} must be a power of two >= 16 (tl.dot's N)"),
            (isinstance(self.prefetch, bool), f"prefetch {self.prefetch!r} must be a bool"),
        ) if not ok]
        if problems:
            raise ValueError(f"PartsSettings: {'; '.join(problems)}")


@triton.jit
def _branch(total, wo, DT: tl.constexpr):
    """fp32 w_out * y, y the tile's sum rounded to the output dtype as it is stored (then widened: exact)."""
    return total.to(DT).to(tl.float32) * wo[None, :]


@triton.jit
def _prefetch_slab(rw_ptr, n0, N, E, BLOCK_N: tl.constexpr):
    """L2 requests for router columns [n0, n0 + BLOCK_N) of every expert row (rows clamped, not masked)."""
    PER_LINE: tl.constexpr = 32  # fp32 elements a 128-byte line
    LINES: tl.constexpr = (BLOCK_N + PER_LINE - 1) // PER_LINE
    ROWS: tl.constexpr = 128
    rows = tl.arange(0, ROWS)
    for e0 in range(0, E, ROWS):
        e = tl.minimum(e0 + rows, E - 1)
        prefetch_rows(rw_ptr + e * N, n0, tl.minimum(n0 + BLOCK_N, N), PER_LINE, LINES)


@triton.jit
def _epilogue(total, y_ptr, stride_ym, r_ptr, stride_rm, rw_ptr, wo_ptr, parts_ptr, pid_n, m, n, m_ok, n_ok, M, N, E,
              BLOCK_E: tl.constexpr):
    """The tile's output stored, then its partial logits for every expert, in chunks of BLOCK_E experts."""
    DT: tl.constexpr = y_ptr.dtype.element_ty
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], total.to(DT), mask=mask)
    # columns >= N and rows >= M are zeros in both operands (masked loads), so they add nothing
    wo = tl.load(wo_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    v = _branch(total, wo, DT)
    rr = tl.load(r_ptr + m[:, None] * stride_rm + n[None, :], mask=mask, other=0.0).to(tl.float32)
    ei = tl.arange(0, BLOCK_E)
    row0 = parts_ptr + (pid_n * 2 * M + m[:, None]) * E  # parts[t, 0, m, :]; parts[t, 1] is M * E further
    for e0 in range(0, E, BLOCK_E):
        e = e0 + ei
        e_ok = e < E
        wt = tl.load(rw_ptr + e[None, :] * N + n[:, None], mask=n_ok[:, None] & e_ok[None, :], other=0.0)
        p0 = tl.dot(rr, wt, input_precision="ieee")
        p1 = tl.dot(v, wt, input_precision="ieee")
        out_ok = m_ok[:, None] & e_ok[None, :]
        tl.store(row0 + e[None, :], p0, mask=out_ok)
        tl.store(row0 + M * E + e[None, :], p1, mask=out_ok)


@triton.jit
def _o_proj_router_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, stride_xm, stride_ym, scale_cols, k_per_split, splits,
    r_ptr, stride_rm, rw_ptr, wo_ptr, parts_ptr, E,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, BLOCK_E: tl.constexpr,
    PDL: tl.constexpr = False, PRELOAD: tl.constexpr = 0, PREFETCH: tl.constexpr = False,
):
    pid_n, pid_k, pid_m, m, n, m_ok, n_ok = fl.program_tile(M, N, BLOCK_M, BLOCK_N)
    if PREFETCH:  # before split_product's wait; one split asks (L2 is shared by whichever split ends last)
        if pid_k == 0:
            _prefetch_slab(rw_ptr, pid_n * BLOCK_N, N, E, BLOCK_N)
    acc = fl.split_product(x_ptr, w_ptr, s_ptr, m, n, m_ok, n_ok, pid_k, K, stride_xm, scale_cols, k_per_split, B0,
                           B1, BLOCK_M, BLOCK_N, BLOCK_K, F32, PREC, PDL, PRELOAD)
    if SPLIT:
        last, total = fl.serial_sum(acc, part_ptr, lock_ptr, m, n, m_ok[:, None] & n_ok[None, :], pid_k,
                                    pid_m * tl.num_programs(0) + pid_n, M, N, splits, BLOCK_M, BLOCK_N)
        if last:
            _epilogue(total, y_ptr, stride_ym, r_ptr, stride_rm, rw_ptr, wo_ptr, parts_ptr, pid_n, m, n, m_ok, n_ok,
                      M, N, E, BLOCK_E)
    else:
        _epilogue(acc, y_ptr, stride_ym, r_ptr, stride_rm, rw_ptr, wo_ptr, parts_ptr, pid_n, m, n, m_ok, n_ok, M, N,
                  E, BLOCK_E)


# ---- host wrapper ----------------------------------------------------------------------------------
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"o_proj_router: {message}")


def lock_count(m: int, n: int, settings: fl.LinearSettings = fl.LinearSettings()) -> int:
    """Counters `o_proj_router(locks=...)` needs for m rows of an n-column projection: the plain linear's."""
    return fl.lock_count(m, n, settings)


def parts_tiles(n: int, settings: fl.LinearSettings = fl.LinearSettings()) -> int:
    """T, the partials' leading size: the projection's output column tiles."""
    return triton.cdiv(n, settings.block_n)


def fits(R: int, E: int, N: int, settings: fl.LinearSettings = fl.LinearSettings()) -> bool:
    """Whether `o_proj_router` takes R rows, E experts and N output columns: the partials [T, 2, R, E] and the router
    [E, N] indexed in int32."""
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (R, E, N))
    return ok and parts_tiles(N, settings) * 2 * R * E <= _INT32 and E * N <= _INT32


def _parts_buffer(tiles: int, rows: int, experts: int, device: torch.device) -> torch.Tensor:
    """The partials' output, every element written by the launch (the tests fill it with NaN instead)."""
    return torch.empty((tiles, 2, rows, experts), dtype=torch.float32, device=device)


def o_proj_router(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], r: torch.Tensor,
                  router_w: torch.Tensor, w_out: torch.Tensor, *, locks: torch.Tensor | None = None,
                  pdl: bool = False, settings: fl.LinearSettings = fl.LinearSettings(),
                  parts_settings: PartsSettings = PartsSettings()) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/fp8_linear.py's `fp8_linear(x, w, scale, block, out_dtype=x.dtype, locks=locks, settings=settings)`
    (bit for bit; without `locks`, K is not split) whose output tiles also write the router's partial logits.
    r [R, N] (the layer's residual; float, unit column stride), router_w [E, N] fp32 contiguous (W' = router * w_ffn),
    w_out [N] (attn_out_norm's weight, any float dtype). Returns (y [R, N] x.dtype, parts [T, 2, R, E] fp32),
    T = cdiv(N, settings.block_n): parts[t, 0] = r's and parts[t, 1] = (w_out * y)'s product with router_w over tile
    t's columns (module docstring). `locks`: zeroed counters (`lock_count`), left zeroed. ValueError for what it does
    not take, before anything is launched."""
    _check(isinstance(settings, fl.LinearSettings), f"settings must be a LinearSettings, got {type(settings).__name__}")
    _check(isinstance(parts_settings, PartsSettings),
           f"parts_settings must be a PartsSettings, got {type(parts_settings).__name__}")
    _check(isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.dim() == 2 and w.dim() == 2,
           "x and w must be 2-D tensors")
    # K split as the plain linear splits it under `settings` (the same sums, bit for bit); without locks, one split
    try:
        st = settings if locks is not None else replace(settings, split_k=1)
        c = fl.plan_call(x, w, scale, block, x.dtype, None, st)
    except ValueError as e:
        raise ValueError(f"o_proj_router: {str(e).removeprefix('fp8_linear: ')}") from None
    R, N = c.M, c.N
    dev = x.device
    _check(isinstance(r, torch.Tensor) and r.dim() == 2 and tuple(r.shape) == (R, N),
           f"r must be [{R}, {N}], got {tuple(r.shape) if isinstance(r, torch.Tensor) else type(r).__name__}")
    _check(r.dtype in _FLOATS, f"r dtype {r.dtype} must be bf16, fp16 or fp32")
    _check(r.stride(1) == 1 or N == 1, "r must have unit stride along N")
    _check((R - 1) * r.stride(0) + N <= _INT32 and r.stride(0) >= 0, "r's offsets must fit int32")
    _check(isinstance(router_w, torch.Tensor) and router_w.dim() == 2 and router_w.shape[1] == N
           and router_w.shape[0] >= 1, f"router_w must be [E, {N}] with E >= 1, got "
           f"{tuple(router_w.shape) if isinstance(router_w, torch.Tensor) else type(router_w).__name__}")
    _check(router_w.dtype == torch.float32 and router_w.is_contiguous(),
           f"router_w must be contiguous fp32 (W' = router * w_ffn), got {router_w.dtype}"
           f"{'' if router_w.is_contiguous() else ', not contiguous'}")
    E = router_w.shape[0]
    got = tuple(w_out.shape) if isinstance(w_out, torch.Tensor) else type(w_out).__name__
    _check(isinstance(w_out, torch.Tensor) and w_out.dim() == 1 and w_out.shape[0] == N,
           f"w_out must be [{N}], got {got}")
    _check(w_out.dtype in _FLOATS and w_out.is_contiguous(), f"w_out must be a contiguous bf16, fp16 or fp32 vector, "
           f"got {w_out.dtype}")
    _check(r.device == dev and router_w.device == dev and w_out.device == dev,
           f"devices differ: x {dev}, r {r.device}, router_w {router_w.device}, w_out {w_out.device}")
    _check(fits(R, E, N, st), f"{R} rows x {E} experts x {N} columns: the partials' offsets exceed int32 (`fits`)")
    grid = fl.tile_grid(R, N, c.splits, st.block_n)
    try:
        fl.check_locks(locks, grid[0] * grid[2], dev)
    except ValueError as e:
        raise ValueError(f"o_proj_router: {str(e).removeprefix('fp8_linear: ')}") from None
    try:
        launch = launch_options(pdl, dev)  # refuses PDL off the GPU
    except ValueError as e:
        raise ValueError(f"o_proj_router: {e}") from None
    parts = _parts_buffer(grid[0], R, E, dev)
    f32 = fl.INTERPRETED or x.dtype == torch.float32
    tiles = fl.preload_tiles(c.K, c.k_per_split, c.block_k) if st.preload else 0
    block_e = min(parts_settings.block_e, max(16, triton.next_power_of_2(E)))  # no chunk wider than the experts
    _o_proj_router_kernel[grid](
        x, w, scale, c.out, c.part, locks if c.splits > 1 else c.part, R, N, c.K, x.stride(0), c.out.stride(0),
        c.scale_cols, c.k_per_split, c.splits, r, r.stride(0), router_w, w_out, parts, E,
        B0=block[0], B1=block[1], BLOCK_M=fl.BLOCK_M, BLOCK_N=st.block_n, BLOCK_K=c.block_k, SPLIT=c.splits > 1,
        F32=f32, PREC="ieee" if f32 else "tf32", BLOCK_E=block_e, PRELOAD=tiles,
        PREFETCH=parts_settings.prefetch and pdl, num_warps=st.num_warps, num_stages=st.num_stages, **launch)
    return c.out, parts


# ---- torch form ------------------------------------------------------------------------------------
def router_parts_torch(y: torch.Tensor, r: torch.Tensor, router_w: torch.Tensor, w_out: torch.Tensor,
                       block_n: int = fl.LinearSettings().block_n) -> torch.Tensor:
    """parts [T, 2, R, E] fp32 of the projection's output y [R, N] as stored: per tile of block_n columns, the fp32
    products summed by torch (elementwise products, then `sum`: no TF32, no float64)."""
    R, N = y.shape
    wo, rw = w_out.float(), router_w.float()
    tiles = []
    for n0 in range(0, N, block_n):
        cols = slice(n0, min(n0 + block_n, N))
        w = rw[:, cols]
        a = torch.stack((r[:, cols].float(), y[:, cols].float() * wo[cols]))  # [2, R, cols]
        tiles.append((a[:, :, None, :] * w[None, None]).sum(-1))
    return torch.stack(tiles)


def o_proj_router_torch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int],
                        r: torch.Tensor, router_w: torch.Tensor, w_out: torch.Tensor,
                        settings: fl.LinearSettings = fl.LinearSettings()) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, parts) in torch: y = `fp8_linear_ref(x, w, scale, block)` for an E4M3 w, or x @ w.T in fp32 rounded to x's
    dtype for a dequantized float w (scale unused); parts from that y (`router_parts_torch`, settings.block_n columns a
    tile). y agrees with the kernel's to the projection's rounding; the parts from the same y to fp32's."""
    if w.dtype == torch.float8_e4m3fn:
        y = fl.fp8_linear_ref(x, w, scale, block, x.dtype)
    else:
        y = (x.float() @ w.float().T).to(x.dtype)
    return y, router_parts_torch(y, r, router_w, w_out, settings.block_n)
