"""The fast engine against the float64 reference: decode agreement, tensor parallelism, ring wrap, rollback.

Agreement means: same tokens until the first divergence, and every divergence explained (both tokens
inside both engines' supports, target distributions within the tolerance). The counts of agreed
tokens are printed (pytest -s) so a reader sees how long the engines stay together.
"""

from __future__ import annotations

import pytest
import torch

from iquest.fast.engine import FastEngine
from iquest.fast.rank import EngineOptions, EngineParts, RankEngine, Request
from iquest.qualify.agreement import compare
from iquest.qualify.controls import ExactWindowRing, OpenCausalMask
from iquest.reference.speculative import generate
from iquest.tests.helpers import (MINI, PARAMS, PROMPTS, RING_SEQ, TINY, TINY_TP8, TOLERANCE, fast_dist, fast_steps,
                                  rank_engine, ref_dist, reference, tokens)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("drafts", [3, 7, "auto", 0])
def test_fast_agrees_with_reference(dtype, drafts):
    engine = rank_engine(TINY, dtype)
    agreed = total = 0
    for i, prompt in enumerate(PROMPTS):
        seed = 1000 + i
        out_fast = tokens(fast_steps(engine, prompt, seed, drafts))
        out_ref = tokens(generate(reference(TINY), prompt, seed=seed, params=PARAMS, max_new_tokens=40, drafts=drafts))
        result = compare(prompt, out_fast, out_ref, fast_dist(engine), ref_dist(TINY), TOLERANCE[dtype])
        print(f"[{dtype} drafts={drafts} prompt {i}] {result}")
        assert result.explained, str(result)
        agreed, total = agreed + result.agreed, total + result.total
    if dtype == "fp32":  # float32 is close enough to float64 that a divergence should be rare
        assert agreed >= 0.9 * total, f"only {agreed}/{total} tokens agree before divergence"


def test_fast_is_deterministic_and_seeded():
    engine = rank_engine(TINY)
    a = tokens(fast_steps(engine, PROMPTS[0], 5, 3))
    assert a == tokens(fast_steps(engine, PROMPTS[0], 5, 3))
    assert a != tokens(fast_steps(engine, PROMPTS[0], 6, 3))


def test_budget_and_stop_tokens():
    engine = rank_engine(TINY)
    steps = fast_steps(engine, PROMPTS[1], 9, 7, n=13)
    assert len(tokens(steps)) == 13
    out = tokens(fast_steps(engine, PROMPTS[1], 9, 7, n=40))
    stop = out[10]
    first = out.index(stop)
    req = Request(tuple(PROMPTS[1]), 9, PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, 40, 7, (stop,))
    stopped = list(engine.decode(req))
    assert tokens(stopped) == out[: first + 1]
    assert stopped[-1].stopped


# ---- ring wrap and rollback, at the model level ------------------------------------------------------
def block_errors(engine: RankEngine, seq: list[int], advance: list[int]) -> float:
    """Run 8-row verification blocks over `seq`, advancing by `advance[i]` rows after block i (so later
    blocks overwrite rejected rows), and return the worst relative logit error against the reference."""
    ref_logits, _ = reference(TINY).forward(torch.tensor(seq), torch.arange(len(seq)), reference(TINY).new_cache())
    engine.cache.reset()
    worst, n, i = 0.0, 0, 0
    toks = torch.tensor(seq)
    while n + 8 <= len(seq):
        pos = torch.arange(n, n + 8)
        logits, _ = engine.model.forward(toks[pos], pos, torch.ones(8, dtype=torch.bool))
        err = (logits.double() - ref_logits[pos]).abs().max() / ref_logits[pos].abs().max()
        worst = max(worst, float(err))
        n += advance[i % len(advance)]
        i += 1
    return worst


def test_ring_wrap_matches_reference_at_every_position():
    # Window 32: 220 positions wrap the ring ~5 times; advances of 1..8 rows mimic accept counts.
    assert block_errors(rank_engine(TINY), RING_SEQ, [1, 3, 8, 2, 5]) < 1e-4


def test_ring_of_exactly_w_slots_fails_the_ring_test():
    """Negative control: with W slots, rows written later in a block evict history of earlier rows."""
    assert block_errors(rank_engine(TINY, parts=EngineParts(cache=ExactWindowRing)), RING_SEQ, [1, 3, 8, 2, 5]) > 1e-2


POISON = 1e4


