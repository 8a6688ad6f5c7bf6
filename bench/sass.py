"""`iquest bench sass`: the decode kernels compiled for the H200 (sm_90a) on any machine, no GPU needed.

Triton compiles for a named target without a device; the ptxas, nvdisasm and cuobjdump of its wheel then give what
ncu would start from: registers per thread, stack (spills), shared memory, and the static instruction mix. The
kernels are compiled as their wrappers launch them at one TP8 rank's decode shapes: the wrappers' defaults for
tiles, warps and stages, and the divisibility by 16 that the runtime finds in every pointer and stride there (without
it, loads are not vectorized and the numbers mean nothing). Use it to check a kernel change for spills and
conversion instructions before spending GPU time (docs/PERF.md: the compact MoE grid's spills were visible here).
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from ..kernels import fp8_linear as fl, fp8_linear_direct as fd, moe as mk
from .tune import H200_SMS, _linear_auto_split

TARGET = GPUTarget("cuda", 90, 32)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_ROUTING = dict(K_TOP=8, K_PAD=8, P_PAD=64, LIVE_COUNT=False)


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


def specs() -> dict[str, KernelSpec]:
    """The MoE's weight-streaming kernels and the FP8 linear at one TP8 rank (H 6144, I_r 256, 6 rows, fp32 MoE
    input rounded to bf16 in the kernel, bf16 linear input), with the wrappers' current defaults."""
    moe_kw = {n: p.default for n, p in inspect.signature(mk.moe).parameters.items()}
    gate_up_types = dict(x_ptr="*fp32", xd_ptr="*fp32", g_ptr="*fp8e4nv", gs_ptr="*fp32", u_ptr="*fp8e4nv",
                         us_ptr="*fp32", experts_ptr="*i64", live_ptr="*u8", part_ptr="*fp32", ran_ptr="*fp32")
    gate_up_constexprs = dict(_ROUTING, B0=128, B1=128, BLOCK_M=mk.BLOCK_M, BLOCK_N=moe_kw["gate_up_block_n"],
                              BLOCK_K=moe_kw["block_k"], ROUND_BF16=True, F32=False, PREC="tf32", STORE_RAN=False,
                              PDL=True, F16=moe_kw["f16"])
    gate_up_div16 = ("x_ptr", "xd_ptr", "g_ptr", "gs_ptr", "u_ptr", "us_ptr", "experts_ptr", "live_ptr", "part_ptr",
                     "H", "I", "P", "stride_x", "stride_xd", "k_per_split")
    gate_up = KernelSpec(mk._moe_gate_up_kernel, gate_up_types, gate_up_constexprs, gate_up_div16,
                         moe_kw["gate_up_warps"], moe_kw["gate_up_stages"], "MoE Gate/Up")
    # As the engine calls it: x's fp16 operand tiles made by the post-attention norm
    gate_up_prescaled = KernelSpec(mk._moe_gate_up_kernel, dict(gate_up_types, x_ptr="*fp16"),
                                   dict(gate_up_constexprs, ROUND_BF16=False, PRESCALED=True), gate_up_div16,
                                   moe_kw["gate_up_warps"], moe_kw["gate_up_stages"],
                                   "MoE Gate/Up on the norm's fp16 tiles")
    down_bk, down_stages = mk.down_tile(moe_kw["fp8_down"], moe_kw["down_block_k"], moe_kw["down_stages"])
    down = KernelSpec(
        mk._moe_down_kernel,
        dict(act_ptr="*fp8e4nv", act_s_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", experts_ptr="*i64",
             live_ptr="*u8", y_ptr="*fp32", ran_ptr="*fp32"),
        dict(_ROUTING, B0=128, GROUP=128, BLOCK_M=mk.BLOCK_M, BLOCK_N=moe_kw["down_block_n"], BLOCK_K=down_bk,
             K_PAD_DOT=down_bk, F32=False, STORE_RAN=False, PDL=True, F16=moe_kw["f16"], FP8=moe_kw["fp8_down"]),
        ("act_ptr", "act_s_ptr", "w_ptr", "ws_ptr", "experts_ptr", "live_ptr", "y_ptr", "H", "I"),
        moe_kw["down_warps"], down_stages, "MoE Down")
    lin_kw = {n: p.default for n, p in inspect.signature(fl.fp8_linear).parameters.items()}
    # q/k/v as the engine calls it: 8 splits of 6 K tiles, each program's tiles loaded before the wait
    qkv_splits = _linear_auto_split(1024, 6144, lin_kw["block_n"], 128, H200_SMS)
    qkv_tiles = fl.preload_plan(6, 1024, 6144, (128, 128), qkv_splits, lin_kw["block_n"])
    linear = KernelSpec(
        fl._fp8_linear_kernel,
        dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32"),
        dict(B0=128, B1=128, BLOCK_M=fl.BLOCK_M, BLOCK_N=lin_kw["block_n"], BLOCK_K=128, SPLIT=True, SERIAL=True,
             F32=False, PREC="tf32", PDL=True, PRELOAD=qkv_tiles),
        ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "part_ptr", "lock_ptr", "N", "K", "stride_xm", "stride_ym",
         "k_per_split"),
        lin_kw["num_warps"], lin_kw["num_stages"], f"FP8 linear (q/k/v: {qkv_tiles} K tiles preloaded), split K summed "
                                                   "in the launch")
    loop = KernelSpec(linear.fn, linear.types, dict(linear.constexprs, PRELOAD=0), linear.div16, linear.num_warps,
                      linear.num_stages, "FP8 linear, the pipelined K loop (without preload)")
    # The plan's fused_input_norm: q/k/v scaling its rows by the residual stream's 1 / rms (24 sums of squares a row),
    # partials left unsummed
    norm = KernelSpec(linear.fn, dict(linear.types, sumsq_ptr="*fp32", eps="fp32"),
                      dict(linear.constexprs, SERIAL=False, NORM=32), linear.div16 + ("sumsq_ptr",),
                      linear.num_warps, linear.num_stages, "FP8 linear (q/k/v) scaling its rows by 1 / rms")
    # As the engine launches them on the H200: the weight tiles through tensor descriptors. These are what
    # ncu profiles (Gate/Up's 188 registers at c199d16: bench/results/ncu-ops-c199d16-details.txt).
    gate_up_tma = _with_descriptors(gate_up_prescaled, ("g_ptr", "u_ptr"), (1, gate_up.constexprs["BLOCK_N"],
                                                                          gate_up.constexprs["BLOCK_K"]),
                                    "MoE Gate/Up as the engine runs it: the norm's fp16 tiles, weights through TMA")
    down_tma = _with_descriptors(down, ("w_ptr",), (1, down.constexprs["BLOCK_N"], down.constexprs["BLOCK_K"]),
                                 "MoE Down as the engine runs it: weights through TMA")
    down_early = KernelSpec(down_tma.fn, dict(down_tma.types, w_raw_ptr="*fp8e4nv"),
                            dict(down_tma.constexprs, EARLY=True, LINE_ELEMS=128, LINES=2), down_tma.div16,
                            down_tma.num_warps, down_tma.num_stages,
                            "MoE Down with early_down: routing and its tile's L2 prefetch before the wait")
    fp8_bk, fp8_stages = mk.down_tile(True)
    down_fp8 = _with_descriptors(
        KernelSpec(down.fn, down.types, dict(down.constexprs, BLOCK_K=fp8_bk, K_PAD_DOT=fp8_bk, FP8=True), down.div16,
                   down.num_warps, fp8_stages, ""),
        ("w_ptr",), (1, down.constexprs["BLOCK_N"], fp8_bk), "MoE Down with fp8_down: E4M3 wgmma, weights through TMA")
    # fp8_linear(direct=...) at o_proj's shape as the engine would call it (one split of 6 tiles over 2 warps, stored)
    direct = KernelSpec(
        fd._fp8_linear_direct_kernel, dict(linear.types, x_ptr="*bf16"),
        dict(B0=128, B1=128, G=2, W_LOAD=fd.load_layout(2), SPLIT=False, SERIAL=False, PRELOAD=6, PDL=True),
        linear.div16, 2, 1, "FP8 linear, operands straight into the MMA's registers (Gluon; o_proj, 2 warps)")
    return {"fp8_linear_direct": direct, "moe_gate_up": gate_up, "moe_gate_up_prescaled": gate_up_prescaled,
            "moe_gate_up_tma": gate_up_tma, "moe_down": down, "moe_down_tma": down_tma, "moe_down_early": down_early,
            "moe_down_fp8": down_fp8, "fp8_linear": linear, "fp8_linear_loop": loop, "fp8_linear_norm": norm}


