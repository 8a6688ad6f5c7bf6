"""How fast can one layer's Gate/Up weights be streamed, by decomposition (`iquest bench stream-probe`, GPU).

Gate/Up reads 13 experts' Gate and Up slices (41 MB at one TP8 rank) in ~16 us, 2.6 TB/s, and its timeline
(`bench moe-timeline`, which the tree held up to b414030) showed every owner program streaming for ~12.8 us: the
memory system, not the program's arithmetic, sets the pace. This probe streams exactly those tiles with no MoE arithmetic at all (each [128, 128]
E4M3 tile goes through TMA into shared memory and into one E4M3 wgmma against a zero tile, the cheapest use that
keeps the load), so that decompositions can be compared on the bytes alone:
  * `gate_up`: Gate/Up's own grid: one program per (pair, I tile, K split), the non-owner pairs exiting at once;
  * `owners`: only the owner programs (13 experts x 2 I tiles x splits), no grid padding;
  * each at several K splits and pipeline depths;
  * `flat`: the same byte count read as one contiguous buffer by 4-16 programs a SM (the layout's best case), with
    16-byte loads, and with the 4-byte loads this probe used before 2026-12-01 (its earlier figures), side by side.
Each variant is timed as `iquest bench tune` times an op: a CUDA graph of back-to-back calls over rotating expert
sets (the weights come from HBM), plain launches, medians of replays, all in one process. Prints us and TB/s per variant; writes JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..kernels import moe as mk
from ..kernels.device import sm_count
from ..provenance import commit
from ..reference.config import Config
from . import tune
from .kernels_micro import FULL_CONFIG, graph_times

DRAFTS = 5  # the benchmarked round's depth: 5 draft layer calls and 6 LM heads beside the main layers
ROUND_KERNELS = 1197  # the default round's kernel launches at cac51df (bench step's eager profile, docs/PERF.md)
EXTRA_MB = (0.5, 1.0, 10.0, 100.0)  # flat reads beside the round's own stream sizes, to show the curve
# (4-byte loads, programs a SM, int32 words a program takes a step): the 16-byte-load forms, and the 4-byte form the
# probe used before 2026-12-01 (4 KB a step, 8 and 16 programs a SM)
FLAT_FORMS = ((False, 4, 1024), (False, 8, 1024), (False, 16, 1024), (False, 4, 4096), (True, 8, 1024),
              (True, 16, 1024))


@triton.jit
def _stream_kernel(g_desc, u_desc, experts_ptr, zero_ptr, out_ptr, n_pairs, k_per_split, OWNERS_ONLY: tl.constexpr,
                   N_OWNERS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (pair, tile, split) (or, OWNERS_ONLY, item (owner, tile, split)): its K range of the expert's Gate and
    Up tiles through TMA, each into one E4M3 wgmma against zeros; a pair owns its expert if it is among the first
    N_OWNERS (the others exit, as Gate/Up's non-owners do)."""
    p = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    if OWNERS_ONLY or p < N_OWNERS:
        e = tl.load(experts_ptr + p).to(tl.int32)
        zero = tl.load(zero_ptr + tl.arange(0, BK)[:, None] * 16 + tl.arange(0, 16)[None, :])  # zeros, from memory
        acc = tl.zeros([BN, 16], tl.float32)
        k0 = split * k_per_split
        for k in range(k0, k0 + k_per_split, BK):
            wg = g_desc.load([e, tile * BN, k]).reshape(BN, BK)
            wu = u_desc.load([e, tile * BN, k]).reshape(BN, BK)
            acc = tl.dot(wg, zero, acc)
            acc = tl.dot(wu, zero, acc)
        tl.store(out_ptr + (p * tl.num_programs(1) + tile) * tl.num_programs(2) + split, tl.sum(tl.sum(acc, 1), 0))


@triton.jit
def _flat_kernel(src_ptr, out_ptr, n_words, per_program, BLOCK: tl.constexpr, SCALAR: tl.constexpr = False):
    """Program i reads int32 words [i * per_program, (i + 1) * per_program) of src in BLOCK-word chunks; one value
    stored (their xor). SCALAR: the addresses built from byte offsets, as this probe read before 2026-12-01, which compiles to
    4-byte loads (`ld.global.b32`) instead of 16-byte ones (`ld.global.v4.b32`): kept to show what that cost."""
    base = tl.program_id(0).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.int32)
    for off in range(0, per_program, BLOCK):
        if SCALAR:
            b = (base + off) * 4 + tl.arange(0, BLOCK) * 4
            v = tl.load((src_ptr.to(tl.pointer_type(tl.uint8)) + b).to(tl.pointer_type(tl.int32)), mask=b < n_words * 4,
                        other=0)
        else:
            i = base + off + tl.arange(0, BLOCK)
            v = tl.load(src_ptr + i, mask=i < n_words, other=0)
        acc = acc ^ v
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, 0))