def rollback_errors(engine: RankEngine, seq: list[int], widths: list[int], accepts: list[int]) -> float:
    """Verification blocks of `widths[i]` live rows (padding to 8), settling `accepts[i]`+1 rows; after
    each settle the KV of rejected rows (positions >= the settled length) is overwritten with huge
    values. Returns the worst relative logit error of live rows against the reference."""
    model = reference(TINY)
    ref_logits, _ = model.forward(torch.tensor(seq), torch.arange(len(seq)), model.new_cache())
    engine.cache.reset()
    toks, worst, n, i = torch.tensor(seq), 0.0, 0, 0
    while n + 8 <= len(seq):
        width, a = widths[i % len(widths)], accepts[i % len(accepts)]
        pos = torch.arange(n, n + 8)
        live = torch.arange(8) < width
        logits, _ = engine.model.forward(toks[pos], pos, live)
        err = (logits.double()[:width] - ref_logits[pos[:width]]).abs().max() / ref_logits[pos].abs().max()
        worst = max(worst, float(err))
        n += min(a, width - 1) + 1
        for kv in engine.cache.layers[:-1]:
            stale = kv.slot_pos >= n
            kv.k[stale] = POISON
            kv.v[stale] = POISON
        i += 1
    return worst


@pytest.mark.parametrize("parts,caught", [(EngineParts(), False), (EngineParts(cache=OpenCausalMask), True)])
def test_rollback_never_reads_rejected_kv(parts, caught):
    """Rounds of varying width leave rejected rows' KV past the next block; reading any of it would
    bring the poison in. Negative control: an open causal mask does read it and must be caught."""
    err = rollback_errors(rank_engine(TINY, parts=parts), RING_SEQ, [8, 4, 6, 5, 8], [6, 0, 2, 1, 3])
    assert (err > 1e-2) if caught else (err < 1e-4), err


def test_decode_loop_unaffected_by_poisoned_rejected_rows():
    """The real round: after each settle, poison every main-layer slot past the settled length."""
    engine = rank_engine(TINY)
    clean = tokens(fast_steps(engine, PROMPTS[2], 21, 7))
    runner, _ = engine.runner(7, PARAMS.top_k)
    original, hits = runner.round, [0]

    def poisoned():
        original()
        for kv in engine.cache.layers[:-1]:
            stale = kv.slot_pos >= engine.state.n
            hits[0] += int(stale.sum())
            kv.k[stale] = POISON
            kv.v[stale] = POISON
    runner.round = poisoned
    try:
        assert tokens(fast_steps(engine, PROMPTS[2], 21, 7)) == clean
    finally:
        runner.round = original
    assert hits[0] > 100, "rejected rows must exist for the poison to mean anything"


# ---- tensor parallelism (processes with gloo) -------------------------------------------------------
def _tp_tokens(model_dir, tp: int, prompt, seed, drafts, n=24) -> list[int]:
    engine = FastEngine.load(model_dir, tp=tp, device="cpu", options=EngineOptions(max_context=256, dtype="fp32"))
    try:
        return tokens(engine.generate(prompt, seed=seed, params=PARAMS, max_new_tokens=n, drafts=drafts))
    finally:
        engine.close()


@pytest.mark.parametrize("model_dir,tp", [(TINY, 2), (TINY_TP8, 8)])
def test_tensor_parallel_agrees_with_tp1(model_dir, tp):
    prompt = PROMPTS[0]
    single = tokens(fast_steps(rank_engine(model_dir), prompt, 77, 3, n=24))
    multi = _tp_tokens(model_dir, tp, prompt, 77, 3)
    # Ranks only change reduction order, so the single-rank engine's distributions stand in for the
    # multi-rank ones when explaining a divergence (both tokens must lie in the support).
    result = compare(prompt, multi, single, fast_dist(rank_engine(model_dir)), fast_dist(rank_engine(model_dir)),
                     TOLERANCE["fp32"])
    print(f"[tp={tp}] {result}")
    assert result.explained, str(result)
    assert result.agreed >= 20


# ---- the trained mini model: real routing and real acceptance ------------------------------------------
MINI_PROMPTS = ["def parse_args(argv):\n    ", "class Cache:\n    def __init__(self, size):\n        self.",
                "import os\n\ndef walk(top):\n    \"\"\"Yield every file under top.\"\"\"\n"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("drafts", [5, "auto"])
def test_fast_agrees_with_reference_on_the_mini_model(dtype, drafts):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MINI / "tokenizer.json"))
    engine = rank_engine(MINI, dtype)
    agreed = total = accepted = 0
    for i, text in enumerate(MINI_PROMPTS):
        prompt = tok.encode(text).ids
        steps = fast_steps(engine, prompt, 300 + i, drafts, n=48)
        out_ref = tokens(generate(reference(MINI), prompt, seed=300 + i, params=PARAMS, max_new_tokens=48,
                                  drafts=drafts))
        result = compare(prompt, tokens(steps), out_ref, fast_dist(engine), ref_dist(MINI), TOLERANCE[dtype])
        print(f"[mini {dtype} drafts={drafts} prompt {i}] {result}")
        assert result.explained, str(result)
        agreed, total = agreed + result.agreed, total + result.total
        accepted += sum(s.accepted for s in steps)
    assert accepted > 0, "the trained draft layer must get drafts accepted (else acceptance paths went untested)"
    if dtype == "fp32":
        assert agreed >= 0.9 * total, f"only {agreed}/{total} tokens agree before divergence"
