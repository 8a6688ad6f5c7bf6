"""`moe(down_direct=True)`: the MoE's Down at decode with each expert's weights in the registers of the tensor cores'
operands before the PDL wait (Triton's Gluon dialect).

Why. Down reads its expert's weights, which are constants, and the routing, which was written two launches back
(kernels/launch.py: final before Down's programs start; stage "early"). So a program can know its expert and hold its
weight tile in registers while the finalize before it still runs, which the Triton kernel cannot ask of its frontend
(it only asks L2 for the tile, `early_down`). This is what made the direct FP8 linears 2 us faster a call
(kernels/fp8_linear_direct.py); the MoE's Gate/Up could not take it (its expert is known only after the wait: the
direct Gate/Up measured slower in every form, docs/PERF.md).

The grid is indexed by distinct expert, not by pair: program (d, c) takes the d-th owner's expert (kernels/moe's
owner rule: the first live pair that chose it) and 128 output channels, found from the routing before the wait (the
owner matrix costs no wait there); programs past the block's distinct experts exit, and a block with more distinct
experts than the grid's slots loops. A warp's 32 channels x 64 K tiles are loaded with 16-byte loads into a layout
whose move into the A fragments stays inside the warp.

The same arithmetic as the Triton kernel's fp16-operand path (kernels/moe.py `_moe_down_kernel`, F16, fp8_down off):
per 64-wide K tile the product of the E4M3 weights and activations converted exactly to fp16 (kWidth 4 operands, as
Triton gives that dot, so the same K steps), from zero, then `acc + product * act_scale * weight_scale` in tile order;
the same fp32 y [P, H] for the combine. So the same bits as that path, which the GPU tests check. That path is not
the engine's default Down (E4M3 wgmma, `fp8_down`): making this one the default is a numerical change against it.
GPU only (Gluon has no interpreter); `applies` says which calls it takes.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from .fp8_linear_direct import _wait_for_inputs

BLOCK_K = gl.constexpr(64)  # Down's K tile on the fp16-operand path (kernels/moe.DOWN_BLOCK_K)
ROWS = gl.constexpr(8)  # the block's rows: the MMA's N (a decode block of up to 8 rows)
CHANNELS = gl.constexpr(128)  # output channels a program: 4 warps x 2 x 16 (the MMA's M)
WARPS = 4
MAX_TILES = 4  # K tiles (I_r / 64) a program holds: 64 registers a thread of weights at 4


def load_layout() -> gl.DistributedLinearLayout:
    """Where each byte of a program's [128, 64] E4M3 weight tile lives as loaded: warp w holds channels 16w .. 16w + 15
    and 64 + 16w .. 64 + 16w + 15 (the rows its MMA fragments hold); lane 4l + q bytes 16q .. 16q + 15 of 4 of them."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0], [64, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[CHANNELS.value, BLOCK_K.value])


