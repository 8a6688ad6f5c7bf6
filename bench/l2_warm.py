"""What the MoE gains when its experts' weights are already in L2 as it starts (`iquest bench l2-warm`, GPU).

Why: the design document's expert prefetch (seed, "Prepare expert weights before routing finishes") warms the
predicted experts' Gate/Up weights in L2 on a side branch while attention runs. Whether that can pay depends on
how much faster the MoE runs from L2, which no earlier measurement settled: `bench tune --hot` held all of one
routing's 61.6 MB (Gate, Up and Down), more than the 50 MB L2, so it was only partly on chip.

This probe uses `bench tune`'s MoE inputs (one TP8 rank, 6 rows, 13 distinct experts a routing, 16 routings over
disjoint expert pools, the weights from HBM) and the MoE as fast/ops.py calls it (E4M3 Down, PDL). Each variant is
a CUDA graph of 16 iterations, one a routing; an iteration is a warm read, then the MoE of routing i:
  * `warm <part>`: the read takes routing i's experts' <part> weights (Gate+Up, Down, or all three) into L2 first;
  * `cold <part>`: the same read of the same size, of routing i+8's experts instead, which routing i does not use;
  * `moe only`: no read.
Warm and cold read the same bytes from HBM, so their difference is what the MoE gains from finding its weights on
chip (an oracle: every expert predicted right). The read alone is timed too (`read <part>`), and a profiler pass
gives each kernel's own duration by variant. The same warm and cold reads also precede Gate/Up's tiles streamed
alone (`bench stream-probe`'s kernel, no MoE arithmetic): how fast the bytes come once on chip. Prints us an iteration (medians of replays) and writes JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..kernels.device import sm_count
from ..provenance import commit
from ..reference.config import Config
from . import tune
from .kernels_micro import FULL_CONFIG, graph_times

PARTS = {"gate_up": ("gate", "up"), "down": ("down",), "all": ("gate", "up", "down")}
REPEATS = 15
SLEEP_CYCLES = 40_000  # ~20 us at the H200's clock: about the attention path a side branch would run beside
PIECES = (768, 12_288)  # bytes a bulk request: bulk_down's size, and one program's 128 requests covering a 1.5 MB slab


@triton.jit
def _read_kernel(base_ptr, experts_ptr, out_ptr, expert_words, per_program, BLOCK: tl.constexpr,
                 EVICT_LAST: tl.constexpr):
    """Program (expert j, chunk c) reads int32 words [c * per_program, (c + 1) * per_program) of expert
    experts[j]'s contiguous slab of expert_words (per_program divides it); their xor stored, so the loads stay."""
    e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    start = e * expert_words + tl.program_id(1).to(tl.int64) * per_program
    acc = tl.zeros([BLOCK], tl.int32)
    for off in range(0, per_program, BLOCK):
        p = base_ptr + start + off + tl.arange(0, BLOCK)
        if EVICT_LAST:
            v = tl.load(p, eviction_policy="evict_last")
        else:
            v = tl.load(p)
        acc = acc ^ v
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.xor_sum(acc, 0))


