"""`fp8_linear_direct`: the FP8 linear's preloading form for decode rows (M <= 8 a row block) with the weights loaded
straight into the tensor cores' registers (Triton's Gluon dialect), never staged through shared memory. The engine's
dispatcher calls it where an op's `LinearSettings.direct` is on, the o-projection's by default (docs/PERF.md, "The
o-projection through the direct kernel again").

Why. In the Triton kernel (kernels/fp8_linear.py) every K tile's weights go from their load layout through shared
memory into the MMA's operand layout behind barriers, one tile after another: in the captured round each of a
program's six tiles cost ~0.5 us in series after the PDL wait (docs/PERF.md). Triton's
frontend does not let a kernel choose its layouts; Gluon does.

The product is taken as (W x^T)^T: the weight is the `mma.sync.m16n8k16` A operand (16 output columns a program)
and x^T the B operand, whose 8 columns are the block's rows, so no MMA row is padding. A thread's A fragment of a
128-wide K tile is 32 bytes of each of two weight rows, at K offsets 16s + 8h + 2q + e (s the K step, q its lane's
quarter); `direct_weight` stores each tile's columns in that order, k' = 32q + 4s + 2h + e, once, when the engine is
built, so a thread loads them with two 16-byte loads a row, before the PDL wait. Loaded as [n, q, 32] and relabelled
by a reshape and a permute, they are the fragments in W's own K order, so the MMAs take W's and x's values at the same
K as the Triton kernel's. Two warps split a program's K tiles (a batched MMA: tile 2j + g at step j on warp g), so
each holds half the weights (no spills); their products meet in 1 KB of shared memory. x's tiles are read with
16-byte loads, all in one L2 round trip, and moved into the B fragments through shared memory.

The same arithmetic as the Triton kernel's preloading path: each tile's product from zero over its eight K steps in
order, then `acc + product * scale` (an FMA) in tile order; the split-K plan, the partials, their sum (in the launch
or a second pass) and the stores as there (`fp8_linear.plan_call`, `sum_splits`). So the same bits, which the GPU
tests show (tests/test_kernel_fp8_linear_direct.py, against the Triton kernel). GPU only (Gluon has no interpreter);
bf16 or fp16 x; 128-wide K tiles, whole preloaded splits: `fp8_linear_direct` checks (`direct_applies`).
"""

from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from . import fp8_linear as fl
from .launch import launch_options, launch_with_carveout

BLOCK_K = gl.constexpr(128)  # the K tile the fragment order is laid out for (a weight scale block at 128 x 128)
ROWS = gl.constexpr(8)  # x rows a program takes: the MMA's N
WARP_N = gl.constexpr(16)  # output columns a warp computes: the MMA's M


def direct_weight(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] E4M3 with each 128-wide K tile's columns in the MMA fragments' order (see the module): column
    k' = 32q + 4s + 2h + e of a tile holds W's column 16s + 8h + 2q + e. A copy, made once; K % 128 == 0."""
    if w.dim() != 2 or w.shape[1] % BLOCK_K.value:
        raise ValueError(f"direct_weight: W must be [N, K] with K a multiple of {BLOCK_K.value}, got {tuple(w.shape)}")
    n, k = w.shape
    # W's tile columns as (s, h, q, e), row-major; the direct order is (q, s, h, e)
    t = w.view(torch.uint8).reshape(n, k // BLOCK_K.value, 8, 2, 4, 2)
    return t.permute(0, 1, 4, 2, 3, 5).reshape(n, k).contiguous().view(w.dtype)


@functools.cache  # built once a group count: constructing one takes ~20 us of host time, on every eager launch
def load_layout(groups: int) -> gl.DistributedLinearLayout:
    """Where each byte of a program's [groups, 16, 4, 32] slab of direct-ordered weight tiles lives: warp g takes
    group g's tile; in it a thread (lane 4l + q) holds the 32 contiguous bytes (q's quarter) of rows l and l + 8."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4], [0, 0, 0, 8], [0, 0, 0, 16], [0, 8, 0, 0]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[1 << i, 0, 0, 0] for i in range(groups.bit_length() - 1)],
        block_bases=[], shape=[groups, WARP_N.value, 4, 32])


