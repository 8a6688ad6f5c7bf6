"""The round with its draws and accept step inside the sampling kernels (fast/round.py: RoundRunner.sample and
RoundRunner.accept through kernels/sample.py's global_sample and accept_settle) against the same round with those
two in their torch forms (fast/torch_ops.py: TorchOps.sample and TorchOps.accept, the rule written once), the rest
of the sampling kernels alike, through whole decodes; and the same way the depth controller's rule as one kernel
(kernels/depth_rule.py, RoundRunner.more) against its torch form (fast/depth_rule.py), under "auto", and a rank's part
of the model's own logprobs (kernels/logprobs.py) against its torch form (fast/sampler.logprob_parts).

The draws differ only in the order the cumulative sums (and the residual's normalizing sum) are added, so a draw
could differ only where its uniform lies within rounding of a boundary; the rule's score only in its entropy's sum,
so a decision could differ only for a score that close to its threshold. On these fixed seeds neither happens, and
the decodes must agree token for token and round for round, with logprobs equal on the GPU (libdevice's logf is
torch's log there) and within 1e-5 under the interpreter (NumPy's log). The fused paths are counted, so a decode
that silently fell back would fail. On CPU one short decode (4 tokens, a few rounds) runs interpreted for each side
(a few seconds each: kernels/testing.py reduces the top-k network's xor sums in NumPy); the GPU runs longer ones in
both dtypes.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from iquest.kernels.testing import worker_fixture

FUSED, PLAIN = "fused", "torch forms"
# (the ops compared, the kernel paths' call counters, ops both sides run as torch forms)
DRAWS = (("sample", "accept"), ("sample_draw", "accept"), ())
RULE = (("more",), ("depth_rule",), ("uniforms", "dist", "sample", "accept"))  # only the rule interpreted: seconds
LOGPROBS = (("model_logprobs",), ("logprob_parts",), ("uniforms", "dist", "sample", "accept", "more"))
# a rule under which the tiny model's draftings stop at every depth 3..7 (its default rule stops at 3 throughout)
DEEP_RULE = {"rule": "logistic", "weights": {"bias": 8.0, "log_running_product": 1.0, "entropy": -0.5},
             "threshold": 0.5}


def tiny_with(rule: dict, into: Path) -> Path:
    """The tiny model with `rule` as its depth controller, copied under `into`."""
    from iquest.tests.helpers import TINY

    model = shutil.copytree(TINY, into / "tiny")
    (model / "depth_controller.json").write_text(json.dumps(rule))
    return model


def round_decode(device: str, dtype: str, cases, n: int, ops=DRAWS, model: Path | None = None) -> dict:
    from iquest.fast.parallel import Parallel
    from iquest.fast.plan import KernelPlan
    from iquest.fast.rank import EngineOptions, EngineParts, RankEngine
    from iquest.tests.helpers import PROMPTS, TINY, fast_steps, torch_forms

    names, counters, common = ops
    out, calls = {}, {}
    for name, parts in ((FUSED, torch_forms(*common) if common else EngineParts()),
                        (PLAIN, torch_forms(*common, *names))):
        engine = RankEngine(model or TINY, Parallel.single(device),
                            EngineOptions(max_context=256, dtype=dtype, kernels=KernelPlan(sampling=True)), parts)
        out[name] = [[(s.tokens, s.logprobs, s.drafts, s.accepted) for s in
                      fast_steps(engine, PROMPTS[i], 40 + i, drafts, n=n)] for i, drafts in cases]
        calls[name] = [engine.model.ops.calls[c] for c in counters]
    fused, plain = out[FUSED], out[PLAIN]
    lp = max(abs(a - b) for r1, r2 in zip(fused, plain) for s1, s2 in zip(r1, r2) for a, b in zip(s1[1], s2[1]))
    return {"tokens_equal": [[s[0] for s in run] for run in fused] == [[s[0] for s in run] for run in plain],
            "rounds_equal": [[s[2:] for s in run] for run in fused] == [[s[2:] for s in run] for run in plain],
            "logprob_err": lp, "calls": calls, "depths": sorted({s[2] for run in fused for s in run})}


def rule_decode(device: str, dtype: str, cases, n: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        return round_decode(device, dtype, cases, n, RULE, tiny_with(DEEP_RULE, Path(d)))


def _check(r: dict, logprob_tol: float) -> None:
    assert "error" not in r, r.get("error")
    assert all(c > 0 for c in r["calls"][FUSED]), f"the fused paths did not run: {r['calls']}"
    assert not any(r["calls"][PLAIN]), r["calls"]
    assert r["tokens_equal"] and r["rounds_equal"], r
    assert r["logprob_err"] <= logprob_tol, r


interpreted = worker_fixture(__file__)


def test_interpreted_round_with_fused_draws_and_accept(interpreted):
    _check(interpreted["round"], 1e-5)


def test_interpreted_round_with_the_logprobs_part_as_one_kernel(interpreted):
    """A rank's part of the model's logprobs in one launch (kernels/logprobs.py) against the torch form: the same
    tokens and rounds (a logprob steers nothing), the logprobs within fp32 rounding of a log-sum-exp."""
    _check(interpreted["logprobs"], 1e-5)


def test_interpreted_round_with_the_rule_as_one_kernel(interpreted):
    r = interpreted["rule"]
    _check(r, 0.0)
    assert {3, 4, 5} <= set(r["depths"]), f"the rule's decisions went one way only: depths {r['depths']}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_round_with_fused_draws_and_accept(dtype):
    _check(round_decode("cuda", dtype, ((0, 3), (1, 7), (2, 5)), 40), 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_round_with_the_rule_as_one_kernel(dtype):
    r = rule_decode("cuda", dtype, ((0, "auto"), (1, "auto"), (2, "auto")), 40)
    _check(r, 0.0)
    assert {3, 4, 5} <= set(r["depths"]), r["depths"]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_round_with_the_logprobs_part_as_one_kernel(dtype):
    _check(round_decode("cuda", dtype, ((0, 3), (1, 7), (2, 5)), 40, LOGPROBS), 1e-5)


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

    worker_main([("round", lambda: round_decode("cpu", "fp32", ((0, 3),), 4)),
                 ("rule", lambda: rule_decode("cpu", "fp32", ((1, "auto"),), 12)),
                 ("logprobs", lambda: round_decode("cpu", "fp32", ((0, 3), (2, 5)), 8, LOGPROBS))])
