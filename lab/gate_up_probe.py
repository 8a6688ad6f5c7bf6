"""Does Gate/Up stream faster as persistent programs than as one program per (expert, tile, split)? (issue 37, GPU)

At 38 distinct experts the ring probe (`lab/ring_probe.py --distinct 38`) streamed a layer's bytes at 1.51x its flat
read, against 1.76x for the PDL chain, and the engine's Gate/Up reads its 119.5 MB at 3.02 TB/s (`bench
graph-trace`). Its grid is one program per (pair, I tile, K split): at 38 experts 608 owner programs of 196 KB, two a
SM at a time, so each SM runs 2.3 waves of programs, each with its own ramp. This probe streams exactly Gate/Up's
weight tiles (TMA into shared memory, each tile into one E4M3 wgmma against zeros, as `bench stream-probe` does; no
MoE arithmetic) in three forms, at 13 and at 38 distinct experts:
  * `grid`: the engine's decomposition, only its owner programs (distinct experts x 2 I tiles x 8 splits);
  * `items`: G persistent programs, each taking the same (expert, tile, split) items in turn (item i, i + G, ...),
    a K loop each: the same items, so the same partial sums as the engine's, with no program ramps but one each item;
  * `units`: G persistent programs, each taking an equal contiguous range of the K tiles of every (expert, tile) in
    one loop, so the pipeline runs on across item boundaries: the balanced bound of a persistent Gate/Up (its
    partials would fall on other boundaries than the engine's 8 splits: a numerical change); `units, affine`: the
    same with the experts' ids computed, not loaded, in the loop (the pipeliner's best case);
  * `grid, fp16 operands`: the grid with the engine's operand form (each E4M3 tile converted to fp16, then fp16 dots
    of 16 rows, Gate's and Up's apart): what the conversions and dots add to the stream.
G is one program a SM (6 stages, 192 KB of tiles in flight) or two (3 stages each). Beside them, a flat read of the
same bytes (`bench stream-probe`'s best form). CUDA graphs of calls back to back over rotating expert sets (weights
from HBM), medians of 15 replays. GPU only; a lab probe the product never imports.

    python3 -m iquest.lab.gate_up_probe OUT.json   (on the device, PYTHONPATH as ci/gpu.sh sets it)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..bench import tune
from ..bench.kernels_micro import FULL_CONFIG
from ..bench.stream_probe import _stream_kernel, _time, flat_read
from ..kernels import moe as mk
from ..kernels.device import sm_count
from ..provenance import commit
from ..reference.config import Config

SPLITS = 8  # the engine's Gate/Up K split at a decode block of 6 rows (kernels/moe.plan_split)
DISTINCT = (13, 38)
FORMS = ((1, 6), (2, 3))  # (programs a SM, pipeline stages) of the persistent forms


@triton.jit
def _convert_kernel(g_desc, u_desc, experts_ptr, zero_ptr, out_ptr, k_per_split, BN: tl.constexpr, BK: tl.constexpr):
    """The engine's grid (owner, tile, split) with its operand form: each E4M3 tile converted to fp16 and multiplied
    against a fp16 tile of 16 rows (the engine's BLOCK_M), as Gate/Up's f16 path does, instead of the E4M3 wgmma."""
    zero = tl.load(zero_ptr + tl.arange(0, 16)[:, None] * BK + tl.arange(0, BK)[None, :]).to(tl.float16)
    e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int32)
    tile = tl.program_id(1)
    k0 = tl.program_id(2) * k_per_split
    acc_g = tl.zeros([16, BN], tl.float32)
    acc_u = tl.zeros([16, BN], tl.float32)
    for k in range(k0, k0 + k_per_split, BK):
        wg = g_desc.load([e, tile * BN, k]).reshape(BN, BK).to(tl.float16)
        wu = u_desc.load([e, tile * BN, k]).reshape(BN, BK).to(tl.float16)
        acc_g = tl.dot(zero, tl.trans(wg), acc_g)
        acc_u = tl.dot(zero, tl.trans(wu), acc_u)
    out = (tl.program_id(0) * tl.num_programs(1) + tile) * tl.num_programs(2) + tl.program_id(2)
    tl.store(out_ptr + out, tl.sum(tl.sum(acc_g + acc_u, 1), 0))


@triton.jit
def _items_kernel(g_desc, u_desc, experts_ptr, zero_ptr, out_ptr, n_items, k_per_split,
                  TILES: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Items (owner, tile, split) i = pid, pid + G, ...: each the K loop of the engine's owner program."""
    zero = tl.load(zero_ptr + tl.arange(0, BK)[:, None] * 16 + tl.arange(0, 16)[None, :])
    total = tl.zeros([BN, 16], tl.float32)
    for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
        owner = item // (TILES * SPLIT)
        tile = (item // SPLIT) % TILES
        e = tl.load(experts_ptr + owner).to(tl.int32)
        k0 = (item % SPLIT) * k_per_split
        acc = tl.zeros([BN, 16], tl.float32)
        for k in range(k0, k0 + k_per_split, BK):
            acc = tl.dot(g_desc.load([e, tile * BN, k]).reshape(BN, BK), zero, acc)
            acc = tl.dot(u_desc.load([e, tile * BN, k]).reshape(BN, BK), zero, acc)
        total += acc
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(total, 1), 0))


