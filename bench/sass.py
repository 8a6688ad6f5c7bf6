"""`iquest bench sass`: the decode kernels compiled for the H200 (sm_90a) on any machine, no GPU needed.

Triton compiles for a named target without a device; the ptxas, nvdisasm and cuobjdump of its wheel then give what ncu
would start from: registers per thread, stack (spills), shared memory, and the static instruction mix. The kernels are
compiled as their wrappers launch them at one TP8 rank's decode shapes of docs/model.md's model: their settings classes'
defaults for tiles, warps and stages, and the divisibility by 16 that the runtime finds in every pointer and stride
there (without it, loads are not vectorized and the numbers mean nothing). Use it to check a kernel change for spills
and conversion instructions before spending GPU time (docs/PERF.md: the compact MoE grid's spills were visible here).
Every kernel the engine launches for a decode round's layer has a spec (`specs`): the FP8 linears, q/k norm + RoPE + KV
write, split-KV attention and its combine, the norms, the router's two launches, the MoE's three (both expert offsets a
TP8 rank can have), the MoE's combine ending in the sandwich tail, the peer all-reduce ending in it (TP 8) and the LM
head, at the bf16 activations the engine runs on the GPU.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from ..fast.kernel_settings import KernelSettings
from ..kernels import fp8_linear as fl, fp8_linear_direct as fd

TARGET = GPUTarget("cuda", 90, 32)
SAMPLING_TOP_K = 20  # candidates a draft distribution holds: the mini model's generation top-k
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
FULL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "iquest-q1.json"
TP = 8
ROWS = 6  # the decode block at depth 5
H200_SMS = 132


@dataclass(frozen=True)
class KernelSpec:
    """One kernel as a wrapper launches it: pointer types, constexprs, the arguments the runtime sees divisible
    by 16, and the launch's warps and stages."""

    fn: object
    types: dict[str, str]
    constexprs: dict[str, object]
    div16: tuple[str, ...]
    num_warps: int
    num_stages: int
    note: str = ""
    options: dict = field(default_factory=dict)  # compile options beyond warps and stages (enable_fp_fusion)


