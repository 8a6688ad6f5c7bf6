"""`iquest bench sass`: the decode kernels compiled for the H200 (sm_90a) on any machine, no GPU needed.

Triton compiles for a named target without a device; the ptxas, nvdisasm and cuobjdump of its wheel then give what
ncu would start from: registers per thread, stack (spills), shared memory, and the static instruction mix. The
kernels are compiled as their wrappers launch them at one TP8 rank's decode shapes of docs/model.md's model: the
wrappers' defaults for tiles, warps and stages, and the divisibility by 16 that the runtime finds in every pointer and
stride there (without it, loads are not vectorized and the numbers mean nothing). Use it to check a kernel change for
spills and conversion instructions before spending GPU time (docs/PERF.md: the compact MoE grid's spills were visible
here). Only the kernels on the product path have specs: the FP8 linears; those written for the retired architecture
get theirs back when the GPU issue re-bases them.
"""

from __future__ import annotations

import collections
import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource

from ..kernels import fp8_linear as fl, fp8_linear_direct as fd

TARGET = GPUTarget("cuda", 90, 32)
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


def specs() -> dict[str, KernelSpec]:
    """The FP8 linear at one TP8 rank of docs/model.md's model (bf16 input, 6 rows): q/k/v as one weight
    [1024 x 3072] and o_proj [3072 x 768], with the wrappers' current defaults. The kernels written for the retired
    architecture (the MoE, attention, the router: not on the product path) have no spec until the GPU issue re-bases
    them."""
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
    lin_kw = {n: p.default for n, p in inspect.signature(fl.fp8_linear).parameters.items()}
    # q/k/v as the engine calls it: its K splits, each program's tiles loaded before the wait
    qkv_splits = _linear_auto_split(qkv_n, qkv_k, lin_kw["block_n"], 128, H200_SMS)
    qkv_tiles = fl.preload_plan(ROWS, qkv_n, qkv_k, (128, 128), qkv_splits, lin_kw["block_n"])
    linear = KernelSpec(
        fl._fp8_linear_kernel,
        dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", y_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32"),
        dict(B0=128, B1=128, BLOCK_M=fl.BLOCK_M, BLOCK_N=lin_kw["block_n"], BLOCK_K=128, SPLIT=True, SERIAL=True,
             F32=False, PREC="tf32", PDL=True, PRELOAD=qkv_tiles),
        ("x_ptr", "w_ptr", "s_ptr", "y_ptr", "part_ptr", "lock_ptr", "N", "K", "stride_xm", "stride_ym",
         "k_per_split"),
        lin_kw["num_warps"], lin_kw["num_stages"], f"FP8 linear (q/k/v [{qkv_n} x {qkv_k}]: {qkv_tiles} K tiles "
                                                   "preloaded), split K summed in the launch")
    loop = KernelSpec(linear.fn, linear.types, dict(linear.constexprs, PRELOAD=0), linear.div16, linear.num_warps,
                      linear.num_stages, "FP8 linear, the pipelined K loop (without preload)")
    # fp8_linear(direct=...) at o_proj's shape (one split of its K tiles over 2 warps, stored)
    direct = KernelSpec(
        fd._fp8_linear_direct_kernel, dict(linear.types, x_ptr="*bf16"),
        dict(B0=128, B1=128, G=2, W_LOAD=fd.load_layout(2), SPLIT=False, SERIAL=False, PRELOAD=o_k // 128, PDL=True),
        linear.div16, 2, 1, f"FP8 linear, operands straight into the MMA's registers (Gluon; o_proj, K {o_k}, 2 warps)")
    return {"fp8_linear": linear, "fp8_linear_loop": loop, "fp8_linear_direct": direct}


def _linear_auto_split(n: int, k: int, block_n: int, block_k: int, sms: int) -> int:
    """fp8_linear.choose_split_k with the SM count given (it reads it from the device)."""
    n_tiles, k_tiles = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    return max(1, min(k_tiles, (2 * sms) // n_tiles))


def compile_spec(spec: KernelSpec, **constexprs) -> object:
    """The compiled kernel for sm_90a (`constexprs` override the spec's, e.g. PRELOAD=0)."""
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
