"""`iquest bench kernels`: our Triton kernels on the product path beside what torch offers, at one TP8 rank's shapes
of docs/model.md's model.

The kernel ops of a decode step (fast/plan.GROUPS), every variant given the same numbers:
- FP8 block-scaled linear, y = x W^T with W E4M3 and fp32 128x128 block scales: kernels.fp8_linear, at the linears
  the engine runs as it (q/k/v as one weight, o_proj, the dense MLP of layer 0, the draft's eh_proj);
  torch's block-wise scaled GEMM (F.scaled_mm, else torch._scaled_mm: x as E4M3 with 1x128 scales, W
  with 128x128; GPU_FACTS.md); cuBLAS bf16 `x @ W.T` on the weight dequantized once (what a bf16 weight
  would cost). The activations are E4M3 values times power-of-two group scales, so the bf16 x our kernel
  reads and the (E4M3, scale) pair torch's GEMM reads are the same numbers: outputs differ only by
  accumulation order and rounding.
- The sampling ops, each against the engine's torch form of it (fast/torch_ops.py, fast/sampler.py): the local
  top-k, the global distribution and its draw, and the accept step.
The kernels written for the retired architecture (decode attention, the MoE, the router, the LM head) are off the
product path until the GPU issue re-bases them, and are not measured here.

Timing: a variant's calls are captured back to back into one CUDA graph; each replay is timed with CUDA
events and divided by the calls in it. The calls rotate over copies of the weight totalling
>= ROTATE_BYTES (4x the 60 MB L2), so each call reads from HBM as a decode step's distinct layers do.
The floor is the op's bytes at the device copy bandwidth measured in the same process.
"""

from __future__ import annotations

import json
import math
import platform
import shlex
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from ..kernels.fp8_linear import fp8_linear, fp8_linear_ref
from ..reference.checkpoint import layer_prefix, shard_range, tensor_specs
from ..reference.config import Config
from ..reference.fp8 import E4M3, dequantize, expand_scales
from .timing import replay_times

FULL_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "iquest-q1.json"
TP = 8
BLOCK = (128, 128)
ROTATE_BYTES = 256 << 20
MIN_CALLS = 24  # calls per captured graph at least: launch gaps between replays amortized
SCALED_MM_ROWS = 4  # _scaled_mm reads scale_a column-major with stride M: M=1 is refused (GPU_FACTS.md)
TOL = {"linear": 1e-2}  # max |y - ref| / max |ref|: bf16 output rounding and sum order
OURS, TORCH = "triton", {"linear": "_scaled_mm"}


# ---- shapes and bytes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearShape:
    name: str
    n: int  # output features (weight rows)
    k: int  # input features


def linear_shapes(config: Config, tp: int = TP) -> list[LinearShape]:
    """Rank 0's FP8 linears on the decode path, as the engine calls the kernel: q/k/v as one weight (the rank's query
    heads and its KV head's k and v rows), o_proj (row-parallel), the dense MLP's gate/up and down (layer 0, in
    `mlp_only_layers`) and the draft's eh_proj (row-parallel over [embedding, hidden], 2H wide). The experts run
    their torch form (the MoE kernel is off the product path)."""
    layout = tensor_specs(config)

    def shape(name: str) -> tuple[int, int]:
        spec = layout[name]
        dims = list(spec.shape)
        part = shard_range(spec, config.mtp if name.startswith("mtp/") else config, tp, 0)
        if part is not None:
            dims[part[0]] = part[2] - part[1]
        return dims[0], dims[1]

    a = layer_prefix(1) + "self_attn."
    qkv = [shape(a + f"{w}_proj.weight") for w in "qkv"]
    out = [LinearShape("q/k/v", sum(n for n, _ in qkv), qkv[0][1]), LinearShape("o_proj", *shape(a + "o_proj.weight"))]
    if config.mlp_only_layers:
        p = layer_prefix(config.mlp_only_layers[0]) + "mlp."
        out += [LinearShape("dense gate/up", *shape(p + "gate_proj.weight")),
                LinearShape("dense down", *shape(p + "down_proj.weight"))]
    return out + [LinearShape("eh_proj", *shape("mtp/mtp.eh_proj.weight"))]