def specs() -> dict[str, KernelSpec]:
    """The FP8 linear at one TP8 rank of docs/model.md's model (bf16 input, 6 rows): q/k/v as one weight
    [1024 x 3072] with `LinearSettings`' defaults (the engine's launch), its K loop, and the direct kernel at o_proj
    [3072 x 768]; then the other kernels (`published_specs`)."""
    from ..reference.checkpoint import layer_prefix, shard_range, tensor_specs
    from ..reference.config import Config

    config = Config.from_file(FULL_CONFIG, FULL_CONFIG.with_name("iquest-q1-mtp.json"))
    layout = tensor_specs(config)
    a = layer_prefix(1) + "self_attn."

    def rank_shape(name: str) -> tuple[int, int]:
        shape = list(layout[a + name].shape)
        dim, start, stop = shard_range(layout[a + name], config, TP, 0)
        shape[dim] = stop - start
        return shape[0], shape[1]

    qkv_n = sum(rank_shape(f"{w}_proj.weight")[0] for w in "qkv")
    qkv_k = rank_shape("q_proj.weight")[1]
    o_k = rank_shape("o_proj.weight")[1]
    ls = KernelSettings().linear  # the engine's launch (q/k/v unfolded)
    # q/k/v as the engine calls it: its K splits, each program's tiles loaded before the wait
    qkv_splits = _linear_auto_split(qkv_n, qkv_k, ls.block_n, 128, H200_SMS)
    qkv_tiles = fl.preload_plan(ROWS, qkv_n, qkv_k, (128, 128), dataclasses.replace(ls, split_k=qkv_splits))
    linear = KernelSpec(
        fl._fp8_linear_kernel,
        dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32"),
        dict(B0=128, B1=128, BLOCK_M=fl.BLOCK_M, BLOCK_N=ls.block_n, BLOCK_K=128, SPLIT=True, SERIAL=True,
             F32=False, PREC="tf32", PDL=True, PRELOAD=qkv_tiles),
        ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "part_ptr", "lock_ptr", "N", "K", "stride_xm", "stride_ym",
         "k_per_split"),
        ls.num_warps, ls.num_stages, f"FP8 linear (q/k/v [{qkv_n} x {qkv_k}]: {qkv_tiles} K tiles preloaded), split "
                                     "K summed in the launch")
    loop = KernelSpec(linear.fn, linear.types, dict(linear.constexprs, PRELOAD=0), linear.div16, linear.num_warps,
                      linear.num_stages, "FP8 linear, the pipelined K loop (without preload)")
    # fp8_linear_direct (LinearSettings.direct, the o-projection's default) at o_proj's shape: one split of its K
    # tiles over 2 warps, stored
    direct = KernelSpec(
        fd._fp8_linear_direct_kernel, dict(linear.types, x_ptr="*bf16"),
        dict(B0=128, B1=128, G=2, W_LOAD=fd.load_layout(2), SPLIT=False, SERIAL=False, PRELOAD=o_k // 128, PDL=True),
        linear.div16, 2, 1, f"FP8 linear, operands straight into the MMA's registers (Gluon; o_proj, K {o_k}, 2 warps)")
    return {"fp8_linear": linear, "fp8_linear_loop": loop, "fp8_linear_direct": direct, **published_specs()}


def _launch(fn, ptrs: dict[str, str], ints: dict[str, int], floats: tuple[str, ...], constexprs: dict,
            num_warps: int, num_stages: int, note: str, options: dict | None = None) -> KernelSpec:
    """A spec as the runtime specializes the launch: pointers 16-byte aligned (torch's allocations, and the column
    views the engine passes start at multiples of 16 bytes), an int argument equal to 1 compiled in as a constant and
    one divisible by 16 marked so (Triton does both on every launch), fp32 scalars."""
    return KernelSpec(fn, {**ptrs, **{n: "fp32" for n in floats}},
                      {**{n: 1 for n, v in ints.items() if v == 1}, **constexprs},
                      tuple(ptrs) + tuple(n for n, v in ints.items() if v != 1 and v % 16 == 0),
                      num_warps, num_stages, note, dict(options or {}))


NO_FMA = {"enable_fp_fusion": False}  # the wrappers that round as torch does launch with contraction off


def published_specs(context: int = 1024) -> dict[str, KernelSpec]:
    """The published model's kernels at one TP8 rank's decode shapes (bench/tune.rank_shapes: 6 query heads and one
    KV head of 128, hidden 3072, 192-row expert shards, 20000 vocabulary rows; ROWS rows, bf16 activations), with
    their settings classes' defaults, as their wrappers launch them on an H200 (132 SMs) with PDL. Attention reads a
    full layer's cache as bench step holds it at `context`, a sliding layer's ring of window + 64 slots."""
    from ..fast.cache import RING_SLACK
    from ..kernels import allreduce as ar, decode_attention as da, depth_rule as dr, expert_prefetch as xp, \
        lm_head as lh, logprobs as lp, moe as mo, o_proj_router as opr, qk_rope_kv as qr, qkv_rope_kv as qrk, \
        rmsnorm as rn, route_tail as rt, router as ro
    from ..reference.depth import FEATURES
    from ..kernels.launch import prefetch_lines
    from .tune import FULL_SLACK, rank_shapes

    s, odd = rank_shapes(0), rank_shapes(1)
    R, H, D, G, hkv = ROWS, s.hidden, s.head_dim, s.q_heads // s.kv_heads, s.kv_heads
    out: dict[str, KernelSpec] = {}

    # ---- attention: the split kernel on a full layer and a sliding one, the combine at a short and a long cache
    def splits(slots: int, st) -> int:  # the grid of a cache of slots + 1 slots (the engine's), on an H200
        return da.default_num_splits(slots + 1, hkv, H200_SMS, st.split_min)

    line_elems, lines = prefetch_lines(D, 2)
    q_ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", slot_pos_ptr="*i64", q_pos_ptr="*i64",
                  part_m_ptr="*fp32", part_l_ptr="*fp32", part_acc_ptr="*fp32")
    full, sliding = KernelSettings().attention_full, KernelSettings().attention_sliding
    for name, st, slots, window in (("attention_split", full, context + FULL_SLACK, None),
                                    ("attention_split_sliding", sliding, s.window + RING_SLACK, s.window)):
        n = splits(slots, st)
        out[name] = _launch(
            da._attention_split_kernel, q_ptrs,
            dict(S=slots + 1, R=R, window=window or 0, stride_qr=s.q_heads * D, stride_qh=D, stride_ks=hkv * D,
                 stride_kh=D, stride_vs=hkv * D, stride_vh=D), ("qk_scale",),
            dict(G=G, D=D, NUM_SPLITS=n, BLOCK_M=max(16, triton.next_power_of_2(R * G)), BLOCK_N=st.block_n,
                 MIN_SPLIT=st.split_min, SLIDING=window is not None, F32=False, PREC="tf32", PDL=True, R_PAD=16,
                 EARLY_SLOTS=da.EARLY_SLOTS if st.early else 0, LINE_ELEMS=line_elems, LINES=lines),
            st.num_warps, st.num_stages, f"attention splits ({'full layer' if window is None else 'sliding layer'}, "
                                         f"{slots} + 1 slots: {n} splits of >= {st.split_min}; {R} rows x {G} heads)")
    long_slots = 2 * H200_SMS * full.split_min  # from here on a full layer gets its most splits
    for name, slots in (("attention_combine", context + FULL_SLACK), ("attention_combine_long", long_slots)):
        st = full
        n = splits(slots, st)
        max_splits = max(16, triton.next_power_of_2(n))
        out[name] = _launch(
            da._attention_combine_kernel,
            dict(part_m_ptr="*fp32", part_l_ptr="*fp32", part_acc_ptr="*fp32", q_ptr="*bf16", sink_k_ptr="*fp32",
                 q_pos_ptr="*i64", out_ptr="*bf16"),
            dict(S=slots + 1, R=R, stride_qr=s.q_heads * D, stride_qh=D, stride_or=s.q_heads * D, stride_oh=D),
            ("qk_scale",),
            dict(G=G, D=D, NUM_SPLITS=n, MAX_SPLITS=max_splits, BLOCK_S=min(st.combine_splits, max_splits),
                 COLS=min(st.combine_cols, D), BLOCK_N=st.block_n, MIN_SPLIT=st.split_min, HAS_SINK=True, PDL=True,
                 R_PAD=16, PRELOAD=st.preload, EARLY=st.early),
            st.combine_warps, 1, f"attention combine ({n} splits, full layer of {slots} + 1 slots, with the sink)")

    # ---- q/k norm + RoPE + KV write, on a full layer's cache; q, k, v are column views of the q/k/v projection
    qkv = (s.q_heads + 2 * hkv) * D
    out["qk_rope_kv"] = _launch(
        qr._qk_rope_kv_kernel,
        dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", qw_ptr="*bf16", kw_ptr="*bf16", cos_ptr="*fp32",
             sin_ptr="*fp32", pos_ptr="*i64", live_ptr="*u8", out_ptr="*bf16", ck_ptr="*bf16", cv_ptr="*bf16",
             sp_ptr="*i64"),
        dict(HQ=s.q_heads, HKV=hkv, SLOTS=context + FULL_SLACK, stride_q=qkv, stride_k=qkv, stride_v=qkv,
             stride_cos=s.rotary, stride_sin=s.rotary, stride_o=s.q_heads * D), ("eps",),
        dict(D=D, ROT=s.rotary, ROPE=True, PDL=True), qr.QkRopeSettings().num_warps, 1,
        f"q/k norm + RoPE ({s.rotary} of {D} dims) + KV write, {R} rows x ({s.q_heads} + {hkv}) heads", NO_FMA)
    # the same prologue at the end of the q/k/v projection (kernels/qkv_rope_kv.py): one head a tile, K split as the
    # product sets it (else as the plain linear splits it: LinearSettings' column tiles on 132 SMs)
    ls = KernelSettings().qkv_rope_kv
    hidden = s.hidden
    splits = ls.split_k or _linear_auto_split(qkv, hidden, ls.block_n, 128, H200_SMS)
    k_per_split = -(-(hidden // 128) // splits) * 128
    out["qkv_rope_kv"] = _launch(
        qrk._qkv_rope_kv_kernel,
        dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32",
             qw_ptr="*bf16", kw_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", live_ptr="*u8",
             ck_ptr="*bf16", cv_ptr="*bf16", sp_ptr="*i64"),
        dict(M=R, N=qkv, K=hidden, stride_xm=hidden, stride_ym=qkv, scale_cols=hidden // 128, k_per_split=k_per_split,
             splits=splits, HQ=s.q_heads, HKV=hkv, SLOTS=context + FULL_SLACK, stride_cos=s.rotary,
             stride_sin=s.rotary), ("eps",),
        dict(B0=128, B1=128, BLOCK_M=fl.BLOCK_M, D=D, BLOCK_K=128, SPLIT=splits > 1, F32=False, PREC="tf32",
             ROT=s.rotary, ROPE=True, INTERP=False, PDL=True,
             PRELOAD=fl.preload_tiles(hidden, k_per_split, 128) if ls.preload else 0), ls.num_warps, ls.num_stages,
        f"q/k/v projection [{qkv} x {hidden}] E4M3 in {splits} K splits, ending in the q/k norm + RoPE + KV write")

    # ---- the norms: a plain RMSNorm, and the attention branch's sandwich tail (branch normalized, scale 1)
    norm_warps, block = rn.RmsNormSettings().num_warps, triton.next_power_of_2(H)
    out["rmsnorm"] = _launch(rn._rmsnorm_kernel, dict(x_ptr="*bf16", w_ptr="*bf16", o_ptr="*bf16"),
                             dict(H=H, stride_x=H, stride_o=H), ("eps",), dict(BLOCK=block, PDL=True), norm_warps, 1,
                             f"RMSNorm, {R} rows of {H}", NO_FMA)
    out["add_norm"] = _launch(
        rn._add_norm_kernel, {f"{n}_ptr": "*bf16" for n in ("r", "y", "yw", "nw", "h", "b")},
        dict(H=H, stride_r=H, stride_y=H, stride_h=H, stride_b=H), ("eps", "scale"),
        dict(BLOCK=block, Y_NORM=True, SCALED=False, PDL=True), norm_warps, 1,
        f"sandwich tail (branch norm, residual add, next norm), {R} rows of {H}", NO_FMA)

    # ---- the router: logits over H splits, then softmax and top-k a row
    rs = ro.RouterSettings()
    split = max(1, min(triton.cdiv(H, rs.block_h), triton.cdiv(rs.programs_per_sm * H200_SMS,
                                                                triton.cdiv(s.experts, rs.block_e))))
    n_split, h_per_split = ro.split_plan(H, split, rs.block_h)
    out["router_logits"] = _launch(
        ro._router_logits_kernel, dict(b_ptr="*bf16", w_ptr="*fp32", part_ptr="*fp32"),
        dict(E=s.experts, H=H, stride_b=H, h_per_split=h_per_split), (),
        dict(ROWS=R, ROWS_PAD=triton.next_power_of_2(R), BLOCK_E=rs.block_e, BLOCK_H=rs.block_h, PDL=True,
             PRELOAD=rs.preload and h_per_split == rs.block_h), rs.num_warps, 1,
        f"router logits, fp32 [{s.experts} x {H}] in {n_split} H splits")
    e_pad = triton.next_power_of_2(s.experts)
    # the select with its L2 requests (EngineOptions.routed_prefetch, off by default: the engine's plain select is this
    # kernel with WARM off, which `compile_spec(spec, WARM=False)` compiles)
    slab = s.inter * H  # one expert's Gate (or Up) codes at the rank: what the select warms once it has chosen
    out["router_select"] = _launch(
        ro._router_select_kernel, dict(part_ptr="*fp32", weights_ptr="*fp32", experts_ptr="*i64", scores_ptr="*fp32",
                                       gate_ptr="*fp8e4nv", up_ptr="*fp8e4nv"),
        dict(R=R, E=s.experts, splits=n_split, stride_gate=slab, stride_up=slab, slab_bytes=slab), (),
        dict(E_PAD=e_pad, SPLIT_BLOCK=max(1, min(triton.next_power_of_2(n_split), ro.PART_CHUNK // e_pad)),
             TOP_K=s.top_k, K_PAD=triton.next_power_of_2(s.top_k), ACCURATE_EXP=True, PDL=True, WARM=True,
             CHUNK=rs.warm_chunk_bytes, CHUNKS_PAD=triton.next_power_of_2(triton.cdiv(slab, rs.warm_chunk_bytes))),
        rs.select_warps, 1, f"router softmax + top-{s.top_k} of {s.experts}, then bulk L2 requests for the chosen "
                            f"experts' Gate and Up ({slab} bytes each)")

    # ---- the router fold (EngineOptions.router_fold): o_proj writing the router's partial logits, and the attention's
    # sandwich tail summing them and selecting (in place of router_logits and router_select)
    o_k = s.q_heads * D
    ls = KernelSettings().o_proj
    o_splits = _linear_auto_split(H, o_k, ls.block_n, 128, H200_SMS)
    o_kps = -(-(o_k // 128) // o_splits) * 128
    ps = KernelSettings().o_proj_router
    out["o_proj_router"] = _launch(
        opr._o_proj_router_kernel,
        dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32",
             r_ptr="*bf16", rw_ptr="*fp32", wo_ptr="*bf16", parts_ptr="*fp32"),
        dict(M=R, N=H, K=o_k, stride_xm=o_k, stride_ym=H, scale_cols=o_k // 128, k_per_split=o_kps, splits=o_splits,
             stride_rm=H, E=s.experts), (),
        dict(B0=128, B1=128, BLOCK_M=fl.BLOCK_M, BLOCK_N=ls.block_n, BLOCK_K=128, SPLIT=o_splits > 1, F32=False,
             PREC="tf32", BLOCK_E=ps.block_e, PDL=True, PRELOAD=fl.preload_tiles(o_k, o_kps, 128) if ls.preload else 0,
             PREFETCH=ps.prefetch), ls.num_warps, ls.num_stages,
        f"o_proj [{H} x {o_k}] E4M3 in {o_splits} K splits, each tile's last split writing the router's partial "
        f"logits over its {ls.block_n} columns ({s.experts} experts)")
    tiles = triton.cdiv(H, ls.block_n)
    out["add_norm_route"] = _launch(
        rt._add_norm_route_kernel,
        dict(**{f"{n}_ptr": "*bf16" for n in ("r", "y", "yw", "nw", "h", "b")}, parts_ptr="*fp32",
             weights_ptr="*fp32", experts_ptr="*i64", scores_ptr="*fp32"),
        dict(R=R, H=H, E=s.experts, T=tiles, stride_r=H, stride_y=H, stride_h=H, stride_b=H), ("eps", "scale"),
        dict(BLOCK=block, SCALED=False, E_PAD=e_pad, T_BLOCK=rt._t_block(tiles, s.experts, rt.RouteTailSettings()),
             TOP_K=s.top_k, K_PAD=triton.next_power_of_2(s.top_k), ACCURATE_EXP=True, PDL=True), norm_warps, 1,
        f"sandwich tail summing {tiles} tiles' partial logits, softmax + top-{s.top_k} of {s.experts}", NO_FMA)

    # ---- the expert prefetch's side branch (EngineOptions.expert_prefetch): the prediction's partial logits, then a
    # row's selection issuing its experts' bulk L2 prefetches
    xs = xp.PrefetchSettings()
    x_split = max(1, min(triton.cdiv(H, xs.block_h), triton.cdiv(xs.programs_per_sm * H200_SMS,
                                                                   triton.cdiv(s.experts, xs.block_e))))
    x_splits, x_hps = ro.split_plan(H, x_split, xs.block_h)
    widths = dict(zip(("W0", "W1", "W2", "W3"), (*xs.rows, *(0,) * (4 - len(xs.rows)))))
    out["prefetch_logits"] = _launch(
        xp._predict_logits_kernel, dict(a_ptr="*bf16", w_ptr="*fp32", part_ptr="*fp32", live_ptr="*i1"),
        dict(E=s.experts, H=H, stride_a=H, h_per_split=x_hps), (),
        dict(ROWS=R, ROWS_PAD=triton.next_power_of_2(R), BLOCK_E=xs.block_e, BLOCK_H=xs.block_h, **widths),
        xs.num_warps, 1, f"the prefetch's predicted logits, fp32 [{s.experts} x {H}] in {x_splits} H splits")
    slab = s.inter * H
    out["prefetch_warm"] = _launch(
        xp._predict_warm_kernel,
        dict(part_ptr="*fp32", live_ptr="*i1", predicted_ptr="*i64", weights_ptr="*fp32", scores_ptr="*fp32",
             gate_ptr="*fp8e4nv", up_ptr="*fp8e4nv"),
        dict(R=R, E=s.experts, splits=x_splits, stride_gate=slab, stride_up=slab, nbytes=slab), (),
        dict(ROWS_PAD=triton.next_power_of_2(R), E_PAD=e_pad,
             SPLIT_BLOCK=max(1, min(triton.next_power_of_2(x_splits), 8192 // e_pad)), TOP_K=s.top_k,
             K_PAD=triton.next_power_of_2(s.top_k), ACCURATE_EXP=True, CHUNK=xs.chunk_bytes,
             CHUNKS_PAD=triton.next_power_of_2(triton.cdiv(slab, xs.chunk_bytes)), ISSUE=True, **widths),
        xs.select_warps, 1, f"the prefetch's top-{s.top_k}, then bulk L2 prefetches of each expert's Gate and Up "
        f"({slab} bytes each)")

    # ---- the routed experts at both offsets (rank 0: 0, odd ranks: 64 rows into a 128-row scale block)
    ms = mo.MoESettings()
    (B0, B1), I, k = s.block, s.inter, s.top_k
    routing = dict(K_TOP=k, K_PAD=max(2, triton.next_power_of_2(k)), P_PAD=max(16, triton.next_power_of_2(R * k)),
                   LIVE_COUNT=False, BLOCK_M=ms.block_m, BF16=True, DOT_F32=False, INTERP=False, PDL=True)
    line_elems, lines = prefetch_lines(I, 1)
    early = dict(PREFETCH=ms.down_prefetch, LINE_ELEMS=line_elems, LINES=lines)  # Down's weight tile before its wait
    step = mo.gate_up_k((B0, B1), ms)  # Gate/Up's K step
    down = dict(BLOCK_N=ms.down_block_n, BLOCK_K=mo.down_k((B0, B1), ms), SCALE_PRODUCT=ms.down_scale == "product")
    launch = mo.down_launch(torch.bfloat16, ms)  # Down's warps, stages and register cap
    down_warps, down_stages = launch.pop("num_warps"), launch.pop("num_stages")
    tail_launch = {k: v for k, v in mo.down_launch(torch.bfloat16, ms, tail=True).items()
                   if k not in ("num_warps", "num_stages")}  # Down ending in the tail: its own cap (none)
    for suffix, shp in (("", s), ("_odd", odd)):
        o = shp.inter_offset
        gs_rows, ds_cols = -(-(I + o) // B0), -(-(I + o) // B1)
        out["moe_gate_up" + suffix] = _launch(
            mo._gate_up_kernel,
            dict(b_ptr="*bf16", g_ptr="*fp8e4nv", gs_ptr="*fp32", u_ptr="*fp8e4nv", us_ptr="*fp32",
                 experts_ptr="*i64", live_ptr="*u8", h_ptr="*fp32", part_ptr="*fp32", lock_ptr="*i32"),
            dict(R=R, H=H, I=I, stride_b=H, gs_e=gs_rows * (H // B1), gs_r=H // B1, us_e=gs_rows * (H // B1),
                 us_r=H // B1, k_per=mo._split_width(H, (B0, B1), ms)), (),
            dict(G_OFF0=o, G_OFF1=0, U_OFF0=o, U_OFF1=0, B0=B0, B1=B1, **routing, PAIR_MAJOR=ms.pair_major,
                 SCALE_PRODUCT=ms.gate_up_scale == "product", SPLIT=ms.gate_up_split, BLOCK_N=ms.gate_up_block_n,
                 BLOCK_K=step), ms.warps, ms.gate_up_stages,
            f"MoE Gate/Up, [{I} x {H}] E4M3 an expert starting {o} rows into its scale block")
        out["moe_down" + suffix] = _launch(
            mo._down_kernel,
            dict(h_ptr="*fp32", d_ptr="*fp8e4nv", ds_ptr="*fp32", experts_ptr="*i64", live_ptr="*u8", y_ptr="*fp32"),
            dict(R=R, H=H, I=I, ds_e=(H // B0) * ds_cols, ds_r=ds_cols), (),
            dict(D_OFF0=0, D_OFF1=o, B0=B0, B1=B1, **routing, PAIR_MAJOR=ms.pair_major, **down, **early), down_warps,
            down_stages, f"MoE Down, [{H} x {I}] E4M3 an expert starting {o} columns into its scale block", launch)
    o = s.inter_offset
    out["moe_down_add_norm"] = _launch(
        mo._down_add_norm_kernel,
        dict(h_ptr="*fp32", d_ptr="*fp8e4nv", ds_ptr="*fp32", experts_ptr="*i64", live_ptr="*u8", y_ptr="*bf16",
             weights_ptr="*fp32", lock_ptr="*i32", r_ptr="*bf16", yw_ptr="*bf16", nw_ptr="*bf16", sum_ptr="*bf16",
             ho_ptr="*bf16", b_ptr="*bf16"),
        dict(R=R, H=H, I=I, ds_e=(H // B0) * -(-(I + o) // B1), ds_r=-(-(I + o) // B1), stride_r=H, stride_sum=H,
             stride_h=H, stride_b=H), ("eps", "scale"),
        dict(D_OFF0=0, D_OFF1=o, B0=B0, B1=B1, **routing, **down, BLOCK_H=block, Y_NORM=False, SCALED=True, **early),
        down_warps, down_stages, f"MoE Down, [{H} x {I}] E4M3 an expert, then a program a row waiting for the "
                                 f"owners' arrivals: the weighted sum of {k} slots and the sandwich tail (TP 1, rank "
                                 f"slices)", {**NO_FMA, **tail_launch})
    out["moe_combine"] = _launch(
        mo._combine_kernel, dict(y_ptr="*fp32", weights_ptr="*fp32", live_ptr="*u8", out_ptr="*fp32"),
        dict(R=R, H=H, stride_o=H), (), dict(K_TOP=k, BLOCK=ms.combine_block, LIVE_COUNT=False, PDL=True), 4, 1,
        f"MoE weighted sum of {k} slots", NO_FMA)
    tail_ptrs = {f"{n}_ptr": "*bf16" for n in ("yw", "nw", "sum", "h", "b")}
    tail_ints = dict(H=H, stride_sum=H, stride_h=H, stride_b=H)
    out["moe_combine_add_norm"] = _launch(
        mo._combine_add_norm_kernel, dict(y_ptr="*fp32", weights_ptr="*fp32", live_ptr="*u8", r_ptr="*bf16",
                                          **tail_ptrs), dict(R=R, stride_r=H, **tail_ints), ("eps", "scale"),
        dict(K_TOP=k, LIVE_COUNT=False, BLOCK=block, Y_NORM=False, SCALED=True, BF16=True, INTERP=False, PDL=True),
        norm_warps, 1, f"MoE weighted sum of {k} slots ending in the sandwich tail (TP 1, rank slices)", NO_FMA)

    # ---- the peer all-reduce at TP 8 ending in the tail: after o_proj (a tensor), after the MoE (its outputs)
    ring = dict(peers_ptr="*i64", own_ptr="*bf16", state_ptr="*i32", error_ptr="*i32", res_ptr="*bf16", **tail_ptrs)
    protocol = dict(WORLD=TP, CAP=64, BLOCK=block, BITS=16, TAIL=True, Y_NORM=False, POLL=ar._poll,
                    REARM=ar._rearm_and_advance, ORDER=ar._rank_order, HOLD=False, PDL=True)
    for name, src, combine in (("all_reduce_add_norm", "*bf16", False), ("all_reduce_combine_add_norm", "*fp32", True)):
        out[name] = _launch(
            ar._all_reduce_kernel, dict(x_ptr=src, rw_ptr=src, live_ptr="*u8" if combine else src, **ring),
            dict(R=R, S=H, stride_x=H, stride_res=H, **tail_ints), ("eps", "scale"),
            dict(protocol, COMBINE=combine, K_TOP=k if combine else 1, LIVE_COUNT=False, SCALED=combine),
            norm_warps, 1, f"peer all-reduce over {TP} ranks ending in the sandwich tail"
            + (f", combining {k} slots as it pushes" if combine else ""), NO_FMA)

    # ---- the LM head: bf16 [20000 x 3072] a rank (held as stored, widened in registers), "rows" (the default) at the
    # verification block's rows and a draft's one, and "dot" at the V tile choose_block_v takes on 132 SMs
    ls = KernelSettings().lm_head
    rows_block_v = ls.block_v or lh.ROWS_BLOCK_V
    head = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*fp32")
    for name, rows in (("lm_head", R), ("lm_head_draft", 1)):
        out[name] = _launch(
            lh._lm_head_rows_kernel, head, dict(V=s.vocab, H=H, stride_x=H, stride_w=H, stride_y=s.vocab), (),
            dict(ROWS=rows, ROWS_PAD=triton.next_power_of_2(rows), BLOCK_V=rows_block_v, BLOCK_K=ls.rows_block_k,
                 PDL=True), ls.rows_warps, 1,
            f"LM head, bf16 [{s.vocab} x {H}], {rows} row(s), {rows_block_v} x {ls.rows_block_k} tiles")
    block_v = next((bv for bv in (64, 32) if triton.cdiv(s.vocab, bv) >= ls.programs_per_sm * H200_SMS), 16)
    out["lm_head_dot"] = _launch(
        lh._lm_head_kernel, head, dict(R=R, V=s.vocab, H=H, stride_x=H, stride_w=H, stride_y=s.vocab), (),
        dict(BLOCK_R=lh.BLOCK_R, BLOCK_V=block_v, BLOCK_K=ls.block_k, PDL=True), ls.num_warps, ls.num_stages,
        f"LM head, \"dot\" form, bf16 [{s.vocab} x {H}], {block_v}-row V tiles")

    # ---- the model's own logprobs: a rank's part over its vocabulary slice, the round's emitted token a row
    out["logprob_parts"] = _launch(
        lp._logprob_parts_kernel, dict(x_ptr="*fp32", tok_ptr="*i64", out_ptr="*i64"),
        dict(Vr=s.vocab, M=1, offset=0, stride_x=s.vocab, stride_t=1, stride_o=2), (),
        dict(BLOCK=lp.BLOCK, M_PAD=2, LIBDEVICE=True, PDL=True), lp.NUM_WARPS, 1,
        f"logprob parts over a {s.vocab}-logit vocabulary slice, one token a row")

    # ---- the depth controller's rule after a draft depth: five features (the mini model's fitted rule), a draft
    # distribution of SAMPLING_TOP_K candidates
    consts, _ = dr.rule_args({f: 1.0 for f in FEATURES})
    out["depth_rule"] = _launch(
        dr._more_kernel, dict(probs_ptr="*fp32", served_ptr="*fp32", product_ptr="*fp32", more_ptr="*i32"),
        dict(K=SAMPLING_TOP_K), ("depth", "logit_threshold", "w0", "w1", "w2", "w3", "w4"),
        dict(**consts, KP=triton.next_power_of_2(SAMPLING_TOP_K), LIBDEVICE=True, PDL=True), dr.NUM_WARPS, 1,
        f"depth rule over a {SAMPLING_TOP_K}-candidate draft distribution, five features", NO_FMA)
    return out


def _linear_auto_split(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """fp8_linear.choose_split_k with the SM count given (it reads it from the device)."""
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    return max(1, min(k_tiles, (2 * sms) // n_tiles))


def compile_spec(spec: KernelSpec, **constexprs) -> object:
    """The compiled kernel for sm_90a (`constexprs` override the spec's, e.g. PRELOAD=0; num_warps and num_stages
    override the launch's, maxnreg its register cap, 0 for none)."""
    launch = {"num_warps": constexprs.pop("num_warps", spec.num_warps),
              "num_stages": constexprs.pop("num_stages", spec.num_stages)}
    options = dict(spec.options)
    cap = constexprs.pop("maxnreg", options.pop("maxnreg", 0))
    if cap:
        options["maxnreg"] = cap
    params = inspect.signature(spec.fn.fn).parameters
    names = list(params)
    defaults = {n: p.default for n, p in params.items()  # constexpr keywords the spec leaves at their defaults
                if p.default is not inspect.Parameter.empty and "constexpr" in str(p.annotation)}
    values = {**defaults, **spec.constexprs, **constexprs}
    unknown = set(values) - set(names)
    if unknown:
        raise ValueError(f"{spec.note}: no parameters {sorted(unknown)} (the kernel's signature changed?)")
    signature = {n: "constexpr" if n in values else spec.types.get(n, "i32") for n in names}
    make = GluonASTSource if getattr(spec.fn, "is_gluon", lambda: False)() else ASTSource
    source = make(spec.fn, signature, {(names.index(k),): v for k, v in values.items()},
                  {(names.index(n),): [["tt.divisibility", 16]] for n in spec.div16})
    return triton.compile(source, target=TARGET, options={**launch, **options})


_INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s*(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9]*)")  # a SASS line's opcode


def sequence(kernel) -> list[str]:
    """The SASS opcodes in program order (predicates and modifiers dropped: "LDG", "BAR", "ACQBULK", ...)."""
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = _tool("nvdisasm", cubin, "-c")
    return [m.group(1) for m in map(_INSTRUCTION.match, text.splitlines()) if m]


def _tool(name: str, cubin: str, *args: str) -> str:
    return subprocess.run([os.path.join(_BIN, name), *args, cubin], capture_output=True, text=True, check=True).stdout


def dot_loop(sass_text: str) -> dict | None:
    """The innermost loop holding a tensor-core instruction (the shortest span from a label to a branch back to it
    with an HMMA or HGMMA inside): what one warp issues a K step. {"instructions", "mix"}, or None without one."""
    lines = sass_text.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m is None or labels.get(m.group(1), i) >= i:
            continue
        ops = [x.group(1) for x in map(_INSTRUCTION.match, lines[labels[m.group(1)]:i + 1]) if x]
        if any(op in ("HMMA", "HGMMA") for op in ops) and (best is None or len(ops) < len(best)):
            best = ops
    return None if best is None else {"instructions": len(best),
                                      "mix": dict(collections.Counter(best).most_common())}


def report(kernel) -> dict:
    """{"registers", "stack_bytes", "shared_bytes", "instructions", "mix": {opcode: static count}, "dot_loop"
    (`dot_loop`)}."""
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = _tool("nvdisasm", cubin, "-c")
        usage = _tool("cuobjdump", cubin, "-res-usage")
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no register count:\n{usage}")
    mix = collections.Counter(ins.group(1) for ins in map(_INSTRUCTION.match, sass.splitlines()) if ins)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2)), "shared_bytes": kernel.metadata.shared,
            "instructions": sum(mix.values()), "mix": dict(mix.most_common()), "dot_loop": dot_loop(sass)}


def run(names: tuple[str, ...], overrides: dict, top: int = 10) -> dict:
    table = specs()
    out = {}
    for name in names:
        r = report(compile_spec(table[name], **overrides.get(name, {})))
        out[name] = r
        print(f"{name} ({table[name].note}): {r['registers']} registers, {r['stack_bytes']} B stack, "
              f"{r['shared_bytes']} B shared, {r['instructions']} instructions")
        print("   " + ", ".join(f"{op} {n}" for op, n in list(r["mix"].items())[:top]))
        if r["dot_loop"]:
            loop = r["dot_loop"]
            print(f"   a K step (the innermost loop with a tensor-core instruction): {loop['instructions']} "
                  "instructions a warp: " + ", ".join(f"{op} {n}" for op, n in list(loop["mix"].items())[:top]))
    return out
