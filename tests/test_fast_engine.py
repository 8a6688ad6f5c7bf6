"""The fast engine against the float64 reference: decode agreement, tensor parallelism, ring wrap, rollback, weight
formats, and a fixture at the published dimensions.

At fp32 on the CPU the fast engine reproduces the reference's tokens exactly (plain and speculative, every depth
policy, several prompts and seeds, TP 1, 2 and 8): the same uniforms and probabilities within ~1e-6 of float64 decide
the same tokens, so any difference is a defect. At bf16 the engines may part at a decision boundary: agreement then
means the same tokens until the first divergence, and that divergence explained (both tokens inside both engines'
supports, target distributions within the tolerance). The counts are printed (pytest -s).
"""

from __future__ import annotations

import time
from functools import lru_cache

import pytest
import torch

from iquest.fast.cache import LayerKV, StaticKV
from iquest.fast.engine import FastEngine
from iquest.fast.rank import EngineOptions, EngineParts, RankEngine, Request
from iquest.qualify.agreement import compare
from iquest.reference.speculative import generate
from iquest.tests.helpers import (PARAMS, PROMPTS, RING_SEQ, TINY, TINY_TP8, TOLERANCE, fast_dist, fast_steps,
                                  fixture_dir, mini_or_skip, rank_engine, ref_dist, reference, tokens)

SEEDS = (1000, 1001)


def ref_steps(model_dir, prompt, seed, drafts, n=40):
    return list(_ref_steps(model_dir, tuple(prompt), seed, drafts, n))


@lru_cache(maxsize=None)
def _ref_steps(model_dir, prompt: tuple, seed, drafts, n) -> tuple:
    """The float64 reference's rounds, decoded once a module for each request: it is seeded and deterministic, and
    several tests hold the fast engine to the same request (the fp32 and bf16 tests share a seed a prompt, the mini
    model's fp32 and bf16 tests every request). Its Steps are only read."""
    return tuple(generate(reference(model_dir), list(prompt), seed=seed, params=PARAMS, max_new_tokens=n,
                          drafts=drafts))


def rounds(steps) -> list[tuple]:
    """Each round's record: (tokens, drafts verified, drafts accepted, bonus)."""
    return [(s.tokens, s.drafts, s.accepted, s.bonus) for s in steps]


# ---- fp32: the reference's tokens, round for round -------------------------------------------------------------
@pytest.mark.parametrize("drafts", [0, 3, 7, "auto"])
def test_fp32_reproduces_the_reference(drafts):
    """Every prompt and seed: the same rounds (tokens, drafts, accepted, bonus) and logprobs within fp32 rounding."""
    engine = rank_engine(TINY)
    spec = 0
    for i, prompt in enumerate(PROMPTS):
        for seed in SEEDS:
            got, want = fast_steps(engine, prompt, seed + i, drafts), ref_steps(TINY, prompt, seed + i, drafts)
            assert rounds(got) == rounds(want), f"prompt {i} seed {seed + i}"
            lp_got, lp_want = [x for s in got for x in s.logprobs], [x for s in want for x in s.logprobs]
            assert max(abs(a - b) for a, b in zip(lp_got, lp_want)) < 1e-4
            spec += sum(s.accepted for s in got)
    if drafts:  # the accept, replacement and bonus paths all ran
        assert spec > 0


@pytest.mark.parametrize("drafts", [3, "auto", 0])
def test_bf16_agrees_with_the_reference(drafts):
    """bf16 activations on a random MoE with flat 20-token distributions part early (tests/helpers.py, TOLERANCE): each
    divergence must be explained."""
    engine = rank_engine(TINY, "bf16")
    for i, prompt in enumerate(PROMPTS):
        seed = 1000 + i
        out_fast = tokens(fast_steps(engine, prompt, seed, drafts))
        out_ref = tokens(ref_steps(TINY, prompt, seed, drafts))
        result = compare(prompt, out_fast, out_ref, fast_dist(engine), ref_dist(TINY), TOLERANCE["bf16"])
        print(f"[bf16 drafts={drafts} prompt {i}] {result}")
        assert result.explained, str(result)


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
class ExactWindowRing(StaticKV):
    """Negative control: sliding-window rings of exactly W slots, no spare slots."""

    ring_slack = 0


