"""Programmatic dependent launch (PDL, sm_90+): let a kernel's programs start while its predecessor on the stream
is still finishing, so launch latency, program start-up and the first constant-weight reads overlap the previous
kernel's tail instead of following it.

A decode round is ~1,200 dependent kernels of 5-30 us each, and every boundary costs a drain of the previous
grid plus the next one's launch and ramp. With PDL the driver may launch kernel B once every program of the
previous kernel A has signalled `griddepcontrol.launch_dependents` (or exited); B's programs then run up to
`griddepcontrol.wait`, which returns once A has completed and its memory is visible.

The contract every kernel launched with `pdl=True` keeps, so that it reads and writes exactly what a plainly
serialized launch would:
  * `wait_for_inputs(PDL)` is the first thing every program does that touches memory another kernel writes or
    reads: no activation load, no store, no atomic comes before it. Only constant weights may be read before
    it (into registers: the FP8 linear's, the router's and the norms' `preload`), and data written two launches
    back or earlier, which the next two points make complete: read, or asked of L2 with `prefetch_l2` (the engine
    guarantees that of the positions where `decode_attention` runs with `AttentionSettings.early`).
  * Every program calls it, unconditionally, so the kernel cannot complete before its predecessor has: the
    chain stays transitive for the kernel after it (which may be a plain launch: that one waits for this
    kernel's completion as usual).
  * It signals its own dependents right after the wait, not before: at most two kernels are in flight, the running
    one and the next one's programs parked at their wait. So kernel C (after B after A) is launched only once every
    program of B has passed its wait, that is, once A has completed and its memory is visible: C is an ordinary
    launch after A's completion, and may read what A (or anything before A) wrote without waiting.
Arithmetic is untouched, so results are bit-identical with and without PDL (tests/test_kernel_launch.py and
the engine's graph-vs-eager checks on the GPU).

Under the interpreter (CPU) PDL is off: the flag is a constexpr that removes the PTX, and `launch_options`
refuses PDL for a tensor off the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """With PDL: wait for the previous kernel to complete, then allow the next one to launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def wait_holding_dependents(PDL: tl.constexpr):
    """With PDL: wait for the previous kernel to complete; the next one launches at `release_dependents` (or exit)."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte lines holding `ptrs` (every one a valid address: clamp, do not mask), without
    waiting: before `wait_for_inputs`, for data the contract above lets a kernel read there, so those reads overlap
    the previous kernel. A hint: it changes no value."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(row_ptrs, start, end, ELEMS_PER_LINE: tl.constexpr, LINES: tl.constexpr):
    """`prefetch_l2` of columns [start, end) of the rows `row_ptrs` points at (each a valid row: clamp the row
    index, do not mask), one request per ELEMS_PER_LINE columns; LINES >= the lines of the range."""
    c = start + tl.arange(0, LINES) * ELEMS_PER_LINE
    prefetch_l2(row_ptrs[:, None] + tl.where(c < end, c, start)[None, :])


@triton.jit
def _bulk_prefetch_l2(ptrs, nbytes):
    """Ask L2 for `nbytes` (a multiple of 16) from each 16-byte-aligned address in `ptrs`, without waiting (sm_90)."""
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r", [ptrs, nbytes],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def warm_slabs(w_ptr, experts, stride_e, nbytes, CHUNK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Bulk-prefetch the first `nbytes` of each chosen expert's slab (experts [K_PAD], -1: none) in CHUNK pieces (the
    expert prefetch's branch and the router's select: kernels/expert_prefetch.py, kernels/router.py)."""
    c = tl.arange(0, CHUNKS_PAD)
    start = c * CHUNK
    ok = (experts[:, None] >= 0) & (start < nbytes)[None, :]
    e = tl.where(experts >= 0, experts, 0).to(tl.int64)
    size = tl.minimum(nbytes - start, CHUNK)
    # Every lane holds a valid request (no mask on inline PTX): a lane with nothing to ask repeats the slab's first
    # chunk, which is then in flight already.
    ptrs = w_ptr + e[:, None] * stride_e + tl.where(ok, start[None, :], 0)
    _bulk_prefetch_l2(ptrs, tl.where(ok, size[None, :], tl.minimum(nbytes, CHUNK)).to(tl.int32))


def slab_ok(q: torch.Tensor) -> bool:
    """An expert's slab of `q` [E, rows, cols] (one byte an element) is contiguous and starts 16-byte aligned: what
    `warm_slabs` asks of L2 in bulk."""
    return (q.dim() == 3 and q.element_size() == 1 and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and q.stride(0) % 16 == 0 and q.data_ptr() % 16 == 0 and (q.shape[1] * q.shape[2]) % 16 == 0)


def prefetch_lines(columns: int, element_bytes: int) -> tuple[int, int]:
    """(ELEMS_PER_LINE, LINES) for `prefetch_rows` over `columns` columns of `element_bytes`-byte elements."""
    per_line = max(1, 128 // element_bytes)
    return per_line, triton.next_power_of_2(max(1, triton.cdiv(columns, per_line)))


def launch_options(pdl: bool, device: torch.device) -> dict:
    """Launch keywords for a kernel call with PDL: the launch attribute and the kernel's PDL constexpr, always
    together (a PDL launch of a kernel compiled without its wait would race its predecessor); {} without PDL (the
    kernels' PDL defaults to False)."""
    if not pdl:
        return {}
    if device.type != "cuda":
        raise ValueError(f"programmatic dependent launch needs a CUDA device, got {device}")
    return {"launch_pdl": True, "PDL": True}


def set_carveout(compiled, percent: int) -> None:
    """Set a compiled kernel's preferred shared-memory carveout (percent of an SM's most; -1: the driver's choice),
    once: the value is kept on the kernel object, so asking again for the same one costs no driver call."""
    if getattr(compiled, "iquest_carveout", None) == percent:
        return
    from cuda.bindings import driver  # GPU-only dependency, imported lazily

    compiled._init_handles()  # loads the module: the function handle exists from here
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    err, = driver.cuFuncSetAttribute(driver.CUfunction(compiled.function), attr, percent)
    if int(err) != 0:
        raise RuntimeError(f"cuFuncSetAttribute(preferred carveout {percent}) on {compiled.name} failed: {err!r}")
    compiled.iquest_carveout = percent


def launch_with_carveout(kernel, grid, args: tuple, kw: dict, carveout: int | None) -> None:
    """kernel[grid](*args, **kw) with the compiled kernel's preferred shared-memory carveout (`set_carveout`; None:
    left as it is). A graph keeps the preference a kernel had when it was captured, so inside a capture it is set
    before the launch (the kernel looked up, or compiled, first); outside one, after it (the lookup is the launch's
    own), so only a kernel's first eager launch may run with the driver's choice."""
    if carveout is None:
        kernel[grid](*args, **kw)
    elif torch.cuda.is_current_stream_capturing():
        set_carveout(kernel.warmup(*args, grid=grid, **kw), carveout)
        kernel[grid](*args, **kw)
    else:
        set_carveout(kernel[grid](*args, **kw), carveout)
