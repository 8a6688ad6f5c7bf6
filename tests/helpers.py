"""What the tests share: the fixtures, prompts and sampling parameters, the decode helpers, and the tolerance of an
explained divergence. Test modules import these from here, never from one another."""

from __future__ import annotations

import atexit
import inspect
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from iquest.fast.parallel import Parallel
from iquest.fast.plan import KernelPlan
from iquest.fast.rank import EngineOptions, EngineParts, RankEngine, Request
from iquest.fast.weights import WeightLoader
from iquest.qualify.checks import fast_prefill_dist
from iquest.reference import sampling
from iquest.reference.model import ReferenceModel
from iquest.reference.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
MINI = ROOT / "fixtures" / "iquest-q1-mini"


def in_published_layout(model_dir: Path) -> bool:
    """Does the folder hold a checkpoint in the published layout (config and the draft's mtp/ that loads)?"""
    from iquest.reference.config import Config, ConfigError

    try:
        Config.from_dir(model_dir)
    except (ConfigError, OSError, ValueError, KeyError):
        return False
    return True


@lru_cache(maxsize=None)
def fixture_dir(preset: str, weights: str = "fp8") -> Path:
    """A fixtures/make.py preset's model folder: the shipped fixtures/<preset> when it is in the published layout and
    is the FP8 form, else the preset made once per process into a temporary folder (removed at exit). make_fixture is
    deterministic, so every process (and every spawned TP rank, which reads the folder it is given) sees the same
    weights."""
    from iquest.fixtures.make import make_fixture

    shipped = ROOT / "fixtures" / preset
    if weights == "fp8" and in_published_layout(shipped):
        return shipped
    out = Path(tempfile.mkdtemp(prefix=f"iquest-{preset}-{weights}-"))
    atexit.register(shutil.rmtree, out, True)
    return make_fixture(preset, out, weights=weights)


def __getattr__(name: str) -> Path:
    """TINY and TINY_TP8, made on first use (module attributes resolved lazily, PEP 562)."""
    presets = {"TINY": "tiny", "TINY_TP8": "tiny-tp8", "MICRO": "micro"}
    if name in presets:
        return fixture_dir(presets[name])
    raise AttributeError(name)


def mini_or_skip() -> Path:
    """The trained mini model, or a skip while the shipped folder predates the published layout (it is retrained)."""
    import pytest

    if not in_published_layout(MINI):
        pytest.skip("fixtures/iquest-q1-mini is not yet retrained in the published layout")
    return MINI

PARAMS = SamplingParams()
# How far the two engines' probabilities of a diverging token may differ and still count as rounding.
# fp32 compute is within ~1e-6 of float64 in probability. bf16 activations on a random MoE move logits
# by up to ~1.5 (router flips amplify rounding; measured alike on CPU and CUDA, final hidden ~12% off), which on
# these flat 20-token distributions (top probabilities ~0.03-0.05) moves a token's probability by a
# few hundredths; 0.05 allows that and still rejects a token one engine favours and the other omits.
TOLERANCE = {"fp32": 1e-3, "bf16": 0.05}
PROMPTS = [list(range(3, 23)), [7, 100, 200, 300, 11, 5, 77, 91, 402, 33] * 3, list(range(400, 470))]
RING_SEQ = [int(x) for x in torch.randint(0, 512, (220,), generator=torch.Generator().manual_seed(3))]
# The kernel plans the GPU agreement tests run, per dtype: every published-architecture kernel (fast/plan.py; the
# attention, norms, MoE and LM head run their torch forms until their kernels are re-based).
GPU_PLANS = {"fp32": KernelPlan.triton(), "bf16": KernelPlan.triton()}
# The short decodes the kernel tests compare: (prompt index, drafts), N_TOKENS each
CASES = [(0, 3), (1, "auto")]
N_TOKENS = 10


@lru_cache(maxsize=None)
def reference(model_dir: Path) -> ReferenceModel:
    return ReferenceModel.load(model_dir)


@lru_cache(maxsize=None)
def rank_engine(model_dir: Path, dtype: str = "fp32", parts: EngineParts = EngineParts()) -> RankEngine:
    return RankEngine(model_dir, Parallel.single(), EngineOptions(max_context=512, dtype=dtype), parts)