def groups_for(tiles: int) -> int:
    """Warps a program splits its K tiles over: 2 where the tiles pair up, else 1."""
    return 2 if tiles % 2 == 0 else 1


@gluon.jit
def _wait_for_inputs(PDL: gl.constexpr):
    """kernels/launch.wait_for_inputs in Gluon: the same two PTX instructions in the same order."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _tile_products(w, x, s, w_op: gl.constexpr, mma: gl.constexpr, sums: gl.constexpr):
    """The G tiles' products, one a warp: w the tiles' loaded [G, 16, 4, 32] slabs, relabelled into W's K order (no
    data moves) and converted exactly to x's dtype; each product from zero over its K steps. Returned with the tiles'
    block scales per output column, both [16, 8, G] with the group in each thread's registers (`sums`): the scaling
    is left to the sum, where it fuses with the add as the Triton kernel's does (one rounding, an FMA)."""
    G: gl.constexpr = w.shape[0]
    n: gl.constexpr = w.shape[1]
    w = w.reshape(G, n, 4, 8, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(G, n, 4 * 32)
    w = gl.convert_layout(w.to(x.dtype), w_op)
    p = mma_v2(w, x, gl.zeros([G, n, x.shape[2]], gl.float32, layout=mma))
    s = gl.convert_layout(s.permute(1, 0), gl.SliceLayout(1, sums))[:, None, :]
    p = gl.convert_layout(p.permute(1, 2, 0), sums)
    p, s = gl.broadcast(p, s)
    return p, s


@gluon.jit
def _fp8_linear_direct_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_ym, scale_cols, k_per_split, splits,
    B0: gl.constexpr, B1: gl.constexpr, G: gl.constexpr, W_LOAD: gl.constexpr,
    SPLIT: gl.constexpr, SERIAL: gl.constexpr, PRELOAD: gl.constexpr, PDL: gl.constexpr = False,
):
    # G warps a program, each with every G-th of the split's PRELOAD K tiles (tile t = j * G + g at step j) for the
    # program's 16 output columns: the MMAs are batched over the warps (a 3-D MMA layout, batch = warp).
    STEPS: gl.constexpr = PRELOAD // G
    TILE_K: gl.constexpr = BLOCK_K
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[G, 1, 1], instr_shape=[1, 16, 8])
    w_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    # the products' ordered sum: a program's [16, 8] in one warp's threads, the G groups in each thread's registers
    sums: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, G], threads_per_warp=[8, 4, 1],
                                          warps_per_cta=[G, 1, 1], order=[2, 1, 0])
    acc_l: gl.constexpr = gl.SliceLayout(2, sums)
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    k_start = pid_k * k_per_split

    gw = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, W_LOAD))))
    nw = pid_n * WARP_N + gl.arange(0, WARP_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, W_LOAD))))
    qw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, W_LOAD))))
    cw = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, W_LOAD))))
    w_off = (gw[:, None, None, None] * TILE_K + gl.minimum(nw, N - 1)[None, :, None, None] * K
             + qw[None, None, :, None] * 32 + cw[None, None, None, :])
    gs = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, mma)))
    ns = pid_n * WARP_N + gl.arange(0, WARP_N, layout=gl.SliceLayout(0, gl.SliceLayout(2, mma)))
    ws = ()
    ss = ()
    for j in gl.static_range(STEPS):  # the constant weight and its scales, before the wait
        k0 = k_start + j * G * TILE_K
        ws = ws + (gl.load(w_ptr + k0 + w_off),)  # rows past N read row N - 1: their columns are never stored
        ss = ss + (gl.load(s_ptr + (ns // B0)[None, :] * scale_cols + ((k0 + gs * TILE_K) // B1)[:, None],
                           mask=(ns < N)[None, :], other=0.0),)
    _wait_for_inputs(PDL)

    # x^T's tiles read with 16-byte loads (8 of a row's K a thread), all in flight at once, then moved into the MMA's
    # B fragments through shared memory; loaded straight into the fragments they were 4-byte loads, which ptxas
    # issued between the MMAs, each another L2 round trip after the last (`bench sass`).
    x_ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8, 1], threads_per_warp=[1, 4, 8],
                                          warps_per_cta=[G, 1, 1], order=[1, 2, 0])
    gx = gl.arange(0, G, layout=gl.SliceLayout(1, gl.SliceLayout(2, x_ld)))
    kx = gl.arange(0, TILE_K, layout=gl.SliceLayout(0, gl.SliceLayout(2, x_ld)))
    mx = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, gl.SliceLayout(1, x_ld)))
    x_off = mx[None, None, :] * stride_xm + (gx * TILE_K)[:, None, None] + kx[None, :, None]
    xs = ()
    for u in gl.static_range(STEPS):
        xs = xs + (gl.load(x_ptr + k_start + u * G * TILE_K + x_off, mask=(mx < M)[None, None, :], other=0.0),)
    ps = ()
    for j in gl.static_range(STEPS):
        ps = ps + (_tile_products(ws[j], gl.convert_layout(xs[j], x_op), ss[j], w_op, mma, sums),)
    acc = _ordered_sum(gl.zeros([WARP_N, ROWS], gl.float32, layout=acc_l), ps, STEPS, G, acc_l)

    n = pid_n * WARP_N + gl.arange(0, WARP_N, layout=gl.SliceLayout(1, acc_l))
    m = pid_m * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, acc_l))
    n_ok = n < N
    m_ok = m < M
    mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        gl.store(part_ptr + (pid_k * M + m[None, :]) * N + n[:, None], acc, mask=mask)
        if SERIAL:  # the tile's last split to arrive sums the partials in split order (fp8_linear's SERIAL)
            gl.thread_barrier()  # every thread's partial stored before the release below
            lock = lock_ptr + pid_m * gl.num_programs(0) + pid_n
            if gl.atomic_add(lock, 1, sem="acq_rel") == splits - 1:
                total = gl.zeros([WARP_N, ROWS], gl.float32, layout=acc_l)
                for sk in range(0, splits):
                    total += gl.load(part_ptr + (sk * M + m[None, :]) * N + n[:, None], mask=mask, other=0.0,
                                     cache_modifier=".cg")
                gl.store(y_ptr + m[None, :] * stride_ym + n[:, None], total.to(y_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(lock, 0)
    else:
        gl.store(y_ptr + m[None, :] * stride_ym + n[:, None], acc.to(y_ptr.dtype.element_ty), mask=mask)


@gluon.jit
def _ordered_sum(acc, ps, STEPS: gl.constexpr, G: gl.constexpr, acc_l: gl.constexpr):
    """acc + the STEPS steps' scaled products `ps` ((products, scales) a step), added in tile order (t = j * G + g)
    as the Triton kernel adds them (the negative control's order is another: tests/kernel_controls.py)."""
    for j in gl.static_range(STEPS):
        acc = _add_groups(acc, ps[j][0], ps[j][1], G, acc_l)
    return acc


@gluon.jit
def _add_groups(acc, p, s, G: gl.constexpr, acc_l: gl.constexpr):
    """acc + p[..., 0] * s[..., 0] + p[..., 1] * s[..., 1] (G = 2), or acc + p[..., 0] * s[..., 0] (G = 1): one
    step's tiles in tile order, each scaled and added as the Triton kernel's `acc + dot * s` (an FMA). The groups are
    picked exactly (a split; a one-element sum)."""
    if G == 2:
        a, b = gl.split(p)
        sa, sb = gl.split(s)
        acc = acc + gl.convert_layout(a, acc_l) * gl.convert_layout(sa, acc_l)
        acc = acc + gl.convert_layout(b, acc_l) * gl.convert_layout(sb, acc_l)
    else:
        acc = acc + gl.sum(p, axis=2) * gl.sum(s, axis=2)
    return acc


# The kernel's preferred shared-memory carveout (percent of an SM's most): 0, the least shared memory (it needs 1 KB a
# program) and the most L1; left to the driver, the router select two launches later ran slower (docs/PERF.md, "The
# direct linear's diagnostics").
CARVEOUT = 0


def direct_applies(x: torch.Tensor, block_k: int, tiles: int) -> bool:
    """Whether the kernel takes a call: a preloading one (`tiles` > 0) on the GPU (compiled, not interpreted) with
    bf16 or fp16 x and 128-wide K tiles."""
    return (not fl.INTERPRETED and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and block_k == BLOCK_K.value
            and tiles > 0)


def applies(x: torch.Tensor, n: int, block: tuple[int, int], settings: fl.LinearSettings) -> bool:
    """Whether `fp8_linear_direct` takes x @ W^T for W [n, x's K] with `block` scales under `settings`, as
    `fp8_linear` would split it: `direct_applies` on that call's plan."""
    return direct_applies(x, *_plan(n, x.shape[1], block, settings, x.device))


def takes_weight(n: int, k: int, block: tuple[int, int], settings: fl.LinearSettings, device: torch.device) -> bool:
    """Whether the kernel takes calls on a W [n, k] at all (given bf16 x on the GPU), so that a copy in the fragments'
    order is worth making: whole 128-wide K tiles, at most 8 a split (not a TP 1 o-projection's 48)."""
    block_k, tiles = _plan(n, k, block, settings, device)
    return block_k == BLOCK_K.value and tiles > 0


def _plan(n: int, k: int, block: tuple[int, int], settings: fl.LinearSettings, device: torch.device
          ) -> tuple[int, int]:
    """(K tile, K tiles each program preloads) of `fp8_linear`'s plan for W [n, k] under `settings`."""
    block_k, _, k_per_split = fl.split_plan(n, k, block, settings, device)
    return block_k, fl.preload_tiles(k, k_per_split, block_k)


def lock_count(m: int, n: int) -> int:
    """Counters `fp8_linear_direct(locks=...)` needs for an [m, n] output: one per output tile (16 x 8)."""
    g = grid(m, n, 1)
    return g[0] * g[2]


def fp8_linear_direct(x: torch.Tensor, direct: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = (128, 128),
                      *, out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
                      locks: torch.Tensor | None = None, pdl: bool = False,
                      settings: fl.LinearSettings = fl.LinearSettings()) -> torch.Tensor:
    """`fp8_linear(x, W, scale, block, ...)`'s bits, from `direct` = direct_weight(W): the same checks, split plan
    (settings.split_k, or `choose_split_k` at settings.block_n), partials and split sum (in the launch with `locks`,
    see `lock_count`; else a second pass). Always the preloading form, each program's K tiles over 2 warps where they
    pair up (1 else): settings' warps, stages and preload are the Triton kernel's and unused here. ValueError where
    `direct_applies` does not hold."""
    c = fl.plan_call(x, direct, scale, block, out_dtype, out, settings)
    tiles = fl.preload_tiles(c.K, c.k_per_split, c.block_k)
    if not direct_applies(x, c.block_k, tiles):
        raise ValueError("fp8_linear_direct: needs a preloading call (whole splits of <= 8 tiles) on the GPU with "
                         "bf16 or fp16 x and 128-wide K tiles")
    g = grid(c.M, c.N, c.splits)
    fl.check_locks(locks, g[0] * g[2], x.device)
    serial = c.splits > 1 and locks is not None
    groups = groups_for(tiles)
    args = (x, direct, scale, c.out, c.part, locks if serial else c.part, c.M, c.N, c.K, x.stride(0), c.out.stride(0),
            c.scale_cols, c.k_per_split, c.splits)
    kw = dict(B0=block[0], B1=block[1], G=groups, W_LOAD=load_layout(groups), SPLIT=c.splits > 1, SERIAL=serial,
              PRELOAD=tiles, num_warps=groups, **launch_options(pdl, x.device))
    launch_with_carveout(_fp8_linear_direct_kernel, g, args, kw, CARVEOUT)
    return fl.sum_splits(c, serial, pdl)


def grid(m: int, n: int, splits: int) -> tuple[int, int, int]:
    """The kernel's grid: 16 output columns, one K split and 8 rows a program."""
    return triton.cdiv(n, WARP_N.value), splits, triton.cdiv(m, ROWS.value)
