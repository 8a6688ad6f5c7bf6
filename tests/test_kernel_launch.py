"""Programmatic dependent launch (kernels/launch.py): it must overlap kernels (else it is dead weight), the wait
must order them (else results race), and the engine's output must not change by one bit.

The overlap and ordering probe: a producer kernel spins 0.5 ms on the GPU timer, then writes 1; a consumer
launched with PDL copies that value. With the wait it must read 1. Without it (the negative control) it reads 0:
that proves the consumer really started while the producer ran, eagerly, in a captured graph and inside a
conditional node's body graph (the decode loop's form), so the wait is what orders the two there.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from iquest.kernels.launch import Pdl, launch_options, prefetch_lines, wait_for_inputs
from iquest.tests.test_fast_kernels import CASES, N_TOKENS
from iquest.tests.test_fast_engine import PROMPTS, TINY, fast_steps

SPIN_NS = 500_000  # far above the host's launch gap between the two eager launches


@triton.jit
def _late_write(out_ptr, spin_ns, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)  # a PDL kernel itself: waits for the zeroing, then lets the consumer launch
    t0 = globaltimer()
    while globaltimer() - t0 < spin_ns:
        pass
    tl.store(out_ptr, 1)


@triton.jit
def _copy(src_ptr, dst_ptr, WAIT: tl.constexpr, PDL: tl.constexpr = False):
    # Launched with PDL always (the PDL flag launch_options passes is ignored): WAIT = False is the defect, a PDL
    # launch of a kernel that skips its wait.
    wait_for_inputs(WAIT)
    tl.store(dst_ptr, tl.load(src_ptr))


def probe(where: str, wait: bool) -> int:
    """The value the consumer read: 1 = after the producer's write."""
    src = torch.zeros(1, dtype=torch.int32, device="cuda")
    dst = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    pdl = launch_options(True, src.device)

    def body():
        src.zero_()
        _late_write[(1,)](src, SPIN_NS, **pdl)
        _copy[(1,)](src, dst, WAIT=wait, **pdl)

    body()  # compile both kernels (the first consumer launch waits for its compilation: no overlap to see)
    torch.cuda.synchronize()
    dst.fill_(-1)
    if where == "eager":
        body()
        torch.cuda.synchronize()
        return int(dst.item())
    if where == "graph":
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
    else:  # "body": inside a conditional IF node, as the decode loop's bodies are
        from iquest.fast.flow import GraphFlow, new_flag

        flow, flag = GraphFlow(), new_flag("cuda", 1)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            flow.when(flag, body)
    g.replay()
    torch.cuda.synchronize()
    return int(dst.item())


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["eager", "graph", "body"])
def test_cuda_pdl_overlaps_and_the_wait_orders(where):
    assert probe(where, wait=True) == 1
    assert probe(where, wait=False) == 0, f"no overlap {where}: the consumer did not start before the producer ended"


@triton.jit
def _read_twice(src_ptr, early_ptr, dst_ptr, PDL: tl.constexpr = False):
    # The third kernel of the cascade probe: what it reads before its wait (a read no kernel may make, the probe's
    # defect) shows whether it started while the first kernel ran; what it reads after shows the order still holds.
    tl.store(early_ptr, tl.load(src_ptr, volatile=True))
    wait_for_inputs(PDL)
    tl.store(dst_ptr, tl.load(src_ptr, volatile=True))


def cascade_probe(mode: Pdl, where: str) -> tuple[int, int]:
    """(read before its wait, read after) by the third of three PDL kernels, the first of which writes 1 late."""
    src = torch.zeros(1, dtype=torch.int32, device="cuda")
    mid = torch.zeros(1, dtype=torch.int32, device="cuda")
    early = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    dst = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    pdl = launch_options(mode, src.device)

    def body():
        src.zero_()
        _late_write[(1,)](src, SPIN_NS, **pdl)
        _copy[(1,)](src, mid, WAIT=int(mode), **pdl)  # the middle kernel: waits (in `mode`), copies
        _read_twice[(1,)](src, early, dst, **pdl)

    body()
    torch.cuda.synchronize()
    early.fill_(-1)
    dst.fill_(-1)
    if where == "eager":
        body()
    else:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        g.replay()
    torch.cuda.synchronize()
    return int(early.item()), int(dst.item())


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["eager", "graph"])
def test_cuda_cascade_runs_ahead_and_keeps_the_order(where):
    """Pdl.CASCADE: the third kernel starts while the first still runs (it reads 0 before its wait: two launches
    ahead, which CHAINED never allows), and its wait still orders it after the first (it reads 1 after). CHAINED, the
    control: the third kernel starts only after the first completed, so even its read before the wait sees 1 (the
    bound stage "early" relies on)."""
    assert cascade_probe(Pdl.CASCADE, where) == (0, 1)
    assert cascade_probe(Pdl.CHAINED, where) == (1, 1)