def scaled_mm_rows(m: int) -> int:
    """Rows _scaled_mm is given: a multiple of 4 (a 16-byte aligned column-major scale_a), zero-padded."""
    return -(-m // SCALED_MM_ROWS) * SCALED_MM_ROWS


def linear_bytes(variant: str, m: int, n: int, k: int) -> int:
    """Bytes a variant must move at least: weight (+ fp32 block scales), x read and bf16 y written."""
    scales = 4 * math.ceil(n / BLOCK[0]) * math.ceil(k / BLOCK[1])
    if variant == "bf16 mm":
        return 2 * n * k + 2 * m * k + 2 * m * n
    if variant == "_scaled_mm":  # E4M3 x with its fp32 1x128 scales at the padded row count; padded scale_b
        mp, kb = scaled_mm_rows(m), math.ceil(k / 128)
        return n * k + 4 * math.ceil(n / 128) * (-(-kb // 4) * 4) + mp * k + 4 * mp * kb + 2 * mp * n
    return n * k + scales + 2 * m * k + 2 * m * n


# ---- inputs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LinearInputs:
    x: torch.Tensor  # [m, k] bf16, exactly xq * xs
    xq: torch.Tensor  # [m, k] E4M3
    xs: torch.Tensor  # [m, k / 128] fp32 powers of two
    w: torch.Tensor  # [n, k] E4M3
    scale: torch.Tensor  # [n / 128, k / 128] fp32


def make_linear(m: int, n: int, k: int, device, seed: int = 0) -> LinearInputs:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(E4M3)
    scale = (torch.rand(math.ceil(n / BLOCK[0]), math.ceil(k / BLOCK[1]), generator=g) + 0.5) / 64
    xq = torch.randn(m, k, generator=g).to(E4M3)
    xs = torch.exp2(torch.randint(-3, 3, (m, math.ceil(k / BLOCK[1])), generator=g).float())
    x = (xq.float() * expand_scales(xs, (m, k), (1, BLOCK[1]))).to(torch.bfloat16)  # 4 significant bits: exact
    return LinearInputs(*(t.to(device) for t in (x, xq, xs, w, scale)))


# ---- variants: prepare operands (untimed), return the timed call ---------------------------------------
Variant = Callable[[object], Callable[[], torch.Tensor]]


def scaled_mm_operands(t: LinearInputs) -> tuple[torch.Tensor, ...]:
    """(a [M, K] E4M3 zero-padded to M rows, b = W^T column-major, scale_a [M, K/128] column-major,
    scale_b [L4, N/128] = the weight's scales transposed, K/128 zero-padded to L4, a multiple of 4).

    cuBLAS reads the 128x128 scales with that padded leading dimension: measured on the H200 (torch 2.11),
    torch._scaled_mm accepts them unpadded and returns wrong sums when K/128 is not a multiple of 4
    (o_proj, expert down), while F.scaled_mm insists on the padded layout and is right."""
    m, k = t.xq.shape
    mp = scaled_mm_rows(m)
    a = torch.zeros(mp, k, dtype=E4M3, device=t.xq.device)
    a[:m] = t.xq
    scale_a = torch.ones(t.xs.shape[1], mp, dtype=torch.float32, device=t.xs.device).t()
    scale_a[:m] = t.xs
    nb, kb = t.scale.shape
    scale_b = torch.zeros(nb, -(-kb // 4) * 4, dtype=torch.float32, device=t.scale.device)
    scale_b[:, :kb] = t.scale
    return a, t.w.t(), scale_a, scale_b.t()


def torch_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    """torch's block-wise FP8 GEMM (1x128 activation scales, 128x128 weight scales): F.scaled_mm with
    explicit recipes where it exists (torch 2.11 has it), else torch._scaled_mm, which then refuses the
    padded scales unless K/128 is a multiple of 4 (an error recorded, rather than wrong sums)."""
    if hasattr(F, "scaled_mm"):
        return F.scaled_mm(a, b, scale_a=scale_a, scale_recipe_a=F.ScalingType.BlockWise1x128, scale_b=scale_b,
                           scale_recipe_b=F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b[: -(-a.shape[1] // 128)], out_dtype=out_dtype)


def linear_variants(ours=fp8_linear, scaled_mm=torch_scaled_mm) -> dict[str, Variant]:
    def triton_(t):
        return lambda: ours(t.x, t.w, t.scale, BLOCK)

    def scaled(t):
        a, b, sa, sb = scaled_mm_operands(t)
        m = t.x.shape[0]
        return lambda: scaled_mm(a, b, sa, sb, torch.bfloat16)[:m]

    def bf16(t):
        w = dequantize(t.w, t.scale, BLOCK, torch.float32).to(torch.bfloat16)
        return lambda: t.x @ w.T

    return {OURS: triton_, "_scaled_mm": scaled, "bf16 mm": bf16}


# ---- correctness (runs on CPU with the *_ref functions in place of the kernels) ------------------------
def rel_diff(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip()}"[:2000]


def agreement(op: str, t, variants: dict[str, Variant]) -> dict[str, dict]:
    """Per variant: its output's max relative difference from the fp32 reference (and ours from torch's
    variant), or the error it raised."""
    assert op == "linear", op
    ref = fp8_linear_ref(t.x, t.w, t.scale, BLOCK, torch.float32)
    outs, result = {}, {}
    for name, prep in variants.items():
        try:
            outs[name] = prep(t)()
        except Exception as e:  # e.g. _scaled_mm block-wise missing on this build: recorded, not fatal
            result[name] = {"error": error_text(e)}
            continue
        result[name] = {"rel_diff_vs_ref": rel_diff(outs[name], ref)}
    if OURS in outs and TORCH[op] in outs:
        result[OURS]["rel_diff_vs_torch"] = rel_diff(outs[OURS], outs[TORCH[op]])
    return result


# ---- timing ------------------------------------------------------------------------------------------
def capture_calls(calls: list[Callable[[], object]], min_calls: int = MIN_CALLS) -> tuple[torch.cuda.CUDAGraph, int]:
    """One CUDA graph holding `calls` back to back (cycled to at least `min_calls`), replayed once; returns
    (graph, calls per replay). Compilation, autotuning and first-use allocations run first, on a side stream."""
    seq = calls * math.ceil(min_calls / len(calls))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in seq:
            c()
    graph.replay()
    return graph, len(seq)


def graph_times(calls: list[Callable[[], object]], repeats: int) -> tuple[list[float], int]:
    """Per-call microseconds of `repeats` replays of one CUDA graph holding `calls` back to back (cycled
    to at least MIN_CALLS), each replay timed with CUDA events; returns (times, calls per replay)."""
    graph, n = capture_calls(calls)
    return replay_times(graph, n, repeats), n


def _measure(op: str, base, copies: list, variants: dict[str, Variant], repeats: int, floor_bytes: int,
             bandwidth: float, bytes_of: Callable[[str], int]) -> list[dict]:
    out = []
    for name, check in agreement(op, base, variants).items():
        row = {"variant": name, **check}
        if "error" not in row:
            try:
                times, n = graph_times([variants[name](t) for t in copies], repeats)
                med = statistics.median(times)
                row.update(median_us=med, bytes=bytes_of(name), gb_per_s=bytes_of(name) / med / 1e3,
                           floor_us=floor_bytes / bandwidth * 1e6, calls_per_graph=n, copies=len(copies),
                           times_us=times)
                row["x_floor"] = med / row["floor_us"]
            except Exception as e:
                row["error"] = error_text(e)
        out.append(row)
        torch.cuda.synchronize()
    return out


def _copies(nbytes: int, rotate: int = ROTATE_BYTES) -> int:
    return max(1, math.ceil(rotate / nbytes))


# ---- the other decode ops: ours against the engine's torch forms --------------------------------------
@dataclass
class OpBench:
    """One op at one row count: its variants (each a list of calls, one per weight copy or input set, that the graph
    rotates over), the bytes a call must move per variant, and the agreement check on the variants' first calls."""

    op: str
    rows: int
    desc: str
    variants: dict[str, list[Callable[[], object]]]
    bytes: dict[str, int]
    check: Callable[[dict], tuple[float | None, str | None]]  # outputs by variant -> (difference, why not agreeing)


def _rel_check(tol: float) -> Callable[[dict], tuple[float | None, str | None]]:
    def check(outs: dict) -> tuple[float | None, str | None]:
        if OURS not in outs or "torch" not in outs:
            return None, None
        d = rel_diff(outs[OURS], outs["torch"])
        return d, (f"{d:.1e} > tol {tol:.0e}" if not d <= tol else None)
    return check


def _equal_check(names: tuple[str, ...]) -> Callable[[dict], tuple[float | None, str | None]]:
    """Tuples of outputs that must be equal element by element (integer results: ids, tokens, keys)."""
    def check(outs: dict) -> tuple[float | None, str | None]:
        if OURS not in outs or "torch" not in outs:
            return None, None
        ours, theirs = outs[OURS], outs["torch"]
        ours, theirs = (ours, theirs) if isinstance(ours, tuple) else ((ours,), (theirs,))
        bad = [n for n, a, b in zip(names, ours, theirs) if not torch.equal(a, b)]
        return 0.0 if not bad else None, (f"{', '.join(bad)} differ" if bad else None)
    return check


def topk_bench(config: Config, rows: int, device, ours=None, k: int = 20, seed: int = 5) -> OpBench:
    """This rank's top-k candidates as rank keys (the sampling's first step), against fast.sampler's torch form."""
    from ..fast import sampler
    from ..kernels.topk import local_topk_keys

    ours = ours or (lambda *a: local_topk_keys(*a)[0])
    g = torch.Generator().manual_seed(seed)
    V = config.vocab_size // TP
    logits = (torch.randn(rows, V, generator=g) * 3).to(device)
    offset = 3 * V  # rank 3's slice
    return OpBench("topk", rows, f"logits [{rows}, {V}] fp32, top-{k} rank keys",
                   {OURS: [lambda: ours(logits, k, offset)], "torch": [lambda: sampler._local_keys(logits, k, offset)]},
                   {v: 4 * rows * V + 8 * rows * k for v in (OURS, "torch")}, _equal_check(("keys",)))


def _sampling_inputs(rows: int, vocab: int, k: int, device, seed: int) -> tuple[torch.Tensor, ...]:
    """The all-gathered candidate keys [rows, TP * k] of TP vocabulary slices, and the 0-dim temperature, top_p and
    seed the sampling kernels read."""
    from ..fast import sampler
    from ..reference import rng

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, TP * vocab, generator=g) * 3
    keys = torch.cat([sampler._local_keys(s, k, r * vocab) for r, s in enumerate(logits.split(vocab, -1))], -1)
    scalars = (torch.tensor(1.0), torch.tensor(0.95), torch.tensor(rng.int64_bits(seed), dtype=torch.int64))
    return tuple(t.to(device) for t in (keys, *scalars))


def sample_bench(config: Config, rows: int, device, ours=None, k: int = 20, seed: int = 6) -> OpBench:
    """The global distribution of the gathered candidates and its draw (the commit draw of `rows` positions), against
    fast.sampler's distribution and draw with fast.philox's uniforms."""
    from ..fast import philox, sampler
    from ..kernels.sample import global_sample
    from ..reference.rng import PURPOSE_COMMIT

    ours = ours or global_sample
    keys, temperature, top_p, seed_t = _sampling_inputs(rows, config.vocab_size // TP, k, device, seed)
    offsets = philox.offsets(torch.arange(1000, 1000 + rows, device=device), PURPOSE_COMMIT)

    def torch_sample():
        ids, probs = sampler._dist_from_keys(keys, k, temperature, top_p)
        return sampler.draw(ids, probs, philox.uniforms(seed_t, offsets)), ids, probs

    def check(outs: dict) -> tuple[float | None, str | None]:
        if len(outs) < 2:
            return None, None
        (t1, i1, p1), (t2, i2, p2) = outs[OURS], outs["torch"]
        d = (p1 - p2).abs().max().item()
        why = "ids differ" if not torch.equal(i1, i2) else "tokens differ" if not torch.equal(t1, t2) else None
        return d, why or (f"probabilities {d:.1e} apart" if d > 1e-6 else None)

    return OpBench("sample", rows, f"candidates [{rows}, {keys.shape[1]}] (TP{TP} x top-{k}), top-p 0.95, a draw",
                   {OURS: [lambda: ours(keys, k, temperature, top_p, seed_t, offsets)], "torch": [torch_sample]},
                   {v: keys.numel() * 8 + rows * (8 + 12 * k) for v in (OURS, "torch")}, check)


def accept_bench(config: Config, drafts: int, device, ours=None, k: int = 20, seed: int = 7) -> OpBench:
    """The round's accept step at depth `drafts` (every draft live): acceptance, the residual or bonus, the commit
    draw and the emitted tokens, against its torch form (fast/torch_ops.TorchOps.accept)."""
    from ..fast import sampler
    from ..fast.torch_ops import TorchOps
    from ..kernels.sample import accept_settle

    ours = ours or (lambda *a: (lambda r: (r["a"], r["token"], r["emitted"]))(accept_settle(*a)))
    keys, temperature, top_p, seed_t = _sampling_inputs(2 * drafts + 1, config.vocab_size // TP, k, device, seed)
    p_ids, p_probs = sampler._dist_from_keys(keys[:drafts + 1], k, temperature, top_p)
    q_ids, q_probs = sampler._dist_from_keys(keys[drafts + 1:], k, temperature, top_p)
    q_ids = p_ids[:drafts].clone()  # proposals over the targets' candidates, so some drafts pass
    d = sampler.draw(q_ids, q_probs, torch.rand(drafts, generator=torch.Generator().manual_seed(seed)).to(device))
    live, n = torch.tensor(drafts, device=device), torch.tensor(1000, device=device)
    args = (p_ids, p_probs, q_ids, q_probs, d, live, n, seed_t)
    return OpBench("accept", drafts + 1, f"depth {drafts}: p [{drafts + 1}, {k}], q [{drafts}, {k}]",
                   {OURS: [lambda: ours(*args)], "torch": [lambda: TorchOps().accept(*args)]},
                   {v: sum(t.numel() * t.element_size() for t in args) for v in (OURS, "torch")},
                   _equal_check(("accepted", "token", "emitted")))


def op_benches(config: Config, rows: tuple[int, ...], device) -> list[Callable[[], OpBench]]:
    """The ops' benches, built one at a time: top-k and the sampling draw at each row count; the accept step at depth
    rows - 1 for each row count above 1."""
    out = []
    for m in rows:
        out += [lambda m=m, f=f: f(config, m, device) for f in (topk_bench, sample_bench)]
    out += [lambda m=m: accept_bench(config, m - 1, device) for m in rows if m > 1]
    return out


def op_agreement(b: OpBench) -> list[dict]:
    """Per variant a row: the error its first call raised, or (ours) the difference from the torch form or reference
    and why it is not agreement (None: it is)."""
    outs, rows = {}, []
    for name, calls in b.variants.items():
        row = {"op": b.op, "rows": b.rows, "desc": b.desc, "variant": name}
        try:
            outs[name] = calls[0]()
        except Exception as e:  # recorded, not fatal
            row["error"] = error_text(e)
        rows.append(row)
    diff, why = b.check(outs)
    for row in rows:
        if row["variant"] == OURS and "error" not in row:
            row.update(agreement=diff, mismatch=why)
    return rows


def measure_op(b: OpBench, repeats: int, bandwidth: float) -> list[dict]:
    """Per variant: its first call's output checked (`op_agreement`), then its calls timed in one graph."""
    rows = op_agreement(b)
    for row in rows:
        if "error" in row:
            continue
        try:
            times, n = graph_times(b.variants[row["variant"]], repeats)
            med = statistics.median(times)
            nbytes = b.bytes[row["variant"]]
            row.update(median_us=med, bytes=nbytes, gb_per_s=nbytes / med / 1e3, floor_us=nbytes / bandwidth * 1e6,
                       calls_per_graph=n, copies=len(b.variants[row["variant"]]), times_us=times)
            row["x_floor"] = med / row["floor_us"]
        except Exception as e:
            row["error"] = error_text(e)
        torch.cuda.synchronize()
    return rows


def run(rows: tuple[int, ...], repeats: int, out: str | None, config_file: str | Path = FULL_CONFIG) -> dict:
    from .full_step import copy_bandwidth
    from ..provenance import commit

    if not torch.cuda.is_available():
        raise RuntimeError("iquest bench kernels needs a CUDA device")
    from .full_step import load_config

    config = load_config(config_file)
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    report = {"bench": "kernels", "commit": commit(), "device": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
              "host": platform.node(), "command": shlex.join(["iquest", *sys.argv[1:]]), "config": str(config_file),
              "tp": TP, "rows": list(rows), "repeats": repeats, "copy_bandwidth_bytes_per_s": bandwidth,
              "timing": f"CUDA graph of >= {MIN_CALLS} back-to-back calls rotating over copies of the weight "
                        f"(>= {ROTATE_BYTES >> 20} MB, so reads come from HBM), each replay timed with CUDA events; "
                        "per call = replay / calls; median over repeats",
              "scaled_mm_api": "F.scaled_mm" if hasattr(F, "scaled_mm") else "torch._scaled_mm",
              "notes": [f"_scaled_mm: {'F.scaled_mm' if hasattr(F, 'scaled_mm') else 'torch._scaled_mm'} block-wise "
                        f"(1x128 x, 128x128 W, scale_b padded to K/128 rounded up to 4); rows zero-padded to a "
                        f"multiple of {SCALED_MM_ROWS} (M=1 is unsupported); activation quantization not timed "
                        "(x given as E4M3 + 1x128 scales)",
                        "bf16 mm: weight dequantized to bf16 once, untimed",
                        "sampling ops: torch = the engine's torch form of the op; each floor is that variant's own "
                        "bytes",
                        "not measured: the kernels written for the retired architecture (decode attention, MoE, "
                        "router, LM head), off the product path until the GPU issue re-bases them"],
              "linear": [], "ops": []}
    for shape in linear_shapes(config):
        for m in rows:
            base = make_linear(m, shape.n, shape.k, dev)
            copies = [base] + [replace(base, w=base.w.clone(), scale=base.scale.clone())
                               for _ in range(_copies(shape.n * shape.k) - 1)]
            for r in _measure("linear", base, copies, linear_variants(), repeats,
                              linear_bytes(OURS, m, shape.n, shape.k), bandwidth,
                              lambda v: linear_bytes(v, m, shape.n, shape.k)):
                report["linear"].append({"shape": shape.name, "n": shape.n, "k": shape.k, "rows": m, **r})
            del base, copies
            torch.cuda.empty_cache()
    for make in op_benches(config, rows, dev):  # one at a time: each holds its own weights
        report["ops"].extend(measure_op(make(), repeats, bandwidth))
        torch.cuda.empty_cache()
    print_report(report)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=1) + "\n")
    return report


# ---- report ------------------------------------------------------------------------------------------
def _cells(r: dict, agreement: bool = False) -> str:
    if "error" in r:
        return "error: " + r["error"].splitlines()[0][:100]
    if agreement:
        diff = "-" if r.get("agreement") is None else f"{r['agreement']:.1e}"
        diff += "" if r.get("mismatch") is None else f" MISMATCH ({r['mismatch']})"
    else:
        diff = "-" if r.get("rel_diff_vs_ref") is None else f"{r['rel_diff_vs_ref']:.1e}"
    if "rel_diff_vs_torch" in r:
        diff += f" (vs torch {r['rel_diff_vs_torch']:.1e})"
    return (f"{r['median_us']:10.1f} {r['bytes'] / 1e6:9.2f} {r['gb_per_s']:8.0f} {r['floor_us']:9.1f} "
            f"{r['x_floor']:8.1f}  {diff}")


def print_report(r: dict) -> None:
    print(f"bench kernels  commit={r['commit']} device={r['device']} torch={r['torch']} triton={r['triton']}")
    print(f"device copy bandwidth {r['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (read + written)")
    print(f"timing: {r['timing']}")
    head = f"{'median us':>10} {'MB':>9} {'GB/s':>8} {'floor us':>9} {'x floor':>8}  max rel diff vs fp32 ref"
    print(f"\nFP8 linear, one TP{r['tp']} rank (W E4M3 [N, K] + fp32 128x128 scales; x, y bf16)")
    print(f"{'shape':24} {'rows':>4} {'variant':14} {head}")
    for x in r["linear"]:
        print(f"{x['shape'] + ' ' + str(x['n']) + 'x' + str(x['k']):24} {x['rows']:4} {x['variant']:14} {_cells(x)}")
    if r.get("ops"):
        print("\nSampling ops, one rank: ours against the engine's torch form; floor = the variant's own bytes")
        print(f"{'op':24} {'rows':>4} {'variant':14} {head[:-len('max rel diff vs fp32 ref')]}agreement")
        for x in r["ops"]:
            print(f"{x['op']:24} {x['rows']:4} {x['variant']:14} {_cells(x, agreement=True)}")
        for x in r["ops"]:
            if x["variant"] == OURS and (x.get("agreement") is not None or x.get("mismatch") is not None):
                print(f"agreement {x['op']} rows={x['rows']}: triton vs torch "
                      f"{'ok' if x['mismatch'] is None else 'MISMATCH: ' + x['mismatch']}")
    for x in r["linear"]:
        if "rel_diff_vs_torch" in x:
            ok = x["rel_diff_vs_torch"] <= TOL["linear"]
            print(f"agreement linear {x['shape']} rows={x['rows']}: triton vs {TORCH['linear']} max rel diff "
                  f"{x['rel_diff_vs_torch']:.1e} ({'ok' if ok else 'MISMATCH'}, tol {TOL['linear']:.0e})")
    for n in r["notes"]:
        print("note:", n)
