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

With `LinearSettings.preload` a program whose split is whole K tiles loads them and their scales into registers
before waiting for the previous kernel (PDL, kernels/launch.py), then runs the same dots in the same order: the
weight's HBM latency overlaps the previous kernel (docs/PERF.md, "Constant weights loaded into registers before the
PDL wait").

kernels/fp8_linear_direct.py holds another kernel for the preloading form (Gluon, the weights straight into the
MMA's registers from a copy in the fragments' order), the same bits; it shares this module's checks, split plan and
split sum, and the dispatcher takes it where `LinearSettings.direct` is on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS, is_pow2, sm_count as _sm_count
from .launch import launch_options, wait_for_inputs

# Under TRITON_INTERPRET=1 (read when triton is imported) tl.dot on bf16 is wrong (GPU_FACTS.md): upcast.
INTERPRETED = bool(triton.knobs.runtime.interpret)
BLOCK_M = 16  # tl.dot's smallest M; decode blocks have 1..8 rows
# Tiles a program may hold for `preload`: 8 x [32 x 128] E4M3 is 32 KB, 64 registers a thread at 4 warps.
MAX_PRELOAD = 8


@dataclass(frozen=True)
class LinearSettings:
    """Launch choices of `fp8_linear`. split_k, and block_n through `choose_split_k`, set how K is split, so the order
    of the fp32 sum (the last bits may move); num_warps, num_stages and preload schedule the same sums (the tests hold
    preload to the loop's bits). The figures behind the defaults are in docs/PERF.md ("How the kernels launch and
    load", "The FP8 linear's other forms"). The engine launches each op (the plain linears, the o-projection, the q/k/v
    fold) with its own settings: fast/kernel_settings.py, where they differ from these."""

    # Output columns a program: narrower tiles give more programs, so fewer K splits, at a TP8 rank's decode shapes
    # (docs/PERF.md, "Launch configurations"; "Retired with the guessed architecture").
    block_n: int = 32
    num_warps: int = 4  # other warps, tiles or splits were all slower (docs/PERF.md, "The FP8 linear's other forms")
    # Pipeline depth of the K loop (the form that does not preload): chosen by `bench tune`, as block_n (docs/PERF.md,
    # "Launch configurations"; "Retired with the guessed architecture").
    num_stages: int = 4
    # Each program's weight tiles and scales loaded before the PDL wait where `preload_tiles` allows, so their HBM
    # reads overlap the previous kernel (docs/PERF.md, "Constant weights loaded into registers before the PDL wait").
    preload: bool = True
    # K splits; None: `choose_split_k`, from N, about two programs an SM in all.
    split_k: int | None = None
    # Calls the direct kernel takes (kernels/fp8_linear_direct.py `applies`: a preloading call on the GPU) run there,
    # from a copy of the weight in the MMA fragments' order that the dispatcher makes once, before any capture; the
    # same bits as this module's kernel, so a launch choice (docs/PERF.md, "The o-projection through the direct kernel
    # again"). Only for the plain linears and the o-projection: the fused kernels have no direct form (the router
    # fold's o-projection runs its own kernel; the fused q/k/v kernel refuses the setting)
    direct: bool = False

    def __post_init__(self):
        problems = [m for ok, m in (
            (is_pow2(self.block_n, 16), f"block_n {self.block_n!r} must be a power of two >= 16"),
            (self.num_warps in (1, 2, 4, 8, 16) and not isinstance(self.num_warps, bool),
             f"num_warps {self.num_warps!r} must be a power of two <= 16"),
            (isinstance(self.num_stages, int) and not isinstance(self.num_stages, bool) and self.num_stages >= 1,
             f"num_stages {self.num_stages!r} must be an int >= 1"),
            (isinstance(self.preload, bool), f"preload {self.preload!r} must be a bool"),
            (isinstance(self.direct, bool), f"direct {self.direct!r} must be a bool"),
            (self.split_k is None or (isinstance(self.split_k, int) and not isinstance(self.split_k, bool)
                                      and self.split_k >= 1), f"split_k {self.split_k!r} must be None or an int >= 1"),
        ) if not ok]
        if problems:
            raise ValueError(f"LinearSettings: {'; '.join(problems)}")


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
def program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's place in the grid (`tile_grid`: N tiles, K splits, M tiles): (pid_n, pid_k, pid_m, its rows m,
    its columns n, their masks)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_n, pid_k, pid_m, m, n, m < M, n < N


