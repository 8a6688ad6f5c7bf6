"""The round with its draws and accept step inside the sampling kernels (fast/round.py: RoundRunner.sample and
RoundRunner.accept through kernels/sample.py's global_sample and accept_settle) against the same round with those
two in their torch forms (fast/torch_ops.py: TorchOps.sample and TorchOps.accept, the rule written once), the rest
of the sampling kernels alike, through whole decodes.

The two differ only in the order the draws' cumulative sums (and the residual's normalizing sum) are added, so a
draw could differ only where its uniform lies within rounding of a boundary; on these fixed seeds none does, and
the decodes must agree token for token and round for round, with logprobs equal on the GPU (libdevice's logf is
torch's log there) and within 1e-5 under the interpreter (NumPy's log). The fused paths are counted, so a decode
that silently fell back would fail. On CPU one short decode (4 tokens, a few rounds) runs interpreted for each side
(a few seconds each: kernels/testing.py reduces the top-k network's xor sums in NumPy); the GPU runs longer ones in
both dtypes.
"""

from __future__ import annotations

import sys

import pytest

from iquest.kernels.testing import worker_fixture

FUSED, PLAIN = "fused", "torch sample and accept"


def round_decode(device: str, dtype: str, cases, n: int) -> dict:
    from iquest.fast.parallel import Parallel
    from iquest.fast.plan import KernelPlan
    from iquest.fast.rank import EngineOptions, EngineParts, RankEngine
    from iquest.tests.helpers import PROMPTS, TINY, fast_steps, torch_forms

    out, calls = {}, {}
    for name, parts in ((FUSED, EngineParts()), (PLAIN, torch_forms("sample", "accept"))):
        engine = RankEngine(TINY, Parallel.single(device),
                            EngineOptions(max_context=256, dtype=dtype, kernels=KernelPlan(sampling=True)), parts)
        out[name] = [[(s.tokens, s.logprobs, s.drafts, s.accepted) for s in
                      fast_steps(engine, PROMPTS[i], 40 + i, drafts, n=n)] for i, drafts in cases]
        calls[name] = [engine.model.ops.calls["sample_draw"], engine.model.ops.calls["accept"]]
    fused, plain = out[FUSED], out[PLAIN]
    lp = max(abs(a - b) for r1, r2 in zip(fused, plain) for s1, s2 in zip(r1, r2) for a, b in zip(s1[1], s2[1]))
    return {"tokens_equal": [[s[0] for s in run] for run in fused] == [[s[0] for s in run] for run in plain],
            "rounds_equal": [[s[2:] for s in run] for run in fused] == [[s[2:] for s in run] for run in plain],
            "logprob_err": lp, "calls": calls}


def _check(r: dict, logprob_tol: float) -> None:
    assert "error" not in r, r.get("error")
    assert r["calls"][FUSED][0] > 0 and r["calls"][FUSED][1] > 0, f"the fused paths did not run: {r['calls']}"
    assert r["calls"][PLAIN] == [0, 0], r["calls"]
    assert r["tokens_equal"] and r["rounds_equal"], r
    assert r["logprob_err"] <= logprob_tol, r


interpreted = worker_fixture(__file__)


def test_interpreted_round_with_fused_draws_and_accept(interpreted):
    _check(interpreted["round"], 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_round_with_fused_draws_and_accept(dtype):
    _check(round_decode("cuda", dtype, ((0, 3), (1, 7), (2, 5)), 40), 0.0)


@pytest.mark.gpu
def test_cuda_round_check_catches_a_broken_accept(monkeypatch):
    """Negative control: an accept kernel whose new token is off by one id must fail the comparison, on a decode in
    which it ran."""
    from iquest.kernels import sample

    original = sample.accept_settle

    def broken(*args, **kwargs):
        import torch

        r = dict(original(*args, **kwargs))  # captured into the decode graph: device ops only, no host read
        rows = torch.arange(r["emitted"].shape[0], device=r["emitted"].device)
        r["token"] = r["token"] + 1
        r["emitted"] = torch.where(rows == r["a"], r["emitted"] + 1, r["emitted"])
        return r

    monkeypatch.setattr(sample, "accept_settle", broken)
    r = round_decode("cuda", "bf16", ((0, 3),), 16)
    assert r["calls"][FUSED][1] > 0
    with pytest.raises(AssertionError):
        _check(r, 0.0)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([("round", lambda: round_decode("cpu", "fp32", ((0, 3),), 4))])
