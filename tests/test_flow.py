"""fast/flow.py: one program text, run by EagerFlow (CPU, CI) and by GraphFlow (captured, GPU).

Each `*_program(flow, s)` below is written once against `Flow`; the CPU tests run it eagerly, the
GPU tests capture it into one CUDA graph and replay it with new device inputs.
"""

import gc
from types import SimpleNamespace

import pytest
import torch

from iquest.fast.flow import EagerFlow, new_flag

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


# -- programs (written against Flow) ----------------------------------------------------------------


def if_program(flow, s):
    """out += 1 iff x > 0, with the flag set by a kernel earlier in the same program."""
    s.flag.copy_(s.x > 0)
    s.before.add_(1)

    def body():
        s.out.add_(1)

    flow.when(s.flag, body)
    s.after.add_(1)


def while_program(flow, s):
    """count from 0 up to a device-chosen bound, one body execution per step."""
    s.count.zero_()
    s.steps.zero_()
    s.flag.copy_(s.count < s.bound)

    def body():
        s.count.add_(1)
        s.steps.add_(s.ones)  # an allocating op inside the body: torch.add into a temporary
        s.steps.copy_(s.steps + 0)
        s.flag.copy_(s.count < s.bound)

    flow.loop(s.flag, body)


MAX_ROUNDS = 16


def rounds_program(flow, s):
    """A WHILE over rounds; per round three depths always run, then an IF chain up to depth 7.

    The target depth (3..7) is chosen on the device from the round index and a seed; depth k+1 is
    decided inside depth k's body, so a skipped depth executes no kernels.
    """
    s.r.zero_()
    s.drafted.zero_()
    s.log.fill_(-1)
    s.go_round.copy_(s.r < s.rounds)

    def depth(k):
        def body():
            s.drafted.add_(1)
            s.reached.fill_(k)
            if k < 7:
                s.go.copy_(s.target > k)
                flow.when(s.go, depth(k + 1))

        return body

    def round_body():
        s.target.copy_(3 + (s.r * 3 + s.seed) % 5)
        s.drafted.add_(3)
        s.reached.fill_(3)
        s.go.copy_(s.target > 3)
        flow.when(s.go, depth(4))
        s.log.index_copy_(0, s.r.long().view(1), s.reached.view(1))
        s.r.add_(1)
        s.go_round.copy_(s.r < s.rounds)

    flow.loop(s.go_round, round_body)


def expected_rounds(rounds, seed):
    depths = [3 + (r * 3 + seed) % 5 for r in range(rounds)]
    return depths + [-1] * (MAX_ROUNDS - rounds), sum(depths)


def if_state(device):
    z = lambda: torch.zeros((), dtype=torch.int32, device=device)  # noqa: E731
    return SimpleNamespace(x=torch.zeros((), device=device), flag=new_flag(device), out=z(), before=z(), after=z())


def while_state(device):
    z = lambda: torch.zeros((), dtype=torch.int32, device=device)  # noqa: E731
    ones = torch.ones((), dtype=torch.int32, device=device)
    return SimpleNamespace(count=z(), steps=z(), bound=z(), flag=new_flag(device), ones=ones)


def rounds_state(device):
    z = lambda: torch.zeros((), dtype=torch.int32, device=device)  # noqa: E731
    return SimpleNamespace(
        r=z(), rounds=z(), seed=z(), target=z(), reached=z(), drafted=z(),
        go=new_flag(device), go_round=new_flag(device),
        log=torch.zeros(MAX_ROUNDS, dtype=torch.int32, device=device),
    )


# -- EagerFlow on CPU (CI) ---------------------------------------------------------------------------


def test_eager_when_runs_body_iff_flag():
    flow, s = EagerFlow(), if_state("cpu")
    for x, ran in [(1.0, 1), (-1.0, 0), (2.0, 1), (0.0, 0)]:
        s.x.fill_(x)
        out0 = int(s.out)
        if_program(flow, s)
        assert int(s.out) - out0 == ran
    assert int(s.before) == int(s.after) == 4


@pytest.mark.parametrize("bound", [0, 1, 5, 13])
def test_eager_loop_counts_to_bound(bound):
    flow, s = EagerFlow(), while_state("cpu")
    s.bound.fill_(bound)
    while_program(flow, s)
    assert int(s.count) == bound and int(s.steps) == bound and int(s.flag) == 0


@pytest.mark.parametrize("rounds,seed", [(0, 0), (1, 2), (5, 1), (MAX_ROUNDS, 4)])
def test_eager_nested_rounds_and_depths(rounds, seed):
    flow, s = EagerFlow(), rounds_state("cpu")
    s.rounds.fill_(rounds)
    s.seed.fill_(seed)
    rounds_program(flow, s)
    log, drafted = expected_rounds(rounds, seed)
    assert s.log.tolist() == log
    assert int(s.drafted) == drafted and int(s.r) == rounds


