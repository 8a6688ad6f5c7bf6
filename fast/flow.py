"""Device-side control flow: the round code is written once against `Flow` and runs three ways.

    flow.when(flag, body)   # run body() iff flag != 0
    flow.loop(flag, body)   # while flag != 0: body()   (body updates flag in place)

* `EagerFlow` on CPU, or on CUDA without graphs: reads the flag on the host (`bool(flag)`, one
  sync per decision) and runs plain Python `if` / `while`.
* `GraphFlow` inside `torch.cuda.graph(...)` capture: each call adds a CUDA conditional node
  (IF for `when`, WHILE for `loop`) whose body graph holds the body's torch ops and Triton
  kernels. A tiny NVRTC kernel copies the device flag into the node's conditional handle, so the
  decision never leaves the GPU and a skipped body executes no kernels.

Both evaluate the flag once, at the call (and, for `loop`, again after each body), so a body may
rewrite the flag freely. Bodies nest: a `when` inside a `loop` body becomes a conditional node
inside the WHILE node's body graph.

Rules the engine follows (they hold for both flows, so eager runs check graph code):

1. Flags are 0-dim (or one-element) contiguous int32 tensors on the flow's device. The device
   kernel reads `*(const int*)flag`; other dtypes are refused rather than reinterpreted.
2. A body returns nothing: it communicates only by writing in place into tensors allocated
   before the `when`/`loop` call (pre-allocated outputs, `out=`, `copy_`, `index_copy_`).
   A tensor allocated inside a body is a temporary: in a graph it holds garbage when the body is
   skipped and it lives in `GraphFlow`'s body pool, reused by later bodies.
3. Bodies are captured once, so Python in a body runs once at capture, not per execution: all
   data-dependent choices go through tensors and nested `when`/`loop`, never `if tensor:`.
4. No host syncs inside bodies (`.item()`, `bool(t)`, `nonzero`, printing tensors), and no torch
   RNG (the philox offset is fixed at capture, so every loop iteration would draw the same
   numbers); sampling uses the project's counter-based RNG keyed by seed and position.
5. Warm up (run eagerly once) every Triton kernel and library call used in a body before capture,
   as for any CUDA graph; construct `GraphFlow` before `torch.cuda.graph(...)` (it compiles and
   loads its kernel, which capture forbids).
6. Keep the `GraphFlow` alive as long as any graph captured with it, and give each concurrently
   replayed graph its own `GraphFlow` (their bodies share one memory pool). `close()` frees the
   pool, streams and kernel module once those graphs are gone.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Protocol

import torch

Body = Callable[[], None]


class Flow(Protocol):
    def when(self, flag: torch.Tensor, body: Body) -> None: ...
    def loop(self, flag: torch.Tensor, body: Body) -> None: ...


def new_flag(device: torch.device | str, value: int = 0) -> torch.Tensor:
    """A flag tensor of the form both flows accept: 0-dim int32."""
    return torch.tensor(value, dtype=torch.int32, device=device)


def _check_flag(flag: torch.Tensor) -> None:
    if flag.dtype != torch.int32 or flag.numel() != 1 or not flag.is_contiguous():
        raise TypeError(f"flag must be one contiguous int32 element, got {flag.dtype} {tuple(flag.shape)}")


class EagerFlow:
    """Host-side control flow: the reference semantics of `Flow`."""

    def when(self, flag: torch.Tensor, body: Body) -> None:
        _check_flag(flag)
        if bool(flag):
            body()

    def loop(self, flag: torch.Tensor, body: Body) -> None:
        _check_flag(flag)
        while bool(flag):
            body()


# cudaGraphSetConditional is a device builtin resolved by the driver at module load; NVRTC knows
# the handle type but not always the declaration, so we declare it (first source) or fall back
# to a plain integer handle type for older NVRTC headers.
_SET_COND_SOURCES = (
    r"""
extern "C" __device__ __cudart_builtin__ void CUDARTAPI cudaGraphSetConditional(cudaGraphConditionalHandle h, unsigned int v);
extern "C" __global__ void set_cond(cudaGraphConditionalHandle h, const int* flag) { cudaGraphSetConditional(h, *flag != 0); }
""",
    r"""
typedef unsigned long long cudaGraphConditionalHandle;
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(cudaGraphConditionalHandle h, unsigned int v);
extern "C" __global__ void set_cond(cudaGraphConditionalHandle h, const int* flag) { cudaGraphSetConditional(h, *flag != 0); }
""",
)


def _ok(result):
    """Unwrap a cuda-python `(err, *values)` tuple, raising on error."""
    err, values = result[0], result[1:]
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"CUDA call failed: {err!r}")
    return values[0] if len(values) == 1 else values


def private_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A CUDA stream that is this process's alone, for work forked off a capture. Not `torch.cuda.Stream()`: torch
    hands out 32 pooled streams a priority round robin, so a pooled stream can be the very stream a capture runs on
    (`torch.cuda.graph`'s default capture stream, itself pooled); work forked onto it from inside a conditional body
    then joins the outer capture, not the body. Free it with `destroy_stream` once no graph captured with it remains."""
    from cuda.bindings import driver  # GPU-only dependency, imported lazily

    raw = _ok(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value))
    return torch.cuda.ExternalStream(int(raw), device=device)


def destroy_stream(stream: torch.cuda.ExternalStream) -> None:
    from cuda.bindings import driver

    _ok(driver.cuStreamDestroy(driver.CUstream(stream.cuda_stream)))


