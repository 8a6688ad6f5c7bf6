"""Where does the context cost go, and which combine removes it? The attention combine's forms, side by side.

Issue 37's context sweep found the added KV costing 2.36x its bytes, 9.4x at 4K. The combine as it was to 18d634c
(`before` here) was one warp a (KV head, row) walking 16-split chunks twice beyond 32 live splits, a max pass and a
sum pass, each chunk one dependent L2 round trip (257 live splits at >= 16K context on a TP8 rank: 17 chunks). This
probe times decode_attention (split kernel + combine, PDL as the engine launches it) with the combine swapped for
each form, and each form's combine alone (the split kernel not launched, its partials left in the workspace):

  * `before`: the combine as it was, the reference of the bit checks;
  * `product`: the product's combine now (a program a (KV head, row, 32 columns), 4 warps over 128 splits a step);
  * `wide-max+pair`: `before` with every live split's maximum in one load (a max is exact in any order) and the
    sum pass two chunks a step (the adds op for op `before`'s, in its order): bit-identical;
  * `rows`, `rows+pair`: the chunk sums written out row by row in the order tl.sum adds one thread's elements of
    `before`'s tile (its LLVM IR is a chain: first + second + third ...): bit-identical;
  * `rows-ds4+quad`: the same over 4 programs of 32 columns, 4 chunks a step: NOT identical (one column a thread
    changes which products the backend fuses into FMAs; `before` mixes fused and unfused by its vector layout);
  * `wide64x8`: 64-split chunks over 8 warps (another order);
  * `sS-cC-wW`: the product's combine with S splits a step, C columns a program, W warps;
  * `min256`, `min256+wide-max+pair`: 256-slot splits at least (4x fewer live splits at long context; another split);
  * `no-combine` (a diagnostic, wrong output): each program waits and stores zeros: the split kernel's cost alone.

The forms in EXACT must give `before`'s output bit for bit in bf16 and fp32 (fp32 output shows a summation order
that bf16 rounding hides; `wide64x8` differing shows the check can fail). Timed as `bench tune` times attention:
CUDA graphs of calls back to back over KV copies, CUDA events, medians. GPU only; a lab probe the product never
imports. Results: docs/PERF.md (C22).

    python3 -m iquest.lab.combine_probe OUT.json [--cases full:16384:6,...] [--forms ...] [--ncu]
    (on the device with PYTHONPATH as ci/gpu.sh sets it)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from ..bench import tune
from ..bench.kernels_micro import FULL_CONFIG, graph_times
from ..kernels import decode_attention as da
from ..kernels.decode_attention import _load_kv_len, _split_len
from ..kernels.launch import wait_for_inputs
from ..provenance import commit
from ..reference.config import Config

CONTEXTS = (1024, 4096, 16384, 65536, 196_000)
REPEATS = 15


@triton.jit
def _live_splits(kv_len_ptr, S, R, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr,
                 HAS_KV_LEN: tl.constexpr, R_PAD: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """The combine's PDL wait and its live split count, in the product's order (EARLY: the count before the wait)."""
    if not EARLY:
        wait_for_inputs(PDL)
    kv_len = _load_kv_len(kv_len_ptr, S, R, HAS_KV_LEN, R_PAD)
    n_live = tl.cdiv(kv_len, _split_len(kv_len, NUM_SPLITS, BLOCK_N, MIN_SPLIT))
    if EARLY:
        wait_for_inputs(PDL)
    return n_live


@triton.jit
def _combine_chunk(part_m_ptr, part_l_ptr, part_acc_ptr, part, ok, d, D: tl.constexpr):
    """Split partials `part` of one (KV head, row): their max, sum of exponentials and weighted V (the combine's
    until the change this probe measured)."""
    ms = tl.load(part_m_ptr + part, mask=ok, other=float("-inf"))
    ls = tl.load(part_l_ptr + part, mask=ok, other=0.0)
    a = tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    return ms, ls, a


@triton.jit
def _combine_add(den, acc, ms, ls, a, m_safe):
    """A chunk of splits added to the denominator and the weighted V at the final max (as the combine was)."""
    w = tl.exp2(ms - m_safe)
    return den + tl.sum(ls * w, axis=0), acc + tl.sum(a * w[:, None], axis=0)


@triton.jit
def _sum_step(part_m_ptr, part_l_ptr, part_acc_ptr, den, acc, base, s0, n_live, c, d, m_safe, row, RG,
              D: tl.constexpr, CHUNK: tl.constexpr, STEP: tl.constexpr):
    """STEP chunks of the sum pass: all their loads first, then the adds in the product's order (a chunk's adds
    only where the product's loop would run them)."""
    p0 = (base + s0 + c) * RG + row
    ms0, ls0, a0 = _combine_chunk(part_m_ptr, part_l_ptr, part_acc_ptr, p0, s0 + c < n_live, d, D)
    if STEP >= 2:
        ms1, ls1, a1 = _combine_chunk(part_m_ptr, part_l_ptr, part_acc_ptr, p0 + CHUNK * RG,
                                      s0 + CHUNK + c < n_live, d, D)
    if STEP == 4:
        ms2, ls2, a2 = _combine_chunk(part_m_ptr, part_l_ptr, part_acc_ptr, p0 + 2 * CHUNK * RG,
                                      s0 + 2 * CHUNK + c < n_live, d, D)
        ms3, ls3, a3 = _combine_chunk(part_m_ptr, part_l_ptr, part_acc_ptr, p0 + 3 * CHUNK * RG,
                                      s0 + 3 * CHUNK + c < n_live, d, D)
    den, acc = _combine_add(den, acc, ms0, ls0, a0, m_safe)
    if STEP >= 2:
        if s0 + CHUNK < n_live:
            den, acc = _combine_add(den, acc, ms1, ls1, a1, m_safe)
    if STEP == 4:
        if s0 + 2 * CHUNK < n_live:
            den, acc = _combine_add(den, acc, ms2, ls2, a2, m_safe)
        if s0 + 3 * CHUNK < n_live:
            den, acc = _combine_add(den, acc, ms3, ls3, a3, m_safe)
    return den, acc