def test_eager_flag_is_evaluated_at_the_call():
    flow, flag, ran = EagerFlow(), new_flag("cpu", 1), []

    def body():
        flag.zero_()  # a body may rewrite its own flag; the decision was already taken
        ran.append(1)

    flow.when(flag, body)
    assert ran == [1]


@pytest.mark.parametrize("bad", [torch.tensor(1.0), torch.tensor(True), torch.tensor([1, 1], dtype=torch.int32)])
def test_flags_must_be_one_int32(bad):
    with pytest.raises(TypeError):
        EagerFlow().when(bad, lambda: None)


# -- GraphFlow inside a captured graph (GPU) ----------------------------------------------------------


def capture(program, s):
    from iquest.fast.flow import GraphFlow

    flow = GraphFlow()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        program(flow, s)
    torch.cuda.synchronize()
    return graph, flow


@pytest.mark.gpu
@gpu
def test_graph_if_follows_device_flag():
    s = if_state("cuda")
    graph, flow = capture(if_program, s)
    for x, ran in [(1.0, 1), (-1.0, 0), (-3.0, 0), (2.0, 1)]:
        s.x.fill_(x)
        out0 = int(s.out)
        graph.replay()
        torch.cuda.synchronize()
        assert int(s.out) - out0 == ran, x
    assert int(s.before) == int(s.after) == 4
    del graph
    flow.close()


@pytest.mark.gpu
@gpu
def test_graph_while_runs_device_chosen_count():
    s = while_state("cuda")
    graph, flow = capture(while_program, s)
    for bound in [7, 3, 0, 1000]:
        s.bound.fill_(bound)
        graph.replay()
        torch.cuda.synchronize()
        assert (int(s.count), int(s.steps), int(s.flag)) == (bound, bound, 0)
    del graph
    flow.close()


@pytest.mark.gpu
@gpu
def test_graph_nested_if_chain_inside_while():
    s = rounds_state("cuda")
    graph, flow = capture(rounds_program, s)
    for rounds, seed in [(5, 1), (MAX_ROUNDS, 4), (0, 0), (9, 3)]:
        s.rounds.fill_(rounds)
        s.seed.fill_(seed)
        graph.replay()
        torch.cuda.synchronize()
        log, drafted = expected_rounds(rounds, seed)
        assert s.log.tolist() == log
        assert int(s.drafted) == drafted and int(s.r) == rounds
    del graph
    flow.close()


@pytest.mark.gpu
@gpu
def test_graph_triton_kernel_and_allocations_in_bodies():
    import triton
    import triton.language as tl

    @triton.jit
    def bump(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    n = 1000
    x = torch.zeros(n, device="cuda")
    a = torch.randn(8, 64, device="cuda")
    w = torch.randn(64, 32, device="cuda")
    acc = torch.zeros(32, device="cuda")
    i, bound, flag, go = (torch.zeros((), dtype=torch.int32, device="cuda") for _ in range(4))

    def launch():
        bump[(triton.cdiv(n, 256),)](x, n, BLOCK=256)

    launch()  # compile and warm up (triton, cuBLAS) before capture
    acc.add_((a @ w).sum(0))
    torch.cuda.synchronize()

    body_ptrs = []

    def program(flow):
        x.zero_()
        acc.zero_()
        i.zero_()
        flag.copy_(i < bound)

        def body():
            launch()
            y = a @ w  # temporaries come from the flow's body pool; cuBLAS runs on the body stream
            body_ptrs.append(y.data_ptr())
            acc.add_(y.relu().sum(0))
            go.copy_(i % 2 == 0)
            flow.when(go, launch)  # a Triton kernel in a nested IF body
            i.add_(1)
            flag.copy_(i < bound)

        flow.loop(flag, body)

    from iquest.fast.flow import GraphFlow

    flow = GraphFlow()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        program(flow)
    pools = {
        tuple(seg.get("segment_pool_id", ())) for seg in torch.cuda.memory_snapshot()
        if seg["address"] <= body_ptrs[0] < seg["address"] + seg["total_size"]
    }
    assert pools == {tuple(flow.pool)}
    ref = (a @ w).relu().sum(0)
    gc.collect()  # an earlier test's cycles freed during the replays would read as a change in what they allocate
    allocated = None
    for b in [4, 7, 0, 4]:
        bound.fill_(b)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.all(x == b + (b + 1) // 2), (b, x[:4])
        torch.testing.assert_close(acc, ref * b, rtol=1e-4, atol=1e-3)
        allocated = allocated or torch.cuda.memory_allocated()
        assert torch.cuda.memory_allocated() == allocated  # replays allocate nothing
    del graph
    flow.close()


@pytest.mark.gpu
@gpu
def test_graph_flow_refuses_outside_capture_and_bad_flags():
    from iquest.fast.flow import GraphFlow

    flow = GraphFlow()
    with pytest.raises(RuntimeError, match="capture"):
        flow.when(new_flag("cuda", 1), lambda: None)
    with pytest.raises(TypeError):
        flow.when(torch.ones((), dtype=torch.bool, device="cuda"), lambda: None)
    flow.close()