def request(prompt, seed, drafts, n=40) -> Request:
    return Request(tuple(prompt), seed, PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, n, drafts, ())


def fast_steps(engine, prompt, seed, drafts, n=40):
    return list(engine.decode(request(prompt, seed, drafts, n)))


def tokens(steps) -> list[int]:
    return [t for s in steps for t in s.tokens]


def ref_dist(model_dir: Path, params: SamplingParams = PARAMS):
    """The reference's target distribution after a prefix (a fresh cache, float64)."""
    model = reference(model_dir)

    def dist(prefix):
        logits, _ = model.forward(torch.tensor(prefix), torch.arange(len(prefix)), model.new_cache())
        return sampling.dist(logits[-1], params)
    return dist


def fast_dist(engine: RankEngine, params: SamplingParams = PARAMS):
    """The fast engine's target distribution after a prefix, from a fresh prefill (after the decode)."""
    return fast_prefill_dist(engine, params)


def decode_cases(engine: RankEngine, logprobs: bool = False) -> dict:
    """CASES decoded on `engine`: per case its tokens and (drafts, accepted) per round, or with `logprobs` every
    round's (tokens, logprobs, drafts, accepted)."""
    out = {}
    for i, drafts in CASES:
        steps = fast_steps(engine, PROMPTS[i], 40 + i, drafts, n=N_TOKENS)
        out[f"{i}-{drafts}"] = ([(s.tokens, s.logprobs, s.drafts, s.accepted) for s in steps] if logprobs else
                                {"tokens": tokens(steps), "rounds": [(s.drafts, s.accepted) for s in steps]})
    return out


@lru_cache(maxsize=None)
def torch_forms(*names: str) -> EngineParts:
    """Engine parts whose ops run the torch forms (fast/torch_ops.py) of the methods `names` whatever the kernel plan,
    bound before any capture: one kernel's A/B against its torch form inside the same engine."""
    from iquest.fast.model import FastModel
    from iquest.fast.torch_ops import TorchOps

    class TorchFormsModel(FastModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for name in names:  # bound as TorchOps binds it (a static method's __get__ gives its function)
                setattr(self.ops, name, inspect.getattr_static(TorchOps, name).__get__(self.ops))

    return EngineParts(model=TorchFormsModel)


class FailingLoader(WeightLoader):
    """A start-up fault (tests/test_fast_startup.py): every rank but 0 fails while it builds its engine. Here, not in
    the test module, so that a spawned worker unpickles it through the installed `iquest`."""

    def __init__(self, reader, par, *args, **kwargs):
        if par.rank > 0:
            raise OSError(f"rank {par.rank} could not read its shard")
        super().__init__(reader, par, *args, **kwargs)


def chi_square(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float],
               min_expected: float = 5.0) -> tuple[float, int, float]:
    """(statistic, df, p) of observed sequence counts against target probabilities, cells pooled in ascending expected
    count until each pool expects >= min_expected; p = 0 when a sampled sequence has target probability 0."""
    import numpy as np
    from scipy import stats

    n = sum(counts.values())
    if any(seq not in probs for seq in counts):  # a token the target could never emit
        return float("inf"), 0, 0.0
    pools_e, pools_o, e, o = [], [], 0.0, 0
    for seq in sorted(probs, key=lambda q: (probs[q], q)):
        e += probs[seq] * n
        o += counts.get(seq, 0)
        if e >= min_expected:
            pools_e.append(e)
            pools_o.append(o)
            e, o = 0.0, 0
    if e > 0 or o > 0:
        pools_e[-1] += e
        pools_o[-1] += o
    E, O = np.array(pools_e), np.array(pools_o, dtype=float)
    stat = float(((O - E) ** 2 / E).sum())
    return stat, len(E) - 1, float(stats.chi2.sf(stat, len(E) - 1))


def stop_server(proc) -> None:
    """Ctrl-C to an `iquest serve` subprocess, as a user stops it; killed if it has not exited 20 s later."""
    import signal
    import subprocess

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def streamed_tool_calls(chunks) -> list[dict]:
    """The tool calls of an OpenAI chat stream's chunks, their argument deltas joined: [{"id", "name", "arguments"}]
    in index order."""
    calls: dict = {}
    for c in chunks:
        for d in c.choices[0].delta.tool_calls or []:
            calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)]
