"""Programmatic dependent launch (kernels/launch.py): it must overlap kernels (else it is dead weight), and the wait
must order them (else results race), for the next kernel and for the one after it.

The overlap and ordering probe: a producer kernel spins 0.5 ms on the GPU timer, then writes 1; a consumer
launched with PDL copies that value. With the wait it must read 1. Without it (the negative control) it reads 0:
that proves the consumer really started while the producer ran, eagerly, in a captured graph and inside a
conditional node's body graph (the decode loop's form), so the wait is what orders the two there. A third kernel
may read what the first wrote before its own wait (the kernels' "early" reads): it must read 1, and reads 0 when
the middle kernel skips its wait (the control: the bound comes from every kernel waiting before it signals).
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

from iquest.kernels.launch import launch_options, prefetch_lines, wait_for_inputs

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
    # The third kernel of the two-back probe: what it reads before its wait shows whether it started while the first
    # kernel ran; what it reads after, that its own wait still orders it.
    tl.store(early_ptr, tl.load(src_ptr, volatile=True))
    wait_for_inputs(PDL)
    tl.store(dst_ptr, tl.load(src_ptr, volatile=True))


def two_back_probe(middle_waits: bool, where: str) -> tuple[int, int]:
    """(read before its wait, read after) by the third of three PDL kernels, the first of which writes 1 late; the
    middle one copies it, with its wait or (the control) without."""
    src = torch.zeros(1, dtype=torch.int32, device="cuda")
    mid = torch.zeros(1, dtype=torch.int32, device="cuda")
    early = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    dst = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    pdl = launch_options(True, src.device)

    def body():
        src.zero_()
        _late_write[(1,)](src, SPIN_NS, **pdl)
        _copy[(1,)](src, mid, WAIT=middle_waits, **pdl)
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
def test_cuda_a_kernel_two_launches_back_is_complete_before_the_wait(where):
    """Every kernel waits before it signals, so the third kernel starts only after the first completed: even its read
    before the wait sees 1 (the bound the kernels' early reads rely on), and after the wait too. The control: with
    the middle kernel skipping its wait, the third starts while the first still runs, and its early read sees 0."""
    assert two_back_probe(True, where) == (1, 1)
    assert two_back_probe(False, where)[0] == 0, f"no overlap {where}: the probe cannot see a read ahead"


def test_launch_options_refuse_pdl_off_the_gpu():
    assert launch_options(False, torch.device("cpu")) == {}
    # the launch attribute never without the kernel's wait
    assert launch_options(True, torch.device("cuda")) == {"launch_pdl": True, "PDL": True}
    with pytest.raises(ValueError, match="CUDA"):
        launch_options(True, torch.device("cpu"))


@pytest.mark.parametrize("columns, element_bytes, want", [(768, 1, (128, 8)), (512, 4, (32, 16)), (100, 1, (128, 1)),
                                                          (6144, 1, (128, 64)), (1, 2, (64, 1))])
def test_prefetch_covers_the_range(columns, element_bytes, want):
    per_line, lines = prefetch_lines(columns, element_bytes)
    assert (per_line, lines) == want and per_line * lines >= columns


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