class GraphFlow:
    """Conditional nodes added to the graph being captured on the current torch stream."""

    def __init__(self, device: torch.device | str | int | None = None, pool=None, max_depth: int = 8):
        from cuda.bindings import driver, nvrtc  # GPU-only dependency, imported lazily

        self._drv = driver
        torch.cuda.init()
        device = torch.device("cuda") if device is None else torch.device(device)
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        with torch.cuda.device(self.device):
            torch.zeros(1, device=self.device)  # make torch's primary context current on this thread
            self._module, self._set_cond = self._compile(driver, nvrtc)
        # Body allocations go to this pool, not the capture's (torch refuses to record one pool
        # twice, and the body streams are not the capture stream, so the capture's own routing
        # would miss them).
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool
        self._pool_refs = 0
        self._streams: list[torch.cuda.ExternalStream] = []
        self._depth = 0
        self._stream(max_depth - 1)  # create the body streams now: capture may forbid it later

    # -- Flow -----------------------------------------------------------------------------------

    def when(self, flag: torch.Tensor, body: Body) -> None:
        self._conditional(flag, body, self._drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_IF)

    def loop(self, flag: torch.Tensor, body: Body) -> None:
        self._conditional(flag, body, self._drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE)

    def close(self) -> None:
        """Free what the captured graphs use: call only after they are destroyed."""
        drv = self._drv
        for _ in range(self._pool_refs):
            torch._C._cuda_releasePool(self.device.index, self.pool)
        self._pool_refs = 0
        for s in self._streams:
            destroy_stream(s)
        self._streams = []
        if self._module is not None:
            _ok(drv.cuModuleUnload(self._module))
            self._module = None

    # -- one conditional node -------------------------------------------------------------------

    def _conditional(self, flag: torch.Tensor, body: Body, kind) -> None:
        drv = self._drv
        _check_flag(flag)
        if flag.device != self.device:
            raise ValueError(f"flag is on {flag.device}, flow on {self.device}")
        stream = drv.CUstream(torch.cuda.current_stream(self.device).cuda_stream)
        status, _, graph, _, _, _ = _ok(drv.cuStreamGetCaptureInfo(stream))
        if status != drv.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            raise RuntimeError("GraphFlow works only inside CUDA graph capture; use EagerFlow outside it")
        ctx = _ok(drv.cuStreamGetCtx(stream))

        # The handle belongs to the graph that holds the node (for nested calls: a body graph).
        handle = _ok(drv.cuGraphConditionalHandleCreate(graph, ctx, 0, drv.CU_GRAPH_COND_ASSIGN_DEFAULT))
        self._launch_set_cond(stream, handle, flag)

        _, _, graph, deps, _, ndeps = _ok(drv.cuStreamGetCaptureInfo(stream))
        params = drv.CUgraphNodeParams()
        params.type = drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_CONDITIONAL
        params.conditional.handle = handle
        params.conditional.type = kind
        params.conditional.size = 1
        params.conditional.ctx = ctx
        node = _ok(drv.cuGraphAddNode(graph, deps[:ndeps], None, ndeps, params))
        body_graph = params.conditional.phGraph_out[0]
        # The capture continues after the conditional node.
        set_deps = drv.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES
        _ok(drv.cuStreamUpdateCaptureDependencies(stream, [node], None, 1, set_deps))

        side = self._stream(self._depth)
        side_raw = drv.CUstream(side.cuda_stream)
        _ok(drv.cuStreamBeginCaptureToGraph(
            side_raw, body_graph, None, None, 0, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
        outermost = self._depth == 0
        if outermost:
            torch._C._cuda_beginAllocateCurrentThreadToPool(self.device.index, self.pool)
            self._pool_refs += 1
        self._depth += 1
        try:
            with torch.cuda.stream(side):
                body()
                if kind == drv.CUgraphConditionalNodeType.CU_GRAPH_COND_TYPE_WHILE:
                    self._launch_set_cond(side_raw, handle, flag)  # re-evaluate for the next iteration
        finally:
            self._depth -= 1
            if outermost:
                torch._C._cuda_endAllocateToPool(self.device.index, self.pool)
            _ok(drv.cuStreamEndCapture(side_raw))

    def _launch_set_cond(self, stream, handle, flag: torch.Tensor) -> None:
        drv = self._drv
        args = ((int(handle), flag.data_ptr()), (ctypes.c_ulonglong, ctypes.c_void_p))
        _ok(drv.cuLaunchKernel(self._set_cond, 1, 1, 1, 1, 1, 1, 0, stream, args, 0))

    def _stream(self, depth: int) -> torch.cuda.ExternalStream:
        """One private stream per nesting depth (a capturing stream cannot start another capture)."""
        while len(self._streams) <= depth:
            self._streams.append(private_stream(self.device))
        return self._streams[depth]

    def _compile(self, driver, nvrtc):
        major, minor = torch.cuda.get_device_capability(self.device)
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode(), b"-std=c++17"]
        errors = []
        for source in _SET_COND_SOURCES:
            prog = _ok(nvrtc.nvrtcCreateProgram(source.encode(), b"set_cond.cu", 0, [], []))
            try:
                err = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)[0]
                if int(getattr(err, "value", err)) != 0:
                    size = _ok(nvrtc.nvrtcGetProgramLogSize(prog))
                    log = b" " * size
                    nvrtc.nvrtcGetProgramLog(prog, log)
                    errors.append(log.decode(errors="replace"))
                    continue
                size = _ok(nvrtc.nvrtcGetCUBINSize(prog))
                cubin = b" " * size
                _ok(nvrtc.nvrtcGetCUBIN(prog, cubin))
            finally:
                nvrtc.nvrtcDestroyProgram(prog)
            module = _ok(driver.cuModuleLoadData(cubin))
            return module, _ok(driver.cuModuleGetFunction(module, b"set_cond"))
        raise RuntimeError("could not compile set_cond with NVRTC:\n" + "\n".join(errors))