@triton.jit
def _units_kernel(g_desc, u_desc, experts_ptr, zero_ptr, out_ptr, n_units, K_TILES: tl.constexpr,
                  TILES: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, AFFINE: tl.constexpr = False):
    """K-tile units [pid * U / G, (pid + 1) * U / G) of all (owner, tile) pairs, in one loop. AFFINE: the experts are
    known to be consecutive ids, so no load in the loop gates the tile loads (the pipelining's best case)."""
    zero = tl.load(zero_ptr + tl.arange(0, BK)[:, None] * 16 + tl.arange(0, 16)[None, :])
    pid, progs = tl.program_id(0), tl.num_programs(0)
    first = tl.load(experts_ptr).to(tl.int32)
    acc = tl.zeros([BN, 16], tl.float32)
    for u in range(pid * n_units // progs, (pid + 1) * n_units // progs):
        pair = u // K_TILES  # (owner, tile)
        if AFFINE:
            e = first + pair // TILES
        else:
            e = tl.load(experts_ptr + pair // TILES).to(tl.int32)
        row, k = (pair % TILES) * BN, (u % K_TILES) * BK
        acc = tl.dot(g_desc.load([e, row, k]).reshape(BN, BK), zero, acc)
        acc = tl.dot(u_desc.load([e, row, k]).reshape(BN, BK), zero, acc)
    tl.store(out_ptr + pid, tl.sum(tl.sum(acc, 1), 0))


def run(distinct: int, dev: torch.device) -> list[dict]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    config = Config.from_file(FULL_CONFIG)
    shape = tune.tune_shape(config)
    E, I, H = shape.experts, shape.inter, shape.hidden
    BN, BK = mk.GATE_UP_BLOCK_N, shape.block[1]
    tiles, k_tiles = I // BN, H // BK
    sms = sm_count(dev)
    gen = torch.Generator(device=dev).manual_seed(distinct)
    gate = torch.randint(0, 120, (E, I, H), dtype=torch.uint8, device=dev, generator=gen).view(torch.float8_e4m3fn)
    up = torch.randint(0, 120, (E, I, H), dtype=torch.uint8, device=dev, generator=gen).view(torch.float8_e4m3fn)
    gd, ud = TensorDescriptor.from_tensor(gate, [1, BN, BK]), TensorDescriptor.from_tensor(up, [1, BN, BK])
    sets = min(16, E // distinct)  # disjoint expert sets: >= 6 x 38 x 3.1 MB rotated, far beyond L2
    # consecutive ids (an expert's slice is 3.1 MB contiguous either way), so that `units, affine` may compute them
    experts = [torch.arange(s * distinct, (s + 1) * distinct, device=dev) for s in range(sets)]
    zero = torch.zeros(BK * 16, dtype=torch.float8_e4m3fn, device=dev)
    out = torch.empty(1 << 16, device=dev)
    nbytes = 2 * distinct * I * H
    kps = H // SPLITS
    items, units = distinct * tiles * SPLITS, distinct * tiles * k_tiles
    variants = {f"grid ({distinct} x {tiles} x {SPLITS} programs, 3 stages)":
                lambda i: _stream_kernel[(distinct, tiles, SPLITS)](gd, ud, experts[i], zero, out, distinct, kps,
                                                                    OWNERS_ONLY=True, N_OWNERS=distinct, BN=BN,
                                                                    BK=BK, num_warps=4, num_stages=3)}
    variants["grid, fp16 operands (the engine's conversions and dots)"] = (
        lambda i: _convert_kernel[(distinct, tiles, SPLITS)](gd, ud, experts[i], zero, out, kps, BN=BN, BK=BK,
                                                             num_warps=4, num_stages=3))
    for per_sm, stages in FORMS:
        g = per_sm * sms
        variants[f"items ({g} programs, {stages} stages)"] = (
            lambda i, g=g, st=stages: _items_kernel[(g,)](gd, ud, experts[i], zero, out, items, kps, TILES=tiles,
                                                          SPLIT=SPLITS, BN=BN, BK=BK, num_warps=4, num_stages=st))
        # the experts' load in the loop takes a stage of every tile pair's: 2 x stages - 1 keeps the tiles in flight
        variants[f"units ({g} programs, {2 * stages - 1} stages)"] = (
            lambda i, g=g, st=2 * stages - 1: _units_kernel[(g,)](gd, ud, experts[i], zero, out, units, K_TILES=k_tiles,
                                                          TILES=tiles, BN=BN, BK=BK, num_warps=4, num_stages=st))
        variants[f"units, affine experts ({g} programs, {stages} stages)"] = (
            lambda i, g=g, st=stages: _units_kernel[(g,)](gd, ud, experts[i], zero, out, units, K_TILES=k_tiles,
                                                          TILES=tiles, BN=BN, BK=BK, AFFINE=True, num_warps=4,
                                                          num_stages=st))
    flat = torch.randint(0, 255, (sets, nbytes), dtype=torch.uint8, device=dev, generator=gen)
    variants["flat read (8 programs a SM)"] = lambda i: flat_read(flat[i], out, 8 * sms)
    rows = []
    for name, fn in variants.items():
        us = _time(fn, sets, 15)
        rows.append({"distinct": distinct, "variant": name, "us": us, "bytes": nbytes,
                     "tb_s": nbytes / (us * 1e-6) / 1e12})
    grid_us = rows[0]["us"]
    for r in rows:
        r["vs_grid"] = r["us"] / grid_us
        print(f"[{distinct} experts, {nbytes / 1e6:.1f} MB] {r['us']:7.2f} us  {r['tb_s']:5.2f} TB/s  "
              f"{r['vs_grid']:5.3f}x grid  {r['variant']}", flush=True)
    del gate, up, flat
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python3 -m iquest.lab.gate_up_probe", description=__doc__.split("\n")[0])
    p.add_argument("out", nargs="?", help="write the raw JSON here")
    args = p.parse_args(argv)
    dev = torch.device("cuda")
    report = {"probe": "gate-up", "commit": commit(), "device": torch.cuda.get_device_name(dev), "splits": SPLITS,
              "rows": [row for d in DISTINCT for row in run(d, dev)]}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
