"""`iquest bench tune`: sweep the decode kernels' launch configurations at one TP8 rank's decode shapes.

Per op (the default configuration first, then a short list of alternatives) every candidate is
1. run once eagerly and checked against the op's reference (`*_ref`) and against the default's
   output, within the op's tolerance; a candidate that raises (does not compile, refuses its
   arguments) or disagrees is reported as such and not timed;
2. captured as `bench/kernels_micro.py` does: its calls back to back in one CUDA graph (at least
   MIN_CALLS), rotating over copies of the weight / KV (>= ROTATE_BYTES, so reads come from HBM).
   The MoE does not copy its 1.2 GB expert stack: its calls rotate over routings that each choose
   a different set of ~13 experts among the 256 (disjoint sets), so every call streams its experts
   from HBM. Ops with an `out=` keyword write static per-copy outputs, and copy 0's output after
   the first replay must equal the eager one bit for bit (a candidate whose graph replays differ is
   reported, not timed);
3. timed: `repeats` rounds, each replaying every captured candidate of the op once (rotating the
   order; a short GPU sleep first, so the replays queue up behind it and launch latency stays out of
   the events), each replay timed with CUDA events; per call = replay / calls in it; median over rounds.

Reported per candidate: median us per call, spread (interquartile range / median), change vs the
default, ratio to the op's byte floor (its bytes at the device copy bandwidth measured in the same
process). Each op also names the Triton kernels one call launches (counted with Triton's launch hook
during the default's check, so the count follows the tree's wrapper); the "launch floor" row (an empty
Triton kernel in a graph, timed the same way) times launches, so a ratio to max(byte floor, launches x
launch floor) tells launch-bound from bandwidth-bound. The MoE gets one extra candidate after the
sweep: the fastest Gate/Up settings (split_k, block_k) with the fastest Down settings (down_block_n,
down_block_k), each chosen among candidates that keep the other kernel's settings at the default.
The MoE is called as fast/triton_ops.py calls it: fp32 x with compute_dtype=bf16 where moe() takes
that keyword, else bf16 x.

Nothing here changes a kernel default: the output names the best configuration per op for the
lead to apply. Shapes (defaults): R = 6 rows (decode depth 5), hidden 6144, 6 query heads + 1 KV
head of 128, 256 experts x I_r 256, top-8, 1K context.
"""

from __future__ import annotations

import gc
import inspect
import json
import math
import platform
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import triton

from ..fast.cache import RING_SLACK
from ..kernels import decode_attention as da
from ..kernels import fp8_linear as fl
from ..kernels.fp8_linear_direct import direct_weight
from ..kernels import moe as mk
from ..kernels.f16_operands import empty_tiles, f16_rows_tiles_ref
from ..kernels import rmsnorm_residual as rn
from ..kernels import router as rt
from ..reference.config import Config
from ..reference.fp8 import E4M3
from .kernels_micro import (FULL_CONFIG, MIN_CALLS, ROTATE_BYTES, TP, capture_calls, error_text, linear_bytes,
                            rel_diff)

OPS = ("moe", "linear_qkv", "linear_o", "attention_sliding", "attention_full", "router", "norm")
LAUNCH = "launch"
H200_SMS = 132  # candidate lists for tests and --help are built for the H200's SM count
LINEAR_LOCKS = 4096  # fast/triton_ops.py's split-K counters (one per output tile)
# max |y - ref| / max |ref| (kernels_micro, tests/test_kernel_*): bf16 outputs; the router's fp32 scores and weights;
# the norm's fp32 output of a residual sum rounded to bf16 (which Triton's CPU interpreter truncates: one bf16 ulp)
TOL = {"moe": 1e-2, "linear_qkv": 1e-2, "linear_o": 1e-2, "attention_sliding": 3e-2, "attention_full": 3e-2,
       "router": 5e-5, "norm": 1e-2}
NOISE = 0.02  # a candidate must beat the default by more than this (and the two spreads) to be recommended
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU sleep before each timing round: the round's replays queue behind it
ROUTINGS = 16  # MoE calls rotate over this many routings (disjoint expert sets when E allows)


# ---- shapes ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneShape:
    rows: int = 6  # R: a decode block at depth 5
    hidden: int = 6144
    q_heads: int = 6  # per rank
    kv_heads: int = 1
    head_dim: int = 128
    experts: int = 256
    top_k: int = 8
    inter: int = 256  # I_r: this rank's slice of an expert's intermediate dimension
    block: tuple[int, int] = (128, 128)
    context: int = 1024  # history positions before the block (the block's own rows are written too)
    window: int = 4096
    ring_slots: int = 4096 + RING_SLACK  # a sliding layer's ring (fast/cache.py)
    full_slots: int = 196_608  # a full layer's capacity: one slot per position up to the maximum context
    distinct: int = 13  # distinct experts one routing of the block chooses (measured 12.9 on the full model)
    norm_topk_prob: bool = True
    scaling: float = 1.0

    @property
    def kv_len(self) -> int:  # slots holding history: positions 0 .. context + rows - 1
        return self.context + self.rows

    @property
    def qkv(self) -> tuple[int, int]:  # (N, K) of the fused q/k/v weight
        return (self.q_heads + 2 * self.kv_heads) * self.head_dim, self.hidden

    @property
    def o(self) -> tuple[int, int]:
        return self.hidden, self.q_heads * self.head_dim

    def text(self) -> str:
        return (f"one TP{TP} rank: R={self.rows} rows, H={self.hidden}, {self.q_heads} q heads + {self.kv_heads} kv "
                f"head of {self.head_dim}, E={self.experts} experts x I_r={self.inter}, top-{self.top_k}, "
                f"{self.context} context (ring {self.ring_slots} slots, full layer {self.full_slots})")