def test_cascade_is_refused_with_early():
    from iquest.fast.ops import CASCADE_OPS, make_ops

    for name in ("triton+cascade", "triton+cascade_norm"):
        with pytest.raises(ValueError, match="early"):
            make_ops(name)
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)  # `_pdl` reads only is_cuda
    every = make_ops("triton-early+cascade")
    assert every.cascade and not every.early and every.cascade_ops == set(CASCADE_OPS)
    assert [every._pdl(cuda, op) for op in CASCADE_OPS] == [Pdl.CASCADE] * len(CASCADE_OPS)
    assert (every._pdl(cpu, "moe"), every.cascade_calls) == (Pdl.OFF, len(CASCADE_OPS))
    but_moe = make_ops("triton-early+cascade-cascade_moe")  # a subset: every group but the MoE's
    assert but_moe.cascade_ops == set(CASCADE_OPS) - {"moe"}
    assert (but_moe._pdl(cuda, "moe"), but_moe._pdl(cuda, "norm")) == (Pdl.CHAINED, Pdl.CASCADE)
    assert make_ops("triton")._pdl(cuda, "norm") == Pdl.CHAINED and make_ops("triton-pdl")._pdl(cuda, "norm") == Pdl.OFF
    assert not make_ops("triton-pdl+cascade").cascade


def test_launch_options_refuse_pdl_off_the_gpu():
    assert launch_options(False, torch.device("cpu")) == {}
    # the launch attribute never without the kernel's wait
    assert launch_options(True, torch.device("cuda")) == {"launch_pdl": True, "PDL": True}
    assert launch_options(Pdl.CHAINED, torch.device("cuda")) == {"launch_pdl": True, "PDL": True}
    assert launch_options(Pdl.CASCADE, torch.device("cuda")) == {"launch_pdl": True, "PDL": 2}
    assert launch_options(Pdl.OFF, torch.device("cpu")) == {}
    with pytest.raises(ValueError, match="CUDA"):
        launch_options(True, torch.device("cpu"))


@pytest.mark.parametrize("columns, element_bytes, want", [(768, 1, (128, 8)), (512, 4, (32, 16)), (100, 1, (128, 1)),
                                                          (6144, 1, (128, 64)), (1, 2, (64, 1))])
def test_prefetch_covers_the_range(columns, element_bytes, want):
    per_line, lines = prefetch_lines(columns, element_bytes)
    assert (per_line, lines) == want and per_line * lines >= columns