@triton.jit
def split_product(x_ptr, w_ptr, s_ptr, m, n, m_ok, n_ok, pid_k, K, stride_xm, scale_cols, k_per_split,
                  B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, PDL: tl.constexpr,
                  PRELOAD: tl.constexpr):
    """The fp32 product [BLOCK_M, BLOCK_N] of rows m and columns n over split pid_k's K range; the program's wait for
    the previous kernel (PDL) is inside, after the preloaded weight's loads."""
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
    return acc


@triton.jit
def arrive_last(lock, splits):
    """This split's arrival on its tile's counter, after every thread's stores of its partial: whether it is the
    last of the `splits` to arrive (which then sums, and re-arms the counter with `tl.atomic_xchg(lock, 0)`)."""
    tl.debug_barrier()  # every thread's partial stored before the release below
    return tl.atomic_add(lock, 1, sem="acq_rel") == splits - 1


@triton.jit
def summed_partials(part_ptr, m, n, mask, M, N, splits, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               UNROLL: tl.constexpr = 8):
    """The partials part[s, m, n] ([splits, M, N] fp32) summed in split order, read UNROLL splits at a time, their
    loads issued together: one L2 round trip a group, where a loop of one split an iteration paid one a split on the
    tile's serial tail (8 at a TP8 rank's q/k/v)."""
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for s0 in range(0, splits, UNROLL):
        for j in tl.static_range(UNROLL):
            # a split past the last reads -0.0, the exact identity of an fp32 add (+0.0 would turn a -0.0 sum
            # into +0.0): the sum's bits are the one-at-a-time loop's
            total += tl.load(part_ptr + ((s0 + j) * M + m[:, None]) * N + n[None, :],
                             mask=mask & (s0 + j < splits), other=-0.0, cache_modifier=".cg")
    return total