def _with_descriptors(spec: KernelSpec, names: tuple[str, ...], box: tuple[int, ...], note: str) -> KernelSpec:
    """`spec` with the E4M3 weight pointers `names` as tensor descriptors of `box` (TMA=True), as moe() passes them."""
    desc = f"tensordesc<fp8e4nv[{','.join(map(str, box))}]>"
    return KernelSpec(spec.fn, {**spec.types, **{n: desc for n in names}}, dict(spec.constexprs, TMA=True),
                      tuple(n for n in spec.div16 if n not in names), spec.num_warps, spec.num_stages, note)


def compile_spec(spec: KernelSpec, **constexprs) -> object:
    """The compiled kernel for sm_90a (`constexprs` override the spec's, e.g. F16=False)."""
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
    return triton.compile(source, target=TARGET, options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})


def sequence(kernel) -> list[str]:
    """The SASS opcodes in program order (predicates and modifiers dropped: "LDG", "BAR", "ACQBULK", ...)."""
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = _tool("nvdisasm", cubin, "-c")
    ops = (re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9]*)", line) for line in text.splitlines())
    return [m.group(1) for m in ops if m]


def _tool(name: str, cubin: str, *args: str) -> str:
    return subprocess.run([os.path.join(_BIN, name), *args, cubin], capture_output=True, text=True, check=True).stdout


def report(kernel) -> dict:
    """{"registers", "stack_bytes", "shared_bytes", "instructions", "mix": {opcode: static count}}."""
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        sass = _tool("nvdisasm", cubin, "-c")
        usage = _tool("cuobjdump", cubin, "-res-usage")
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no register count:\n{usage}")
    mix = collections.Counter()
    for line in sass.splitlines():
        ins = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9]*)", line)
        if ins:
            mix[ins.group(1)] += 1
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2)), "shared_bytes": kernel.metadata.shared,
            "instructions": sum(mix.values()), "mix": dict(mix.most_common())}


def run(names: tuple[str, ...], overrides: dict, top: int = 10) -> dict:
    table = specs()
    out = {}
    for name in names:
        r = report(compile_spec(table[name], **overrides.get(name, {})))
        out[name] = r
        print(f"{name} ({table[name].note}): {r['registers']} registers, {r['stack_bytes']} B stack, "
              f"{r['shared_bytes']} B shared, {r['instructions']} instructions")
        print("   " + ", ".join(f"{op} {n}" for op, n in list(r["mix"].items())[:top]))
    return out
