"""The expert prefetch (EngineOptions.expert_prefetch; fast/expert_prefetch.py, kernels/expert_prefetch.py): a cache
hint, so the engine's tokens, values and acceptance are bit for bit those without it; its branch runs only on the
target's sliding MoE layers; its prediction is the router's selection over W' a; the kernel predicts exactly that at
the paying widths and nothing at the others (`predicted` -1).

On CPU the kernel runs under Triton's interpreter (in a worker subprocess), where it predicts but issues no prefetch.
`@pytest.mark.gpu`: the captured decode loop with the branch on a side stream gives the same tokens as without it,
and the kernel's predictions at the published shapes match the torch form's.
"""

from __future__ import annotations

import json
import sys

import pytest
import torch

from iquest.fast import expert_prefetch as fp
from iquest.fast.engine import FastEngine
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine
from iquest.kernels.testing import interpreted_tests
from iquest.reference.layers import route
from iquest.tests.helpers import PARAMS, TINY

CASES = [dict(name=f"rows{R}_live{n}_E{E}_H{H}_k{k}", R=R, live=n, E=E, H=H, I=I, k=k)
         for R, n, E, H, I, k in [(8, 3, 64, 256, 64, 8), (8, 4, 64, 256, 64, 8), (8, 5, 64, 256, 64, 8),
                                  (8, 8, 64, 256, 64, 8), (6, 5, 48, 320, 32, 6), (4, 4, 256, 1024, 48, 8)]]
PAYING = (4, 5)  # kernels.expert_prefetch.PrefetchSettings().rows


def run_case(c: dict, device: str) -> dict:
    from iquest.kernels import expert_prefetch as kp

    g = torch.Generator().manual_seed(c["E"] * 7 + c["live"])
    a = torch.randn(c["R"], c["H"], generator=g).bfloat16().to(device)
    router = torch.randn(c["E"], c["H"], generator=g).to(device)
    w_ffn = (torch.rand(c["H"], generator=g) + 0.5).to(device)
    gate, up = (torch.randn(c["E"], c["I"], c["H"], generator=g).to(torch.float8_e4m3fn).to(device) for _ in "gu")
    warm = fp.make(router, w_ffn, c["k"])
    live = torch.arange(c["R"], device=device) < c["live"]
    got = kp.warm(a, live, warm.predictor, gate, up, c["k"])
    want = fp.predict(a, live, warm)
    return {"got": got.cpu().tolist(), "want": want.cpu().tolist()}


def check_case(c: dict, r: dict) -> None:
    if c["live"] in PAYING:
        assert r["got"] == r["want"], r  # random data: no near-ties at these sizes
    else:
        assert r["got"] == [[-1] * c["k"]] * c["R"], r


interpreted, test_interpreted = interpreted_tests(__file__, CASES, check_case)


def test_the_prediction_is_the_routers_selection_over_the_scaled_router():
    g = torch.Generator().manual_seed(1)
    a, router, w_ffn = torch.randn(5, 32, generator=g), torch.randn(12, 32, generator=g), torch.rand(32, generator=g)
    live = torch.tensor([True, True, True, False, False])
    warm = fp.make(router, w_ffn, 3)
    got = fp.predict(a, live, warm)
    want = route((a * w_ffn) @ router.T, 3)[1]
    assert torch.equal(got[:3], want[:3]) and (got[3:] == -1).all()
    shared = torch.randn(12, 32)
    assert fp.make(router, w_ffn, 3, scaled=shared).predictor is shared  # the fold's W', not a copy


def test_coverage_counts_rows_and_the_blocks_distinct_experts():
    experts = torch.tensor([[0, 1], [1, 2], [5, 6]])
    predicted = torch.tensor([[0, 3], [1, 2], [-1, -1]])
    live = torch.tensor([True, True, False])
    assert fp.coverage(predicted, experts, live) == (3, 4, 3, 3)  # rows: 1 + 2 of 4; block {0,1,2}: all warmed
    assert fp.coverage(torch.tensor([[4, 3], [7, 2], [0, 0]]), experts, live) == (1, 4, 1, 3)


def _engine(prefetch: bool, device: str = "cpu") -> FastEngine:
    return FastEngine.load(TINY, tp=1, device=device, options=EngineOptions(max_context=256, expert_prefetch=prefetch))


def _decode(e: FastEngine, drafts: int, n: int = 24) -> list[tuple]:
    steps = e.generate(list(range(3, 40)), seed=5, params=PARAMS, max_new_tokens=n, drafts=drafts)
    return [(s.tokens, s.logprobs, s.drafts, s.accepted) for s in steps]


def test_the_engine_with_the_prefetch_decodes_the_same_bits_and_branches_on_sliding_moe_layers_only():
    on, off = _engine(True), _engine(False)
    assert _decode(on, 3) == _decode(off, 3)
    ops, c = on.rank0.model.ops, on.config
    sliding_moe = [i for i in range(c.num_hidden_layers) if not c.is_dense(i) and c.window(i) is not None]
    moe_layers = sum(not c.is_dense(i) for i in range(c.num_hidden_layers))
    assert sliding_moe and len(ops._warm) == len(sliding_moe) < moe_layers  # no predictor on a full layer
    forwards = ops.calls["warm_experts"] / len(sliding_moe)
    assert forwards == int(forwards) and forwards >= 2, ops.calls  # every target forward, those layers only
    assert off.rank0.model.ops.calls["warm_experts"] == 0