@triton.jit
def _ask_l2(ptrs, size):
    """One `cp.async.bulk.prefetch.L2` a lane for `size` bytes at `ptrs` (16-byte aligned; size <= 0: none)."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _bulk_kernel(base_ptr, experts_ptr, expert_bytes, PIECES: tl.constexpr, PIECE: tl.constexpr):
    """Program (expert j, chunk c) asks L2 for PIECES pieces of PIECE bytes of expert experts[j]'s slab, one
    `cp.async.bulk.prefetch.L2` a thread (launch.prefetch_bulk_l2's request): the copy engine fetches, nothing waits."""
    e = tl.load(experts_ptr + tl.program_id(0)).to(tl.int64)
    start = tl.program_id(1).to(tl.int64) * (PIECES * PIECE)
    off = start + tl.arange(0, PIECES).to(tl.int64) * PIECE
    size = tl.minimum(expert_bytes - off, PIECE).to(tl.int32)
    _ask_l2(base_ptr + e * expert_bytes + tl.where(size > 0, off, 0), size)


def bulk_experts(tensors: list[torch.Tensor], experts: torch.Tensor, piece: int, threads: int = 128) -> None:
    """Ask L2 for each listed expert's slab of each tensor: `piece` bytes a request, `threads` requests a program."""
    for t in tensors:
        slab = t[0].numel() * t.element_size()
        _bulk_kernel[(experts.numel(), triton.cdiv(slab, threads * piece))](t.view(torch.uint8), experts, slab,
                                                                             PIECES=threads, PIECE=piece,
                                                                             num_warps=threads // 32)


def read_experts(tensors: list[torch.Tensor], experts: torch.Tensor, out: torch.Tensor, sms: int,
                 evict_last: bool = False, block: int = 1024) -> None:
    """Read each listed expert's slab of each tensor ([E, ...] contiguous) once: ~4 programs a SM."""
    for t in tensors:
        words = t[0].numel() * t.element_size() // 4
        chunks = max(1, (4 * sms) // experts.numel())
        while chunks > 1 and words % (chunks * block):
            chunks -= 1
        if words % (chunks * block):
            raise ValueError(f"an expert's slab ({words} words) is not a multiple of {block}")
        per = words // chunks
        _read_kernel[(experts.numel(), chunks)](t.view(torch.int32), experts, out, words, per,
                                                BLOCK=block, EVICT_LAST=evict_last, num_warps=4)


def main(argv: list[str]) -> None:
    out_path = argv[0] if argv else None
    dev = torch.device("cuda")
    config = Config.from_file(FULL_CONFIG)
    shape = tune.tune_shape(config)
    sms = sm_count(dev)
    case = tune.build_case("moe", shape, dev, sms)
    engine = dict(fp8_down=True, early_down=True, pdl=True)  # fast/ops.py's call (tune's "engine" candidate)
    weights = {p: case.tensors[p] for p in ("gate", "up", "down")}  # the objects its run() reads
    routes = case.tensors["routes"]
    n = len(routes)
    distinct = [torch.unique(e.flatten()).to(torch.int32) for e, _ in routes]
    outs = [case.new_out() for _ in range(n)]
    sink = torch.zeros(1 << 16, dtype=torch.int32, device=dev)

    def moe(i):
        case.run(engine, i, outs[i])

    def variant(part: str | None, warm: bool, with_moe: bool = True, evict_last: bool = False):
        def it(i):
            if part is not None:
                src = i if warm else (i + n // 2) % n
                read_experts([weights[p] for p in PARTS[part]], distinct[src], sink, sms, evict_last)
            if with_moe:
                moe(i)
        return it

    variants = {"moe only": variant(None, True)}
    for part in PARTS:
        variants[f"cold {part}"] = variant(part, False)
        variants[f"warm {part}"] = variant(part, True)
        variants[f"read {part}"] = variant(part, True, with_moe=False)
    # Gate/Up's tiles alone (stream-probe's kernel: TMA, one E4M3 wgmma a tile against zeros, owners only, 8 splits,
    # 3 stages): how fast the bytes themselves come once on chip, without the MoE's arithmetic
    from triton.tools.tensor_descriptor import TensorDescriptor

    from .stream_probe import _stream_kernel

    BN, BK = 128, shape.block[1]
    gd = TensorDescriptor.from_tensor(weights["gate"], [1, BN, BK])
    ud = TensorDescriptor.from_tensor(weights["up"], [1, BN, BK])
    zero = torch.zeros(BK * 16, dtype=weights["gate"].dtype, device=dev)
    tiles_out = torch.empty(1 << 16, device=dev)

    def tiles(warm: bool | None):
        def it(i):
            if warm is not None:
                src = i if warm else (i + n // 2) % n
                read_experts([weights["gate"], weights["up"]], distinct[src], sink, sms)
            d = distinct[i]
            _stream_kernel[(d.numel(), shape.inter // BN, 8)](gd, ud, d, zero, tiles_out, d.numel(), shape.hidden // 8,
                                                              OWNERS_ONLY=True, N_OWNERS=d.numel(), BN=BN, BK=BK,
                                                              num_warps=4, num_stages=3)
        return it

    variants["tiles only"] = tiles(None)
    variants["cold gate_up, tiles"] = tiles(False)
    variants["warm gate_up, tiles"] = tiles(True)
    variants["warm gate_up evict_last"] = variant("gate_up", True, evict_last=True)
    variants["cold gate_up evict_last"] = variant("gate_up", False, evict_last=True)

    def asked(piece: int | None, warm: bool, with_moe: bool = True):
        """Bulk requests for Gate/Up (routing i's experts or routing i+8's), ~20 us of sleep, then the MoE."""
        def it(i):
            if piece is not None:
                src = i if warm else (i + n // 2) % n
                bulk_experts([weights["gate"], weights["up"]], distinct[src], piece)
            torch.cuda._sleep(SLEEP_CYCLES)
            if with_moe:
                moe(i)
        return it

    variants["sleep, moe"] = asked(None, True)
    variants["sleep only"] = asked(None, True, with_moe=False)
    for piece in PIECES:
        variants[f"bulk {piece} cold gate_up"] = asked(piece, False)
        variants[f"bulk {piece} warm gate_up"] = asked(piece, True)
        variants[f"bulk {piece} only"] = asked(piece, True, with_moe=False)

    for i in range(n):  # compile everything, and check warm and cold give the MoE's bits
        for f in variants.values():
            f(i)
    torch.cuda.synchronize()
    ref = [o.clone() for o in outs]
    variants["warm all"](0)
    torch.cuda.synchronize()
    same_bits = bool(torch.equal(outs[0], ref[0]))

    per_part_mb = {part: sum(weights[p][0].numel() for p in PARTS[part]) * statistics.mean(len(d) for d in distinct)
                   / 1e6 for part in PARTS}
    report = {"commit": commit(), "device": torch.cuda.get_device_name(dev), "shape": shape.text(),
              "distinct_experts": [len(d) for d in distinct], "part_mb": per_part_mb, "same_bits": same_bits,
              "repeats": REPEATS, "variants": {}}
    names_ = list(variants)
    # every variant's graph timed in one loop, the order rotated each round, so drift hits them alike
    graphs = []
    for name in names_:
        graph, calls = tune.capture([lambda i=i, f=variants[name]: f(i) for i in range(n)])
        graphs.append((graph, calls))
    times = tune.time_graphs(graphs, REPEATS)
    for name, t in zip(names_, times):
        report["variants"][name] = {"median_us": statistics.median(t), "times_us": t}
    report["kernels_us"] = _profile(variants, n)

    print(f"l2-warm at {report['commit']} on {report['device']}: {shape.text()}")
    print(f"experts a routing: {report['distinct_experts']}; MB a routing: "
          + ", ".join(f"{k} {v:.1f}" for k, v in per_part_mb.items()) + f"; warm output bit-equal: {same_bits}")
    med = {k: v["median_us"] for k, v in report["variants"].items()}
    for name in names_:
        print(f"  {name:<28} {med[name]:8.2f} us an iteration")
    gains = {}
    for part in list(PARTS) + ["gate_up evict_last"]:
        gains[part] = med[f"cold {part}"] - med[f"warm {part}"]
        print(f"  MoE gain with its {part} in L2 (cold - warm): {gains[part]:+.2f} us a call "
              f"(MoE alone {med['moe only']:.2f} us)")
    gains["tiles"] = med["cold gate_up, tiles"] - med["warm gate_up, tiles"]
    print(f"  Gate/Up's tiles alone (no MoE arithmetic) gain with them in L2: {gains['tiles']:+.2f} us a call "
          f"(alone, from HBM: {med['tiles only']:.2f} us)")
    for piece in PIECES:
        gains[f"bulk {piece}"] = med[f"bulk {piece} cold gate_up"] - med[f"bulk {piece} warm gate_up"]
        print(f"  MoE gain with Gate/Up asked of L2 in {piece}-byte requests ~20 us ahead: {gains[f'bulk {piece}']:+.2f}"
              f" us a call (asking and sleeping alone {med[f'bulk {piece} only']:.2f}, sleeping alone "
              f"{med['sleep only']:.2f})")
    report["gain_us"] = gains
    for name, ks in report["kernels_us"].items():
        print(f"  kernels, {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in ks.items()))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(report, indent=1) + "\n")


def _profile(variants: dict, n: int) -> dict[str, dict[str, float]]:
    """Each kernel's mean duration (us) by variant, from one profiled pass of eager iterations."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    for name in ("moe only", "cold gate_up", "warm gate_up", "cold all", "warm all", "bulk 12288 cold gate_up",
                 "bulk 12288 warm gate_up", "tiles only", "cold gate_up, tiles", "warm gate_up, tiles"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                for i in range(n):
                    variants[name](i)
            torch.cuda.synchronize()
        ks: dict[str, list[float]] = {}
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                ks.setdefault(_short(ev.name), []).append(ev.time_range.elapsed_us())
        out[name] = {k: statistics.median(v) for k, v in sorted(ks.items())}
    return out


def _short(kernel: str) -> str:
    return kernel.split("(")[0][:40]


if __name__ == "__main__":
    main(sys.argv[1:])