class _OpenMaskKV(LayerKV):
    causal = False


class OpenCausalMask(StaticKV):
    """Negative control: every row of a block sees the whole block, later rows (and rejected KV) included."""

    layer_kv = _OpenMaskKV


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
    """The real round: after each settle, poison every slot past the settled length in the target's layers and in the
    draft's (whose rows past the last committed position hold KV written from draft hiddens: depth 0 rewrites it)."""
    engine = rank_engine(TINY)
    clean = tokens(fast_steps(engine, PROMPTS[2], 21, 7))
    runner, _ = engine.runner(7, PARAMS.top_k)
    original, hits = runner.round, [0, 0]

    def poisoned():
        original()
        for i, kv in enumerate(engine.cache.layers):
            stale = kv.slot_pos >= engine.state.n
            hits[i == len(engine.cache.layers) - 1] += int(stale.sum())
            kv.k[stale] = POISON
            kv.v[stale] = POISON
    runner.round = poisoned
    try:
        assert tokens(fast_steps(engine, PROMPTS[2], 21, 7)) == clean
    finally:
        runner.round = original
    assert hits[0] > 100 and hits[1] > 10, "rejected rows must exist for the poison to mean anything"


def test_draft_rows_read_the_target_hidden_at_their_own_position():
    """docs/model.md: the draft row at p reads h_p and x_{p+1}. The engine's depth-0 rows against the reference's
    draft over the same (hidden, token) pairs, and against the shifted pairing (h_{p-1}, x_p) of the earlier design,
    which must differ."""
    engine, ref = rank_engine(TINY), reference(TINY)
    seq = torch.tensor(PROMPTS[0])
    m = len(seq)
    cache = ref.new_cache()
    _, hidden = ref.forward(seq, torch.arange(m), cache)
    want, _ = ref.draft(seq[1:], hidden[:-1], torch.arange(m - 1), cache)
    engine.cache.reset()
    pos = torch.arange(m)
    _, h = engine.model.forward(seq, pos, torch.ones(m, dtype=torch.bool))
    got, _ = engine.model.draft(seq[1:], h[:-1], pos[:-1], torch.ones(m - 1, dtype=torch.bool))
    assert (got.double() - want).abs().max() / want.abs().max() < 1e-4
    shifted, _ = ref.draft(seq[1:], torch.cat([hidden[:1], hidden[:-2]]), torch.arange(m - 1), ref.new_cache())
    assert (shifted - want).abs().max() / want.abs().max() > 1e-2


# ---- weight formats ---------------------------------------------------------------------------------------
def test_a_bf16_checkpoint_runs_as_stored_or_quantized_at_load():
    """A BF16 checkpoint as BF16 reproduces the reference (which reads the same bf16 values); quantized at load to
    FP8 it computes a different model (E4M3 values), the same one at every TP degree (each rank quantizes the whole
    blocks its slice touches)."""
    bf16 = fixture_dir("tiny", "bf16")
    plain = RankEngine(bf16, _single(), EngineOptions(max_context=256, dtype="fp32", weights="bf16"))
    assert plain.model.w.format == "bf16" and not plain.model.w.layers[0].attn.wq.quantized
    for drafts in (0, 3):
        got, want = fast_steps(plain, PROMPTS[0], 7, drafts, n=24), ref_steps(bf16, PROMPTS[0], 7, drafts, n=24)
        assert rounds(got) == rounds(want)
    quant = RankEngine(bf16, _single(), EngineOptions(max_context=256, dtype="fp32", weights="fp8"))
    assert quant.model.w.format == "fp8" and quant.model.w.layers[1].mlp.gate.quantized
    assert not torch.equal(quant.model.w.layers[0].attn.wq.dense(), plain.model.w.layers[0].attn.wq.dense())
    one = tokens(fast_steps(quant, PROMPTS[0], 7, 3, n=24))
    two = _tp_tokens(bf16, 2, PROMPTS[0], 7, 3, weights="fp8")
    assert one == two
    from iquest.reference.config import ConfigError

    with pytest.raises(ConfigError, match="--weights bf16"):
        RankEngine(TINY, _single(), EngineOptions(max_context=64, dtype="fp32", weights="bf16"))