def decode_with_logprobs(kernels: str, dtype: str) -> dict:
    from iquest.fast.parallel import Parallel
    from iquest.fast.rank import EngineOptions, RankEngine

    engine = RankEngine(TINY, Parallel.single("cuda"), EngineOptions(max_context=256, dtype=dtype, kernels=kernels))
    out = {}
    for i, drafts in CASES:
        steps = fast_steps(engine, PROMPTS[i], 40 + i, drafts, n=N_TOKENS)
        out[f"{i}-{drafts}"] = [(s.tokens, s.logprobs, s.drafts, s.accepted) for s in steps]
    ops = engine.model.ops
    return {"steps": out, "pdl": ops.pdl, "prefetch": ops.prefetch, "f16": ops.f16, "fallbacks": dict(ops.fallbacks),
            "f16_norm_calls": ops.f16_norm_calls, "tma_calls": ops.tma_calls,
            "embed_calls": ops.embed_calls, "settle_calls": ops.settle_calls, "preload_calls": ops.preload_calls,
            "fp8_down_calls": ops.fp8_down_calls, "moe_fold_calls": ops.moe_fold_calls,
            "early_calls": ops.early_calls, "rope_sum_calls": ops.rope_sum_calls, "cascade_calls": ops.cascade_calls,
            "norm_qkv_calls": ops.norm_qkv_calls}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_pdl_decodes_bit_identically(dtype):
    """Every kernel launched with PDL, with and without the weight prefetch: the same tokens, logprobs and
    acceptance sequence as every kernel launched plainly, through the captured decode loop."""

    base = decode_with_logprobs("triton-pdl", dtype)
    pdl = decode_with_logprobs("triton", dtype)  # pdl is a default stage
    both = decode_with_logprobs("triton+prefetch", dtype)
    assert (base["pdl"], pdl["pdl"], both["pdl"], both["prefetch"]) == (False, True, True, True)
    assert pdl["steps"] == base["steps"] and both["steps"] == base["steps"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_preload_decodes_bit_identically(dtype):
    """The FP8 linears and the router loading their weight tiles before the PDL wait (stage preload): the same tokens,
    logprobs and acceptance sequence as without, through the captured decode loop, with the preload counted."""
    base = decode_with_logprobs("triton-preload", dtype)
    pre = decode_with_logprobs("triton", dtype)  # preload is a default stage
    assert base["preload_calls"] == 0 and pre["preload_calls"] > 0
    assert pre["steps"] == base["steps"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_cascade_decodes_bit_identically(dtype):
    """Every kernel signalling the next before its wait (stage cascade): the same tokens, logprobs and acceptance
    sequence as signalling after it, through the captured decode loop, with the cascading launches counted."""
    base = decode_with_logprobs("triton-early", dtype)
    cascade = decode_with_logprobs("triton-early+cascade", dtype)
    assert base["cascade_calls"] == 0 and cascade["cascade_calls"] > 0
    assert cascade["steps"] == base["steps"]


@pytest.mark.gpu
def test_prefer_carveout_reaches_the_compiled_kernels():
    """kernels/launch.prefer_carveout (stages carveout_l1, carveout_smem): every kernel compiled so far, read back."""
    from cuda.bindings import driver

    from iquest.kernels.fp8_linear import fp8_linear
    from iquest.kernels.launch import compiled_kernels, prefer_carveout
    from iquest.reference.fp8 import quantize

    w, s = quantize(torch.randn(256, 256), (128, 128))
    fp8_linear(torch.randn(4, 256).to(torch.bfloat16).cuda(), w.cuda(), s.cuda())
    names = {k.name for k in compiled_kernels()}
    assert "_fp8_linear_kernel" in names
    attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
    for percent in (0, 100):
        assert prefer_carveout(percent) == len(compiled_kernels())
        got = {driver.cuFuncGetAttribute(attr, driver.CUfunction(k.function))[1] for k in compiled_kernels()}
        assert got == {percent}
    small = [k for k in compiled_kernels() if k.metadata.shared <= 48 * 1024]
    assert small and prefer_carveout(0, max_shared=48 * 1024) == len(small)
    assert {driver.cuFuncGetAttribute(attr, driver.CUfunction(k.function))[1] for k in small} == {0}


@pytest.mark.parametrize("capturing", [False, True])
@pytest.mark.parametrize("carveout", [None, 0, -1])
def test_launch_with_carveout_sets_it_where_a_graph_keeps_it(monkeypatch, capturing, carveout):
    """kernels/launch.launch_with_carveout's order of events, on a stand-in kernel: inside a capture the compiled
    kernel is looked up (warmup) and its carveout set before the captured launch (a graph keeps what the kernel had
    when captured); outside one the launch comes first and the carveout is set on what it returned; None sets
    nothing and launches once."""
    from iquest.kernels import launch as ln

    events = []

    class Kernel:
        def warmup(self, *args, grid, **kw):
            events.append(("warmup", grid, args, kw))
            return "compiled"

        def __getitem__(self, grid):
            def run(*args, **kw):
                events.append(("launch", grid, args, kw))
                return "compiled"
            return run

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    monkeypatch.setattr(ln, "set_carveout", lambda compiled, percent: events.append(("carveout", compiled, percent)))
    ln.launch_with_carveout(Kernel(), (3, 1, 2), (7, 8), {"X": 1}, carveout)
    launch = ("launch", (3, 1, 2), (7, 8), {"X": 1})
    if carveout is None:
        assert events == [launch]
    elif capturing:
        assert events == [("warmup", (3, 1, 2), (7, 8), {"X": 1}), ("carveout", "compiled", carveout), launch]
    else:
        assert events == [launch, ("carveout", "compiled", carveout)]
