"""The fast engine with the Triton kernels (`EngineOptions(kernels="triton")`) against its torch fallback.

On CPU the kernels run under Triton's interpreter, in a worker subprocess (TRITON_INTERPRET is read
when triton is imported); on a GPU they run compiled, inside the captured decode loop.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine
from iquest.qualify.agreement import compare
from iquest.tests.test_fast_engine import PROMPTS, TINY, TOLERANCE, fast_dist, fast_steps, tokens

CASES = [(0, 3), (1, "auto")]  # (prompt index, drafts)
N_TOKENS = 12


def decode(kernels: str, device: str = "cpu", dtype: str = "fp32") -> dict:
    engine = RankEngine(TINY, Parallel.single(device), EngineOptions(max_context=256, dtype=dtype, kernels=kernels))
    out = {}
    for i, drafts in CASES:
        steps = fast_steps(engine, PROMPTS[i], 40 + i, drafts, n=N_TOKENS)
        out[f"{i}-{drafts}"] = {"tokens": tokens(steps), "rounds": [(s.drafts, s.accepted) for s in steps]}
    return out


@pytest.mark.slow
def test_interpreted_kernels_decode_like_the_torch_fallback():
    from iquest.kernels.testing import run_worker

    got = run_worker(os.path.abspath(__file__))["decode"]
    assert "error" not in got, got.get("error")
    torch_engine = RankEngine(TINY, Parallel.single(), EngineOptions(max_context=256, dtype="fp32"))
    want = decode("torch")
    for i, drafts in CASES:
        key = f"{i}-{drafts}"
        # The interpreted kernels' own distributions are not available in this process: the fallback's
        # stand in for both sides (fp32 kernels differ from it by rounding only), so only support is checked.
        result = compare(PROMPTS[i], got[key]["tokens"], want[key]["tokens"], fast_dist(torch_engine),
                         fast_dist(torch_engine), TOLERANCE["fp32"])
        print(f"[interpreted kernels, {key}] {result}")
        assert result.explained and result.agreed >= N_TOKENS // 2, str(result)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_kernels_decode_like_the_torch_fallback(dtype):
    got, want = decode("triton", "cuda", dtype), decode("torch", "cuda", dtype)
    # Each side's divergence is explained with its own engine's distributions.
    with_kernels, fallback = (RankEngine(TINY, Parallel.single("cuda"),
                                         EngineOptions(max_context=256, dtype=dtype, kernels=k)) for k in ("triton", "torch"))
    for i, drafts in CASES:
        key = f"{i}-{drafts}"
        result = compare(PROMPTS[i], got[key]["tokens"], want[key]["tokens"], fast_dist(with_kernels),
                         fast_dist(fallback), TOLERANCE[dtype])
        print(f"[cuda kernels {dtype}, {key}] {result}")
        assert result.explained, str(result)


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    torch.set_num_threads(1)
    worker_main([("decode", lambda: decode("triton"))])