def _single():
    from iquest.fast.parallel import Parallel

    return Parallel.single()


# ---- tensor parallelism (processes with gloo) -------------------------------------------------------
def _tp_tokens(model_dir, tp: int, prompt, seed, drafts, n=24, weights="auto") -> list[int]:
    engine = FastEngine.load(model_dir, tp=tp, device="cpu",
                             options=EngineOptions(max_context=256, dtype="fp32", weights=weights))
    try:
        return tokens(engine.generate(prompt, seed=seed, params=PARAMS, max_new_tokens=n, drafts=drafts))
    finally:
        engine.close()


def test_cpu_ranks_fork_from_a_server_and_cuda_ranks_spawn():
    """CPU ranks start from a fork server that imported the engine once (where the platform has one); CUDA cannot
    be forked into, so its ranks spawn a fresh interpreter each."""
    import multiprocessing

    from iquest.fast.engine import _rank_processes

    assert _rank_processes("cuda").get_start_method() == "spawn"
    server = "forkserver" in multiprocessing.get_all_start_methods()
    assert _rank_processes("cpu").get_start_method() == ("forkserver" if server else "spawn")


def test_tp2_reproduces_the_reference():
    """One TP 2 engine (a process holds one process group at a time), plain and speculative, two prompts and seeds."""
    engine = FastEngine.load(TINY, tp=2, device="cpu", options=EngineOptions(max_context=256, dtype="fp32"))
    try:
        for drafts in (0, 3, "auto"):
            for i, seed in enumerate((77, 78)):
                got = list(engine.generate(PROMPTS[i], seed=seed, params=PARAMS, max_new_tokens=24, drafts=drafts))
                assert rounds(got) == rounds(ref_steps(TINY, PROMPTS[i], seed, drafts, n=24)), (drafts, seed)
    finally:
        engine.close()


def test_tp8_reproduces_the_reference():
    """tiny-tp8 at 8 ranks: KV heads replicated 2x, expert shards starting inside their 16-row scale blocks, the
    draft's eh_proj split over embedding and hidden columns. One speculative request (~40 s on 2 cores)."""
    t0 = time.monotonic()
    got = _tp_tokens(TINY_TP8, 8, PROMPTS[0], 77, 3)
    assert got == tokens(ref_steps(TINY_TP8, PROMPTS[0], 77, 3, n=24))
    print(f"[tp8] {time.monotonic() - t0:.0f} s")


# ---- the published dimensions ----------------------------------------------------------------------------
@pytest.mark.slow
def test_published_dimensions_load_and_agree_at_tp1_and_tp8(monkeypatch):
    """fixtures/make.py's published-small preset: hidden 3072, 48 query heads of 128 with partial RoPE over 32 dims,
    8 KV heads, experts 1536 wide (192 rows a rank at TP 8: 128-row FP8 blocks shared by two ranks), the dense MLP
    12288 wide, window 4096 and the draft's 512; 2 layers, 4 experts. TP 1 and TP 8 (gloo) emit the same tokens, plain
    and speculative."""
    from iquest.fast import weights

    model = fixture_dir("published-small")
    # TP 1 in this process: keep every dequantized weight (the same values) instead of rebuilding the large ones per
    # call; the TP 8 ranks' slices are small enough to be kept anyway
    monkeypatch.setattr(weights, "KEEP_DENSE_BYTES", 1 << 30)
    prompt, seed, n = PROMPTS[0][:12], 5, 8
    t0 = time.monotonic()
    one = FastEngine.load(model, tp=1, device="cpu", options=EngineOptions(max_context=64, dtype="fp32"))
    try:
        single = {d: tokens(one.generate(prompt, seed=seed, params=PARAMS, max_new_tokens=n, drafts=d))
                  for d in (0, 3)}
    finally:
        one.close()
    t1 = time.monotonic()
    eight = FastEngine.load(model, tp=8, device="cpu", options=EngineOptions(max_context=64, dtype="fp32"))
    try:
        multi = {d: tokens(eight.generate(prompt, seed=seed, params=PARAMS, max_new_tokens=n, drafts=d))
                 for d in (0, 3)}
    finally:
        eight.close()
    print(f"[published-small] tp1 {t1 - t0:.0f} s, tp8 {time.monotonic() - t1:.0f} s: {single}")
    assert multi == single and all(len(v) == n for v in single.values())


