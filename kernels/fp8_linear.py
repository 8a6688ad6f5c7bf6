"""y = x @ W^T for a few rows (M = 1..8) against an E4M3 weight with fp32 block scales (docs/model.md).

W[n, k] = W_e4m3[n, k] * scale[n // B0, k // B1]. At decode sizes the product is a weight stream:
each program reads a [BLOCK_N, BLOCK_K] E4M3 tile once for all rows. A K tile never crosses a
scale block (BLOCK_K divides B1), so the tile is converted exactly (every E4M3 value is a bf16 and
an fp16 value) and multiplied in x's dtype with fp32 accumulation; the block scale multiplies the
tile's [M, BLOCK_N] partial product instead of every weight element.

When N gives too few tiles to fill the GPU (k/v projections, one KV head per rank), K is split
over a second grid axis: each split writes fp32 partials, which are summed in a fixed split order
and cast (deterministic, unlike atomic accumulation). The split count comes from N: about two
programs per SM in all. The sum is a second pass, or, given a buffer of zeroed counters, is done by
each output tile's last split to arrive (an atomic arrival count per tile): one launch, same bits.

With `preload` (launched with PDL, kernels/launch.py) a program whose split is whole K tiles loads them and their
scales into registers before waiting for the previous kernel, then runs the same dots in the same order: the weight's
HBM latency overlaps the previous kernel (q/k/v 6.90 -> 6.34 us, o_proj 4.77 -> 4.18 us a call on an H200,
bench/results/tune-h200-pdl-a42bba2.*).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS, is_pow2, sm_count as _sm_count
from .launch import launch_options, wait_for_inputs

# Under TRITON_INTERPRET=1 (read when triton is imported) tl.dot on bf16 is wrong (GPU_FACTS.md): upcast.
INTERPRETED = bool(triton.knobs.runtime.interpret)
BLOCK_M = 16  # tl.dot's smallest M; decode blocks have 1..8 rows
# Output tile width and pipeline depth: narrower tiles give more programs, so fewer K splits, at a TP8 rank's decode
# shapes (measured, and to re-measure at the published shapes: docs/PERF.md, "Decisions kept").
BLOCK_N, NUM_STAGES = 32, 4
# Tiles a program may hold for `preload`: 8 x [32 x 128] E4M3 is 32 KB, 64 registers a thread at 4 warps.
MAX_PRELOAD = 8


@triton.jit
def _after_wait(w, PDL: tl.constexpr):
    """w unchanged (a register move), as a value the compiler cannot see through. Used after the PDL wait on the
    preloaded weight tiles: Triton otherwise converts each tile to the dot's operand layout right after its load,
    through shared memory with a barrier, which makes the program wait for each tile's bytes before issuing the next
    tile's load (six HBM round trips in a row instead of one; `iquest bench sass` shows the barriers)."""
    if not PDL:  # no wait to order against (and no inline PTX under the interpreter)
        return w
    bits = w.to(tl.uint8, bitcast=True)
    bits = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [bits], dtype=tl.uint8, is_pure=False, pack=4)
    return bits.to(w.dtype, bitcast=True)


@triton.jit
def _tile_dot(acc, x, w, s, F32: tl.constexpr, PREC: tl.constexpr):
    """acc + (x @ w^T) * s for one K tile: w E4M3 [BLOCK_N, BLOCK_K], s its block scale per output column."""
    if F32:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    else:
        w = w.to(x.dtype)  # exact
    return acc + tl.dot(x, tl.trans(w), input_precision=PREC) * s[None, :]


