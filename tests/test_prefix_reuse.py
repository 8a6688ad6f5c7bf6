"""Prefix reuse (issue 51) at the engine level: a request that takes up the prefix it shares with the last one emits
the tokens and logprobs of a full prefill, bit for bit, plain and speculative, fp32 and bf16, over rings that wrap.

The tiny fixture's target window is 32 (rings of 96 slots) and its draft's 16 (80): a 127-token first turn wraps both
during its own prefill. A negative control that skips restoring the rings' copies must come out different.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from iquest.fast.cache import RingSnapshot
from iquest.fast.engine import FastEngine
from iquest.fast.rank import PREFILL_BLOCK, EngineOptions, EngineParts
from iquest.tests.helpers import PARAMS, TINY, rank_engine, request

FIRST = [int(x) for x in torch.randint(1, 512, (127,), generator=torch.Generator().manual_seed(51))]
EXTRA = [int(x) for x in torch.randint(1, 512, (20,), generator=torch.Generator().manual_seed(52))]


class NoRestore(RingSnapshot):
    """Negative control: the rings are left as the last decode left them."""

    def restore(self, cache, layers) -> None:
        pass


def run(engine, prompt, seed, drafts, n, reuse: bool):
    """(tokens, logprob bits, positions reused); with `reuse` the engine takes what the last kept prefix offers and
    keeps this one, without it a full prefill that keeps nothing."""
    cached = engine.reusable(prompt, bool(drafts)) if reuse else 0
    steps = list(engine.decode(replace(request(prompt, seed, drafts, n), reuse=cached, keep_prefix=reuse)))
    toks = [t for s in steps for t in s.tokens]
    bits = np.array([lp for s in steps for lp in s.logprobs], dtype=np.float32).view(np.int32).tolist()
    return toks, bits, cached


def cold(engine, prompt, seed, drafts, n):
    return run(engine, prompt, seed, drafts, n, reuse=False)[:2]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("drafts", [0, 3])
def test_next_turn_reuses_the_prefix_exactly(dtype, drafts):
    """Turn 2 = turn 1's prompt + its reply + more: the whole blocks of turn 1's prompt are reused, and the result is
    a full prefill's; a third turn reuses the second's (a chain)."""
    engine = rank_engine(TINY, dtype)
    reply, _, _ = run(engine, FIRST, 3, drafts, 8, reuse=True)
    second = FIRST + reply + EXTRA
    toks, bits, cached = run(engine, second, 4, drafts, 8, reuse=True)
    assert cached == (len(FIRST) - 1) // PREFILL_BLOCK * PREFILL_BLOCK == 64
    third = second + toks + EXTRA
    toks3, bits3, cached3 = run(engine, third, 5, drafts, 8, reuse=True)
    assert cached3 == 128
    assert (toks, bits) == cold(engine, second, 4, drafts, 8)
    assert (toks3, bits3) == cold(engine, third, 5, drafts, 8)


def test_reuse_without_the_ring_copies_differs():
    """Negative control: the reused full layers alone are not enough once decode has overwritten ring slots that the
    second turn's first rows read."""
    engine = rank_engine(TINY, "fp32", EngineParts(snapshot=NoRestore))
    reply, _, _ = run(engine, FIRST, 3, 3, 8, reuse=True)
    second = FIRST + reply + EXTRA
    toks, bits, cached = run(engine, second, 4, 3, 8, reuse=True)
    assert cached == 64
    assert (toks, bits) != cold(engine, second, 4, 3, 8)


def test_what_a_prompt_shares_decides_the_reuse_and_it_stays_exact():
    """Nothing shared or a divergence before the first block: a full prefill. The same prompt again, or a shorter one
    inside the last: its whole blocks. A divergence long before the end of a long last prompt: its rings no longer hold
    the window there, so a full prefill. A plain turn keeps no draft KV: a speculative one after it prefills it all."""
    engine = rank_engine(TINY)
    other = [(t * 7 + 1) % 511 + 1 for t in FIRST]
    long = FIRST + EXTRA * 8  # 287 tokens
    cases = [(FIRST, other, 0), (FIRST, FIRST[:40] + other[40:], 0), (FIRST, FIRST, 64), (FIRST, FIRST[:100], 64),
             (long, long[:100] + other[:60], 0), (long, long[:260] + other[:9], 256)]
    for i, (before, now, want) in enumerate(cases):
        run(engine, before, 10 + i, 3, 4, reuse=True)
        got = run(engine, now, 20 + i, 3, 4, reuse=True)
        assert got[2] == want, i
        assert got[:2] == cold(engine, now, 20 + i, 3, 4), i
    # a chain through a shorter prompt: the second leaves the first's KV past its end in the rings, which the third
    # must neither read nor miss
    chain = [FIRST, FIRST[:100], FIRST[:100] + EXTRA * 2]
    for i, prompt in enumerate(chain):
        got = run(engine, prompt, 30 + i, 3, 4, reuse=True)
        assert got[2] == (64 if i else 0), i
    assert got[:2] == cold(engine, chain[-1], 32, 3, 4)
    run(engine, FIRST, 1, 0, 4, reuse=True)
    assert engine.reusable(FIRST + EXTRA, True) == 0 and engine.reusable(FIRST + EXTRA, False) == 64


def test_a_reset_or_an_unkept_prefill_drops_the_prefix():
    engine = rank_engine(TINY)
    run(engine, FIRST, 1, 0, 2, reuse=True)
    assert engine.reusable(FIRST, False) == 64
    engine.cache.reset()  # what a debugging prefill (qualify) does before writing the caches itself
    assert engine.reusable(FIRST, False) == 0
    run(engine, FIRST, 1, 0, 2, reuse=True)
    cold(engine, FIRST, 1, 0, 2)
    assert engine.reusable(FIRST, False) == 0
    assert engine.snapshot_bytes > 0


def test_tp2_reuses_exactly():
    """Every rank restores its own rings and prefills the same suffix: turn 2 at TP 2 is a full prefill's."""
    engine = FastEngine.load(TINY, tp=2, device="cpu", options=EngineOptions(max_context=256, dtype="fp32"))
    try:
        def gen(prompt, reuse):
            steps = list(engine.generate(prompt, seed=4, params=PARAMS, max_new_tokens=6, drafts=3,
                                         prefix_reuse=reuse))
            return [t for s in steps for t in s.tokens], [lp for s in steps for lp in s.logprobs]

        reply, _ = gen(FIRST, True)
        second = FIRST + reply + EXTRA
        assert engine.cached_prefix(second, 3) == 64
        warm = gen(second, True)
        assert engine.cached_prefix(second, 3) == 128  # this turn kept its own prefix (153 tokens)
        assert warm == gen(second, False)
        assert engine.cached_prefix(second, 3) == 0  # a request that keeps nothing leaves nothing
    finally:
        engine.close()
