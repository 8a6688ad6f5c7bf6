"""`iquest bench tune`: each kernel of the published model timed at its default launch settings and at a few others,
at one TP8 rank's decode shapes of configs/iquest-q1.json, in one process.

Every kernel file has a frozen settings dataclass (kernels/*.py) and takes `settings=`; a candidate here is the
default with a few fields replaced (`GRIDS`, data, so a maintainer can read or extend what is swept). For each op:
its inputs are built once (`build`); each candidate's calls (one per input copy) are captured into a CUDA graph
launched with PDL as the engine launches them; then the graphs are replayed in turns, one replay a candidate a round,
so that clock and thermal drift fall on every candidate alike, and medians are taken. Each candidate's output from
one eager call is compared with the default's bit for bit: a setting that sets the order of an fp32 sum
(`ORDER_FIELDS`, from the settings classes' own docstrings) is expected to move the last bits, and is then a
numerical change that needs qualification before it becomes a default; one that changes bits without such a field is
reported as unexpected.

Why copies: in a decode round every layer reads its own weights and KV, so those come from HBM; back-to-back calls on
one input would read them from the 60 MB L2. Calls rotate over copies totalling >= ROTATE_BYTES of what a call
reads (the MoE rotates over disjoint expert sets of one weight instead). Activations (norm rows, the q/k/v block)
are the previous kernel's output in the engine, in L2: one copy.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..kernels import decode_attention as da, expert_prefetch as xp, fp8_linear as fl, lm_head as lh, moe as mo, \
    o_proj_router as opr, qk_rope_kv as qr, qkv_rope_kv as qrk, rmsnorm as rn, route_tail as rt, router as ro, \
    topk as tk
from ..fast.kernel_settings import KernelSettings

FULL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "iquest-q1.json"
TP = 8
OPS = ("linear_qkv", "linear_o", "attention_full", "attention_sliding", "attention_draft", "qk_rope_kv", "qkv_rope_kv",
       "rmsnorm", "add_norm", "router", "moe", "lm_head", "topk", "expert_prefetch", "o_proj_router", "add_norm_route")
ROTATE_BYTES = 192 << 20  # > 3x the H200's L2: a call finds little of its inputs left there by the previous copies
MAX_COPIES = 384  # a short cache's copies: 2 kernels each, a graph stays a few hundred nodes
MIN_CALLS = 24  # calls a graph at least, so a replay's launch overhead spreads thin
# bench step's full-layer cache at --config: the context, two 16-token chunks and 64 slots of slack
FULL_SLACK = 2 * 16 + 64

# ---- the candidate grids: field overrides of each op's default settings ---------------------------------------------
# Kept though `bench sass` shows them spilling on sm_90a (the split kernel sits at 254 registers by default): attention
# block_n=128 (152 B of stack) and num_warps=2 (248 B), so the tune measures what the spill costs.
_ATTENTION = ({"min_split": 128}, {"min_split": 256}, {"num_warps": 2},
              {"num_warps": 8}, {"combine_splits": 64}, {"combine_cols": 16}, {"combine_cols": 64},
              {"combine_warps": 2}, {"combine_warps": 8}, {"preload": False}, {"early": False})
_NORM = ({"num_warps": 2}, {"num_warps": 4}, {"num_warps": 16})
_LINEAR = ({"block_n": 16}, {"block_n": 64}, {"num_warps": 2}, {"num_warps": 8}, {"num_stages": 3}, {"num_stages": 4},
           {"preload": False})
GRIDS: dict[str, tuple[dict, ...]] = {
    # q/k/v splits its 24 K tiles 8 ways by default (3 a program), o_proj takes its 6 tiles in one program: split_k
    # tries fewer and more around each
    "linear_qkv": _LINEAR + ({"split_k": 1}, {"split_k": 3}, {"split_k": 12}),
    "linear_o": _LINEAR + ({"split_k": 2}, {"split_k": 3}, {"split_k": 12}),
    # full layers stream 64-slot K/V tiles one in flight by default, sliding ones 32-slot tiles: each grid tries the
    # tiles and depths around its own (and sliding ones, merging up to 256 splits a combine step, the full layers' 128).
    # A capped grid (num_splits) keeps 1K's splits (17 on full layers, 33 on sliding ones, under 64) and makes them
    # longer past it, where each split's fp32 partials (18.7 KB at 6 rows) outweigh its one or two K/V tiles
    "attention_full": ({"block_n": 32}, {"block_n": 128}) + _ATTENTION + ({"num_stages": 2}, {"num_stages": 3},
                                                                          {"num_splits": 64}, {"num_splits": 128},
                                                                          {"long_stages": 2}, {"long_stages": 3},
                                                                          {"long_stages": 2, "long_tiles": 2}),
    "attention_sliding": ({"block_n": 16}, {"block_n": 64}) + _ATTENTION + ({"num_stages": 2}, {"num_stages": 3},
                                                                            {"combine_splits": 128}, {"min_split": 64},
                                                                            {"num_splits": 32}, {"num_splits": 64}),
    "attention_draft": ({"block_n": 16}, {"block_n": 64}) + _ATTENTION + ({"num_stages": 2}, {"num_stages": 3}),
    "qk_rope_kv": ({"num_warps": 2}, {"num_warps": 4}),
    # the q/k/v projection ending in the prologue (kernels/qkv_rope_kv.py), one head a tile (8 tiles): the default
    # splits its 24 K tiles 8 ways (3 a program, 64 programs); 12 and 24 splits give 96 and 192 programs, 4 splits 32
    # programs of twice the loads in flight
    "qkv_rope_kv": ({"split_k": 4}, {"split_k": 12}, {"split_k": 24}, {"preload": False}, {"num_warps": 4},
                    {"num_stages": 2}),
    "rmsnorm": _NORM,
    "add_norm": _NORM,
    "router": ({"block_e": 2}, {"block_e": 8}, {"block_h": 256}, {"block_h": 1024}, {"num_warps": 2},
               {"split": 1}, {"split": 3}, {"programs_per_sm": 4}, {"programs_per_sm": 16}, {"select_warps": 2},
               {"select_warps": 8}, {"preload": False}),
    # down_block_k 128 at rank 1 takes a dot a scale block a step (its 64-column offset is not a multiple of 128)
    "moe": (  # a program's K steps first (docs/PERF.md, "What Gate/Up's compiled step says"): H over 1, 2 or 8
            # programs an (expert, tile) against the default 4, summed by the last (a numerical change: the sum's
            # order), 24, 12 or 3 steps a program instead of 6; the scales on every weight element, not on each step's
            # product (a numerical change: 382 instructions a warp a step against 318); the pipeline's depth (the same
            # bits)
            {"gate_up_split": 1}, {"gate_up_split": 2}, {"gate_up_split": 8}, {"gate_up_scale": "weight"},
            {"gate_up_split": 8, "gate_up_scale": "weight"},
            # Down's scales on every weight element, not on each step's product (a numerical change), and the product
            # form without its register cap (the same bits)
            {"down_scale": "weight"}, {"down_registers": None},
            {"gate_up_stages": 4}, {"gate_up_stages": 6}, {"gate_up_stages": 8},
            {"gate_up_stages": 6, "gate_up_block_n": 16}, {"gate_up_stages": 8, "gate_up_block_n": 16},
            # a step's work over more warps or programs: Triton repeats the dequantization in the dot operand's
            # layout (2x a thread at 8 warps, 4x at 16 columns: 346 and 627 instructions a warp a step)
            {"gate_up_block_n": 16, "warps": 8},
            {"gate_up_block_n": 16}, {"gate_up_block_n": 64}, {"gate_up_block_k": 64}, {"down_block_n": 64},
            {"down_block_n": 256}, {"down_block_k": 32}, {"down_block_k": 128}, {"warps": 2}, {"warps": 8},
            {"stages": 2}, {"stages": 4}, {"combine_block": 128}, {"combine_block": 512},
            {"down_prefetch": False},
            # the three-axis grids, the pair fastest (the default before the pair slowest; same bits)
            {"pair_major": False}),
    # "rows" (the default: 8-row V tiles over 4 warps) around its tile, the 16 x 8 warps it replaced among them, then
    # "dot" (the form before it) at its own defaults and grid; block_v 128 is left out for "dot":
    # kernels/lm_head.choose_block_v says it spills on sm_90a
    "lm_head": ({"block_v": 16}, {"block_v": 4}, {"rows_block_k": 64}, {"rows_block_k": 256}, {"rows_warps": 2},
                {"rows_warps": 8}, {"block_v": 16, "rows_warps": 8}, {"rows_block_k": 64, "rows_warps": 8},
                {"form": "dot"}, {"form": "dot", "block_v": 16}, {"form": "dot", "block_v": 64},
                {"form": "dot", "block_k": 64}, {"form": "dot", "num_warps": 8}, {"form": "dot", "num_stages": 3}),
    # smaller tiles: more, shorter pass-1 programs (10 tiles a row at 2048). The skip only acts with more tiles than
    # KP = 32 (k = 20), so it is turned off where it would act: tiles of 256 (79 a row) and 512 (40)
    "topk": ({"tile": 256}, {"tile": 512}, {"tile": 2048}, {"tile": 4096}, {"num_warps": 1}, {"num_warps": 2},
             {"num_warps": 8}, {"tile": 256, "skip": False}, {"tile": 512, "skip": False}),
    # the side branch alone (its overlap with the attention is bench step's +expert_prefetch): the prediction's grid,
    # which measured ~50 us a layer at 2 programs an SM, and the prefetch requests' size
    "expert_prefetch": ({"programs_per_sm": 2}, {"programs_per_sm": 4}, {"programs_per_sm": 16}, {"block_e": 8},
                        {"block_h": 256}, {"num_warps": 2}, {"chunk_bytes": 8192}, {"chunk_bytes": 131072},
                        {"select_warps": 2}, {"select_warps": 8}),
    # the router fold's o-projection (EngineOptions.router_fold): its last split reads its [E x 32] router slab
    # block_e experts at a time, each chunk's loads after the last one's products; one chunk of 256 is the default
    # since the round put the fold's o-projection at 12.9 us a call there against 37.2 at 32 (5bc518f)
    "o_proj_router": ({"block_e": 32}, {"block_e": 64}, {"block_e": 128}, {"prefetch": False}),
    # the router fold's tail (kernels/route_tail.py): one program a row sums the o-projection's T x 2 x E partials,
    # 11.8 us a call at 72c654b against add_norm's 2.5: smaller and larger steps of that sum
    "add_norm_route": ({"part_chunk": 2048}, {"part_chunk": 4096}, {"part_chunk": 16384}),
}

# Fields that set the order of some fp32 sum (so a candidate changing one may change the last bits): from each settings
# class's docstring, plus the MoE's K steps (each step's dot is added to the accumulator: the step's width groups the
# products), Gate/Up's scale form (a rounding fewer) and the norms' warps (a row's sum of squares is a tree over its
# threads).
_ATTENTION_ORDER = frozenset({"block_n", "min_split", "num_splits", "num_warps", "combine_splits", "combine_cols",
                              "combine_warps"})
ORDER_FIELDS: dict[str, frozenset[str]] = {
    "linear_qkv": frozenset({"block_n", "split_k"}), "linear_o": frozenset({"block_n", "split_k"}),
    "attention_full": _ATTENTION_ORDER, "attention_sliding": _ATTENTION_ORDER, "attention_draft": _ATTENTION_ORDER,
    "qk_rope_kv": frozenset({"num_warps"}), "rmsnorm": frozenset({"num_warps"}), "add_norm": frozenset({"num_warps"}),
    # the split's, as the plain linear's (block_n only through choose_split_k: a tile is one head whatever it says)
    "qkv_rope_kv": frozenset({"block_n", "split_k"}),
    "router": frozenset({"block_e", "block_h", "num_warps", "split", "programs_per_sm", "select_warps"}),
    "moe": frozenset({"gate_up_block_k", "down_block_k", "gate_up_scale", "gate_up_split"}),
    "lm_head": frozenset({"form", "block_k", "rows_block_k", "rows_warps"}),
    "topk": frozenset(),  # no sum: the keys are exact and unique, so every setting gives the same top-k
    "expert_prefetch": frozenset({"block_e", "block_h", "num_warps", "programs_per_sm"}),  # the prediction's logits
    "o_proj_router": frozenset(),  # block_e moves no bit (every partial is one sum over the tile's columns)
    "add_norm_route": frozenset({"part_chunk"}),  # the partials' summation tree (never h or b)
}


def default_settings(op: str):
    """The settings the engine launches `op` with: fast/kernel_settings.py's for the ops it holds, else the kernel
    wrapper's default."""
    ks = KernelSettings()
    return {"linear_qkv": ks.linear, "linear_o": ks.o_proj, "attention_full": ks.attention_full,
            "attention_sliding": ks.attention_sliding, "attention_draft": ks.attention_sliding,
            "qk_rope_kv": qr.QkRopeSettings(),
            "qkv_rope_kv": ks.qkv_rope_kv, "rmsnorm": rn.RmsNormSettings(), "add_norm": rn.RmsNormSettings(),
            "router": ro.RouterSettings(), "moe": ks.moe, "lm_head": ks.lm_head,
            "topk": ks.topk, "expert_prefetch": xp.PrefetchSettings(),
            "o_proj_router": ks.o_proj_router, "add_norm_route": rt.RouteTailSettings()}[op]


