"""The fast engine's speculative decoding is lossless: its first L = 5 tokens over many request seeds follow the exact
target distribution, as plain sampling's do (tests/test_lossless.py does this for the reference; here the fast engine's
own round runs: its device-side accept, replacement, bonus and settle steps, its Philox uniforms, its draft rows).

Model: the micro preset (vocabulary 8) in BF16 turned into a noisy bigram model the draft can predict: embeddings x2,
lm_head row sigma(x) pulled towards token x's embedding (sigma(x) = x + 3 mod 8), and the draft sharing the target's
embedding and head with eh_proj = [I | 0], so it reads the token it is given. Written as a checkpoint folder, so the
exact distribution comes from the float64 reference on the very same weights (every prefix from a fresh cache) and
the fast engine runs them at fp32 (BF16 weights run as stored on the CPU). Sampling: temperature 1, top-k 8, top-p 0.8.
With fixed depth 3, about two thirds of the requests draw a replacement and a third a bonus token inside the window.

Statistic: Pearson chi-square over length-5 sequences, cells pooled in ascending expected count until each pool
expects >= 5 (pooling from the exact distribution only). A sequence outside the exact support fails outright.

CI form: speculative on seeds 0..299 (about 15 s), and the negative control (the replacement drawn from p instead of
normalize(max(0, p - q)), the fast engine's accept step swapped) on the same seeds, which must give p < 1e-6; plain
sampling and the full 600 seeds are `pytest -m slow`. Measured on this model (N = 300): speculative chi2 35.3 on 29 df
(p = 0.19, 200 replacements, 100 bonuses); plain p = 0.63; the control chi2 147.8 (p = 7e-18).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from iquest.fast import sampler
from iquest.fast.model import FastModel
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, EngineParts, RankEngine, Request
from iquest.fast.torch_ops import TorchOps
from iquest.fixtures.make import preset_config, random_weights
from iquest.reference import sampling
from iquest.reference.checkpoint import DRAFT, save_checkpoint
from iquest.reference.config import GenerationConfig
from iquest.reference.model import ReferenceModel
from iquest.reference.sampling import SamplingParams
from iquest.tests.helpers import chi_square

L, K = 5, 3
PROMPT = [1, 2, 3, 4, 5, 6]  # longer than the micro windows (4 and the draft's 4): both rings already full
PARAMS = SamplingParams(temperature=1.0, top_k=8, top_p=0.8)
ALPHA, BROKEN_P, MIN_BRANCH_SHARE = 1e-3, 1e-6, 0.05
N_CI, N = 300, 600


def bigram_micro(out, seed: int = 2, embed_scale: float = 2.0, pull: float = 0.7):
    config = preset_config("micro", "bf16")
    w = random_weights(config, seed, lm_head_gain=1.0)
    H, V = config.hidden_size, config.vocab_size
    emb = w["model.embed_tokens.weight"].float() * embed_scale
    head = w["lm_head.weight"].float().clone()
    for x in range(V):
        head[(x + 3) % V] += pull * emb[x] / emb[x].norm()
    w["model.embed_tokens.weight"], w["lm_head.weight"] = emb.bfloat16(), head.bfloat16()
    w[DRAFT + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    w[DRAFT + "lm_head.weight"] = w["lm_head.weight"].clone()
    w[DRAFT + "mtp.eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1).bfloat16()
    save_checkpoint(out, config, w, GenerationConfig(PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, ()))
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return bigram_micro(tmp_path_factory.mktemp("bigram-micro"))


@pytest.fixture(scope="module")
def exact(model_dir) -> dict[tuple[int, ...], float]:
    """Every continuation of L tokens with its exact target probability (float64, a fresh cache per prefix)."""
    model = ReferenceModel.load(model_dir)
    probs: dict[tuple[int, ...], float] = {}
    truncated = [0]

    def walk(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == L:
            probs[prefix] = mass
            return
        seq = PROMPT + list(prefix)
        logits, _ = model.forward(torch.tensor(seq), torch.arange(len(seq)), model.new_cache())
        d = sampling.dist(logits[-1], PARAMS)
        truncated[0] += d.ids.numel() < model.config.vocab_size
        for t, pt in zip(d.ids.tolist(), d.probs.tolist()):
            walk(prefix + (t,), mass * pt)

    walk((), 1.0)
    assert abs(sum(probs.values()) - 1.0) < 1e-9 and truncated[0] > 0  # top-p truncates: the test exercises it
    return probs


# ---- the negative control: the replacement drawn from p ---------------------------------------------------------
class FromPOps(TorchOps):
    """The accept step of fast/torch_ops.py, but a rejected draft's replacement is drawn from p_{a} itself instead of
    normalize(max(0, p - q)) (q zeroed where the residual is formed: TorchOps.commit_dist substituted)."""

    @staticmethod
    def commit_dist(p_ids, p_probs, q_ids, q_probs, a, k):
        return sampler.commit_dist(p_ids, p_probs, q_ids, torch.zeros_like(q_probs), a, k)


class FromPModel(FastModel):
    def __init__(self, config, weights, cache, par, dtype, ops=None):
        super().__init__(config, weights, cache, par, dtype, FromPOps())


# ---- sampling and the test ------------------------------------------------------------------------------------
@dataclass
class Sampled:
    counts: dict[tuple[int, ...], int]
    replacements: int = 0  # runs with a rejection whose replacement token is inside the window
    bonuses: int = 0       # runs with an all-accepted round whose bonus token is inside the window


def sample(model_dir, drafts: int, seeds, parts: EngineParts = EngineParts()) -> Sampled:
    engine = RankEngine(model_dir, Parallel.single(), EngineOptions(max_context=64, dtype="fp32"), parts)
    out = Sampled({})
    for seed in seeds:
        toks: list[int] = []
        rep = bon = False
        for step in engine.decode(Request(tuple(PROMPT), seed, PARAMS.temperature, PARAMS.top_k, PARAMS.top_p, L,
                                          drafts, ())):
            if step.drafts and len(step.tokens) == step.accepted + 1:  # its last token is in the window
                bon |= step.bonus
                rep |= not step.bonus
            toks += step.tokens
        assert len(toks) == L
        out.replacements += rep
        out.bonuses += bon
        out.counts[tuple(toks)] = out.counts.get(tuple(toks), 0) + 1
    return out


SIZES = [pytest.param(N_CI, id="ci"), pytest.param(N, id="full", marks=pytest.mark.slow)]


@pytest.mark.parametrize("n", SIZES)
def test_speculative_matches_the_target(model_dir, exact, n):
    s = sample(model_dir, K, range(n))
    stat, df, p = chi_square(s.counts, exact)
    print(f"fast speculative: chi2={stat:.1f} df={df} p={p:.3g} replacements={s.replacements} bonuses={s.bonuses}")
    assert s.replacements >= MIN_BRANCH_SHARE * n and s.bonuses >= MIN_BRANCH_SHARE * n
    assert p > ALPHA, f"the fast engine's speculative decoding is not lossless: chi2={stat:.1f} df={df} p={p:.3g}"


@pytest.mark.slow
def test_plain_matches_the_target(model_dir, exact):
    stat, df, p = chi_square(sample(model_dir, 0, range(N)).counts, exact)
    print(f"fast plain: chi2={stat:.1f} df={df} p={p:.3g}")
    assert p > ALPHA


@pytest.mark.parametrize("n", SIZES)
def test_a_replacement_from_p_is_caught(model_dir, exact, n):
    s = sample(model_dir, K, range(n), EngineParts(model=FromPModel))
    stat, df, p = chi_square(s.counts, exact)
    print(f"fast FromP: chi2={stat:.1f} df={df} p={p:.3g} replacements={s.replacements}")
    assert s.replacements >= MIN_BRANCH_SHARE * n, "the broken branch must run"
    assert p < BROKEN_P, f"the test failed to detect a replacement drawn from p: p={p:.3g}"