def tune_shape(config: Config, tp: int = TP, rows: int = 6, context: int = 1024) -> TuneShape:
    return TuneShape(rows=rows, hidden=config.hidden_size, q_heads=config.num_attention_heads // tp,
                     kv_heads=max(1, config.num_key_value_heads // tp), head_dim=config.head_dim,
                     experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                     inter=config.moe_intermediate_size // tp, block=tuple(config.weight_block_size),
                     context=context, window=config.sliding_window, ring_slots=config.sliding_window + RING_SLACK,
                     full_slots=config.max_position_embeddings, norm_topk_prob=config.norm_topk_prob,
                     scaling=float(config.routed_scaling_factor))


WRAPPERS: dict[str, Callable] = {"moe": mk.moe, "linear_qkv": fl.fp8_linear, "linear_o": fl.fp8_linear,
                                 "attention_sliding": da.decode_attention, "attention_full": da.decode_attention,
                                 "router": rt.route, "norm": rn.rmsnorm_residual}
TUNABLES = {"moe": ("split_k", "block_k", "gate_up_block_n", "gate_up_warps", "gate_up_stages", "down_block_n",
                    "down_block_k", "down_warps", "down_stages", "f16", "f16_input", "tma", "fp8_down", "early_down"),
            "linear": ("split_k", "block_n", "num_warps", "num_stages", "preload", "direct"),
            "attention": ("num_splits", "block_n", "min_split", "num_warps", "num_stages", "combine_splits",
                          "combine_cols", "combine_warps"),
            "router": ("split", "block_e", "block_h", "num_warps", "select_warps", "packed_topk", "preload"),
            "norm": ("num_warps", "f16_out")}
# The MoE's independent kernels: the extra "combined best" candidate takes each group's fastest settings.
# (tma is one switch for both kernels' weight loads; it sits with Gate/Up's, whose bytes dominate.)
MOE_GROUPS = (("split_k", "block_k", "gate_up_block_n", "gate_up_warps", "gate_up_stages", "f16", "f16_input", "tma"),
              ("down_block_n", "down_block_k", "down_warps", "down_stages", "fp8_down", "early_down"))


def family(op: str) -> str:
    return op.split("_")[0] if op.startswith(("linear", "attention")) else op


def wrapper_defaults(fn: Callable) -> dict:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


# ---- candidates ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    kwargs: tuple[tuple[str, object], ...] = ()  # keywords given to the wrapper; () = all its defaults
    note: str = ""

    @property
    def kw(self) -> dict:
        return dict(self.kwargs)


def cand(note: str = "", **kw) -> Candidate:
    return Candidate(tuple(sorted(kw.items())), note)


def _moe_dims(shape: TuneShape, gate_up_block_n: int = mk.GATE_UP_BLOCK_N) -> tuple[int, int, int, int, int, int]:
    """(P, E, k, H, I, Gate/Up block_n) as moe() computes them."""
    return (shape.rows * shape.top_k, shape.experts, shape.top_k, shape.hidden, shape.inter,
            mk._pow2_divisor(shape.inter, gate_up_block_n))


def _linear_auto_split(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """fp8_linear.choose_split_k with the SM count given (it reads it from the device)."""
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    return max(1, min(k_tiles, (2 * sms) // n_tiles))


def _attention_auto_splits(slots: int, kv_heads: int, min_split: int, sms: int) -> int:
    """decode_attention.default_num_splits with the SM count given."""
    return max(1, min(triton.cdiv(slots, min_split), max(1, 2 * sms // kv_heads)))


def _router_auto_split(e: int, h: int, block_e: int, block_h: int, sms: int) -> int:
    """router.choose_split with the SM count given."""
    e_tiles, h_tiles = triton.cdiv(e, block_e), triton.cdiv(h, block_h)
    return max(1, min(h_tiles, triton.cdiv(rt.PROGRAMS_PER_SM * sms, e_tiles)))


def attention_slots(op: str, shape: TuneShape) -> int:
    """k.shape[0] of the op's cache: ring or full capacity, plus the trash slot."""
    return (shape.ring_slots if op == "attention_sliding" else shape.full_slots) + 1


def attention_window(op: str, shape: TuneShape) -> int | None:
    """The window decode_attention is given for the op: the sliding layers' or none."""
    return shape.window if op == "attention_sliding" else None


def resolve(op: str, kw: dict, shape: TuneShape, sms: int) -> dict:
    """The launch configuration the wrapper ends up with for keywords `kw` (its defaults for the rest): split
    counts as launched (after the wrappers' rounding to whole tiles), so equal dicts mean equal launches."""
    d = wrapper_defaults(WRAPPERS[op])
    g = {**d, **kw}
    if op == "moe":
        P, E, k, H, I, bn = _moe_dims(shape, g["gate_up_block_n"])
        fp8 = bool(g["fp8_down"] and mk.fp8_down_fits(g["down_block_n"]))  # on the GPU, which tunes run on
        bk = mk._pow2_divisor(shape.block[1], g["block_k"])
        split, _ = mk.plan_split(P, E, k, H, I, bn, bk, g["split_k"], sms)
        return {"split_k": split, "block_k": bk, "gate_up_block_n": bn, "gate_up_warps": g["gate_up_warps"],
                "gate_up_stages": g["gate_up_stages"], "down_block_n": g["down_block_n"],
                "down_block_k": mk._pow2_divisor(shape.block[1], mk.down_tile(fp8, g["down_block_k"])[0]),
                "down_warps": g["down_warps"], "down_stages": mk.down_tile(fp8, None, g["down_stages"])[1],
                "f16": g["f16"],
                # the engine's call: x's tiles made by the norm; TMA where aligned (it is here)
                "f16_input": g["f16"] and (g["f16_input"] is None or bool(g["f16_input"])),
                "tma": True if g["tma"] is None else g["tma"],
                "fp8_down": fp8, "early_down": g["early_down"]}
    if family(op) == "linear":
        n, k = shape.qkv if op == "linear_qkv" else shape.o
        bk = fl._block_k(shape.block[1])
        split = g["split_k"] or _linear_auto_split(n, k, g["block_n"], bk, sms)
        k_per_split = triton.cdiv(triton.cdiv(k, bk), split) * bk
        direct = {"direct": True} if g["direct"] else {}  # the Gluon kernel (direct=True here: the weight's copy)
        return {"split_k": triton.cdiv(k, k_per_split), "block_n": g["block_n"], "num_warps": g["num_warps"],
                "num_stages": g["num_stages"], "preload": bool(g["preload"] and fl.preload_tiles(k, k_per_split, bk)),
                **direct}
    if family(op) == "attention":
        bn = g["block_n"]
        ms = bn if g["min_split"] is None else g["min_split"]  # decode_attention's default: one tile
        ns = g["num_splits"] or _attention_auto_splits(attention_slots(op, shape), shape.kv_heads, ms, sms)
        per = max(triton.cdiv(triton.cdiv(shape.kv_len, ns), bn) * bn, ms)  # the kernels' _split_len
        return {"num_splits": ns, "live_splits": triton.cdiv(shape.kv_len, per), "block_n": bn, "min_split": ms,
                "num_warps": g["num_warps"], "num_stages": g["num_stages"] or da.default_num_stages(
                    attention_window(op, shape)), "combine_splits": g["combine_splits"],
                "combine_cols": g["combine_cols"], "combine_warps": g["combine_warps"]}
    if op == "router":
        split = g["split"] or _router_auto_split(shape.experts, shape.hidden, g["block_e"], g["block_h"], sms)
        splits, h_per_split = rt._split_plan(shape.hidden, split, g["block_h"])
        return {"split": splits, "block_e": g["block_e"], "block_h": g["block_h"], "num_warps": g["num_warps"],
                "select_warps": g["select_warps"], "packed_topk": g["packed_topk"],
                "preload": bool(g["preload"] and h_per_split == g["block_h"])}  # route()'s rule: one tile a split
    if op == "norm":  # by default as the engine calls it: with the MoE's operand tiles
        return {"num_warps": g["num_warps"], "f16_out": g["f16_out"] is None or bool(g["f16_out"])}
    raise ValueError(f"unknown op {op!r}")


def label(resolved: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in resolved.items())


def _raw_candidates(op: str, shape: TuneShape, sms: int) -> list[Candidate]:
    if op == "moe":
        s = resolve(op, {}, shape, sms)["split_k"]
        engine = dict(fp8_down=True, early_down=True)  # as fast/triton_ops.py calls it (early_down needs --pdl)
        return [cand(),
                cand("engine", **engine),
                # Down's grid in the engine's form: fewer, wider programs (fewer waves behind the owners) or more warps
                cand("engine down", **engine, down_block_n=256), cand("engine down", **engine, down_block_n=256,
                                                                      down_warps=8),
                cand("engine down", **engine, down_warps=8), cand("engine down", **engine, down_block_n=64),
                cand("engine down", **engine, down_stages=1),
                # E4M3 x E4M3 in Down's tensor cores (wgmma, weight tile as the row operand): a numerical change;
                # its own Down defaults (128-deep tiles, 2 stages: the best of ten at a1380b4) and neighbours
                cand(fp8_down=True), cand(fp8_down=True, down_block_k=64), cand(fp8_down=True, down_stages=3),
                cand(fp8_down=True, down_block_n=256), cand(fp8_down=True, down_block_n=64),
                cand("2x auto split", split_k=2 * s), cand("4x auto split", split_k=4 * s),
                cand(block_k=128), cand("2x auto split", block_k=128, split_k=2 * s),
                cand(down_block_n=32), cand(down_block_n=128), cand(down_block_k=64),
                cand(down_block_n=32, down_block_k=64), cand(down_block_n=128, down_block_k=64),
                cand("2x auto split", split_k=2 * s, down_block_n=128),
                cand("932ec08 default", block_k=64, down_block_n=64, down_block_k=128),
                # Gate/Up's and Down's launch settings: more bytes in flight per SM (deeper pipelines, narrower
                # tiles with more programs, fewer warps per program so more programs fit)
                cand(gate_up_stages=2), cand(gate_up_stages=4), cand(gate_up_stages=5), cand(gate_up_warps=8),
                cand(gate_up_warps=8, gate_up_stages=4), cand(gate_up_block_n=64),
                cand(gate_up_block_n=64, gate_up_warps=8), cand(gate_up_block_n=64, gate_up_stages=4),
                cand(down_warps=8), cand(down_stages=3), cand(down_stages=4), cand(down_warps=8, down_stages=4),
                # bf16 tensor-core operands (before ef1c46c): two conversion steps per E4M3 weight
                cand("bf16 operands", f16=False),
                cand(down_stages=2), cand(down_block_k=128), cand(gate_up_block_n=64, gate_up_stages=3),
                # x rescaled by every Gate/Up program, weight tiles through per-element pointers (before 242fbb5)
                cand("x rescaled in the programs", f16_input=False), cand("pointer loads", tma=False),
                # with TMA: wider Down tiles, more warps
                cand(down_block_n=256), cand(gate_up_warps=8, down_warps=8), cand(down_block_k=128, down_stages=2)]
    if family(op) == "linear":
        auto = {bn: resolve(op, {"block_n": bn}, shape, sms)["split_k"] for bn in (16, 32, 64, 128)}
        half = {bn: max(1, a // 2) for bn, a in auto.items()}
        narrow = max(auto[16], auto[32])  # 16-wide tiles keep the 32-wide split: whole splits of <= 8 tiles (preload)
        return [cand(), cand("auto/2", split_k=half[64]), cand("auto x2", split_k=2 * auto[64]),
                cand(num_warps=8), cand(num_stages=4), cand(num_warps=8, num_stages=4),
                cand(block_n=32), cand("auto x2", block_n=32, split_k=2 * auto[32]), cand(block_n=32, num_stages=4),
                cand(block_n=128), cand(block_n=128, num_warps=8), cand("auto/2", block_n=128, split_k=half[128]),
                cand(block_n=128, num_warps=8, num_stages=4), cand("932ec08 default", block_n=64, num_stages=3),
                # constant weights read into registers before the PDL wait (meaningful with --pdl)
                cand("engine", preload=True),
                # the engine's form (preload) with the router's shape of work: fewer warps a program, more programs
                # (the router's logits, 768 one-warp programs, stream their 3.1 MB in ~2.6 us of the captured round)
                cand("engine warps", preload=True, num_warps=2), cand("engine warps", preload=True, num_warps=1),
                cand("engine warps", preload=True, num_warps=2, block_n=16, split_k=narrow),
                cand("engine warps", preload=True, num_warps=1, block_n=16, split_k=narrow),
                cand("engine warps x2", preload=True, num_warps=2, split_k=2 * auto[32]),
                cand("engine warps x2", preload=True, num_warps=1, block_n=16, split_k=2 * narrow),
                # shorter chains a program: half the K tiles each (twice the splits), or 64-wide tiles
                cand("engine x2", preload=True, split_k=2 * auto[32]), cand("engine x4", preload=True, split_k=4 * auto[32]),
                cand("engine 64", preload=True, block_n=64, split_k=auto[32]),
                cand("engine 8 warps", preload=True, num_warps=8),
                # operands straight into the MMA's registers (kernels/fp8_linear_direct.py, Gluon): 16 output columns
                # and 8 rows a program, its K tiles over 2 warps; the same splits as the engine's form
                cand("engine direct", preload=True, direct=True)]
    if family(op) == "attention":
        return [cand(), cand(min_split=128), cand(min_split=64), cand(min_split=64, num_warps=8),
                cand("f48fb0e default", num_stages=2), cand(num_stages=3), cand(num_stages=4),
                cand(min_split=128, num_stages=2),
                cand(block_n=32, min_split=64), cand(block_n=32, min_split=32),
                cand(block_n=128, min_split=128, num_warps=8), cand("932ec08 default", min_split=256),
                # the combine: more splits a step, wider column blocks (fewer programs, more warps each)
                cand(combine_splits=256, combine_warps=8), cand(combine_cols=64, combine_warps=8),
                cand(combine_cols=128, combine_splits=64, combine_warps=8)]
    if op == "router":
        s = resolve(op, {}, shape, sms)["split"]
        return [cand(), cand("auto/2", split=max(1, s // 2)), cand(block_h=256),
                cand("auto x2", block_h=256, split=2 * s),
                cand(num_warps=2), cand(block_e=8, num_warps=2), cand("default's split", block_e=2, split=s),
                cand("auto x2", block_e=8, block_h=256, split=2 * s),
                cand("the fp32 router's 8 KB tile", block_h=1024),  # a bf16 tile holds half the bytes in flight
                cand(select_warps=1), cand(select_warps=2), cand(select_warps=8),  # packed top-k keys (default)
                # the select's top-k by two reductions per round (before 64-bit keys): the same bits, "=" vs the default
                cand("two-reduction top-k", packed_topk=False),
                cand(preload=True)]  # the weight tile before the PDL wait (see linear)
    if op == "norm":  # one program per row: its warps set the reduction tree, so other counts may round differently
        return [cand(), cand(num_warps=1), cand(num_warps=2), cand(num_warps=4), cand(num_warps=16),
                cand("without the MoE's tiles", f16_out=False)]
    raise ValueError(f"unknown op {op!r}")


def candidates(op: str, shape: TuneShape, sms: int, only: tuple[str, ...] = ()) -> list[Candidate]:
    """The op's candidates, the default (no keywords) first; alternatives that resolve to a launch already
    listed are left out (e.g. a doubled split that the wrapper rounds back to the same count). `only`: keep just
    the default and the candidates whose label or note contains one of these strings."""
    out, seen = [], set()
    for j, c in enumerate(_raw_candidates(op, shape, sms)):
        res = resolve(op, c.kw, shape, sms)
        key = tuple(res.items())
        if j and only and not any(o in label(res) or o in c.note for o in only):
            continue
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


# ---- the launch floor ----------------------------------------------------------------------------------
@triton.jit
def _empty_kernel(x_ptr):
    pass


def launch_programs(sms: int) -> tuple[int, ...]:
    return (1, 2 * sms)


# ---- op cases: inputs, the timed call, the check -----------------------------------------------------
@dataclass
class OpCase:
    op: str
    desc: str
    bytes: int  # per call, at least: the floor's numerator
    launches: int  # kernel launches per call
    copies: int  # calls the graph rotates over
    run: Callable  # (kw, copy index, out or None) -> output(s)
    ref: object  # copy 0's reference output(s)
    new_out: Callable | None = None  # () -> a static output for one copy (ops with `out=`)
    prepare: Callable | None = None  # (kw) -> extra keywords shared by the candidate's calls (static workspaces)
    facts: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # inputs a probe may need by name (the MoE: weights and routings)


def _gen(device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _copies(nbytes: int, rotate: int) -> int:
    return max(1, math.ceil(rotate / nbytes))


def _fp8(shape: tuple[int, ...], g, device, chunk: int = 1 << 26) -> torch.Tensor:
    """Random E4M3 values (standard normal, saturated at 448), generated in chunks (1.2 GB stacks)."""
    out = torch.empty(shape, dtype=E4M3, device=device)
    flat = out.view(-1)
    for i in range(0, flat.numel(), chunk):
        n = min(chunk, flat.numel() - i)
        flat[i:i + n] = torch.randn(n, generator=g, device=device).to(E4M3)
    return out


def _scales(shape: tuple[int, ...], g, device) -> torch.Tensor:
    return (torch.rand(shape, generator=g, device=device) + 0.5) / 64


def routings(shape: TuneShape, count: int, device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` routings (experts [R, k] int64, weights [R, k] fp32, rows normalized) of the block, each over
    its own pool of `shape.distinct` experts (disjoint pools while E allows, so consecutive calls share no
    expert): row r takes k consecutive pool entries from r * step (cyclically), in shuffled slot order, so rows
    share experts as decode rows do (step 2: 6 rows at k = 8 over a pool of 13 use all 13; a larger pool widens the
    step until the rows cover it, e.g. 6 apart for the 38 of real requests)."""
    R, k, E = shape.rows, shape.top_k, shape.experts
    d = min(max(k, shape.distinct), E)
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(1))
    step = max(2, -(-(d - k) // max(1, R - 1)))
    out = []
    for v in range(count):
        pool = perm.roll(-v * d)[:d]
        rows = []
        for r in range(R):
            idx = (step * r + torch.arange(k)) % d
            idx = idx[torch.randperm(k, generator=torch.Generator().manual_seed(100 * v + r))]
            rows.append(pool[idx])
        w = torch.rand(R, k, generator=torch.Generator().manual_seed(7 + v)) + 0.1
        out.append((torch.stack(rows).to(device), (w / w.sum(1, keepdim=True)).to(device)))
    return out


def moe_takes_fp32_x() -> bool:
    """Whether moe() takes fp32 x with compute_dtype=bf16 (rounded in its registers), as fast/triton_ops.py
    then calls it; otherwise the caller converts x to bf16 first."""
    return "compute_dtype" in inspect.signature(mk.moe).parameters


def moe_case(shape: TuneShape, device, rotate: int = ROTATE_BYTES) -> OpCase:
    g = _gen(device, 0)
    R, H, E, I, (b0, b1) = shape.rows, shape.hidden, shape.experts, shape.inter, shape.block
    gate, up = _fp8((E, I, H), g, device), _fp8((E, I, H), g, device)
    down = _fp8((E, H, I), g, device)
    gs = _scales((E, triton.cdiv(I, b0), triton.cdiv(H, b1)), g, device)
    us = _scales((E, triton.cdiv(I, b0), triton.cdiv(H, b1)), g, device)
    ds = _scales((E, triton.cdiv(H, b0), triton.cdiv(I, b1)), g, device)
    x32 = torch.randn(R, H, generator=g, device=device)
    fp32_x = moe_takes_fp32_x()
    x = x32 if fp32_x else x32.to(torch.bfloat16)
    given = {"compute_dtype": torch.bfloat16} if fp32_x else {}
    live = torch.ones(R, dtype=torch.bool, device=device)
    per_expert = 3 * I * H + 4 * (gs[0].numel() + us[0].numel() + ds[0].numel())
    routes = routings(shape, ROUTINGS, device)
    distinct = [len(set(e.flatten().tolist())) for e, _ in routes]
    nbytes = round(statistics.mean(distinct)) * per_expert + x.element_size() * R * H + 2 * R * H

    tiles = {}  # f16_input=True: x's operand tiles for that K tile, made once (the engine's norm makes them)

    def run(kw, i, out=None):
        e, w = routes[i]
        # By default as the engine calls it: the tiles made by the norm (fp16 operands only); False: none.
        if kw.get("f16_input", True) and kw.get("f16", True):
            tile = mk.gate_up_k_tile(shape.block, kw.get("block_k", 128))
            if tile not in tiles:
                tiles[tile] = tuple(t.contiguous() for t in f16_rows_tiles_ref(x32.to(torch.bfloat16), tile))
            kw = {**kw, "f16_input": tiles[tile]}
        else:
            kw = {**kw, "f16_input": None}
        return mk.moe(x, e, w, live, gate, gs, up, us, down, ds, shape.block, group=b1, out_dtype=torch.bfloat16,
                      out=out, **given, **kw)

    ref = mk.moe_ref(x32.to(torch.bfloat16), routes[0][0], routes[0][1], live, gate, gs, up, us, down, ds,
                     shape.block, b1)
    xs = "fp32 (compute_dtype bf16: rounded in the kernel)" if fp32_x else "bf16"
    return OpCase("moe", f"x [{R}, {H}] {xs}, {E} experts x I_r {I} (E4M3, {b0}x{b1} scales), top-{shape.top_k}; "
                         f"{len(routes)} routings of {min(distinct)}..{max(distinct)} distinct experts "
                         f"({sum(distinct) * per_expert / 1e6:.0f} MB of experts per rotation)",
                  nbytes, 4, len(routes), run, ref,
                  new_out=lambda: torch.empty(R, H, dtype=torch.bfloat16, device=device),
                  facts={"distinct_experts": distinct, "expert_bytes": per_expert, "x_dtype": str(x.dtype)},
                  tensors={"gate": gate, "up": up, "down": down, "routes": routes})


def linear_case(op: str, shape: TuneShape, device, rotate: int = ROTATE_BYTES) -> OpCase:
    g = _gen(device, 1)
    n, k = shape.qkv if op == "linear_qkv" else shape.o
    m, (b0, b1) = shape.rows, shape.block
    w0 = _fp8((n, k), g, device)
    s0 = _scales((triton.cdiv(n, b0), triton.cdiv(k, b1)), g, device)
    copies = _copies(n * k, rotate)
    ws = [(w0, s0)] + [(w0.clone(), s0.clone()) for _ in range(copies - 1)]
    xq = torch.randn(m, k, generator=g, device=device).to(E4M3)  # x = E4M3 x powers of two: exact in bf16
    x = (xq.float() * torch.exp2(torch.randint(-3, 3, (m, 1), generator=g, device=device).float())).to(torch.bfloat16)

    def run(kw, i, out=None, locks=None, directs=None):
        w, s = ws[i]
        if kw.get("direct"):  # direct=True: fp8_linear's direct= with this copy's weight in the MMA's order
            kw = dict(kw, direct=directs[i])
        return fl.fp8_linear(x, w, s, shape.block, out_dtype=x.dtype, out=out, locks=locks, **kw)

    def prepare(kw):  # before any capture: the counters, and the direct-ordered copies a direct candidate reads
        extra = {"locks": torch.zeros(LINEAR_LOCKS, dtype=torch.int32, device=device)}
        if kw.get("direct"):
            extra["directs"] = [direct_weight(w) for w, _ in ws]
        return extra

    what = "q/k/v fused" if op == "linear_qkv" else "o_proj"
    return OpCase(op, f"{what}: x [{m}, {k}] bf16 @ W[{n}, {k}]^T E4M3 ({b0}x{b1} scales), split-K summed in the "
                      f"launch (fast/triton_ops.py's {LINEAR_LOCKS} counters); {copies} weight copies",
                  linear_bytes("triton", m, n, k), 1, copies, run,
                  fl.fp8_linear_ref(x, w0, s0, shape.block, torch.float32),
                  new_out=lambda: torch.empty(m, n, dtype=x.dtype, device=device),
                  prepare=prepare, facts={"n": n, "k": k})


def attention_case(op: str, shape: TuneShape, device, sms: int, rotate: int = ROTATE_BYTES) -> OpCase:
    """A cache as fast/cache.py holds it after `context` positions and the block's own rows: positions
    0 .. kv_len-1 at slot = position (neither a ring of `ring_slots` nor a full layer has wrapped), the rest
    and the trash slot empty; kv_len = last position + 1 as the model passes it to every layer. The copies
    are views into one buffer, `stride` slots apart (>= kv_len: the slots a call reads never overlap)."""
    g = _gen(device, 2)
    R, hq, hkv, d, n = shape.rows, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len
    slots = attention_slots(op, shape)
    if n > slots - 1:
        raise ValueError(f"context {shape.context} + {R} rows does not fit {slots - 1} slots")
    window = attention_window(op, shape)
    kv = 2 * n * hkv * d * 2
    copies, stride = _copies(kv, rotate), triton.cdiv(n, 64) * 64
    total = (copies - 1) * stride + slots
    kbuf = torch.randn(total, hkv, d, generator=g, device=device).to(torch.bfloat16)
    vbuf = torch.randn(total, hkv, d, generator=g, device=device).to(torch.bfloat16)
    ks = [kbuf[i * stride:i * stride + slots] for i in range(copies)]
    vs = [vbuf[i * stride:i * stride + slots] for i in range(copies)]
    ar = torch.arange(slots, device=device)
    slot_pos = torch.where(ar < n, ar, -1)
    q = (torch.randn(R, hq, d, generator=g, device=device) * 0.6).to(torch.bfloat16)
    q_pos = torch.arange(n - R, n, device=device)
    sinks = torch.randn(hq, generator=g, device=device)
    kv_len = torch.tensor([n], device=device)

    def run(kw, i, out=None, workspace=None):
        return da.decode_attention(q, ks[i], vs[i], slot_pos, q_pos, sinks, window, 0, kv_len, out=out,
                                   workspace=workspace, **kw)

    def prepare(kw):
        ns = resolve(op, kw, shape, sms)["num_splits"]
        return {"workspace": da.decode_attention_workspace(R, hq, hkv, d, ns, device)}

    kind = f"sliding (window {shape.window}, ring of {slots - 1} slots)" if window else f"full ({slots - 1} slots)"
    ref = da.decode_attention_ref(q, ks[0], vs[0], slot_pos, q_pos, sinks, window, 0, kv_len)
    return OpCase(op, f"{kind}, {shape.context} context + {R} rows = kv_len {n}; q [{R}, {hq}, {d}] bf16, sinks; "
                      f"{copies} KV copies", kv + 8 * n + 2 * 2 * R * hq * d, 2, copies, run, ref,
                  new_out=lambda: torch.empty_like(q), prepare=prepare,
                  facts={"slots": slots, "kv_len": n, "stride": stride})


def router_case(shape: TuneShape, device, rotate: int = ROTATE_BYTES) -> OpCase:
    g = _gen(device, 3)
    R, H, E, k = shape.rows, shape.hidden, shape.experts, shape.top_k
    x = torch.randn(R, H, generator=g, device=device)
    w0 = (torch.randn(E, H, generator=g, device=device) * 0.05).bfloat16()  # held in bf16, as fast/weights.py does
    copies = _copies(2 * E * H, rotate)
    ws = [w0] + [w0.clone() for _ in range(copies - 1)]

    def run(kw, i, out=None):
        return rt.route(x, ws[i], k, shape.norm_topk_prob, shape.scaling, **kw)

    return OpCase("router", f"x [{R}, {H}] fp32 @ router_w [{E}, {H}]^T bf16, softmax, top-{k}; {copies} weight copies",
                  2 * E * H + 4 * R * H + R * E * 4 + R * k * 12, 2, copies, run,
                  rt.route_ref(x, w0, k, shape.norm_topk_prob, shape.scaling))


def norm_case(shape: TuneShape, device) -> OpCase:
    """The post-attention norm as the engine calls it: bf16 residual + attention output, fp32 normalized rows for
    routing, and (by default) the MoE input's fp16 operand tiles. Its inputs are activations just written, so they
    are read from L2, as here (no copies)."""
    g = _gen(device, 4)
    R, H = shape.rows, shape.hidden
    x = torch.randn(R, H, generator=g, device=device).to(torch.bfloat16)
    attn = (torch.randn(R, H, generator=g, device=device) / 8).to(torch.bfloat16)
    w = (torch.rand(H, generator=g, device=device) + 0.5).to(torch.bfloat16)
    tile = mk.gate_up_k_tile(shape.block)
    tiles = empty_tiles(R, H, tile, device)
    eps = 1e-6

    def run(kw, i, out=None):
        kw = {**kw, "f16_out": tiles if kw.get("f16_out", True) else None}
        return rn.rmsnorm_residual(attn, x, w, eps, torch.float32, out=out, **kw)[0]

    return OpCase("norm", f"residual add + RMSNorm of [{R}, {H}] bf16, fp32 output, the MoE's fp16 tiles of "
                          f"{tile} columns; inputs from L2", R * H * (2 + 2 + 4 + 2 + 2) + 2 * H, 1, 1, run,
                  rn.rmsnorm_residual_ref(attn, x, w, eps, torch.float32)[0],
                  new_out=lambda: torch.empty(R, H, dtype=torch.float32, device=device))


def build_case(op: str, shape: TuneShape, device, sms: int, rotate: int = ROTATE_BYTES) -> OpCase:
    if op == "moe":
        return moe_case(shape, device, rotate)
    if family(op) == "linear":
        return linear_case(op, shape, device, rotate)
    if family(op) == "attention":
        return attention_case(op, shape, device, sms, rotate)
    if op == "router":
        return router_case(shape, device, rotate)
    if op == "norm":
        return norm_case(shape, device)
    raise ValueError(f"unknown op {op!r}")


def compare(op: str, got, want) -> tuple[float, str | None]:
    """(difference, why it fails or None): max |got - want| / max |want| for tensors; the router's scores and
    weights that way with its experts equal."""
    if op == "router":
        (w, e, s), (w2, e2, s2) = got, want
        diff = max(rel_diff(s, s2), rel_diff(w, w2))
        if not torch.equal(e.cpu(), e2.cpu()):
            return diff, "chosen experts differ"
        return diff, (f"{diff:.1e} > tol {TOL[op]:.0e}" if diff > TOL[op] else None)
    diff = rel_diff(got, want)
    return diff, (f"{diff:.1e} > tol {TOL[op]:.0e}" if not diff <= TOL[op] else None)


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes (NaN payloads and -0 included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


class LaunchCounter:
    """Names of the Triton kernels launched inside the block (Triton's launch hook; nothing under the
    interpreter, which does not call it)."""

    def __init__(self):
        self.names: list[str] = []

    def _hook(self, meta) -> None:
        try:
            self.names.append(str(meta.get()["name"]))
        except Exception:
            self.names.append("?")

    def __enter__(self):
        try:
            triton.knobs.runtime.launch_enter_hook.add(self._hook)
        except Exception:
            pass
        return self

    def __exit__(self, *exc):
        try:
            triton.knobs.runtime.launch_enter_hook.remove(self._hook)
        except Exception:
            pass
        return False


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def check(case: OpCase, kw: dict, default_out) -> tuple[dict, object]:
    """Run the candidate once on copy 0 (eager) and compare: ({status fields}, its output)."""
    extra = case.prepare(kw) if case.prepare else {}
    out = case.run(kw, 0, None, **extra)
    _sync()
    row = {}
    row["rel_diff_vs_ref"], why = compare(case.op, out, case.ref)
    if why:
        row.update(status="mismatch", error=f"vs the reference: {why}")
    if default_out is not None:
        row["rel_diff_vs_default"], why2 = compare(case.op, out, default_out)
        if why2 and not why:
            row.update(status="mismatch", error=f"vs the default: {why2}")
    row.setdefault("status", "ok")
    return row, out


# ---- timing ------------------------------------------------------------------------------------------
def capture(calls: list[Callable[[], object]]) -> tuple[torch.cuda.CUDAGraph, int]:
    """kernels_micro.capture_calls with this sweep's MIN_CALLS, synchronized."""
    graph, n = capture_calls(calls, MIN_CALLS)
    torch.cuda.synchronize()
    return graph, n


def _queue_behind_sleep() -> None:
    try:
        torch.cuda._sleep(SLEEP_CYCLES)
    except Exception:  # a private helper: without it the first replay of a round carries its launch latency
        pass


def time_graphs(graphs: list[tuple[torch.cuda.CUDAGraph, int]], repeats: int) -> list[list[float]]:
    """Per graph, `repeats` per-call times (us): each round replays every graph once, the order rotated."""
    times: list[list[float]] = [[] for _ in graphs]
    for rep in range(repeats):
        _queue_behind_sleep()
        marks = []
        for j in range(len(graphs)):
            i = (j + rep) % len(graphs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[i][0].replay()
            end.record()
            marks.append((i, start, end))
        torch.cuda.synchronize()
        for i, start, end in marks:
            times[i].append(start.elapsed_time(end) * 1e3 / graphs[i][1])
    return times


def summarize(times: list[float]) -> dict:
    med = statistics.median(times)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [med, med, med]
    return {"median_us": med, "min_us": min(times), "spread": (q[2] - q[0]) / med if med > 0 else 0.0}


# ---- the sweep ---------------------------------------------------------------------------------------
class Clock:
    def __init__(self, budget_s: float, log=None):
        self.t0, self.budget, self.log = time.monotonic(), budget_s, log or sys.stderr

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def over(self) -> bool:
        return self.elapsed() > self.budget

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", file=self.log, flush=True)


def _cuda_broken(e: BaseException) -> bool:
    """An error that leaves the CUDA context unusable (every later call would fail the same way)."""
    text = str(e).lower()
    return any(s in text for s in ("illegal memory access", "illegal instruction", "unspecified launch failure",
                                   "device-side assert", "misaligned address"))


def measure_launch(sms: int, repeats: int, clock: Clock) -> dict:
    buf = torch.zeros(1, device="cuda")
    rows, graphs = [], []
    for programs in launch_programs(sms):
        row = {"label": f"empty kernel, {programs} program{'s' if programs > 1 else ''}", "programs": programs}
        try:
            graphs.append(capture([lambda p=programs: _empty_kernel[(p,)](buf)]))
            rows.append(row)
        except Exception as e:
            row.update(status="error", error=error_text(e))
            rows.append(row)
    ok = [r for r in rows if "error" not in r]
    for r, t in zip(ok, time_graphs(graphs, repeats) if graphs else []):
        r.update(status="ok", times_us=t, calls_per_graph=graphs[0][1], **summarize(t))
    clock.say("launch floor: " + ", ".join(f"{r['label']} {r['median_us']:.2f} us" if "median_us" in r else
                                             f"{r['label']} ERROR" for r in rows))
    return {"op": LAUNCH, "candidates": rows}


def _combined_moe(rows: list[dict], cands: list[Candidate]) -> Candidate | None:
    """The fastest Gate/Up settings with the fastest Down settings, each among the ok candidates that keep the
    other group at the default; None when that is already a candidate or nothing qualifies."""
    base = rows[0]["resolved"]
    chosen = {}
    for group in MOE_GROUPS:
        others = [k for k in base if k not in group]
        pool = [(r, c) for r, c in zip(rows, cands) if r.get("status") == "ok" and "median_us" in r
                and all(r["resolved"][k] == base[k] for k in others)]
        if not pool:
            return None
        r, c = min(pool, key=lambda rc: rc[0]["median_us"])
        chosen.update({k: v for k, v in c.kw.items() if k in group})
    return cand("combined best", **chosen)


def with_pdl(run: Callable) -> Callable:
    """An op's call with every kernel launched as the engine launches them: programmatic dependent launch."""
    return lambda kw, i, out=None, **extra: run({**kw, "pdl": True}, i, out, **extra)


def sweep_op(op: str, shape: TuneShape, device, sms: int, repeats: int, clock: Clock, bandwidth: float,
             launch_us: float | None, rotate: int = ROTATE_BYTES, pdl: bool = False, hot: bool = False,
             only: tuple[str, ...] = ()) -> dict:
    clock.say(f"{op}: building inputs")
    t_op = clock.elapsed()
    case = build_case(op, shape, device, sms, rotate)
    if pdl:
        case = replace(case, run=with_pdl(case.run))
    if hot:  # one weight copy / routing: after the first call its weights are L2 hits (what latency is left)
        case = replace(case, copies=1)
    _sync()
    floor = case.bytes / bandwidth * 1e6
    entry = {"op": op, "desc": case.desc, "bytes": case.bytes, "floor_us": floor, "launches": case.launches,
             "launch_bound_us": case.launches * launch_us if launch_us else None, "copies": case.copies,
             "tolerance": TOL[op], "facts": case.facts, "candidates": []}
    cands = candidates(op, shape, sms, only)
    rows: list[dict] = []
    captured: list[tuple[int, tuple]] = []  # (row index, (graph, calls))
    keep_alive: list = []
    default_out = None

    def prep(c: Candidate, is_default: bool) -> dict:
        nonlocal default_out
        res = resolve(op, c.kw, shape, sms)
        row = {"label": label(res), "kwargs": c.kw, "resolved": res, "note": c.note, "default": is_default}
        if not is_default and clock.over():
            row.update(status="skipped", error=f"time budget ({clock.budget:.0f} s) spent before this candidate")
            clock.say(f"{op}: skipped {row['label']} (budget)")
            return row
        t = time.monotonic()
        try:
            with LaunchCounter() as launched:
                got, out = check(case, c.kw, default_out)
            row.update(got)
            if launched.names:
                row["kernels"] = launched.names
            if is_default and launched.names:  # what this tree's wrapper launches, rather than the static count
                entry.update(launches=len(launched.names), kernels=launched.names,
                             launch_bound_us=len(launched.names) * launch_us if launch_us else None)
            if is_default and row["status"] != "mismatch":
                default_out = out
            if row["status"] == "ok":
                extra = case.prepare(c.kw) if case.prepare else {}
                outs = [case.new_out() for _ in range(case.copies)] if case.new_out else [None] * case.copies
                calls = [lambda i=i: case.run(c.kw, i, outs[i], **extra) for i in range(case.copies)]
                graph = capture(calls)
                if case.new_out:  # copy 0's output after a fresh replay, vs the eager run on the same inputs
                    outs[0].fill_(float("nan"))
                    graph[0].replay()
                    _sync()
                    row["replay_bit_equal"] = bit_equal(outs[0], out)
                    if not row["replay_bit_equal"]:
                        diff, _ = compare(op, outs[0], out)
                        row.update(status="replay_mismatch",
                                   error=f"graph replay output differs from the eager one (rel diff {diff:.1e})")
                if row["status"] == "ok":
                    captured.append((len(rows), graph))
                    keep_alive.append((outs, extra))
        except Exception as e:
            row.update(status="error", error=error_text(e))
            if _cuda_broken(e):
                raise
        row["prep_s"] = time.monotonic() - t
        clock.say(f"{op}: {row['status']:<15} {row['label']}  ({row['prep_s']:.1f} s)"
                  + (f"  {row['error'].splitlines()[0][:160]}" if row.get("error") else ""))
        return row

    for j, c in enumerate(cands):
        rows.append(prep(c, j == 0))
    if captured:
        for (i, graph), t in zip(captured, time_graphs([g for _, g in captured], repeats)):
            rows[i].update(times_us=t, calls_per_graph=graph[1], **summarize(t))
    if op == "moe" and len(rows) > 1 and rows[0].get("median_us"):
        combo = _combined_moe(rows, cands)
        key = tuple(resolve(op, combo.kw, shape, sms).items()) if combo else None
        if combo and all(tuple(r["resolved"].items()) != key for r in rows):
            before = len(captured)
            rows.append(prep(combo, False))
            cands.append(combo)
            if len(captured) > before:
                i, graph = captured[-1]
                t = time_graphs([graph], repeats)[0]
                rows[i].update(times_us=t, calls_per_graph=graph[1], **summarize(t))
    for r in rows:
        if "median_us" in r:
            r["x_floor"] = r["median_us"] / floor if floor > 0 else None
            bound = max(floor, entry["launch_bound_us"] or 0.0)
            r["x_bound"] = r["median_us"] / bound if bound > 0 else None
    entry["candidates"] = rows
    entry.update(pick(rows))
    entry["elapsed_s"] = clock.elapsed() - t_op
    captured.clear()  # the graphs, then the static buffers they write
    keep_alive.clear()
    return entry


def pick(rows: list[dict]) -> dict:
    """The fastest ok candidate, and whether it beats the default by more than the noise."""
    timed = [r for r in rows if r.get("status") == "ok" and "median_us" in r]
    if not timed:
        return {"best": None, "recommend": None, "recommend_kwargs": None, "verdict": "no candidate passed its check"}
    best = min(timed, key=lambda r: r["median_us"])
    d = rows[0] if rows and rows[0].get("default") and "median_us" in rows[0] else None
    for r in timed:
        r["vs_default"] = (r["median_us"] / d["median_us"] - 1) if d else None
    if d is None:
        return {"best": best["label"], "recommend": best["label"], "recommend_kwargs": best.get("kwargs"),
                "verdict": f"default not timed ({rows[0].get('status') if rows else '-'}): fastest passing candidate"}
    gain = 1 - best["median_us"] / d["median_us"]
    noise = max(NOISE, d["spread"] + best["spread"])
    if best is d or gain <= noise:
        return {"best": best["label"], "recommend": d["label"], "recommend_kwargs": {},
                "verdict": f"keep the default (best {gain * 100:+.1f}% faster, within noise {noise * 100:.1f}%)"
                if best is not d else "keep the default (fastest)"}
    return {"best": best["label"], "recommend": best["label"], "recommend_kwargs": best.get("kwargs"),
            "verdict": f"use it: {gain * 100:.1f}% faster than the default "
                       f"({d['median_us']:.2f} -> {best['median_us']:.2f} us)"}


def _kw_text(kw: dict | None) -> str:
    return " [keywords: " + (", ".join(f"{k}={v}" for k, v in kw.items()) or "none") + "]" if kw is not None else ""


def _write(report: dict, out: str | None) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1, default=str) + "\n")


NOTES = [
    "moe: the finalize/combine tiles are module constants, not swept; 'combined best' = fastest Gate/Up "
    "settings + fastest Down settings",
    "attention: min_split (default block_n) also sets the default split count at long context; this sweep "
    "is at the stated context only",
    "router: the select kernel (launch 2) is swept by its warps and its top-k form (packed_topk=False: two "
    "reductions per round, the same bits)",
    "linear: block_k is fixed by the weight block (128); split-K summed in the launch with fresh zeroed counters",
]


def run(ops: tuple[str, ...], repeats: int, out: str | None, budget_s: float = 240.0, rows: int = 6,
        context: int = 1024, config_file: str | Path = FULL_CONFIG, pdl: bool = False, hot: bool = False,
        only: tuple[str, ...] = (), distinct: int | None = None) -> dict:
    from ..provenance import commit
    from .full_step import copy_bandwidth

    if not torch.cuda.is_available():
        raise RuntimeError("iquest bench tune needs a CUDA device")
    clock = Clock(budget_s)
    config = Config.from_file(config_file)
    shape = tune_shape(config, TP, rows, context)
    shape = shape if distinct is None else replace(shape, distinct=distinct)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bandwidth = copy_bandwidth(dev)
    report = {"bench": "tune", "commit": commit(), "device": torch.cuda.get_device_name(dev), "sms": sms,
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
              "host": platform.node(), "command": shlex.join(["iquest", *sys.argv[1:]]), "config": str(config_file),
              "tp": TP, "shape": asdict(shape), "shape_text": shape.text(), "repeats": repeats, "budget_s": budget_s,
              "pdl": pdl, "hot": hot, "only": list(only),
              "copy_bandwidth_bytes_per_s": bandwidth,
              "timing": f"per candidate one CUDA graph of >= {MIN_CALLS} back-to-back calls rotating over "
                        f"copies/routings (>= {ROTATE_BYTES >> 20} MB, reads from HBM); {repeats} rounds, each "
                        "replaying every candidate "
                        "of the op once behind a GPU sleep, timed with CUDA events; per call = replay / calls; median",
              "notes": list(NOTES), "launch": None, "ops": {}}
    clock.say(f"bench tune on {report['device']} ({sms} SMs), copy bandwidth {bandwidth / 1e12:.2f} TB/s; ops: "
              + ",".join(ops))
    launch_us = None
    try:
        report["launch"] = measure_launch(sms, repeats, clock)
        one = report["launch"]["candidates"][0]
        launch_us = one.get("median_us")
    except Exception as e:
        report["launch"] = {"op": LAUNCH, "error": error_text(e), "candidates": []}
    broken = None
    for op in ops:
        if broken:
            report["ops"][op] = {"op": op, "error": f"not run: the CUDA context failed earlier ({broken})",
                                 "candidates": []}
            continue
        try:
            report["ops"][op] = sweep_op(op, shape, dev, sms, repeats, clock, bandwidth, launch_us, pdl=pdl, hot=hot,
                                         only=only)
        except Exception as e:
            report["ops"][op] = {"op": op, "error": error_text(e), "candidates": []}
            clock.say(f"{op}: FAILED {error_text(e).splitlines()[0][:200]}")
            if _cuda_broken(e):
                broken = error_text(e).splitlines()[0][:200]
        gc.collect()
        if not broken:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        report["elapsed_s"] = clock.elapsed()
        _write(report, out)  # partial results survive a later crash
    report["elapsed_s"] = clock.elapsed()
    print_report(report)
    _write(report, out)
    return report


# ---- report ------------------------------------------------------------------------------------------
def _check_text(r: dict) -> str:
    def f(v):
        return "-" if v is None else ("=" if v == 0 else f"{v:.1e}")
    return f"{f(r.get('rel_diff_vs_ref'))}/{f(r.get('rel_diff_vs_default'))}"


def _row_text(r: dict, best: str | None) -> str:
    mark = ("*" if r["label"] == best and "median_us" in r else " ") + ("d" if r.get("default") else " ")
    cfg = r["label"] + (f"  ({r['note']})" if r.get("note") else "")
    if "median_us" not in r:
        status = r.get("status", "?").upper()
        err = (r.get("error") or "").splitlines()[0][:120] if r.get("error") else ""
        diff = _check_text(r) if r.get("rel_diff_vs_ref") is not None else ""
        return f"  {mark} {status:>15} {'':>23}  {diff:>17}  {cfg}  <- {err}"
    vs = "-" if r.get("vs_default") is None or r.get("default") else f"{r['vs_default'] * 100:+.1f}%"
    xf = "-" if r.get("x_floor") is None else f"{r['x_floor']:.1f}"
    xb = "-" if r.get("x_bound") is None else f"{r['x_bound']:.2f}"
    return (f"  {mark} {r['median_us']:9.2f} {r['spread'] * 100:5.1f}% {vs:>7} {xf:>7} {xb:>7}  "
            f"{_check_text(r):>17}  {cfg}")


def print_report(r: dict, file=None) -> None:
    file = file or sys.stdout

    def p(s: str = "") -> None:
        print(s, file=file)

    p(f"bench tune  commit={r['commit']} device={r['device']} SMs={r['sms']} torch={r['torch']} triton={r['triton']}")
    p(f"shapes: {r['shape_text']}")
    p(f"device copy bandwidth {r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (read + written)")
    p(f"timing: {r['timing']}")
    if r.get("pdl") or r.get("hot"):
        p("every kernel launched with PDL (as the engine does): yes" if r.get("pdl") else "launches: plain")
        if r.get("hot"):
            p("HOT: one weight copy / routing per op, so its weights are L2 hits after the first call: the floors "
              "below do not apply; this is what latency is left with the bytes already on chip")
    launch = r.get("launch") or {}
    lrows = launch.get("candidates") or []
    if lrows:
        p("launch floor (an empty Triton kernel per call, same timing): " + "; ".join(
            f"{x['label']} {x['median_us']:.2f} us" if "median_us" in x
            else f"{x['label']} ERROR {x.get('error', '')[:80]}"
            for x in lrows))
    elif launch.get("error"):
        p(f"launch floor: ERROR {launch['error'][:200]}")
    head = (f"  {'':2} {'median us':>9} {'spread':>6} {'vs dflt':>7} {'x floor':>7} {'x bound':>7}  "
            f"{'diff ref/dflt':>17}  config")
    for op in r["ops"].values():
        p()
        if op.get("error") and not op.get("candidates"):
            p(f"{op['op']}: ERROR {op['error'][:300]}")
            continue
        lb = op.get("launch_bound_us")
        p(f"{op['op']}: {op['desc']}")
        p(f"  {op['bytes'] / 1e6:.3f} MB per call, byte floor {op['floor_us']:.2f} us; {op['launches']} launch"
          f"{'es' if op['launches'] > 1 else ''} per call" + (f" (launch floor {lb:.2f} us)" if lb else "")
          + f"; tolerance {op['tolerance']:.0e}".replace("0e+00", "exact (bit-equal)")
          + f"; {len(op['candidates'])} candidates in {op.get('elapsed_s', 0):.0f} s")
        if op.get("kernels"):
            p(f"  kernels per call (default): {', '.join(op['kernels'])}")
        p(head)
        for x in op["candidates"]:
            p(_row_text(x, op.get("best")))
        use = op.get("recommend") and op["candidates"] and op["recommend"] != op["candidates"][0]["label"]
        rec = f": {op['recommend']}{_kw_text(op.get('recommend_kwargs'))}" if use else ""
        p(f"  -> {op.get('verdict', '-')}{rec}")
    p()
    p("summary (us per call: default -> recommended)")
    for op in r["ops"].values():
        cs = op.get("candidates") or []
        d = cs[0] if cs and cs[0].get("default") else None
        rec = next((x for x in cs if x["label"] == op.get("recommend") and "median_us" in x), None)
        if op.get("error") and not cs:
            p(f"  {op['op']:18} ERROR")
        elif d is None or rec is None:
            p(f"  {op['op']:18} {op.get('verdict', 'no result')}")
        else:
            tag = "default" if rec is d else rec["label"] + _kw_text(op.get("recommend_kwargs"))
            p(f"  {op['op']:18} {d.get('median_us', float('nan')):8.2f} -> {rec['median_us']:8.2f}   {tag}")
    failed = [(op["op"], x) for op in r["ops"].values() for x in op.get("candidates") or []
              if x.get("status") not in ("ok", None)]
    if failed:
        p(f"{len(failed)} candidate(s) not timed: " + "; ".join(f"{o} [{x['label']}] {x['status']}" for o, x in failed))
    p(f"total {r.get('elapsed_s', 0):.0f} s")
    for n in r.get("notes", []):
        p(f"note: {n}")