@triton.jit
def _inv_rms(sumsq_ptr, m, m_ok, stride, tiles, K, eps, NORM: tl.constexpr):
    """The rows' 1 / rms from their `tiles` partial sums of squares: summed in one fixed order, the same in every
    program, so every K range is scaled alike."""
    t = tl.arange(0, NORM)
    part = tl.load(sumsq_ptr + m[:, None] * stride + t[None, :], mask=m_ok[:, None] & (t < tiles)[None, :], other=0.0)
    return 1.0 / tl.sqrt(tl.sum(part, axis=1) / K + eps)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_ym, scale_cols, k_per_split, splits,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SERIAL: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr = False, PRELOAD: tl.constexpr = 0,
    sumsq_ptr=None, stride_sumsq=0, norm_tiles=0, eps=0.0,
    NORM: tl.constexpr = 0,  # > 0: the rows scaled by their 1 / rms (`rms`); the sums' count padded to a power of two
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    s_row = s_ptr + (n // B0) * scale_cols

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if PRELOAD > 0:
        # The split's PRELOAD whole K tiles (every split is full) of the constant weight and its scales are loaded
        # into registers before the wait, so their HBM reads overlap the previous kernel; then the same dots in the
        # same order as the loop below.
        ws = ()
        ss = ()
        for t in tl.static_range(PRELOAD):
            kk = k_start + t * BLOCK_K + tl.arange(0, BLOCK_K)
            ws = ws + (tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=n_ok[:, None], other=0.0),)
            ss = ss + (tl.load(s_row + (k_start + t * BLOCK_K) // B1, mask=n_ok, other=0.0),)
        wait_for_inputs(PDL)
        xs = ()
        for t in tl.static_range(PRELOAD):  # every x tile's load issued before the first dot
            kk = k_start + t * BLOCK_K + tl.arange(0, BLOCK_K)
            xs = xs + (tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None], other=0.0),)
        for t in tl.static_range(PRELOAD):
            acc = _tile_dot(acc, xs[t], _after_wait(ws[t], PDL), ss[t], F32, PREC)
    else:
        wait_for_inputs(PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            x = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + n[:, None] * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            s = tl.load(s_row + k0 // B1, mask=n_ok, other=0.0)  # the tile lies in one K block
            acc = _tile_dot(acc, x, w, s, F32, PREC)

    if NORM > 0:  # each split's partial scaled alike: the sum is the row's product scaled
        acc = acc * _inv_rms(sumsq_ptr, m, m_ok, stride_sumsq, norm_tiles, K, eps, NORM)[:, None]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + (pid_k * M + m[:, None]) * N + n[None, :], acc, mask=mask)
        if SERIAL:
            # The tile's last split to finish sums all partials (in split order, so the result does not depend
            # on which one arrives last) and re-arms the counter: no second launch for the sum.
            tl.debug_barrier()  # every thread's partial stored before the release below
            lock = lock_ptr + pid_m * tl.num_programs(0) + pid_n
            if tl.atomic_add(lock, 1, sem="acq_rel") == splits - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for sk in range(0, splits):
                    total += tl.load(part_ptr + (sk * M + m[:, None]) * N + n[None, :], mask=mask, other=0.0,
                                     cache_modifier=".cg")
                tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], total.to(y_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock, 0)
    else:
        tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _split_k_sum_kernel(part_ptr, y_ptr, M, N, stride_ym, splits, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * M * N + i, mask=ok, other=0.0)
    tl.store(y_ptr + (i // N) * stride_ym + i % N, acc.to(y_ptr.dtype.element_ty), mask=ok)


# ---- host wrapper ----------------------------------------------------------------------------------


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"fp8_linear: {message}")


def _block_k(b1: int) -> int:
    """Largest power of two <= 128 dividing B1 (a K tile must not cross a scale block)."""
    bk = 128
    while bk >= 16 and b1 % bk:
        bk //= 2
    _check(bk >= 16, f"weight block {b1} along K has no power-of-two divisor >= 16")
    return bk


def lock_count(m: int, n: int, block_n: int = BLOCK_N, direct: bool = False) -> int:
    """Counters `fp8_linear(locks=...)` needs for an [m, n] output: one per output tile (the direct kernel's tiles
    with `direct`)."""
    if direct:
        from .fp8_linear_direct import grid

        g = grid(m, n, 1)
        return g[0] * g[2]
    return triton.cdiv(n, block_n) * triton.cdiv(m, BLOCK_M)


def _split_plan(n: int, k: int, block: tuple[int, int], split_k: int | None, block_n: int,
                device: torch.device) -> tuple[int, int, int]:
    """(block_k, splits launched, K columns per split) for a call's `split_k` (None: `choose_split_k`)."""
    block_k = _block_k(block[1])
    if split_k is None:
        split_k = choose_split_k(n, k, block_n, block_k, device)
    _check(split_k >= 1, f"split_k must be >= 1, got {split_k}")
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    return block_k, triton.cdiv(k, k_per_split), k_per_split  # no empty split


def _grid(m: int, n: int, splits: int, block_n: int) -> tuple[int, int, int]:
    """The launch grid (N tiles, K splits, M tiles)."""
    return triton.cdiv(n, block_n), splits, triton.cdiv(m, BLOCK_M)


def preload_plan(m: int, n: int, k: int, block: tuple[int, int], split_k: int | None = None, block_n: int = BLOCK_N,
                 device: torch.device = torch.device("cpu")) -> int:
    """K tiles each program of an [m, n, k] call preloads with `preload=True` (0: the loop runs instead)."""
    block_k, _, k_per_split = _split_plan(n, k, block, split_k, block_n, device)
    return preload_tiles(k, k_per_split, block_k)


def preload_tiles(k: int, k_per_split: int, block_k: int) -> int:
    """K tiles a program preloads (`fp8_linear(preload=True)`), 0 where it cannot: every split must be whole
    (K a multiple of the split), and at most MAX_PRELOAD tiles are held (their registers)."""
    tiles = k_per_split // block_k
    return tiles if k % k_per_split == 0 and tiles <= MAX_PRELOAD else 0


def choose_split_k(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Splits along K so that N tiles x splits ~ two programs per SM (1 when N alone fills the GPU)."""
    sms = _sm_count(device)
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    return max(1, min(k_tiles, (2 * sms) // n_tiles))


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
               out_dtype: torch.dtype | None = None, *, split_k: int | None = None, block_n: int = BLOCK_N,
               out: torch.Tensor | None = None, locks: torch.Tensor | None = None, num_warps: int = 4,
               num_stages: int = NUM_STAGES, pdl: bool = False, preload: bool = False, unsummed: bool = False,
               rms: tuple[torch.Tensor, float] | None = None, direct: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, unit stride along K) @ W^T, W E4M3 [N, K] with fp32 scale
    [ceil(N/B0), ceil(K/B1)] -> [M, N] in out_dtype (default x's dtype). fp32 accumulation.

    `locks`: zeroed int32 counters (>= one per output tile, see `lock_count`); with them a split K is summed by
    the tile's last split inside the one launch (same order, same bits), and they are left zeroed for the next
    call. Calls sharing counters must not overlap in time (one stream). Without them a second kernel sums.
    `pdl`: programmatic dependent launch (kernels/launch.py); `preload`: with it, each program loads its weight tiles
    and scales into registers before waiting for the previous kernel, where `preload_tiles` allows it (else the loop
    as without it). Neither changes a value.
    `unsummed`: return the K splits' fp32 partial products [splits, M, N] instead (no `out`; `locks` unused; one
    split when K is not split): a consumer that sums them in split order from zero, 0 + p_0 + p_1 + ..., and rounds
    the sum to out_dtype has this function's bits.
    `rms` = (sumsq [M, T] fp32, eps): row m of the product (of each split's partial, unsummed) is scaled by
    1 / sqrt(sum_t sumsq[m, t] / K + eps), the sums taken in one fixed order by every program: a norm folded into
    the product (a numerical change). The engine uses neither form today (the retired architecture's fused input
    norm and rotary stage used them; docs/PERF.md); the direct kernel's tests hold both to this kernel's bits.
    `direct`: W's copy in the MMA fragments' order (kernels/fp8_linear_direct.direct_weight); with it, a preloading
    call runs that module's Gluon kernel (16 output columns and 8 rows a program, its K tiles over 2 warps) instead:
    GPU only, bf16 or fp16 x, 128-wide K tiles (`direct_applies`). The same tiles, scales, order and splits as the
    Triton kernel's preloading path."""
    _check(x.dim() == 2 and w.dim() == 2, f"x {tuple(x.shape)} and w {tuple(w.shape)} must be 2-D")
    M, K = x.shape
    N, Kw = w.shape
    B0, B1 = block
    _check(Kw == K, f"x has K={K}, w has K={Kw}")
    _check(M >= 1 and N >= 1 and K >= 1, "empty operand")
    _check(x.dtype in _FLOATS, f"x dtype {x.dtype} must be bf16, fp16 or fp32")
    _check(w.dtype == torch.float8_e4m3fn, f"w dtype {w.dtype} must be float8_e4m3fn")
    expect = (triton.cdiv(N, B0), triton.cdiv(K, B1))
    _check(scale.dtype == torch.float32 and tuple(scale.shape) == expect,
           f"scale must be fp32 {expect} for w {(N, K)} with blocks {block}, got {scale.dtype} {tuple(scale.shape)}")
    _check(x.device == w.device == scale.device, f"devices differ: x {x.device}, w {w.device}, scale {scale.device}")
    _check(x.stride(1) == 1, "x must have unit stride along K")
    _check(w.is_contiguous() and scale.is_contiguous(), "w and scale must be contiguous")
    _check(is_pow2(block_n, 16), f"block_n {block_n} must be a power of two >= 16")
    out_dtype = out_dtype or x.dtype
    _check(out_dtype in _FLOATS, f"out_dtype {out_dtype} must be bf16, fp16 or fp32")
    _check(not (unsummed and out is not None), "unsummed returns the partials: give no out")
    block_k, split_k, k_per_split = _split_plan(N, K, block, split_k, block_n, x.device)
    split = split_k > 1 or unsummed
    part = torch.empty((split_k, M, N), dtype=torch.float32, device=x.device) if split else None
    if unsummed:
        out = part[0]  # the kernel's y argument, never stored to under SPLIT
    else:
        if out is None:
            out = torch.empty((M, N), dtype=out_dtype, device=x.device)
        _check(tuple(out.shape) == (M, N) and out.dtype == out_dtype and out.device == x.device
               and out.stride(1) == 1, f"out must be [{M}, {N}] {out_dtype} with unit stride along N")
        part = part if split else out
    norm_args = _rms_args(rms, M, x.device)
    f32 = INTERPRETED or x.dtype == torch.float32
    tiles = preload_tiles(K, k_per_split, block_k) if preload else 0
    if direct is not None:
        _check(direct_applies(x, block_k, tiles),
               "direct needs a preloading call (whole splits of <= 8 tiles) on the GPU with bf16 or fp16 x and "
               "128-wide K tiles")
        _check(direct.shape == w.shape and direct.dtype == w.dtype and direct.is_contiguous()
               and direct.device == w.device, f"direct must be W's [{N}, {K}] E4M3 copy (direct_weight), contiguous")
        from . import fp8_linear_direct as fd

        grid = fd.grid(M, N, split_k)
    else:
        grid = _grid(M, N, split_k, block_n)
    if locks is not None:
        _check(locks.dtype == torch.int32 and locks.is_contiguous() and locks.device == x.device
               and locks.numel() >= grid[0] * grid[2], f"locks must be contiguous int32 on {x.device} with at least "
               f"{grid[0] * grid[2]} counters")
    serial = split_k > 1 and locks is not None and not unsummed
    if direct is not None:
        fd.launch(grid, x, direct, scale, out, part, locks if serial else part, M, N, K, x.stride(0), out.stride(0),
                  expect[1], k_per_split, split_k, block, split, serial, tiles, norm_args,
                  launch_options(pdl, x.device))
    else:
        _fp8_linear_kernel[grid](
            x, w, scale, out, part, locks if serial else part, M, N, K, x.stride(0), out.stride(0), expect[1],
            k_per_split, split_k, B0=B0, B1=B1, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
            SERIAL=serial, F32=f32, PREC="ieee" if f32 else "tf32", num_warps=num_warps, num_stages=num_stages,
            PRELOAD=tiles, **norm_args, **launch_options(pdl, x.device))
    if unsummed:
        return part
    if split_k > 1 and not serial:
        BLOCK = 1024
        _split_k_sum_kernel[(triton.cdiv(M * N, BLOCK),)](part, out, M, N, out.stride(0), split_k, BLOCK=BLOCK,
                                                          **launch_options(pdl, x.device))
    return out


def direct_applies(x: torch.Tensor, block_k: int, tiles: int) -> bool:
    """Whether `fp8_linear(direct=...)` takes a call: a preloading one (`tiles` > 0) on the GPU (compiled, not
    interpreted) with bf16 or fp16 x and 128-wide K tiles."""
    return (not INTERPRETED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and block_k == 128
            and tiles > 0)


def _rms_args(rms, M: int, device: torch.device) -> dict:
    """The kernel's arguments for `fp8_linear(rms=...)` (none without it), checked."""
    if rms is None:
        return {}
    sumsq, eps = rms
    _check(sumsq.dim() == 2 and sumsq.shape[0] == M and sumsq.shape[1] >= 1 and sumsq.dtype == torch.float32
           and sumsq.stride(1) == 1 and sumsq.device == device,
           f"rms's sumsq must be fp32 [{M}, T] with unit stride on {device}, got {sumsq.dtype} {tuple(sumsq.shape)}")
    _check(isinstance(eps, float) and eps > 0, f"rms's eps must be a positive float, got {eps!r}")
    tiles = sumsq.shape[1]
    return dict(sumsq_ptr=sumsq, stride_sumsq=sumsq.stride(0), norm_tiles=tiles, eps=eps,
                NORM=max(2, triton.next_power_of_2(tiles)))


def fp8_linear_rms_ref(x: torch.Tensor, sumsq: torch.Tensor, eps: float, w: torch.Tensor, scale: torch.Tensor,
                       block: tuple[int, int] = (128, 128), out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`fp8_linear(x, rms=(sumsq, eps))` in torch: the fp32 product's rows scaled by 1 / rms from their partial sums
    of squares (summed in torch's order), cast to out_dtype (default x's)."""
    inv = torch.rsqrt(sumsq.sum(dim=1, keepdim=True) / x.shape[1] + eps)
    return (fp8_linear_ref(x, w, scale, block, torch.float32) * inv).to(out_dtype or x.dtype)


# ---- reference -------------------------------------------------------------------------------------
def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ dequantize(W).T in fp32, cast to out_dtype (default x's dtype)."""
    from ..reference.fp8 import dequantize

    y = x.float() @ dequantize(w, scale, tuple(block), torch.float32).T
    return y.to(out_dtype or x.dtype)