def test_the_memory_check_counts_a_predictor_a_sliding_moe_layer_unless_the_fold_holds_it():
    from iquest.fast.memory import expert_prefetch_bytes
    from iquest.reference.config import Config
    from iquest.tests.helpers import ROOT

    c = Config.from_file(ROOT / "configs" / "iquest-q1.json")
    sliding = [i for i in range(c.num_hidden_layers) if c.window(i) is not None]
    assert len(sliding) == 63 and not any(c.is_dense(i) for i in sliding)  # 21 blocks of three sliding layers
    assert expert_prefetch_bytes(c, 8, router_fold=False) == 63 * 256 * 3072 * 4
    assert expert_prefetch_bytes(c, 8, router_fold=True) == expert_prefetch_bytes(c, 1, router_fold=False)
    assert expert_prefetch_bytes(c, 1, router_fold=True) == 0  # the fold's W' of every MoE layer is shared


def test_taps_hold_the_prediction_for_the_coverage_report():
    e = RankEngine(TINY, Parallel.single("cpu"), EngineOptions(max_context=256, expert_prefetch=True))
    taps: dict = {}
    pos = torch.arange(6)
    e.model.forward(torch.arange(3, 9), pos, torch.ones(6, dtype=torch.bool), taps)
    names = sorted(n for n in taps if n.endswith("predicted_experts"))
    assert names and all(taps[n].shape == taps[n.replace("predicted_experts", "experts")].shape for n in names)


def test_bench_prefetch_reports_coverage_per_sliding_layer_and_width(tmp_path, capsys):
    from iquest.cli.main import main
    from iquest.tests.helpers import MINI

    out = tmp_path / "prefetch.json"
    assert main(["bench", "prefetch", "--model", str(MINI), "--device", "cpu", "--prompts", "1", "--widths", "4",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["widths"] == [4] and r["layers"] and all(r_["width"] == 4 for r_ in r["layers"])
    for row in r["layers"]:
        # a prediction of k experts a row: chance is k / E; the trained router's own direction does far better
        assert r["top_k"] / r["experts"] < row["block_coverage"] <= 1 and row["blocks"] >= 10, row
    assert main(["bench", "prefetch", "--model", str(MINI), "--widths", "0,9"]) != 0
    assert "--widths must be in 1..8" in capsys.readouterr().err


# ---- on the GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES, ids=[c["name"] for c in CASES])
def test_cuda_kernel_predicts_as_the_torch_form(c):
    check_case(c, run_case(c, "cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("drafts", [3, 4, 6])
def test_cuda_captured_loop_with_the_branch_decodes_the_same_tokens(drafts):
    on, off = _engine(True, "cuda"), _engine(False, "cuda")
    assert _decode(on, drafts, 40) == _decode(off, drafts, 40)
    assert on.rank0.model.ops.calls["expert_prefetch"] > 0, on.rank0.model.ops.calls


def _pool_at_the_capture_stream(device: str = "cuda") -> int:
    """Moves torch's stream pool (its pooled streams are handed out round robin) so that the next
    `torch.cuda.Stream()` is `torch.cuda.graph`'s default capture stream, itself pooled; returns that stream's handle."""
    torch.cuda.graph(torch.cuda.CUDAGraph())  # makes the default capture stream, if no capture has yet
    capture = torch.cuda.graph.default_capture_stream.cuda_stream
    take = lambda: torch.cuda.Stream(device).cuda_stream
    if all(take() != capture for _ in range(256)):  # stops just past the capture stream
        pytest.fail("torch's stream pool never handed out the capture stream")
    period = 1
    while take() != capture:
        period += 1
    for _ in range(period - 1):
        take()
    return capture


@pytest.mark.gpu
def test_cuda_the_branch_forks_onto_a_stream_of_its_own():
    """The branch's stream is none of torch's pooled streams: a pooled one can be the stream the decode loop is
    captured on, and the branch, forked onto it from inside a conditional body, then joins the outer capture (the
    captured loop's segmentation fault in `capture_end`, one suite in six). With the pool moved so that the next
    pooled stream is the capture stream, the captured loop with the branch decodes the same tokens."""
    capture = _pool_at_the_capture_stream()
    on = _engine(True, "cuda")
    side = on.rank0.model.ops._side.cuda_stream
    pooled = {torch.cuda.Stream("cuda").cuda_stream for _ in range(256)}
    assert capture in pooled and side not in pooled
    assert _decode(on, 3, 40) == _decode(_engine(False, "cuda"), 3, 40)
    assert on.rank0.model.ops.calls["expert_prefetch"] > 0, on.rank0.model.ops.calls


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in CASES])