def flat_read(src: torch.Tensor, out: torch.Tensor, programs: int, scalar: bool = False, block: int = 1024) -> None:
    """Read all of `src` (bytes, a multiple of 16, 16-byte aligned) once with `programs` programs of 4 warps."""
    words = src.numel() * src.element_size() // 4
    per = triton.cdiv(triton.cdiv(words, programs), block) * block
    _flat_kernel[(triton.cdiv(words, per),)](src.view(torch.int32), out, words, per, BLOCK=block, SCALAR=scalar,
                                              num_warps=4)


def _flat_name(per_sm: int, scalar: bool, block: int) -> str:
    return f"{per_sm} programs a SM, {4 * block // 1024} KB a step" + (", 4-byte loads" if scalar else "")


def round_streams(config: Config, shape: tune.TuneShape) -> dict[str, int]:
    """Bytes of each weight stream of a layer call at one rank (router bf16, the FP8 projections, the MoE's
    `shape.distinct` experts), and of one LM head (bf16, this rank's vocabulary slice)."""
    down = shape.distinct * shape.inter * shape.hidden
    return {"router": shape.experts * shape.hidden * 2, "o_proj": shape.o[0] * shape.o[1],
            "qkv": shape.qkv[0] * shape.qkv[1], "down": down, "gate_up": 2 * down,
            "lm_head": -(-config.vocab_size // tune.TP) * shape.hidden * 2}


def stream_bound(flat_us: dict[str, float], step_us: float, layer_calls: int, lm_heads: int,
                 round_kernels: int = ROUND_KERNELS, pdl_overlap: bool = False) -> dict:
    """The round's time if every weight stream ran as fast as a flat contiguous read of its size (`flat_us`: stream
    name of `round_streams` -> us a call, measured back to back, so each includes one kernel boundary) and every
    other kernel took one bare dependent step: the kernel-per-op structure's bound at the measured stream
    efficiencies. `pdl_overlap`: each stream's boundary taken as hidden under the previous kernel (PDL), i.e. one
    step less per stream."""
    layer = sum(us for name, us in flat_us.items() if name != "lm_head")
    streams = layer_calls * (len(flat_us) - 1) + lm_heads
    us = layer_calls * layer + lm_heads * flat_us["lm_head"] + (round_kernels - streams) * step_us
    if pdl_overlap:
        us -= streams * step_us
    return {"us": us, "layer_streams_us": layer, "streams": streams, "other_kernels": round_kernels - streams}


def _time(fn, sets: int, repeats: int) -> float:
    """Median us of one call in a CUDA graph of calls back to back over `sets` rotating inputs (weights from HBM)."""
    return statistics.median(graph_times([lambda i=i: fn(i) for i in range(sets)], repeats)[0])


def main(argv: list[str]) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    out_path = argv[0] if argv else None
    dev = torch.device("cuda")
    config = Config.from_file(FULL_CONFIG)  # one TP8 rank of it (bench tune's shapes)
    shape = tune.tune_shape(config)
    E, I, H, DISTINCT = shape.experts, shape.inter, shape.hidden, shape.distinct
    BN, BK = mk.GATE_UP_BLOCK_N, shape.block[1]
    pairs = shape.rows * shape.top_k
    gen = torch.Generator(device=dev).manual_seed(0)
    gate = torch.randint(0, 120, (E, I, H), dtype=torch.uint8, device=dev, generator=gen).view(torch.float8_e4m3fn)
    up = torch.randint(0, 120, (E, I, H), dtype=torch.uint8, device=dev, generator=gen).view(torch.float8_e4m3fn)
    gd, ud = TensorDescriptor.from_tensor(gate, [1, BN, BK]), TensorDescriptor.from_tensor(up, [1, BN, BK])
    sets = 16  # disjoint expert sets of 13: 16 x 13 x 3.1 MB = 654 MB rotated, far beyond L2
    perm = torch.randperm(E, device=dev, generator=gen)
    experts = [torch.cat([perm[s * DISTINCT:(s + 1) * DISTINCT], perm[:pairs - DISTINCT]]).contiguous()
               for s in range(sets)]
    streams = round_streams(config, shape)
    nbytes = streams["gate_up"]
    flat = torch.randint(0, 255, (sets, nbytes), dtype=torch.uint8, device=dev, generator=gen)
    out = torch.empty(1 << 16, device=dev)
    zero = torch.zeros(BK * 16, dtype=torch.float8_e4m3fn, device=dev)
    sms = sm_count(dev)
    rows = []

    def stream(grid_pairs, owners_only, splits, stages, warps=4):
        kps = H // splits

        def run(i):
            _stream_kernel[(grid_pairs, I // BN, splits)](gd, ud, experts[i], zero, out, grid_pairs, kps,
                                                          OWNERS_ONLY=owners_only, N_OWNERS=DISTINCT, BN=BN, BK=BK,
                                                          num_warps=warps, num_stages=stages)
        return run

    variants = []
    for splits in (4, 8, 12, 16, 24):
        for stages in (2, 3, 4):
            variants.append((f"gate_up grid ({pairs} pairs) split {splits} stages {stages}",
                             stream(pairs, False, splits, stages)))
            variants.append((f"owners only ({DISTINCT}) split {splits} stages {stages}",
                             stream(DISTINCT, True, splits, stages)))
    for scalar, per_sm, block in FLAT_FORMS:
        variants.append((f"flat contiguous, {_flat_name(per_sm, scalar, block)}",
                         lambda i, progs=per_sm * sms, scalar=scalar, block=block: flat_read(flat[i], out, progs,
                                                                                             scalar, block)))
    # The flat read's time by size: what a weight stream of each of the round's sizes can take at best, launched
    # back to back (so each call also pays one kernel boundary): q/k/v, o_proj, the router, Down, Gate/Up, the LM head
    sizes = {name: n // 4096 * 4096 for name, n in streams.items()} | {f"{mb:g} MB": int(mb * 1e6) // 4096 * 4096
                                                                        for mb in EXTRA_MB}
    big = torch.randint(0, 255, (2 * max(sizes.values()) + (1 << 20),), dtype=torch.uint8, device=dev, generator=gen)
    rotations, flat_names = {}, {}
    for label, n in sizes.items():
        # successive calls read regions >= 8 MB apart, 64 of them for small sizes: >= 200 MB touched, beyond L2
        stride = max(n, 8 << 20) // 4096 * 4096
        regions = max(2, min(64, (big.numel() - n) // stride))
        for scalar, per_sm, block in FLAT_FORMS:
            name = f"flat {n / 1e6:.1f} MB ({label}), {_flat_name(per_sm, scalar, block)}"
            rotations[name], flat_names[name] = regions, (label, n, scalar)
            variants.append((name, lambda i, n=n, progs=per_sm * sms, stride=stride, scalar=scalar, block=block:
                             flat_read(big[i * stride:i * stride + n], out, progs, scalar, block)))
    for name, fn in variants:
        us = _time(fn, rotations.get(name, sets), 15)
        label, size, scalar = flat_names.get(name, (None, nbytes, None))
        rows.append({"variant": name, "stream": label, "scalar_loads": scalar, "us": us, "bytes": size,
                     "tb_s": size / (us * 1e-6) / 1e12})
        print(f"{us:8.2f} us  {rows[-1]['tb_s']:5.2f} TB/s  {name}", flush=True)
    flat_us = {name: min(r["us"] for r in rows if r["stream"] == name and not r["scalar_loads"]) for name in streams}
    scalar_us = {name: min(r["us"] for r in rows if r["stream"] == name and r["scalar_loads"]) for name in streams}
    from .parking import dependent_step_us

    step = dependent_step_us(dev)
    layer_calls, lm_heads = config.num_hidden_layers + DRAFTS, DRAFTS + 1
    bounds = {k: stream_bound(flat_us, step, layer_calls, lm_heads, pdl_overlap=k == "pdl") for k in ("plain", "pdl")}
    scalar_bounds = {k: stream_bound(scalar_us, step, layer_calls, lm_heads, pdl_overlap=k == "pdl")
                     for k in ("plain", "pdl")}
    print(f"dependent step {step:.2f} us; the round with every weight stream at its flat-read speed and every other "
          f"kernel one step: {bounds['plain']['us']:.0f} us ({bounds['pdl']['us']:.0f} us with each stream's boundary "
          f"hidden by PDL); with 4-byte loads, as measured before: {scalar_bounds['plain']['us']:.0f} "
          f"({scalar_bounds['pdl']['us']:.0f}) us")
    report = {"bench": "stream-probe", "commit": commit(), "device": torch.cuda.get_device_name(dev),
              "bytes": nbytes, "streams": streams, "rows": rows, "flat_us": flat_us, "flat_us_scalar": scalar_us,
              "dependent_step_us": step, "stream_bound": bounds, "stream_bound_scalar": scalar_bounds}
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