# ---- the trained mini model: real routing and real acceptance ------------------------------------------
MINI_PROMPTS = ["def parse_args(argv):\n    ", "class Cache:\n    def __init__(self, size):\n        self.",
                "import os\n\ndef walk(top):\n    \"\"\"Yield every file under top.\"\"\"\n"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("drafts", [5, "auto"])
def test_fast_agrees_with_reference_on_the_mini_model(dtype, drafts):
    from tokenizers import Tokenizer

    mini = mini_or_skip()
    tok = Tokenizer.from_file(str(mini / "tokenizer.json"))
    engine = rank_engine(mini, dtype)
    agreed = total = accepted = 0
    for i, text in enumerate(MINI_PROMPTS):
        prompt = tok.encode(text).ids
        steps = fast_steps(engine, prompt, 300 + i, drafts, n=48)
        out_ref = tokens(ref_steps(mini, prompt, 300 + i, drafts, n=48))
        result = compare(prompt, tokens(steps), out_ref, fast_dist(engine), ref_dist(mini), TOLERANCE[dtype])
        print(f"[mini {dtype} drafts={drafts} prompt {i}] {result}")
        assert result.explained, str(result)
        agreed, total = agreed + result.agreed, total + result.total
        accepted += sum(s.accepted for s in steps)
    assert accepted > 0, "the trained draft layer must get drafts accepted (else acceptance paths went untested)"
    if dtype == "fp32":
        assert agreed == total, f"only {agreed}/{total} tokens agree"


def test_the_controller_decides_only_where_a_branch_reads_it(monkeypatch):
    """Under the controller, a drafting that stops at depth d (3..7) evaluates the rule and a device condition
    min(d, 6) - 2 times each (depths 3.. decide; depth d+1's condition sits inside depth d's branch): one each at
    depth 3, where a condition a depth 4..7 every drafting cost four condition kernels and graph nodes."""
    from iquest.fast.flow import EagerFlow
    from iquest.fast.round import RoundRunner

    mini = mini_or_skip()
    conditions, rule_depths = [0], []
    when, more = EagerFlow.when, RoundRunner.more

    def counted_when(self, flag, body):
        conditions[0] += 1
        return when(self, flag, body)

    def recorded_more(self, depth, served, probs):
        rule_depths.append(depth)
        return more(self, depth, served, probs)

    monkeypatch.setattr(EagerFlow, "when", counted_when)
    monkeypatch.setattr(RoundRunner, "more", recorded_more)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(mini / "tokenizer.json"))
    engine = rank_engine(mini)
    verified, slack = [], 0
    for i, text in enumerate(MINI_PROMPTS):
        steps = fast_steps(engine, tok.encode(text).ids, 300 + i, "auto", n=64)
        verified += [s.drafts for s in steps if s.drafts]  # the draftings whose rows a round verified
        slack += 4  # the drafting after a request's last round is not verified: at most four more
    assert min(verified) >= 3 and max(verified) > 3, verified  # deeper depths reached
    expected = sum(min(d, 6) - 2 for d in verified)
    assert expected <= conditions[0] <= expected + slack, (conditions[0], verified)
    assert expected <= len(rule_depths) <= expected + slack and min(rule_depths) >= 3, rule_depths
