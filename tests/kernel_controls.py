"""The broken pieces of the kernels' negative controls, each a stand-in for one jit piece of a product kernel, so the
product files carry no switch for a defect. Module-level jit functions: Triton reads a kernel's globals from its
module.

- The peer collectives (tests/test_tp_collectives.py), pieces `_all_reduce` takes: a poll that does not wait for the
  data, a re-arm that never re-arms, a re-arm only as wide as its own call, a reduction in each rank's own order
  (`BROKEN`).
- moe (tests/test_kernel_moe.py), put into copies of its kernels by `kernels.testing.substituted` (`MOE`): scales
  indexed without the shard's offset in its first block, liveness ignored (padding rows' experts computed and
  combined), the slots summed without their routing weights (by the combine, or by the combine fused with the tail),
  each pair's last tile dropped from the pair-major grids, the product forms' step scaled by its first block's scales
  alone (blocks narrower than the step).
- The FP8 linears (tests/test_bench_sass.py, tests/test_kernel_fp8_linear_direct.py): the preloaded weight tiles
  used without the opaque move after the wait (`linear_transparent`), the direct kernel's K tiles summed last to
  first (`DIRECT_REVERSED`).
"""

import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from iquest.kernels import moe
from iquest.kernels.allreduce import _advance, _sentinel
from iquest.kernels.testing import substitute


@triton.jit
def poll_without_waiting(own_ptr, slot, p, row, W, S, error_ptr, timeout_ns, tag, start, WORLD: tl.constexpr,
                         CAP: tl.constexpr, BLOCK: tl.constexpr, BITS: tl.constexpr):
    i = tl.arange(0, BLOCK)
    return tl.load(own_ptr + ((slot * WORLD + p) * CAP + row).to(tl.int64) * S + i, mask=i < W, volatile=True)


@triton.jit
def never_rearm(own_ptr, state_ptr, call, slot, first, P, R, W, S, WORLD: tl.constexpr, CAP: tl.constexpr,
                BLOCK: tl.constexpr, BITS: tl.constexpr):
    _advance(state_ptr, call, slot, P, R, W)