def fits(R: int, H: int, I: int, block: tuple[int, int], group: int, block_k: int) -> bool:
    """The shapes the kernel takes: at most 8 rows, 128 x 128 weight blocks with act_quant groups of 128, Down's
    64-wide K tiles, H whole 128-channel groups, and I_r whole tiles, at most MAX_TILES."""
    return (R <= ROWS.value and tuple(block) == (128, 128) and group == 128 and block_k == BLOCK_K.value
            and H % CHANNELS.value == 0 and I % BLOCK_K.value == 0 and 1 <= I // BLOCK_K.value <= MAX_TILES)


@gluon.jit
def _live(live_ptr, rows, R, LIVE_COUNT: gl.constexpr):
    """kernels/moe_route.load_live in Gluon: liveness of `rows` (a mask [R], or rows < a device count)."""
    if LIVE_COUNT:
        return rows < gl.load(live_ptr).to(gl.int32)
    return gl.load(live_ptr + rows, mask=rows < R, other=0) != 0


@gluon.jit
def _owners(experts_ptr, live_ptr, R, P, K_TOP: gl.constexpr, P_PAD: gl.constexpr, LIVE_COUNT: gl.constexpr,
            DEDUP: gl.constexpr, sq: gl.constexpr):
    """The block's distinct live experts, as kernels/moe._expert_owner assigns them: pair q owns its expert when its
    row is live and (DEDUP) no earlier live pair chose it. (pairs q, their experts, owns, owners before q), [P_PAD]
    each in SliceLayout(1, sq), and the number of owners."""
    q = gl.arange(0, P_PAD, layout=gl.SliceLayout(1, sq))
    c = gl.arange(0, P_PAD, layout=gl.SliceLayout(0, sq))
    eq = gl.load(experts_ptr + q, mask=q < P, other=-1)
    own = _live(live_ptr, q // K_TOP, R, LIVE_COUNT) & (q < P)
    earlier = c[None, :] < q[:, None]
    if DEDUP:
        ec = gl.load(experts_ptr + c, mask=c < P, other=-1)
        lc = _live(live_ptr, c // K_TOP, R, LIVE_COUNT) & (c < P)
        own = own & (gl.sum((earlier & (ec[None, :] == eq[:, None]) & lc[None, :]).to(gl.int32), axis=1) == 0)
    rank = gl.sum((earlier & gl.convert_layout(own, gl.SliceLayout(0, sq))[None, :]).to(gl.int32), axis=1)
    return q, eq, own, rank, gl.sum(own.to(gl.int32), axis=0)


@gluon.jit
def _weights(w_ptr, ws_ptr, e, ok, n0, H, I, s_rows, s_cols, TILES: gl.constexpr, B0: gl.constexpr,
             GROUP: gl.constexpr, W_LD: gl.constexpr, mma: gl.constexpr):
    """Expert e's [128, 64] weight tiles at channels n0.. (E4M3, as loaded) and their block scales per channel, all
    issued at once; nothing is read unless `ok`."""
    ex = e.to(gl.int64)
    nw = n0 + gl.arange(0, CHANNELS, layout=gl.SliceLayout(1, W_LD))
    kw = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, W_LD))
    w_e = w_ptr + ex * H * I
    off = nw[:, None] * I + kw[None, :]
    ns = n0 + gl.arange(0, CHANNELS, layout=gl.SliceLayout(1, mma))
    ws_e = ws_ptr + ex * s_rows * s_cols + (ns // B0) * s_cols
    wt = ()
    st = ()
    for t in gl.static_range(TILES):
        wt = wt + (gl.load(w_e + off + t * BLOCK_K, mask=(nw < H)[:, None] & ok, other=0.0),)
    for t in gl.static_range(TILES):
        st = st + (gl.load(ws_e + (t * BLOCK_K) // GROUP, mask=(ns < H) & ok, other=0.0),)
    return wt, st


@gluon.jit
def _expert_of(d, eq, own, rank):
    """The d-th owner's expert (0 past the last owner)."""
    return gl.sum(gl.where(own & (rank == d), eq, 0), axis=0)


@gluon.jit
def _rows(e, chosen, rr, jj, row_live, K_TOP: gl.constexpr, x_ld: gl.constexpr, mma: gl.constexpr):
    """The rows that chose e (a row's experts are distinct: one slot at most): their pairs and mask in the
    activations' load layout and in the MMA's."""
    hit = chosen == e
    m_ok = (gl.sum(hit.to(gl.int32), axis=1) > 0) & row_live
    pair = rr * K_TOP + gl.sum(gl.where(hit, jj[None, :], 0), axis=1)
    return (gl.convert_layout(pair, gl.SliceLayout(0, x_ld)), gl.convert_layout(m_ok, gl.SliceLayout(0, x_ld)),
            gl.convert_layout(pair, gl.SliceLayout(0, mma)), gl.convert_layout(m_ok, gl.SliceLayout(0, mma)))


@gluon.jit
def _item(wt, st, rows, act_ptr, act_s_ptr, y_ptr, n0, H, I, TILES: gl.constexpr, GROUP: gl.constexpr,
          x_ld: gl.constexpr, mma: gl.constexpr, REVERSED: gl.constexpr):
    """y[pair, n0 .. n0 + 127] for the `rows` that chose the expert, from its loaded weight tiles `wt` and scales
    `st`: each tile's product from zero, scaled and added in tile order."""
    pair_x, ok_x, pair_m, ok_m = rows
    # the activations' K tiles, [64, 8] each, 16-byte loads (each warp reads the whole tile, its B operand)
    kx = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, x_ld))
    xs = ()
    sa = ()
    for t in gl.static_range(TILES):
        xs = xs + (gl.load(act_ptr + pair_x[None, :] * I + t * BLOCK_K + kx[:, None], mask=ok_x[None, :], other=0.0),)
        sa = sa + (gl.load(act_s_ptr + pair_m * (I // GROUP) + (t * BLOCK_K) // GROUP, mask=ok_m, other=0.0),)
    w_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)
    x_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=4)
    ps = ()
    for t in gl.static_range(TILES):
        w = gl.convert_layout(wt[t], w_op).to(gl.float16)  # E4M3 -> fp16: exact
        x = gl.convert_layout(xs[t], x_op).to(gl.float16)
        ps = ps + (mma_v2(w, x, gl.zeros([CHANNELS, ROWS], gl.float32, layout=mma)),)
    acc = gl.zeros([CHANNELS, ROWS], gl.float32, layout=mma)
    for i in gl.static_range(TILES):  # as the Triton kernel: (product * act scale) * weight scale, added
        if REVERSED:
            acc = acc + ps[TILES - 1 - i] * sa[TILES - 1 - i][None, :] * st[TILES - 1 - i][:, None]
        else:
            acc = acc + ps[i] * sa[i][None, :] * st[i][:, None]
    n = n0 + gl.arange(0, CHANNELS, layout=gl.SliceLayout(1, mma))
    gl.store(y_ptr + pair_m[None, :] * H + n[:, None], acc, mask=ok_m[None, :] & (n < H)[:, None])


@gluon.jit
def _moe_down_direct_kernel(
    act_ptr, act_s_ptr, w_ptr, ws_ptr, experts_ptr, live_ptr, y_ptr, ran_ptr,
    R, H, I, P, s_rows, s_cols,
    K_TOP: gl.constexpr, K_PAD: gl.constexpr, P_PAD: gl.constexpr, LIVE_COUNT: gl.constexpr, DEDUP: gl.constexpr,
    B0: gl.constexpr, GROUP: gl.constexpr, TILES: gl.constexpr, W_LD: gl.constexpr, STORE_RAN: gl.constexpr,
    EARLY: gl.constexpr, PDL: gl.constexpr = False,
    REVERSED: gl.constexpr = False,  # True: negative control only (tests): the K tiles summed last to first
):
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, 1], instr_shape=[16, 8])
    sq: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                        order=[1, 0])
    route: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1], threads_per_warp=[4, 8], warps_per_cta=[4, 1],
                                           order=[1, 0])
    slot = gl.program_id(0)
    n0 = gl.program_id(1) * CHANNELS
    if not EARLY:
        _wait_for_inputs(PDL)
    # The routing (with EARLY: written two launches back, so final before this kernel's programs start) and this
    # program's expert's weights: with EARLY all before the wait, beside the finalize
    rr = gl.arange(0, ROWS, layout=gl.SliceLayout(1, route))
    jj = gl.arange(0, K_PAD, layout=gl.SliceLayout(0, route))
    chosen = gl.load(experts_ptr + rr[:, None] * K_TOP + jj[None, :], mask=(rr < R)[:, None] & (jj < K_TOP)[None, :],
                     other=-1)
    row_live = _live(live_ptr, rr, R, LIVE_COUNT)
    q, eq, own, rank, owners = _owners(experts_ptr, live_ptr, R, P, K_TOP, P_PAD, LIVE_COUNT, DEDUP, sq)
    x_ld: gl.constexpr = gl.BlockedLayout(size_per_thread=[16, 1], threads_per_warp=[4, 8], warps_per_cta=[1, 4],
                                          order=[0, 1])
    e = _expert_of(slot, eq, own, rank)
    wt, st = _weights(w_ptr, ws_ptr, e, slot < owners, n0, H, I, s_rows, s_cols, TILES, B0, GROUP, W_LD, mma)
    rows = _rows(e, chosen, rr, jj, row_live, K_TOP, x_ld, mma)
    if EARLY:
        _wait_for_inputs(PDL)
    if STORE_RAN:  # debug: which pairs' experts were streamed (by whichever programs)
        gl.store(ran_ptr + q, own.to(gl.int32), mask=(q < P) & (slot == 0) & (gl.program_id(1) == 0))
    if slot < owners:
        _item(wt, st, rows, act_ptr, act_s_ptr, y_ptr, n0, H, I, TILES, GROUP, x_ld, mma, REVERSED)
    for d in range(slot + gl.num_programs(0), owners, gl.num_programs(0)):  # more experts than slots: after the wait
        e = _expert_of(d, eq, own, rank)
        wt, st = _weights(w_ptr, ws_ptr, e, True, n0, H, I, s_rows, s_cols, TILES, B0, GROUP, W_LD, mma)
        _item(wt, st, _rows(e, chosen, rr, jj, row_live, K_TOP, x_ld, mma), act_ptr, act_s_ptr, y_ptr, n0, H, I,
              TILES, GROUP, x_ld, mma, REVERSED)


def launch(act, act_scale, down, down_scale, experts, live_arg, y, ran, R, H, I, P, routing: dict, store_ran: bool,
           early: bool, launch_kw: dict, slots: int, reversed_tiles: bool = False) -> None:
    """The kernel's launch for `moe(down_direct=True)`, which checks the arguments and that `fits`: `slots` distinct
    experts (moe.expected_segments) x 128-channel groups."""
    _moe_down_direct_kernel[(slots, H // CHANNELS.value)](
        act, act_scale, down, down_scale, experts, live_arg, y, ran, R, H, I, P, down_scale.shape[1],
        down_scale.shape[2], **routing, B0=128, GROUP=128, TILES=I // BLOCK_K.value, W_LD=load_layout(),
        STORE_RAN=store_ran, EARLY=early, REVERSED=reversed_tiles, num_warps=WARPS, **launch_kw)
