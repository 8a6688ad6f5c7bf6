"""The MoE's Gate/Up, finalize and Down in one persistent launch: does Down's stream start under Gate/Up's tail?
(issue 37's first real-arithmetic prototype, GPU)

The ring probe's timer stamps at 38 distinct experts (`ring-probe-h200-d38-7a9a2de.json`) put Gate/Up and Down
at 44.4 us a layer together, the flat-read pace of their 179 MB, because Down's chunks stream in while Gate/Up is still
read; the engine spends 60.0 us on the pair (Gate/Up 39.5, finalize 2.1, Down 18.4: `bench graph-trace`). Here the
engine's own arithmetic runs in G persistent programs (two a SM), in three phases:
  1. Gate/Up items (owner, I tile, K split), round robin: exactly the engine's owner programs' work (the same tiles,
     dots and partial stores, in the same order). After an item, the program counts itself in on the expert's arrival
     counter; the item that completes an expert's count finalizes it (its splits summed in order, SiLU, act_quant:
     kernels/moe.py's helpers) and raises the expert's flag to this call's epoch.
  2. Down items (owner, 64 H rows), round robin: the next item's weight tile is loaded into registers while this
     one polls the experts' flags (one vector load of them all), reads its activations and runs the engine's E4M3
     dots. A program whose Gate/Up items are done loads Down's weights while others still stream Gate/Up's.
  3. The engine's combine kernel, unchanged, as the next launch.
Only the engine's configuration at a decode block is built (bf16 compute, the norm's fp16 operand tiles, TMA Gate/Up
tiles, E4M3 Down, R <= 16 rows). Every value is computed as the engine computes it, so the output must be the engine's
bit for bit: `main` checks that before timing. The flags carry a call epoch (the last program of a call advances
it), the counters are reset by their finalizer, and every poll is bounded (a program that gives up sets the error
word, which `main` checks), so an unscheduled program ends the call instead of hanging it. Persistent programs that
wait on each other need all G resident, so this runs only on the GPU (the interpreter runs programs one at a time).

    python3 -m iquest.lab.moe_fused OUT.json   (on the device, PYTHONPATH as ci/gpu.sh sets it)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..bench import tune
from ..bench.kernels_micro import FULL_CONFIG, graph_times
from ..kernels import moe as mk
from ..kernels.device import sm_count
from ..kernels.f16_operands import f16_rows_tiles_ref
from ..kernels.launch import launch_options, wait_for_inputs
from ..kernels.moe_route import load_live
from ..provenance import commit
from ..reference.config import Config

SPIN_LIMIT = tl.constexpr(1 << 20)  # polls before a waiting program gives up and sets the error word
PER_SM = (1, 2)  # persistent programs a SM to time (the items probe: two a SM streamed Gate/Up's items best)
DOWN_N = 64  # Down's weight rows an item: two items' tiles in registers fit without spills at 64 (not at 128)


@triton.jit
def _owners(experts_ptr, live_ptr, R, P, K_TOP: tl.constexpr, P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr):
    """(pairs q, their experts, owner mask, rank among owners): pair q owns its expert if its row is live and no
    earlier live pair chose it (kernels/moe._expert_owner's rule, for all pairs at once)."""
    q = tl.arange(0, P_PAD)
    eq = tl.load(experts_ptr + q, mask=q < P, other=-1)
    lq = load_live(live_ptr, q // K_TOP, R, LIVE_COUNT) & (q < P)
    earlier = (eq[:, None] == eq[None, :]) & lq[None, :] & (q[None, :] < q[:, None])
    own = lq & (tl.sum(earlier.to(tl.int32), axis=1) == 0)
    rank = tl.cumsum(own.to(tl.int32), axis=0) - 1
    return q, eq, own, rank


@triton.jit
def _owner_of(q, eq, own, rank, c):
    """(pair, expert) of the c-th owner."""
    hit = own & (rank == c)
    return tl.sum(tl.where(hit, q, 0), axis=0), tl.sum(tl.where(hit, eq, 0), axis=0)


@triton.jit
def _down_tile(d_ptr, ds_ptr, q, eq, own, rank, item, n_down, H_TILES, H, I, ds_rows, ds_cols, B0: tl.constexpr,
               GROUP: tl.constexpr, DOWN_N: tl.constexpr):
    """Down item `item`'s weight tile (both K tiles, I = 2 GROUP) and its column scales; zeros past n_down."""
    live = item < n_down
    c = tl.where(live, item // H_TILES, 0)
    p, e = _owner_of(q, eq, own, rank, c)
    ex = e.to(tl.int64)
    n = (item % H_TILES) * DOWN_N + tl.arange(0, DOWN_N)
    ok = (n < H) & live
    kk = tl.arange(0, GROUP)
    w_rows = d_ptr + ex * H * I + n[:, None] * I
    w0 = tl.load(w_rows + kk[None, :], mask=ok[:, None], other=0.0)
    w1 = tl.load(w_rows + GROUP + kk[None, :], mask=ok[:, None], other=0.0)
    ws_row = ds_ptr + ex * ds_rows * ds_cols + (n // B0) * ds_cols
    return w0, w1, tl.load(ws_row, mask=ok, other=0.0), tl.load(ws_row + 1, mask=ok, other=0.0)


@triton.jit
def _moe_fused_kernel(
    x_ptr, xd_ptr, g_desc, gs_ptr, u_desc, us_ptr, d_ptr, ds_ptr, experts_ptr, live_ptr,
    part_ptr, act_ptr, act_s_ptr, y_ptr, count_ptr, flag_ptr, state_ptr, err_ptr,
    R, H, I, P, stride_x, stride_xd, s_rows, s_cols, ds_rows, ds_cols, k_per_split,
    K_TOP: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, LIVE_COUNT: tl.constexpr,
    B0: tl.constexpr, B1: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, GROUP: tl.constexpr, DOWN_N: tl.constexpr, I_CONST: tl.constexpr, PDL: tl.constexpr,
    DOWN: tl.constexpr = True, FINALIZE: tl.constexpr = True,
):
    wait_for_inputs(PDL)
    pid, progs = tl.program_id(0), tl.num_programs(0)
    epoch = tl.load(state_ptr) + 1  # state[0]: the last completed call's epoch; state[1]: programs done this call
    q, eq, own, rank = _owners(experts_ptr, live_ptr, R, P, K_TOP, P_PAD, LIVE_COUNT)
    D = tl.sum(own.to(tl.int32), axis=0)
    TILES: tl.constexpr = I_CONST // BLOCK_N
    GU_ITEMS: tl.constexpr = TILES * SPLIT

    # ---- Gate/Up items, then each expert's finalize by the item that completes it --------------------------
    for item in range(pid, D * GU_ITEMS, progs):
        c = item // GU_ITEMS
        tile = (item // SPLIT) % TILES
        split = item % SPLIT
        p, e = _owner_of(q, eq, own, rank, c)
        rows, pair, m_ok = mk._expert_rows(experts_ptr, live_ptr, e, 0, R, K_TOP, K_PAD, BLOCK_M, LIVE_COUNT)
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_start = split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, H)
        ex = e.to(tl.int64)
        gs_row = gs_ptr + ex * s_rows * s_cols + (n // B0) * s_cols
        us_row = us_ptr + ex * s_rows * s_cols + (n // B0) * s_cols
        x_rows = x_ptr + rows[:, None] * stride_x
        xd_rows = xd_ptr + rows * stride_xd
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):  # kernels/moe._moe_gate_up_kernel's PRESCALED F16 TMA path
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < H
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            x_down = tl.load(xd_rows + k0 // BLOCK_K, mask=m_ok, other=1.0)
            wg = g_desc.load([e.to(tl.int32), tile * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
            wu = u_desc.load([e.to(tl.int32), tile * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K)
            sg = tl.load(gs_row + k0 // B1)[None, :]
            su = tl.load(us_row + k0 // B1)[None, :]
            sg = x_down[:, None] * sg
            su = x_down[:, None] * su
            wg = wg.to(tl.float16)
            wu = wu.to(tl.float16)
            acc_g += tl.dot(x, tl.trans(wg), input_precision="tf32") * sg
            acc_u += tl.dot(x, tl.trans(wu), input_precision="tf32") * su
        dst = part_ptr + ((split * P + pair) * 2)[:, None] * I + n[None, :]
        tl.store(dst, acc_g, mask=m_ok[:, None])
        tl.store(dst + I, acc_u, mask=m_ok[:, None])
        tl.debug_barrier()  # every thread's partials issued before the count (released by it)
        if FINALIZE and tl.atomic_add(count_ptr + c, 1, sem="acq_rel") == GU_ITEMS - 1:  # the expert's last item
            tl.debug_barrier()
            for grp in tl.static_range(I_CONST // GROUP):
                g, u, summed = mk._split_sum(part_ptr, pair, grp * GROUP + tl.arange(0, GROUP), m_ok, P, I, SPLIT)
                mk._act_store(g, u, pair, grp * GROUP, m_ok, act_ptr, act_s_ptr, act_s_ptr, act_s_ptr, summed, I,
                              GROUP, False)
            tl.debug_barrier()
            tl.atomic_xchg(count_ptr + c, 0)  # every arrival of this call is in: the next call counts from zero
            tl.atomic_xchg(flag_ptr + c, epoch, sem="release")

    # ---- Down items: the next item's weight tile in flight while this one waits, reads and multiplies --------
    if DOWN:
        H_TILES = tl.cdiv(H, DOWN_N)
        n_down = D * H_TILES
        kk = tl.arange(0, GROUP)
        slots = tl.arange(0, P_PAD)
        ready = slots < 0  # which experts' activations this program has seen finalized (polled as one vector)
        w0, w1, sw0, sw1 = _down_tile(d_ptr, ds_ptr, q, eq, own, rank, pid, n_down, H_TILES, H, I, ds_rows, ds_cols,
                                      B0, GROUP, DOWN_N)
        for item in range(pid, n_down, progs):
            c = item // H_TILES
            n = (item % H_TILES) * DOWN_N + tl.arange(0, DOWN_N)
            n_ok = n < H
            # the next item's tile (masked off past the last), loaded before this item's wait and dots
            nw0, nw1, nsw0, nsw1 = _down_tile(d_ptr, ds_ptr, q, eq, own, rank, item + progs, n_down, H_TILES, H, I,
                                              ds_rows, ds_cols, B0, GROUP, DOWN_N)
            p, e = _owner_of(q, eq, own, rank, c)
            rows, pair, m_ok = mk._expert_rows(experts_ptr, live_ptr, e, 0, R, K_TOP, K_PAD, BLOCK_M, LIVE_COUNT)
            spins = 0
            while (tl.sum((ready & (slots == c)).to(tl.int32), axis=0) == 0) & (spins < SPIN_LIMIT):
                ready = tl.load(flag_ptr + slots, mask=slots < D, other=0, volatile=True) == epoch
                spins += 1
            if spins >= SPIN_LIMIT:
                tl.atomic_xchg(err_ptr, 1)
            tl.debug_barrier()
            a0 = tl.load(act_ptr + pair[:, None] * I + kk[None, :], mask=m_ok[:, None], other=0,
                         cache_modifier=".cg").to(tl.float8e4nv, bitcast=True)  # act_ptr: the E4M3 bits as uint8
            a1 = tl.load(act_ptr + pair[:, None] * I + GROUP + kk[None, :], mask=m_ok[:, None], other=0,
                         cache_modifier=".cg").to(tl.float8e4nv, bitcast=True)
            sa0 = tl.load(act_s_ptr + pair * (I // GROUP), mask=m_ok, other=0.0, cache_modifier=".cg")
            sa1 = tl.load(act_s_ptr + pair * (I // GROUP) + 1, mask=m_ok, other=0.0, cache_modifier=".cg")
            acc_t = tl.zeros([DOWN_N, BLOCK_M], tl.float32)  # kernels/moe._moe_down_kernel's FP8 path, K tile by K tile
            acc_t += tl.dot(w0, tl.trans(a0)) * sa0[None, :] * sw0[:, None]
            acc_t += tl.dot(w1, tl.trans(a1)) * sa1[None, :] * sw1[:, None]
            tl.store(y_ptr + pair[None, :] * H + n[:, None], acc_t, mask=m_ok[None, :] & n_ok[:, None])
            w0, w1, sw0, sw1 = nw0, nw1, nsw0, nsw1

    # ---- the call's end: the last program advances the epoch ------------------------------------------------
    tl.debug_barrier()
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel") == progs - 1:
        tl.atomic_xchg(state_ptr + 1, 0)
        tl.atomic_xchg(state_ptr, epoch, sem="release")


class FusedMoE:
    """The workspaces of `moe_fused` (counters and flags zeroed once; every call leaves them reusable)."""

    def __init__(self, experts: int, device: torch.device, per_sm: int) -> None:
        self.per_sm = per_sm
        self.count = torch.zeros(experts, dtype=torch.int32, device=device)  # indexed by owner rank (< E)
        self.flag = torch.zeros(experts, dtype=torch.int32, device=device)
        self.state = torch.zeros(2, dtype=torch.int32, device=device)
        self.err = torch.zeros(1, dtype=torch.int32, device=device)

    def __call__(self, x, f16_input, experts, weights, live, gate, gate_scale, up, up_scale, down, down_scale,
                 block=(128, 128), out=None, pdl=True, split_k=None, with_down=True,
                 finalize=True):
        R, H = x.shape
        k = experts.shape[1]
        P = R * k
        E, I = gate.shape[0], gate.shape[1]
        group = block[1]
        if not (R <= mk.BLOCK_M and I == 2 * group and group == 128 and x.is_cuda):
            raise ValueError("moe_fused: built for a decode block on the GPU (R <= 16, I_r = 256, 128x128 blocks)")
        dev = x.device
        grid, bn, bk, k_per_split = mk.gate_up_grid(P, E, k, H, I, block, 128, mk.GATE_UP_BLOCK_N, split_k,
                                                    sm_count(dev))
        split = grid[2]
        part = torch.empty((split, P, 2, I), dtype=torch.float32, device=dev)
        act = torch.empty((P, I), dtype=torch.float8_e4m3fn, device=dev)
        act_scale = torch.empty((P, I // group), dtype=torch.float32, device=dev)
        y = torch.empty((P, H), dtype=torch.float32, device=dev)
        if out is None:
            out = torch.empty((R, H), dtype=torch.bfloat16, device=dev)
        live_arg = live.view(torch.uint8) if live.dtype == torch.bool else live
        count = mk.check_live(live, R, dev)
        routing = dict(K_TOP=k, K_PAD=max(2, triton.next_power_of_2(k)), P_PAD=max(16, triton.next_power_of_2(P)),
                       LIVE_COUNT=count)
        xt, xd = f16_input
        launch = launch_options(pdl, dev)
        _moe_fused_kernel[(self.per_sm * sm_count(dev),)](
            xt, xd, mk._descriptor(gate, (bn, bk)), gate_scale, mk._descriptor(up, (bn, bk)), up_scale, down,
            down_scale, experts, live_arg, part, act.view(torch.uint8), act_scale, y, self.count, self.flag,
            self.state, self.err, R, H, I, P, xt.stride(0), xd.stride(0), gate_scale.shape[1], gate_scale.shape[2],
            down_scale.shape[1], down_scale.shape[2], k_per_split, **routing, B0=block[0], B1=block[1],
            BLOCK_M=mk.BLOCK_M, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split, GROUP=group, DOWN_N=DOWN_N, I_CONST=I,
            DOWN=with_down, FINALIZE=finalize, num_warps=4, num_stages=mk.NUM_STAGES, **launch)
        mk._moe_combine_kernel[(R, triton.cdiv(H, mk.COMBINE_BLOCK))](
            y, weights, live_arg, out, R, H, out.stride(0), K_TOP=k, BLOCK=mk.COMBINE_BLOCK, LIVE_COUNT=count,
            num_warps=4, **launch)
        return out


def run(distinct: int, dev: torch.device, repeats: int) -> list[dict]:
    config = Config.from_file(FULL_CONFIG)
    shape = replace(tune.tune_shape(config), distinct=distinct)
    case = tune.moe_case(shape, dev)
    t = case.tensors
    R, H = shape.rows, shape.hidden
    live = torch.ones(R, dtype=torch.bool, device=dev)
    # the engine's input form: its x and the norm's fp16 operand tiles of it, as moe_case's run builds them
    engine_kw = {"fp8_down": True, "early_down": True, "pdl": True}

    def engine(i, out=None):
        return case.run(engine_kw, i, out)

    x32 = t["x32"]
    tiles = tuple(tt.contiguous() for tt in f16_rows_tiles_ref(x32.to(torch.bfloat16), 128))
    xb = x32.to(torch.bfloat16)
    gs, us, ds = t["scales"]
    routes = t["routes"]
    forms = {"engine": engine}
    fused = {}
    for per_sm in PER_SM:
        f = fused[per_sm] = FusedMoE(shape.experts, dev, per_sm)
        forms[f"fused, {per_sm} a SM"] = (
            lambda i, out=None, f=f: f(xb, tiles, routes[i][0], routes[i][1], live, t["gate"], gs, t["up"], us,
                                       t["down"], ds, shape.block, out=out))
    f = FusedMoE(shape.experts, dev, 2)
    timing_only = "fused, 2 a SM, no Down (timing only)"
    forms[timing_only] = (lambda i, out=None, f=f: f(xb, tiles, routes[i][0], routes[i][1], live, t["gate"], gs,
                                                     t["up"], us, t["down"], ds, shape.block, out=out, with_down=False))
    items_only = "fused, 2 a SM, Gate/Up items only (timing only)"
    forms[items_only] = (lambda i, out=None, f=f: f(xb, tiles, routes[i][0], routes[i][1], live, t["gate"], gs,
                                                    t["up"], us, t["down"], ds, shape.block, out=out, with_down=False,
                                                    finalize=False))
    same = {}
    for name, fn in forms.items():
        if name in ("engine", timing_only, items_only):
            continue
        same[name] = []
        for i in range(len(routes)):
            a, b = engine(i), fn(i)
            torch.cuda.synchronize()
            same[name].append(bool(torch.equal(a, b)))
    def check_errors(when):
        for per_sm, f in fused.items():
            if int(f.err.item()):
                raise RuntimeError(f"{distinct} experts, {per_sm} a SM: a program gave up polling {when}")
    check_errors("in the bit check")
    outs = {name: [torch.empty(R, H, dtype=torch.bfloat16, device=dev) for _ in routes] for name in forms}
    calls = {name: [lambda i=i, fn=fn, o=outs[name][i]: fn(i, o) for i in range(len(routes))]
             for name, fn in forms.items()}
    times = {name: [] for name in calls}
    for _ in range(3):  # alternating rounds of graph replays: each form's median of its replays, a round
        for name, cs in calls.items():
            times[name].append(statistics.median(graph_times(cs, repeats)[0]))
    check_errors("during the timed replays")
    rows = []
    base = statistics.median(times["engine"])
    for name, ts in times.items():
        med = statistics.median(ts)
        ok = same.get(name)
        rows.append({"distinct": distinct, "form": name, "median_us": med, "rounds_us": ts, "vs_engine": med / base,
                     "bytes": case.bytes, "bit_identical_routings": None if ok is None else f"{sum(ok)}/{len(ok)}"})
        print(f"[{distinct} experts] {name:18s} {med:7.2f} us  {med / base:5.3f}x engine  rounds "
              f"{[round(v, 2) for v in ts]}" + ("" if ok is None else f"  bit-identical {sum(ok)}/{len(ok)}"),
              flush=True)
    return rows


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python3 -m iquest.lab.moe_fused", description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", help="write the raw JSON here")
    p.add_argument("--distinct", default="13,38", help="comma-separated distinct experts a routing (default 13,38)")
    p.add_argument("--repeats", type=int, default=10, help="graph replays a round (default 10)")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    report = {"probe": "moe-fused", "commit": commit(), "device": torch.cuda.get_device_name(dev),
              "rows": [r for d in args.distinct.split(",") for r in run(int(d), dev, args.repeats)]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