def candidate_name(overrides: dict) -> str:
    return "+".join(f"{k}={v}" for k, v in overrides.items())


def candidates(op: str, only: tuple[str, ...] | None = None) -> list[tuple[str, dict, object]]:
    """(name, overrides, settings) of each candidate of `op` (restricted to the names in `only`), settings built
    from the default with dataclasses.replace (an unknown field raises TypeError)."""
    base = default_settings(op)
    return [(candidate_name(ov), ov, dataclasses.replace(base, **ov)) for ov in GRIDS[op]
            if only is None or candidate_name(ov) in only]


def parse_ops(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if names == ("all",):
        return OPS
    unknown = [n for n in names if n not in OPS]
    if not names or unknown:
        raise ValueError(f"--ops: unknown {', '.join(unknown) or '(none given)'}; choose from all, {', '.join(OPS)}")
    return names


def parse_only(text: str | None, ops: tuple[str, ...]) -> tuple[str, ...] | None:
    """The candidate names `--only` keeps; each must be a candidate of some op in `ops`."""
    if text is None:
        return None
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    known = {candidate_name(ov) for op in ops for ov in GRIDS[op]}
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise ValueError(f"--only: {', '.join(unknown) or '(none given)'} is not a candidate of "
                         f"{', '.join(ops)}; theirs: {', '.join(sorted(known))}")
    return names


def order_changes(op: str, overrides: dict) -> list[str]:
    return [k for k in overrides if k in ORDER_FIELDS[op]]


# ---- shapes of one TP8 rank ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankShapes:
    rank: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rotary: int
    experts: int
    top_k: int
    inter: int  # a rank's rows of an expert's Gate/Up (columns of its Down)
    inter_offset: int  # where they start inside their first 128-row scale block
    block: tuple[int, int]
    vocab: int  # a rank's rows of the heads
    window: int
    draft_window: int
    eps: float
    scale: float
    theta: float  # the full layers' RoPE base (qk_rope_kv is timed on a full layer)


def rank_shapes(rank: int, config_file: Path = FULL_CONFIG) -> RankShapes:
    from ..reference.checkpoint import layer_prefix, shard_range, tensor_specs
    from ..reference.config import Config

    config = Config.from_file(config_file, config_file.with_name(config_file.stem + "-mtp.json"))
    layout = tensor_specs(config)

    def part(name: str) -> tuple[int, int]:
        spec = layout[name]
        dim, start, stop = shard_range(spec, config, TP, rank)
        return start, stop - start

    a, e = layer_prefix(1) + "self_attn.", layer_prefix(1) + "mlp.experts.0."  # layer 1: attention and the MoE
    start, inter = part(e + "gate_proj.weight")
    block = tuple(config.weight_block_size)
    return RankShapes(rank, config.hidden_size, part(a + "q_proj.weight")[1] // config.head_dim,
                      part(a + "k_proj.weight")[1] // config.head_dim, config.head_dim, config.rotary_dim,
                      config.num_experts, config.num_experts_per_tok, inter, start % block[0], block,
                      part("lm_head.weight")[1], config.sliding_window, config.mtp.sliding_window,
                      config.rms_norm_eps, config.scale, config.rope_theta_for(0))


# ---- an op's inputs and calls -------------------------------------------------------------------------------------
@dataclass
class Case:
    """One op's inputs: `calls(settings)` gives one call a copy (each returning the tensors it wrote), the first of
    which the bit comparison reads."""

    op: str
    desc: str
    shapes: dict
    copies: int
    calls: Callable[[object], list[Callable[[], tuple[torch.Tensor, ...]]]]


def _copies(call_bytes: int, most: int = MAX_COPIES) -> int:
    return max(1, min(most, math.ceil(ROTATE_BYTES / max(call_bytes, 1))))


def _randn(shape, g: torch.Generator, device, dtype=torch.bfloat16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)


def _fp8_weight(n: int, k: int, block: tuple[int, int], g, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A random E4M3 [n, k] weight and its fp32 block scales (of order 1/64: outputs stay O(1))."""
    w = torch.randn((n, k), generator=g, device=device).to(torch.float8_e4m3fn)
    return w, (torch.rand((-(-n // block[0]), -(-k // block[1])), generator=g, device=device) + 0.5) / 64


def _linear(op: str, s: RankShapes, rows: int, device, g, pdl: bool) -> Case:
    """One attention projection as the engine calls it: q/k/v as one weight (the rank's query heads and its KV head's k
    and v) or o_proj; bf16 rows in and out, the split sum done in the launch (arrival counters)."""
    q_cols, kv_cols = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
    N, K = (q_cols + 2 * kv_cols, s.hidden) if op == "linear_qkv" else (s.hidden, q_cols)
    w, sc = _fp8_weight(N, K, s.block, g, device)
    x = _randn((rows, K), g, device)
    n = _copies(w.numel() + sc.numel() * 4)
    ws = [w] + [w.clone() for _ in range(n - 1)]

    def calls(st):
        out = torch.empty((rows, N), dtype=torch.bfloat16, device=device)
        locks = torch.zeros(fl.lock_count(rows, N, st), dtype=torch.int32, device=device)
        return [lambda w=w: (fl.fp8_linear(x, w, sc, s.block, out_dtype=torch.bfloat16, out=out, locks=locks, pdl=pdl,
                                           settings=st),) for w in ws]

    name = "q/k/v" if op == "linear_qkv" else "o_proj"
    return Case(op, f"x [{rows}, {K}] bf16 @ {name} [{N} x {K}] E4M3 with fp32 {s.block[0]}x{s.block[1]} block "
                    f"scales, bf16 out",
                {"rows": rows, "n": N, "k": K, "block": list(s.block), "weight_bytes": w.numel()}, n, calls)


def _attention(op: str, s: RankShapes, rows: int, context: int, device, g, pdl: bool) -> Case:
    window = {"attention_full": None, "attention_sliding": s.window, "attention_draft": s.draft_window}[op]
    from ..fast.cache import RING_SLACK

    # a full layer's cache as bench step holds it at --config; a ring as the engine holds it at any context past it
    slots = context + FULL_SLACK if window is None else window + RING_SLACK
    positions = torch.arange(context, context + rows, device=device)
    held = torch.arange(max(0, context + rows - slots), context + rows, device=device)  # the block's rows written
    slot_pos = torch.full((slots + 1,), -1, dtype=torch.int64, device=device)
    slot_pos[held % slots] = held
    k = _randn((slots + 1, s.kv_heads, s.head_dim), g, device)
    v = _randn((slots + 1, s.kv_heads, s.head_dim), g, device)
    q = _randn((rows, s.q_heads, s.head_dim), g, device)
    sink = torch.randn((s.kv_heads, s.head_dim), generator=g, device=device)
    read = min(context + rows, slots + 1) * s.kv_heads * s.head_dim * 2 * k.element_size()
    n = _copies(read)
    caches = [(k, v, slot_pos)] + [(k.clone(), v.clone(), slot_pos.clone()) for _ in range(n - 1)]

    def calls(st):
        out = torch.empty_like(q)
        ws = da.decode_attention_workspace(q, k, st)
        return [lambda c=c: (da.decode_attention(q, c[0], c[1], c[2], positions, s.scale, sink, window, settings=st,
                                                 out=out, workspace=ws, pdl=pdl),) for c in caches]

    return Case(op, f"q [{rows}, {s.q_heads}, {s.head_dim}] bf16 at positions {context}..{context + rows - 1}, cache "
                    f"[{slots} + 1, {s.kv_heads}, {s.head_dim}] bf16, window {window}, sink",
                {"rows": rows, "q_heads": s.q_heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "slots": slots,
                 "window": window, "context": context, "kv_bytes_read": read}, n, calls)


def _prologue_inputs(s: RankShapes, rows: int, slots: int, context: int, device, g) -> tuple:
    """What the q/k prologue reads besides the projection, as the engine holds it at `context`: (q norm, k norm,
    positions, cos, sin, live mask, K cache, V cache, slot positions), a full layer's cache of `slots` + 1 slots."""
    from ..reference.layers import rope_cos_sin

    D, hkv = s.head_dim, s.kv_heads
    qw, kw = _randn((D,), g, device), _randn((D,), g, device)
    positions = torch.arange(context, context + rows, device=device)
    cos, sin = rope_cos_sin(positions, s.rotary, s.theta, torch.float32)
    live = torch.ones(rows, dtype=torch.bool, device=device)
    ck = torch.zeros((slots + 1, hkv, D), dtype=torch.bfloat16, device=device)
    cv, sp = torch.zeros_like(ck), torch.full((slots + 1,), -1, dtype=torch.int64, device=device)
    return qw, kw, positions, cos, sin, live, ck, cv, sp


def _qk_rope_kv(s: RankShapes, rows: int, context: int, device, g, pdl: bool) -> Case:
    D, hq, hkv = s.head_dim, s.q_heads, s.kv_heads
    slots = context + FULL_SLACK
    qkv = _randn((rows, (hq + 2 * hkv) * D), g, device)  # the q/k/v projection's rows: q, k, v are column views
    q = qkv[:, :hq * D].view(rows, hq, D)
    k = qkv[:, hq * D:(hq + hkv) * D].view(rows, hkv, D)
    v = qkv[:, (hq + hkv) * D:].view(rows, hkv, D)
    qw, kw, positions, cos, sin, live, ck, cv, sp = _prologue_inputs(s, rows, slots, context, device, g)

    def calls(st):
        out = torch.empty((rows, hq, D), dtype=q.dtype, device=device)  # not q itself: every replay reads the same q

        def call():
            qr.qk_rope_kv(q, k, v, qw, kw, s.eps, cos, sin, positions, live, ck, cv, sp, out=out, settings=st, pdl=pdl)
            return out, ck, cv, sp
        return [call]

    return Case("qk_rope_kv", f"q/k/v [{rows}, {hq}+{hkv}+{hkv} heads x {D}] bf16 (views of one projection), rotary "
                              f"{s.rotary}, full-layer cache of {slots} + 1 slots", {"rows": rows, "q_heads": hq,
                "kv_heads": hkv, "head_dim": D, "rotary": s.rotary, "slots": slots}, 1, calls)


def _qkv_rope_kv(s: RankShapes, rows: int, context: int, device, g, pdl: bool) -> Case:
    """The q/k/v projection and its prologue in one launch as the engine calls it (fast/triton_ops.py
    qkv_rope_write): linear_qkv's weight and rows, qk_rope_kv's norms, RoPE, positions and full-layer cache; the
    weight rotated over copies as linear_qkv's. A call returns the whole projection (the rotated q over its q columns,
    k and v as summed), so the bit comparison sees every tile's sum, not only what the prologue rounds from it."""
    D, hq, hkv, K = s.head_dim, s.q_heads, s.kv_heads, s.hidden
    N, (B0, B1), slots = (hq + 2 * hkv) * D, s.block, context + FULL_SLACK
    w, sc = _fp8_weight(N, K, s.block, g, device)
    x = _randn((rows, K), g, device)
    n = _copies(w.numel() + sc.numel() * 4)
    ws = [w] + [w.clone() for _ in range(n - 1)]
    qw, kw, positions, cos, sin, live, ck, cv, sp = _prologue_inputs(s, rows, slots, context, device, g)
    # as the engine's: one counter a (row tile, head) whatever the split, left zeroed by each call for the next
    locks = torch.zeros(qrk.lock_count(rows, D, N), dtype=torch.int32, device=device)

    def calls(st):
        def call(w):
            q = qrk.qkv_rope_kv(x, w, sc, s.block, hq, hkv, qw, kw, s.eps, cos, sin, positions, live, ck, cv, sp,
                                locks=locks, pdl=pdl, settings=st)
            return q.as_strided((rows, N), (q.stride(0), 1)), ck, cv, sp  # q is a view of the projection's start
        return [lambda w=w: call(w) for w in ws]

    return Case("qkv_rope_kv", f"x [{rows}, {K}] bf16 @ q/k/v [{N} x {K}] E4M3 with fp32 {B0}x{B1} block scales, "
                               f"one head of {D} a tile, then the q/k norms, rotary {s.rotary} and the KV write to a "
                               f"full-layer cache of {slots} + 1 slots",
                {"rows": rows, "n": N, "k": K, "block": list(s.block), "q_heads": hq, "kv_heads": hkv,
                 "head_dim": D, "rotary": s.rotary, "slots": slots, "weight_bytes": w.numel()}, n, calls)


def _norm(op: str, s: RankShapes, rows: int, device, g, pdl: bool) -> Case:
    H = s.hidden
    x, y = _randn((rows, H), g, device), _randn((rows, H), g, device)
    w1, w2 = _randn((H,), g, device, scale=0.1) + 1, _randn((H,), g, device, scale=0.1) + 1

    def calls(st):
        if op == "rmsnorm":
            out = torch.empty_like(x)
            return [lambda: (rn.rmsnorm(x, w1, s.eps, out=out, settings=st, pdl=pdl),)]
        h, b = torch.empty_like(x), torch.empty_like(x)  # not in place: every replay reads the same residual
        return [lambda: rn.add_norm(x, y, 1.0, w1, w2, s.eps, torch.bfloat16, h_out=h, b_out=b, settings=st, pdl=pdl)]

    desc = (f"x [{rows}, {H}] bf16" if op == "rmsnorm" else
            f"residual, branch [{rows}, {H}] bf16: the attention tail (branch normalized, scale 1, next norm)")
    return Case(op, desc, {"rows": rows, "hidden": H}, 1, calls)


def _router(s: RankShapes, rows: int, device, g, pdl: bool) -> Case:
    b = _randn((rows, s.hidden), g, device)
    w = torch.randn((s.experts, s.hidden), generator=g, device=device) * 0.02
    n = _copies(w.numel() * 4)
    ws = [w] + [w.clone() for _ in range(n - 1)]

    def calls(st):
        return [lambda w=w: ro.route(b, w, s.top_k, settings=st, pdl=pdl) for w in ws]

    return Case("router", f"b [{rows}, {s.hidden}] bf16, router [{s.experts}, {s.hidden}] fp32, top-{s.top_k}",
                {"rows": rows, "experts": s.experts, "hidden": s.hidden, "top_k": s.top_k}, n, calls)


def _moe(s: RankShapes, rows: int, distinct: int, device, g, pdl: bool) -> Case:
    E, H, I, k = s.experts, s.hidden, s.inter, s.top_k
    (B0, B1), o = s.block, s.inter_offset

    def weight(shape, offset) -> mo.ExpertWeights:
        q = torch.randn((E, *shape), generator=g, device=device).to(torch.float8_e4m3fn)
        sc = (torch.rand((E, -(-(shape[0] + offset[0]) // B0), -(-(shape[1] + offset[1]) // B1)), generator=g,
                         device=device) + 0.5) / 64
        return mo.ExpertWeights(q, sc, (B0, B1), offset)

    gate, up, down = weight((I, H), (o, 0)), weight((I, H), (o, 0)), weight((H, I), (0, o))
    b = _randn((rows, H), g, device)
    live = torch.ones(rows, dtype=torch.bool, device=device)
    rw = torch.rand((rows, k), generator=g, device=device) + 0.1
    rw = (rw / rw.sum(-1, keepdim=True)).contiguous()
    read = distinct * 3 * I * H  # E4M3 bytes of the experts a call streams
    n = min(E // distinct, _copies(read))
    pair = torch.arange(rows * k, device=device).view(rows, k)
    # pair p takes its set's expert p mod distinct: `distinct` experts in all, a row's k consecutive ones distinct
    routings = [(c * distinct + pair % distinct) for c in range(n)]

    def calls(st):
        out = torch.empty((rows, H), dtype=torch.float32, device=device)
        locks = torch.zeros(mo.gate_up_lock_count(rows, k, I, st), dtype=torch.int32, device=device)  # left zeroed
        return [lambda ex=ex: (mo.moe(b, ex, rw, live, gate, up, down, settings=st, out=out,
                                      gate_up_locks=locks if st.gate_up_split > 1 else None, pdl=pdl),)
                for ex in routings]

    return Case("moe", f"b [{rows}, {H}] bf16, top-{k} over {distinct} distinct experts of {E}, Gate/Up [{I} x {H}] "
                       f"and Down [{H} x {I}] E4M3 a rank, offset {o} in a {B0}-row scale block",
                {"rows": rows, "experts": E, "distinct": distinct, "hidden": H, "inter": I, "offset": o,
                 "top_k": k, "expert_bytes_read": read}, n, calls)


def _o_proj_router(s: RankShapes, rows: int, device, g, pdl: bool) -> Case:
    """The router fold's o-projection as the engine calls it: o_proj's shape with the layer's residual, W' and the
    attn_out_norm weight; the partial logits [T, 2, rows, E] written beside y."""
    N, K, E = s.hidden, s.q_heads * s.head_dim, s.experts
    w, sc = _fp8_weight(N, K, s.block, g, device)
    x, r = _randn((rows, K), g, device), _randn((rows, N), g, device)
    wo = (torch.rand(N, generator=g, device=device) + 0.5).to(torch.bfloat16)
    rw = torch.randn((E, N), generator=g, device=device) * 0.02
    n = _copies(w.numel() + rw.numel() * 4)
    rws = [rw] + [rw.clone() for _ in range(n - 1)]
    linear = KernelSettings().o_proj  # the projection as the engine launches it

    def calls(st):
        locks = torch.zeros(fl.lock_count(rows, N, linear), dtype=torch.int32, device=device)
        return [lambda rw=rw: opr.o_proj_router(x, w, sc, s.block, r, rw, wo, locks=locks, pdl=pdl, settings=linear,
                                                parts_settings=st)
                for rw in rws]

    return Case("o_proj_router", f"x [{rows}, {K}] bf16 @ o_proj [{N} x {K}] E4M3, partial logits of W' [{E}, {N}] "
                                 f"fp32 over r and w_out * y",
                {"rows": rows, "n": N, "k": K, "experts": E}, n, calls)


def _add_norm_route(s: RankShapes, rows: int, device, g, pdl: bool) -> Case:
    """The router fold's tail as the engine calls it: the attention's sandwich tail, then the sum of the o-projection's
    partial logits over its column tiles and the selection; the partials just written, in L2 (one copy)."""
    H, E = s.hidden, s.experts
    T = -(-H // fl.LinearSettings().block_n)  # the o-projection's output tiles, each writing its partials
    residual, y = _randn((rows, H), g, device), _randn((rows, H), g, device)
    w1, w2 = _randn((H,), g, device, scale=0.1) + 1, _randn((H,), g, device, scale=0.1) + 1
    parts = torch.randn((T, 2, rows, E), generator=g, device=device) * 0.01

    def calls(st):
        return [lambda: rt.add_norm_route(residual, y, 0.5, w1, w2, s.eps, torch.bfloat16, parts, s.top_k, pdl=pdl,
                                          settings=st)]

    return Case("add_norm_route", f"residual, o [{rows}, {H}] bf16 and the partial logits [{T}, 2, {rows}, {E}] fp32: "
                                  f"the attention tail, the folded logits' sum and the top-{s.top_k}",
                {"rows": rows, "hidden": H, "tiles": T, "experts": E, "top_k": s.top_k}, 1, calls)


def _expert_prefetch(s: RankShapes, rows: int, device, g) -> Case:
    """The expert prefetch's branch on a block of `rows` rows with its first min(rows, 5) live (5: a width where it
    prefetches, `PrefetchSettings.rows`), a sliding layer's predictor W' and this rank's Gate and Up slabs. Launched
    plainly: the branch runs on a side stream, outside the PDL chain."""
    E, H, I, k = s.experts, s.hidden, s.inter, s.top_k
    a = _randn((rows, H), g, device)
    live = torch.arange(rows, device=device) < min(rows, 5)
    gate, up = (torch.randn((E, I, H), generator=g, device=device).to(torch.float8_e4m3fn) for _ in "gu")
    w = torch.randn((E, H), generator=g, device=device) * 0.02
    n = _copies(w.numel() * 4)
    ws = [w] + [w.clone() for _ in range(n - 1)]

    def calls(st):
        return [lambda w=w: (xp.warm(a, live, w, gate, up, k, settings=st),) for w in ws]

    return Case("expert_prefetch", f"a [{rows}, {H}] bf16 ({int(live.sum())} live), W' [{E}, {H}] fp32, top-{k}, "
                                   f"Gate and Up [{I} x {H}] E4M3 a rank",
                {"rows": rows, "live": int(live.sum()), "experts": E, "hidden": H, "inter": I, "top_k": k}, n, calls)


def _lm_head(s: RankShapes, rows: int, device, g, pdl: bool) -> Case:
    x = _randn((rows, s.hidden), g, device)
    w = (torch.randn((s.vocab, s.hidden), generator=g, device=device) * 0.02).bfloat16()  # held as stored
    n = _copies(w.numel() * 2, most=2)  # 123 MB a copy: past L2 already
    ws = [w] + [w.clone() for _ in range(n - 1)]

    def calls(st):
        out = torch.empty((rows, s.vocab), dtype=torch.float32, device=device)
        return [lambda w=w: (lh.lm_head(x, w, settings=st, out=out, pdl=pdl),) for w in ws]

    return Case("lm_head", f"hidden [{rows}, {s.hidden}] bf16, head [{s.vocab}, {s.hidden}] bf16",
                {"rows": rows, "vocab": s.vocab, "hidden": s.hidden}, n, calls)


def _topk(s: RankShapes, rows: int, device, g, pdl: bool) -> Case:
    """This rank's top-k candidates as the engine samples: k = min(top_k, the rank's vocabulary) (fast/round.py
    _sampling_args), top_k the generation config's default, 20."""
    from ..reference.config import GenerationConfig

    k = min(GenerationConfig().top_k, s.vocab)
    offset = s.rank * s.vocab
    logits = torch.randn((rows, s.vocab), generator=g, device=device) * 3  # the LM head's output: in L2, one copy

    def calls(st):
        out = (torch.empty((rows, k), dtype=torch.int64, device=device),
               torch.empty((rows, k), dtype=torch.float32, device=device),
               torch.empty((rows, k), dtype=torch.int64, device=device))
        return [lambda: tk.local_topk_keys(logits, k, offset, out=out, settings=st, pdl=pdl)]

    return Case("topk", f"logits [{rows}, {s.vocab}] fp32 (ids from {offset}), top-{k} rank keys, values and ids",
                {"rows": rows, "vocab": s.vocab, "k": k, "vocab_offset": offset}, 1, calls)


def build(op: str, s: RankShapes, rows: int, context: int, distinct: int, device, seed: int = 0,
          pdl: bool = True) -> Case:
    g = torch.Generator(device=device).manual_seed(seed)
    if op.startswith("linear_"):
        return _linear(op, s, rows, device, g, pdl)
    if op.startswith("attention_"):
        return _attention(op, s, rows, context, device, g, pdl)
    if op == "qk_rope_kv":
        return _qk_rope_kv(s, rows, context, device, g, pdl)
    if op == "qkv_rope_kv":
        return _qkv_rope_kv(s, rows, context, device, g, pdl)
    if op in ("rmsnorm", "add_norm"):
        return _norm(op, s, rows, device, g, pdl)
    if op == "router":
        return _router(s, rows, device, g, pdl)
    if op == "moe":
        return _moe(s, rows, distinct, device, g, pdl)
    if op == "lm_head":
        return _lm_head(s, rows, device, g, pdl)
    if op == "topk":
        return _topk(s, rows, device, g, pdl)
    if op == "expert_prefetch":
        return _expert_prefetch(s, rows, device, g)
    if op == "o_proj_router":
        return _o_proj_router(s, rows, device, g, pdl)
    if op == "add_norm_route":
        return _add_norm_route(s, rows, device, g, pdl)
    raise ValueError(f"unknown op {op!r}")


# ---- measuring ------------------------------------------------------------------------------------------------------
def same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    """Equal element by element as bit patterns (NaNs included)."""
    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y))
                                    for x, y in zip(a, b))


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def tune_op(case: Case, cands: list[tuple[str, dict, object]], default, repeats: int, deadline: float,
            op: str) -> dict:
    """Times the default and `cands` on `case`, alternating replays; returns the op's JSON record."""
    from .kernels_micro import capture_calls

    entries = [("default", {}, default)] + cands
    rows, graphs, ref = [], {}, None
    held = []  # each graph's calls, and with them the buffers it writes: a graph does not keep them alive
    for name, overrides, st in entries:
        row = {"name": name, "overrides": overrides, "settings": dataclasses.asdict(st),
               "order_fields": order_changes(op, overrides)}
        rows.append(row)
        if time.monotonic() > deadline and name != "default":
            row["error"] = "skipped: --budget spent"
            continue
        try:
            calls = case.calls(st)
            out = tuple(t.clone() for t in calls[0]())
            torch.cuda.synchronize()
            if name == "default":
                ref = out
            if ref is not None:
                row["bit_identical"] = same_bits(out, ref)
            graphs[name] = capture_calls(calls, MIN_CALLS)
            held.append(calls)
            row["calls_per_graph"] = graphs[name][1]
        except Exception as e:  # a candidate the kernel refuses or cannot compile: recorded, the others go on
            row["error"] = _error(e)
        torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times: dict[str, list[float]] = {name: [] for name in graphs}
    names = list(graphs)
    for name in names:  # one untimed replay each
        graphs[name][0].replay()
    torch.cuda.synchronize()
    for i in range(repeats if names else 0):
        if i and time.monotonic() > deadline:
            break
        for name in names[i % len(names):] + names[:i % len(names)]:  # each round starts one candidate later
            graph, n = graphs[name]
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) * 1e3 / n)
    base = statistics.median(times["default"]) if times.get("default") else None
    for row in rows:
        t = times.get(row["name"])
        if t:
            row.update(times_us=t, median_us=statistics.median(t))
            if base:
                row["ratio"] = row["median_us"] / base
    del graphs
    return {"op": op, "desc": case.desc, "shapes": case.shapes, "copies": case.copies,
            "repeats_done": min((len(t) for t in times.values()), default=0), "candidates": rows}


def bits_text(row: dict) -> str:
    if "bit_identical" not in row:
        return "-"
    if row["name"] == "default":
        return "reference"
    if row["bit_identical"]:
        return "same bits"
    if row["order_fields"]:
        return f"numerical change ({', '.join(row['order_fields'])} sets a sum's order)"
    return "DIFFERENT BITS (no field it changes sets a sum's order)"


def line(op: str, row: dict) -> str:
    if "median_us" not in row:
        return f"{op:18} {row['name']:24} {'':>10} {'':>6}  {row.get('error', 'not timed')}"
    ratio = f"{row['ratio']:6.3f}" if "ratio" in row else f"{'-':>6}"
    return f"{op:18} {row['name']:24} {row['median_us']:8.2f}us {ratio}  {bits_text(row)}"


def run(ops: tuple[str, ...], only: tuple[str, ...] | None, rank: int, rows: int, context: int, distinct: int,
        repeats: int, budget: float | None, out: str | None, pdl: bool = True, seed: int = 0) -> dict:
    import triton

    from ..provenance import commit

    if not torch.cuda.is_available():
        raise RuntimeError("iquest bench tune needs a CUDA device")
    t0 = time.monotonic()
    deadline = t0 + budget if budget else math.inf
    dev = torch.device("cuda")
    shapes = rank_shapes(rank)
    report = {"bench": "tune", "commit": commit(), "device": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
              "host": platform.node(), "command": shlex.join(["iquest", *sys.argv[1:]]), "tp": TP,
              "rank": dataclasses.asdict(shapes), "rows": rows, "context": context, "distinct": distinct,
              "repeats": repeats, "budget_s": budget, "pdl": pdl, "seed": seed,
              "timing": f"per candidate a CUDA graph of >= {MIN_CALLS} back-to-back calls"
                        f"{' launched with PDL' if pdl else ''}, rotating over input copies (>= "
                        f"{ROTATE_BYTES >> 20} MB of weights or KV, at most {MAX_COPIES}); the graphs replayed in "
                        "turns, one replay each a round; per call = replay / calls; median over rounds",
              "ops": []}
    print(f"bench tune  commit={report['commit']} device={report['device']} rank {rank} of TP{TP}, {rows} rows, "
          f"context {context}, {distinct} experts")
    print(f"{'op':18} {'candidate':24} {'median':>10} {'ratio':>6}  bits against the default")
    for op in ops:
        if time.monotonic() > deadline:
            report["ops"].append({"op": op, "skipped": "--budget spent"})
            print(f"{op:18} skipped: --budget spent")
            continue
        try:
            case = build(op, shapes, rows, context, distinct, dev, seed, pdl)
        except Exception as e:
            report["ops"].append({"op": op, "error": _error(e)})
            print(f"{op:18} error: {_error(e)}")
            continue
        rec = tune_op(case, candidates(op, only), default_settings(op), repeats, deadline, op)
        report["ops"].append(rec)
        for row in rec["candidates"]:
            print(line(op, row))
        del case
        torch.cuda.empty_cache()
    report["seconds"] = time.monotonic() - t0
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report