@triton.jit
def _combine_probe_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, kv_len_ptr, out_ptr,
    S, R, stride_or, stride_oh,
    G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_KV_LEN: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr = False, ONE_PASS: tl.constexpr = True, R_PAD: tl.constexpr = 16,
    PRELOAD: tl.constexpr = False, EARLY: tl.constexpr = False,
    MAX_BLOCK: tl.constexpr = 512, WIDE_MAX: tl.constexpr = True, STEP: tl.constexpr = 1,
    CHUNK: tl.constexpr = 16, ZEROS: tl.constexpr = False,
):
    RG = R * G
    pid = tl.program_id(0)
    g = pid // RG
    row = pid % RG
    r = row // G
    head = g * G + row % G
    d = tl.arange(0, D)
    if HAS_SINKS and PRELOAD:
        sink = tl.load(sinks_ptr + head)
    n_live = _live_splits(kv_len_ptr, S, R, NUM_SPLITS, BLOCK_N, MIN_SPLIT, HAS_KV_LEN, R_PAD, PDL, EARLY)
    if ZEROS:
        tl.store(out_ptr + r * stride_or + head * stride_oh + d, tl.zeros([D], tl.float32).to(out_ptr.dtype.element_ty))
        return

    s = tl.arange(0, BLOCK_S)
    m = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), axis=0)
    if HAS_SINKS:
        if not PRELOAD:
            sink = tl.load(sinks_ptr + head)
        sink = sink.to(tl.float32) * 1.4426950408889634
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    acc = tl.zeros([D], tl.float32)
    if ONE_PASS and n_live <= 2 * BLOCK_S:  # the combine's short-context form as it was
        ok0, ok1 = s < n_live, BLOCK_S + s < n_live
        part0 = (g * NUM_SPLITS + s) * RG + row
        part1 = part0 + BLOCK_S * RG
        ms0, ls0, a0 = _combine_chunk(part_m_ptr, part_l_ptr, part_acc_ptr, part0, ok0, d, D)
        ms1, ls1, a1 = _combine_chunk(part_m_ptr, part_l_ptr, part_acc_ptr, part1, ok1, d, D)
        m = tl.maximum(tl.maximum(m, tl.max(ms0, axis=0)), tl.max(ms1, axis=0))
        if HAS_SINKS:
            m = tl.maximum(m, sink)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        den, acc = _combine_add(den, acc, ms0, ls0, a0, m_safe)
        if n_live > BLOCK_S:
            den, acc = _combine_add(den, acc, ms1, ls1, a1, m_safe)
    else:
        if WIDE_MAX:
            sa = tl.arange(0, MAX_BLOCK)
            ms_all = tl.load(part_m_ptr + (g * NUM_SPLITS + sa) * RG + row, mask=sa < n_live, other=float("-inf"))
            m = tl.maximum(m, tl.max(ms_all, axis=0))
        else:
            for s0 in range(0, n_live, BLOCK_S):
                ms = tl.load(part_m_ptr + (g * NUM_SPLITS + s0 + s) * RG + row, mask=s0 + s < n_live,
                             other=float("-inf"))
                m = tl.maximum(m, tl.max(ms, axis=0))
        if HAS_SINKS:
            m = tl.maximum(m, sink)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        c = tl.arange(0, CHUNK)
        for s0 in range(0, n_live, STEP * CHUNK):
            den, acc = _sum_step(part_m_ptr, part_l_ptr, part_acc_ptr, den, acc, g * NUM_SPLITS, s0, n_live, c, d,
                                 m_safe, row, RG, D, CHUNK, STEP)
    if HAS_SINKS:
        den += tl.exp2(sink - m_safe)
    out = tl.where(den > 0, acc / den, 0.0)
    tl.store(out_ptr + r * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _rows_chunk(part_m_ptr, part_acc_ptr, base, s0, n_live, row, RG, d, m_safe, D: tl.constexpr,
                BLOCK_S: tl.constexpr):
    """A chunk's weighted V, row by row: the product's [BLOCK_S, D] tile keeps a column's BLOCK_S rows in one thread
    and tl.sum adds them in row order, first + second + third ... (the LLVM IR's fadd chain), which is this."""
    ok = s0 < n_live
    p = (base + s0) * RG + row
    t = tl.load(part_acc_ptr + p * D + d, mask=ok, other=0.0) * tl.exp2(
        tl.load(part_m_ptr + p, mask=ok, other=float("-inf")) - m_safe)
    for i in tl.static_range(1, BLOCK_S):
        ok = s0 + i < n_live
        p = (base + s0 + i) * RG + row
        t = t + tl.load(part_acc_ptr + p * D + d, mask=ok, other=0.0) * tl.exp2(
            tl.load(part_m_ptr + p, mask=ok, other=float("-inf")) - m_safe)
    return t


@triton.jit
def _rows_den(part_m_ptr, part_l_ptr, base, s0, n_live, row, RG, m_safe, BLOCK_S: tl.constexpr):
    """A chunk's sum of exponentials, as the product's _combine_add (a [BLOCK_S] vector across lanes, tl.sum)."""
    sv = s0 + tl.arange(0, BLOCK_S)
    pv = (base + sv) * RG + row
    ms = tl.load(part_m_ptr + pv, mask=sv < n_live, other=float("-inf"))
    ls = tl.load(part_l_ptr + pv, mask=sv < n_live, other=0.0)
    return tl.sum(ls * tl.exp2(ms - m_safe), axis=0)


@triton.jit
def _combine_rows_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, kv_len_ptr, out_ptr,
    S, R, stride_or, stride_oh,
    G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_KV_LEN: tl.constexpr, HAS_SINKS: tl.constexpr,
    PDL: tl.constexpr = False, ONE_PASS: tl.constexpr = True, R_PAD: tl.constexpr = 16,
    PRELOAD: tl.constexpr = False, EARLY: tl.constexpr = False,
    MAX_BLOCK: tl.constexpr = 512, STEP: tl.constexpr = 2, DSPLIT: tl.constexpr = 1,
):
    """The combine with the chunk sums written out row by row (so any layout gives the product's order), DSPLIT
    programs a (KV head, row) each on D / DSPLIT columns, STEP chunks' loads issued before their adds."""
    RG = R * G
    pid = tl.program_id(0) // DSPLIT
    DB: tl.constexpr = D // DSPLIT
    d = (tl.program_id(0) % DSPLIT) * DB + tl.arange(0, DB)
    g = pid // RG
    row = pid % RG
    r = row // G
    head = g * G + row % G
    if HAS_SINKS and PRELOAD:
        sink = tl.load(sinks_ptr + head)
    n_live = _live_splits(kv_len_ptr, S, R, NUM_SPLITS, BLOCK_N, MIN_SPLIT, HAS_KV_LEN, R_PAD, PDL, EARLY)
    base = g * NUM_SPLITS
    sa = tl.arange(0, MAX_BLOCK)
    m = tl.max(tl.load(part_m_ptr + (base + sa) * RG + row, mask=sa < n_live, other=float("-inf")), axis=0)
    if HAS_SINKS:
        if not PRELOAD:
            sink = tl.load(sinks_ptr + head)
        sink = sink.to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    acc = tl.zeros([DB], tl.float32)
    for s0 in range(0, n_live, STEP * BLOCK_S):
        t0 = _rows_chunk(part_m_ptr, part_acc_ptr, base, s0, n_live, row, RG, d, m_safe, D, BLOCK_S)
        e0 = _rows_den(part_m_ptr, part_l_ptr, base, s0, n_live, row, RG, m_safe, BLOCK_S)
        if STEP >= 2:
            t1 = _rows_chunk(part_m_ptr, part_acc_ptr, base, s0 + BLOCK_S, n_live, row, RG, d, m_safe, D, BLOCK_S)
            e1 = _rows_den(part_m_ptr, part_l_ptr, base, s0 + BLOCK_S, n_live, row, RG, m_safe, BLOCK_S)
        if STEP == 4:
            t2 = _rows_chunk(part_m_ptr, part_acc_ptr, base, s0 + 2 * BLOCK_S, n_live, row, RG, d, m_safe, D,
                             BLOCK_S)
            e2 = _rows_den(part_m_ptr, part_l_ptr, base, s0 + 2 * BLOCK_S, n_live, row, RG, m_safe, BLOCK_S)
            t3 = _rows_chunk(part_m_ptr, part_acc_ptr, base, s0 + 3 * BLOCK_S, n_live, row, RG, d, m_safe, D,
                             BLOCK_S)
            e3 = _rows_den(part_m_ptr, part_l_ptr, base, s0 + 3 * BLOCK_S, n_live, row, RG, m_safe, BLOCK_S)
        den, acc = den + e0, acc + t0
        if STEP >= 2:  # a chunk past n_live adds nothing: adding its zeros could turn a -0 into +0
            live = s0 + BLOCK_S < n_live
            den, acc = tl.where(live, den + e1, den), tl.where(live, acc + t1, acc)
        if STEP == 4:
            live = s0 + 2 * BLOCK_S < n_live
            den, acc = tl.where(live, den + e2, den), tl.where(live, acc + t2, acc)
            live = s0 + 3 * BLOCK_S < n_live
            den, acc = tl.where(live, den + e3, den), tl.where(live, acc + t3, acc)
    if HAS_SINKS:
        den += tl.exp2(sink - m_safe)
    out = tl.where(den > 0, acc / den, 0.0)
    tl.store(out_ptr + r * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


class Combine:
    """Stands in for da._attention_combine_kernel: the wrapper's launch with `kernel` (one program a (KV head, row),
    one warp, 16-split chunks, as the combine was) and this form's constants (DSPLIT programs a row)."""

    replaces = True

    def __init__(self, kernel=None, kw=None, **form):
        self.kernel = kernel or _combine_probe_kernel
        self.kw = dict(kw or {})  # decode_attention keywords besides (other splits)
        self.form = dict(form)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            rows = grid[0] // (kw["D"] // kw.pop("COLS"))
            kw.pop("MAX_SPLITS")
            block = triton.next_power_of_2(kw["NUM_SPLITS"])
            kw.update(MAX_BLOCK=block, BLOCK_S=min(16, block), num_warps=1)
            kw.update(self.form)
            return self.kernel[(rows * self.form.get("DSPLIT", 1),)](*args, **kw)
        return launch


class Keywords:
    """The product's combine with other decode_attention keywords: its own constants, or other splits (min_split)."""

    replaces = False

    def __init__(self, **kw):
        self.kw = kw


def rows(**form):
    return Combine(_combine_rows_kernel, **form)


def product(splits: int, cols: int, warps: int) -> Keywords:
    return Keywords(combine_splits=splits, combine_cols=cols, combine_warps=warps)


FORMS = {
    "before": Combine(WIDE_MAX=False),  # the reference of the bit checks
    "product": None,
    "wide-max+pair": Combine(STEP=2),
    "rows": rows(STEP=1),
    "rows+pair": rows(STEP=2),
    "rows-ds4+quad": rows(DSPLIT=4, STEP=4),
    "wide64x8": Combine(CHUNK=64, num_warps=8),
    "s256-c32-w8": product(256, 32, 8),
    "s128-c32-w4": product(128, 32, 4),
    "s128-c64-w8": product(128, 64, 8),
    "s64-c128-w8": product(64, 128, 8),
    "s64-c32-w2": product(64, 32, 2),
    "s512-c32-w8": product(512, 32, 8),
    "s128-c16-w4": product(128, 16, 4),
    "min256": Keywords(min_split=256),
    "min256+wide-max+pair": Combine(STEP=2, kw={"min_split": 256}),
    "no-combine": Combine(ZEROS=True),
}
EXACT = ("wide-max+pair", "rows", "rows+pair")  # must give "before"'s bits


class _NoSplit:
    """Stands in for the split kernel: launches nothing, so a call is its combine alone (on the partials left)."""

    def __getitem__(self, grid):
        return lambda *args, **kw: None


def run_form(form, fn, alone=False):
    product, split = da._attention_combine_kernel, da._attention_split_kernel
    if form is not None and form.replaces:
        da._attention_combine_kernel = form
    if alone:
        da._attention_split_kernel = _NoSplit()
    try:
        return fn()
    finally:
        da._attention_combine_kernel, da._attention_split_kernel = product, split


def form_kw(kw: dict, form) -> dict:
    return {**kw, **(form.kw if form is not None else {})}


def case_row(op: str, context: int, rows: int, dev, sms: int) -> dict:
    config = Config.from_file(FULL_CONFIG)
    shape = tune.tune_shape(config, rows=rows, context=context)
    case = tune.attention_case(op, shape, dev, sms)
    kw = {"pdl": True, "preload": True}
    ws = case.prepare(kw)["workspace"]
    ns = ws[0].shape[1]
    split_len = max(triton.cdiv(triton.cdiv(shape.kv_len, ns), 64) * 64, 64)
    row = {"op": op, "context": context, "rows": rows, "kv_len": shape.kv_len, "num_splits": ns,
           "live_splits": triton.cdiv(shape.kv_len, split_len), "copies": case.copies, "forms": {}}
    outs, wss = {}, {}
    for name, form in FORMS.items():  # a form's own workspace: its keywords may change the split count
        out, wss[name] = case.new_out(), case.prepare(form_kw(kw, form))["workspace"]
        run_form(form, lambda: case.run(form_kw(kw, form), 0, out, wss[name]))
        outs[name] = out
    want = outs["before"]
    for name, form in FORMS.items():
        outs_all = [case.new_out() for _ in range(case.copies)]
        fkw, ws = form_kw(kw, form), wss[name]
        calls = [lambda i=i, o=outs_all[i]: case.run(fkw, i, o, ws) for i in range(case.copies)]
        times = run_form(form, lambda: graph_times(calls, REPEATS)[0])
        run_form(form, lambda: case.run(fkw, 0, outs_all[0], ws))  # the partials of this form's split
        alone = run_form(form, lambda: graph_times(calls, REPEATS)[0], alone=True)
        row["forms"][name] = {"median_us": statistics.median(times), "times_us": times,
                              "alone_median_us": statistics.median(alone), "alone_times_us": alone,
                              "same_bf16": bool(torch.equal(outs[name], want))}
    row["fp32_same"] = fp32_checks(case, op, shape, dev)
    return row


def fp32_checks(case, op, shape, dev) -> dict:
    """Each form's fp32 output on one set of fp32 partials, against the product's, bit for bit."""
    g = torch.Generator(device=dev).manual_seed(5)
    R, hq, hkv, d, n = shape.rows, shape.q_heads, shape.kv_heads, shape.head_dim, shape.kv_len
    slots = tune.attention_slots(op, shape)
    k = torch.randn(slots, hkv, d, generator=g, device=dev)
    v = torch.randn(slots, hkv, d, generator=g, device=dev)
    ar = torch.arange(slots, device=dev)
    slot_pos = torch.where(ar < n, ar, -1)
    q = torch.randn(R, hq, d, generator=g, device=dev) * 0.6
    q_pos = torch.arange(n - R, n, device=dev)
    sinks = torch.randn(hq, generator=g, device=dev)
    kv_len = torch.tensor([n], device=dev)
    window = shape.window if op == "attention_sliding" else None
    outs = {name: run_form(form, lambda: da.decode_attention(q, k, v, slot_pos, q_pos, sinks, window, 0, kv_len,
                                                             **form_kw({"pdl": True, "preload": True}, form)))
            for name, form in FORMS.items()}
    return {name: bool(torch.equal(o, outs["before"])) for name, o in outs.items()}


def main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python3 -m iquest.lab.combine_probe")
    ap.add_argument("out", nargs="?", help="JSON file to write")
    ap.add_argument("--cases", help="op:context:rows,... (op full or sliding); default: the sweep")
    ap.add_argument("--forms", help="forms to run, comma-separated (before and product always); default: all")
    ap.add_argument("--ncu", action="store_true", help="one call of each form of each case inside "
                    "cudaProfilerStart/Stop, for ncu --profile-from-start off; no timing")
    a = ap.parse_args(argv)
    global FORMS
    if a.forms:
        FORMS = {n: f for n, f in FORMS.items() if n in ("before", "product") or n in a.forms.split(",")}
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if a.cases:
        cases = [(f"attention_{o}", int(c), int(r)) for o, c, r in (x.split(":") for x in a.cases.split(","))]
    else:
        cases = [("attention_full", c, r) for c in CONTEXTS for r in (6, 1)] + \
                [("attention_sliding", c, r) for c in (4096,) for r in (6, 1)]
    if a.ncu:
        return profile(cases, dev, sms)
    report = {"probe": "combine", "commit": commit(), "device": torch.cuda.get_device_name(dev),
              "forms": list(FORMS), "exact_forms": [n for n in EXACT if n in FORMS], "repeats": REPEATS, "rows": []}
    failures = []
    for op, context, rows in cases:
        row = case_row(op, context, rows, dev, sms)
        report["rows"].append(row)
        f = row["forms"]
        base = f["before"]["median_us"]
        print(f"{op} {context} ctx x {rows} rows ({row['live_splits']}/{row['num_splits']} live splits): "
              + "; ".join(f"{n} {f[n]['median_us']:.2f}us [alone {f[n]['alone_median_us']:.2f}] "
                          f"{'=' if f[n]['same_bf16'] else '!='}{'=' if row['fp32_same'][n] else '!='}"
                          + ("" if n == "before" else f" ({f[n]['median_us'] / base - 1:+.1%})") for n in f),
              flush=True)
        failures += [f"{op} {context} {rows} {n}" for n in report["exact_forms"]
                     if not (f[n]["same_bf16"] and row["fp32_same"][n])]
        torch.cuda.empty_cache()
    report["exact_failures"] = failures
    if out_path := a.out:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(report, indent=1) + "\n")
    if failures:
        raise SystemExit(f"forms that should be bit-identical differ: {failures}")


def profile(cases, dev, sms) -> None:
    config = Config.from_file(FULL_CONFIG)
    runs = []
    for op, context, rows in cases:
        shape = tune.tune_shape(config, rows=rows, context=context)
        case = tune.attention_case(op, shape, dev, sms)
        kw = {"pdl": True, "preload": True}
        for name, form in FORMS.items():
            out, ws = case.new_out(), case.prepare(form_kw(kw, form))["workspace"]
            for i in range(3):
                run_form(form, lambda: case.run(form_kw(kw, form), i % case.copies, out, ws))
            runs.append((name, case, form, form_kw(kw, form), out, ws))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, case, form, fkw, out, ws in runs:
        run_form(form, lambda: case.run(fkw, 1 % case.copies, out, ws))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", "; ".join(n for n, *_ in runs))


if __name__ == "__main__":
    main(sys.argv[1:])