@triton.jit
def rearm_current_width(own_ptr, state_ptr, call, slot, first, P, R, W, S, WORLD: tl.constexpr, CAP: tl.constexpr,
                        BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Re-arms the previous call's rows only as wide as this call: a wider previous call's tail stays stale."""
    i = tl.arange(0, BLOCK)
    prev = (call + 2) % 3
    r = first
    while r < tl.load(state_ptr + 2 + prev):
        for p in tl.static_range(WORLD):
            dst = own_ptr + ((prev * WORLD + p) * CAP + r).to(tl.int64) * S + i
            tl.store(dst, _sentinel(tl.zeros([BLOCK], dtype=own_ptr.dtype.element_ty), BITS), mask=i < W)
        r += P
    _advance(state_ptr, call, slot, P, R, W)


@triton.jit
def own_order(step, rank, WORLD: tl.constexpr):
    return (step + rank) % WORLD


BROKEN = {"poll": poll_without_waiting, "rearm": never_rearm, "rearm_width": rearm_current_width,
          "order": own_order}


@triton.jit
def scales_without_offset(s_ptr, n, k0, K, n_ok, OFF0: tl.constexpr, OFF1: tl.constexpr, B0: tl.constexpr,
                          B1: tl.constexpr, stride_r, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """kernels/moe.py `_tile_scales` as if the shard started on a block boundary: each element's scale by its local
    row and column."""
    kk = k0 + tl.arange(0, BLOCK_K)
    return tl.load(s_ptr + (n // B0)[:, None] * stride_r + (kk // B1)[None, :], mask=n_ok[:, None] & (kk < K)[None, :],
                   other=0.0)


@triton.jit
def row_scales_without_offset(s_ptr, n, k0, n_ok, OFF0: tl.constexpr, OFF1: tl.constexpr, B0: tl.constexpr,
                              B1: tl.constexpr, stride_r):
    """kernels/moe.py `_row_scales` as if the shard started on a block boundary (Gate/Up's product form)."""
    return tl.load(s_ptr + (n // B0) * stride_r + k0 // B1, mask=n_ok, other=0.0)


@triton.jit
def block_dots_one_scale(a, q_ptrs, s_ptr, n, k0, K, n_ok, ok, OFF0: tl.constexpr, OFF1: tl.constexpr,
                         B0: tl.constexpr, B1: tl.constexpr, stride_r, BLOCK_K: tl.constexpr, BF16: tl.constexpr,
                         DOT_F32: tl.constexpr):
    """kernels/moe.py `_block_dots` as one dot a step times the scales of the block holding its first column, as if
    no step crossed a block (scale blocks narrower than the step)."""
    return moe._scaled_dot(a, q_ptrs, s_ptr, n, k0, n_ok, ok, OFF0, OFF1, B0, B1, stride_r, BF16, DOT_F32)


@triton.jit
def owner_ignoring_live(experts_ptr, live_ptr, p, R, K_TOP: tl.constexpr, P_PAD: tl.constexpr,
                        LIVE_COUNT: tl.constexpr):
    e = tl.load(experts_ptr + p)
    q = tl.arange(0, P_PAD)
    before = q < p
    same = before & (tl.load(experts_ptr + q, mask=before, other=-1) == e)
    return e, tl.sum(same.to(tl.int32), axis=0) == 0


@triton.jit
def rows_ignoring_live(experts_ptr, live_ptr, e, m0, R, K_TOP: tl.constexpr, K_PAD: tl.constexpr,
                       BLOCK_M: tl.constexpr, LIVE_COUNT: tl.constexpr):
    rows = m0 + tl.arange(0, BLOCK_M)
    j = tl.arange(0, K_PAD)
    ex = tl.load(experts_ptr + rows[:, None] * K_TOP + j[None, :],
                 mask=(rows < R)[:, None] & (j < K_TOP)[None, :], other=-1)
    hit = ex == e
    return rows * K_TOP + tl.sum(tl.where(hit, j[None, :], 0), axis=1), tl.sum(hit.to(tl.int32), axis=1) > 0


@triton.jit
def all_live(live_ptr, rows, R, LIVE_COUNT: tl.constexpr):
    return rows < R


@triton.jit
def sum_without_weights(y_ptr, weights_ptr, r, n, n_ok, live, H, K_TOP: tl.constexpr, CG: tl.constexpr = False):
    acc = tl.zeros([n.shape[0]], tl.float32)
    for j in tl.static_range(K_TOP):
        acc += tl.load(y_ptr + (r * K_TOP + j) * H + n, mask=n_ok & live, other=0.0)
    return acc


@triton.jit
def grid_item_last_tile_dropped(PAIR_MAJOR: tl.constexpr):
    """`moe._grid_item`, but with the pair slowest each pair's last tile's programs given its first tile instead."""
    p, tile, split, tiles = moe._grid_item(PAIR_MAJOR)
    if PAIR_MAJOR:
        tile = tl.where(tile == tiles - 1, 0, tile)
    return p, tile, split, tiles


_IGNORING_LIVE = {"_expert_owner": owner_ignoring_live, "_expert_rows": rows_ignoring_live}
MOE = {"offset_ignored": {"_gate_up_kernel": {"_tile_scales": scales_without_offset},
                          "_down_kernel": {"_down_tiles": substitute(moe._down_tiles,
                                                                     _tile_scales=scales_without_offset)}},
       "padding_computed": {"_gate_up_kernel": _IGNORING_LIVE,
                            "_down_kernel": {"_expert_owner": owner_ignoring_live,
                                             "_down_tiles": substitute(moe._down_tiles,
                                                                       _expert_rows=rows_ignoring_live)},
                            "_combine_kernel": {"load_live": all_live}},
       "product_offset_ignored": {"_gate_up_kernel": {"_block_dots": substitute(moe._block_dots, _scaled_dot=substitute(
           moe._scaled_dot, _row_scales=row_scales_without_offset))}},
       "product_one_scale_a_step": {"_gate_up_kernel": {"_block_dots": block_dots_one_scale},
                                    "_down_kernel": {"_down_tiles": substitute(moe._down_tiles,
                                                                               _block_dots=block_dots_one_scale)}},
       "down_product_offset_ignored": {"_down_kernel": {"_down_tiles": substitute(
           moe._down_tiles, _block_dots=substitute(moe._block_dots, _scaled_dot=substitute(
               moe._scaled_dot, _row_scales=row_scales_without_offset)))}},
       "pair_major_last_tile_dropped": {"_gate_up_kernel": {"_grid_item": grid_item_last_tile_dropped},
                                        "_down_kernel": {"_grid_item": grid_item_last_tile_dropped}},
       "weights_not_applied": {"_combine_kernel": {"weighted_sum": sum_without_weights}},
       "tail_weights_not_applied": {"_combine_add_norm_kernel": {
           "_row_tail": substitute(moe._row_tail, weighted_sum=sum_without_weights)}}}


@triton.jit
def after_wait_transparent(w, PDL: tl.constexpr):
    return w


def linear_transparent() -> dict:
    """The FP8 linear kernel's pieces with `after_wait_transparent` in its split product (which holds the wait)."""
    from iquest.kernels import fp8_linear
    from iquest.kernels.testing import substitute

    return {"split_product": substitute(fp8_linear.split_product, _after_wait=after_wait_transparent)}


@gluon.jit
def sum_reversed(acc, ps, STEPS: gl.constexpr, G: gl.constexpr, acc_l: gl.constexpr):
    for j in gl.static_range(STEPS):  # the last step first, and within a step the second tile first
        p, s = ps[STEPS - 1 - j]
        if G == 2:
            a, b = gl.split(p)
            sa, sb = gl.split(s)
            acc = acc + gl.convert_layout(b, acc_l) * gl.convert_layout(sb, acc_l)
            acc = acc + gl.convert_layout(a, acc_l) * gl.convert_layout(sa, acc_l)
        else:
            acc = acc + gl.sum(p, axis=2) * gl.sum(s, axis=2)
    return acc


DIRECT_REVERSED = {"_fp8_linear_direct_kernel": {"_ordered_sum": sum_reversed}}