@triton.jit
def serial_sum(acc, part_ptr, lock_ptr, m, n, mask, pid_k, lock_index, M, N, splits,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store this split's partial; the tile's last split to arrive gets (True, the partials summed in split order,
    so the result does not depend on which one arrives last) and re-arms the counter; the others (False, zeros)."""
    tl.store(part_ptr + (pid_k * M + m[:, None]) * N + n[None, :], acc, mask=mask)
    lock = lock_ptr + lock_index
    last = arrive_last(lock, splits)
    total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if last:
        total = summed_partials(part_ptr, m, n, mask, M, N, splits, BLOCK_M, BLOCK_N)
        tl.atomic_xchg(lock, 0)
    return last, total


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_ym, scale_cols, k_per_split, splits,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, SERIAL: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr = False, PRELOAD: tl.constexpr = 0,
):
    pid_n, pid_k, pid_m, m, n, m_ok, n_ok = program_tile(M, N, BLOCK_M, BLOCK_N)
    acc = split_product(x_ptr, w_ptr, s_ptr, m, n, m_ok, n_ok, pid_k, K, stride_xm, scale_cols, k_per_split, B0, B1,
                        BLOCK_M, BLOCK_N, BLOCK_K, F32, PREC, PDL, PRELOAD)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        if SERIAL:  # no second launch for the sum
            last, total = serial_sum(acc, part_ptr, lock_ptr, m, n, mask, pid_k, pid_m * tl.num_programs(0) + pid_n,
                                     M, N, splits, BLOCK_M, BLOCK_N)
            if last:
                tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], total.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptr + (pid_k * M + m[:, None]) * N + n[None, :], acc, mask=mask)
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


def lock_count(m: int, n: int, settings: LinearSettings = LinearSettings()) -> int:
    """Counters `fp8_linear(locks=...)` needs for an [m, n] output: one per output tile."""
    return triton.cdiv(n, settings.block_n) * triton.cdiv(m, BLOCK_M)


def split_plan(n: int, k: int, block: tuple[int, int], settings: LinearSettings,
                device: torch.device) -> tuple[int, int, int]:
    """(block_k, splits launched, K columns per split) for `settings.split_k` (None: `choose_split_k`)."""
    block_k = _block_k(block[1])
    split_k = settings.split_k
    if split_k is None:
        split_k = choose_split_k(n, k, settings.block_n, block_k, device)
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), split_k) * block_k
    return block_k, triton.cdiv(k, k_per_split), k_per_split  # no empty split


def tile_grid(m: int, n: int, splits: int, block_n: int) -> tuple[int, int, int]:
    """The launch grid (N tiles, K splits, M tiles)."""
    return triton.cdiv(n, block_n), splits, triton.cdiv(m, BLOCK_M)


def preload_plan(m: int, n: int, k: int, block: tuple[int, int], settings: LinearSettings = LinearSettings(),
                 device: torch.device = torch.device("cpu")) -> int:
    """K tiles each program of an [m, n, k] call with `settings` loads before its wait (0: the loop runs instead)."""
    block_k, _, k_per_split = split_plan(n, k, block, settings, device)
    return preload_tiles(k, k_per_split, block_k) if settings.preload else 0


def preload_tiles(k: int, k_per_split: int, block_k: int) -> int:
    """K tiles a preloading program holds, 0 where it cannot: every split must be whole (K a multiple of the
    split), and at most MAX_PRELOAD tiles are held (their registers)."""
    tiles = k_per_split // block_k
    return tiles if k % k_per_split == 0 and tiles <= MAX_PRELOAD else 0


def choose_split_k(n: int, k: int, block_n: int, block_k: int, device: torch.device) -> int:
    """Splits along K so that N tiles x splits ~ two programs per SM (1 when N alone fills the GPU)."""
    sms = _sm_count(device)
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    return max(1, min(k_tiles, (2 * sms) // n_tiles))


class Call(NamedTuple):
    """One call's checked operands and plan (`plan_call`), shared with kernels/fp8_linear_direct.py."""

    M: int
    N: int
    K: int
    block_k: int
    splits: int
    k_per_split: int
    scale_cols: int
    out: torch.Tensor   # [M, N] out_dtype
    part: torch.Tensor  # [splits, M, N] fp32 split partials; `out` itself when K is not split


def plan_call(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
              out_dtype: torch.dtype | None, out: torch.Tensor | None, settings: LinearSettings) -> Call:
    """The operands checked (ValueError naming what is wrong), the split chosen, out and the partials allocated."""
    _check(isinstance(settings, LinearSettings), f"settings must be a LinearSettings, got {type(settings).__name__}")
    _check(x.dim() == 2 and w.dim() == 2, f"x {tuple(x.shape)} and w {tuple(w.shape)} must be 2-D")
    M, K = x.shape
    N, Kw = w.shape
    _check(Kw == K, f"x has K={K}, w has K={Kw}")
    _check(M >= 1 and N >= 1 and K >= 1, "empty operand")
    _check(x.dtype in _FLOATS, f"x dtype {x.dtype} must be bf16, fp16 or fp32")
    _check(w.dtype == torch.float8_e4m3fn, f"w dtype {w.dtype} must be float8_e4m3fn")
    expect = (triton.cdiv(N, block[0]), triton.cdiv(K, block[1]))
    _check(scale.dtype == torch.float32 and tuple(scale.shape) == expect,
           f"scale must be fp32 {expect} for w {(N, K)} with blocks {block}, got {scale.dtype} {tuple(scale.shape)}")
    _check(x.device == w.device == scale.device, f"devices differ: x {x.device}, w {w.device}, scale {scale.device}")
    _check(x.stride(1) == 1, "x must have unit stride along K")
    _check(w.is_contiguous() and scale.is_contiguous(), "w and scale must be contiguous")
    out_dtype = out_dtype or x.dtype
    _check(out_dtype in _FLOATS, f"out_dtype {out_dtype} must be bf16, fp16 or fp32")
    block_k, splits, k_per_split = split_plan(N, K, block, settings, x.device)
    if out is None:
        out = torch.empty((M, N), dtype=out_dtype, device=x.device)
    _check(tuple(out.shape) == (M, N) and out.dtype == out_dtype and out.device == x.device and out.stride(1) == 1,
           f"out must be [{M}, {N}] {out_dtype} with unit stride along N")
    part = torch.empty((splits, M, N), dtype=torch.float32, device=x.device) if splits > 1 else out
    return Call(M, N, K, block_k, splits, k_per_split, expect[1], out, part)


def check_locks(locks: torch.Tensor | None, tiles: int, device: torch.device) -> None:
    """`locks` (when given) holds at least `tiles` int32 counters on `device`, contiguous."""
    if locks is not None:
        _check(locks.dtype == torch.int32 and locks.is_contiguous() and locks.device == device
               and locks.numel() >= tiles, f"locks must be contiguous int32 on {device} with at least {tiles} counters")


def sum_splits(c: Call, serial: bool, pdl: bool) -> torch.Tensor:
    """c.out, after the second pass that sums the split partials in split order where the launch did not."""
    if c.splits > 1 and not serial:
        BLOCK = 1024
        _split_k_sum_kernel[(triton.cdiv(c.M * c.N, BLOCK),)](c.part, c.out, c.M, c.N, c.out.stride(0), c.splits,
                                                              BLOCK=BLOCK, **launch_options(pdl, c.out.device))
    return c.out


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128), *,
               out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
               locks: torch.Tensor | None = None, pdl: bool = False,
               settings: LinearSettings = LinearSettings()) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, unit stride along K) @ W^T, W E4M3 [N, K] with fp32 scale
    [ceil(N/B0), ceil(K/B1)] -> [M, N] in out_dtype (default x's dtype), into `out` when given. fp32 accumulation.

    `locks`: zeroed int32 counters (>= one per output tile, see `lock_count`); with them a split K is summed by
    the tile's last split inside the one launch (same order, same bits), and they are left zeroed for the next
    call. Calls sharing counters must not overlap in time (one stream). Without them a second kernel sums.
    `pdl`: programmatic dependent launch (kernels/launch.py). `settings`: the launch (`LinearSettings`)."""
    c = plan_call(x, w, scale, block, out_dtype, out, settings)
    grid = tile_grid(c.M, c.N, c.splits, settings.block_n)
    check_locks(locks, grid[0] * grid[2], x.device)
    serial = c.splits > 1 and locks is not None
    f32 = INTERPRETED or x.dtype == torch.float32
    tiles = preload_tiles(c.K, c.k_per_split, c.block_k) if settings.preload else 0
    _fp8_linear_kernel[grid](
        x, w, scale, c.out, c.part, locks if serial else c.part, c.M, c.N, c.K, x.stride(0), c.out.stride(0),
        c.scale_cols, c.k_per_split, c.splits, B0=block[0], B1=block[1], BLOCK_M=BLOCK_M, BLOCK_N=settings.block_n,
        BLOCK_K=c.block_k, SPLIT=c.splits > 1, SERIAL=serial, F32=f32, PREC="ieee" if f32 else "tf32",
        num_warps=settings.num_warps, num_stages=settings.num_stages, PRELOAD=tiles, **launch_options(pdl, x.device))
    return sum_splits(c, serial, pdl)


# ---- reference -------------------------------------------------------------------------------------
def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ dequantize(W).T in fp32, cast to out_dtype (default x's dtype)."""
    from ..reference.fp8 import dequantize

    y = x.float() @ dequantize(w, scale, tuple(block), torch.float32).T
    return y.to(out_dtype or x.dtype)
