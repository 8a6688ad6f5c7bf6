"""The fast engine on CUDA: the captured decode-loop graph is bit-exact against the same round run
eagerly, and the CUDA engine agrees with the float64 reference up to explained divergences."""

from __future__ import annotations

import pytest
import torch

from iquest.fast.engine import FastEngine
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine, Request
from iquest.qualify.agreement import compare

from iquest.tests.test_fast_engine import PARAMS, PROMPTS, TINY, TOLERANCE, fast_dist, ref_dist, reference, tokens

pytestmark = pytest.mark.gpu


def _run(engine: RankEngine, prompt, seed, drafts, graphs: bool, n=48):
    req = Request(tuple(prompt), seed, PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, n, drafts, ())
    runner, graph = engine.runner(drafts, PARAMS.top_k)
    engine.start(req, runner)
    while not bool(engine.state.done):
        engine.decode_chunk(runner, graph if graphs else None)
    st = engine.state
    e = int(st.emitted)
    return st.log_tokens[:e].tolist(), st.log_rounds[: int(st.rounds)].tolist(), st.log_logprobs[:e].clone()


@pytest.mark.parametrize("drafts", [3, 7, "auto", 0])
def test_graph_replay_is_bit_exact_against_eager(drafts):
    engine = RankEngine(TINY, Parallel.single("cuda"), EngineOptions(max_context=512))
    for i, prompt in enumerate(PROMPTS):
        g_tok, g_rounds, g_lp = _run(engine, prompt, 50 + i, drafts, graphs=True)
        e_tok, e_rounds, e_lp = _run(engine, prompt, 50 + i, drafts, graphs=False)
        assert g_tok == e_tok and g_rounds == e_rounds  # same tokens and acceptance sequence
        assert torch.equal(g_lp, e_lp)                   # same values, bit for bit


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_engine_agrees_with_reference(dtype):
    engine = RankEngine(TINY, Parallel.single("cuda"), EngineOptions(max_context=512, dtype=dtype))
    from iquest.reference.speculative import generate

    for i, prompt in enumerate(PROMPTS):
        out_fast, _, _ = _run(engine, prompt, 70 + i, 5, graphs=True, n=40)
        out_ref = tokens(generate(reference(TINY), prompt, seed=70 + i, params=PARAMS, max_new_tokens=40, drafts=5))
        result = compare(prompt, out_fast, out_ref, fast_dist(engine), ref_dist(TINY), TOLERANCE[dtype])
        print(f"[cuda {dtype} prompt {i}] {result}")
        assert result.explained, str(result)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_on_two_gpus_agrees_with_tp1():
    single = RankEngine(TINY, Parallel.single("cuda"), EngineOptions(max_context=512, dtype="fp32"))
    one, _, _ = _run(single, PROMPTS[0], 5, 3, graphs=True, n=24)
    engine = FastEngine.load(TINY, tp=2, device="cuda", options=EngineOptions(max_context=512, dtype="fp32"))
    try:
        two = tokens(engine.generate(PROMPTS[0], seed=5, params=PARAMS, max_new_tokens=24, drafts=3))
    finally:
        engine.close()
    result = compare(PROMPTS[0], two, one, fast_dist(single), fast_dist(single), TOLERANCE["fp32"])
    print(f"[cuda tp=2] {result}")
    assert result.explained and result.agreed >= 20, str(result)


@pytest.mark.skipif(torch.cuda.device_count() < 8, reason="needs eight GPUs")
def test_tp8_on_eight_gpus_agrees_with_tp1():
    """Issue 8: the same tokens at TP=8 as at TP=1 on the fixture built for TP8, until an explained divergence."""
    tiny8 = TINY.parent / "tiny-tp8"
    single = RankEngine(tiny8, Parallel.single("cuda"), EngineOptions(max_context=512, dtype="fp32"))
    one, _, _ = _run(single, PROMPTS[0], 5, 3, graphs=True, n=24)
    engine = FastEngine.load(tiny8, tp=8, device="cuda", options=EngineOptions(max_context=512, dtype="fp32"))
    try:
        eight = tokens(engine.generate(PROMPTS[0], seed=5, params=PARAMS, max_new_tokens=24, drafts=3))
    finally:
        engine.close()
    result = compare(PROMPTS[0], eight, one, fast_dist(single), fast_dist(single), TOLERANCE["fp32"])
    print(f"[cuda tp=8] {result}")
    assert result.explained and result.agreed >= 20, str(result)
