"""reference/model.py on a small random IQuest-Q1: batch invariance, windows, sinks, KV rules, taps, I/O."""

from __future__ import annotations

import copy

import pytest
import torch

from iquest.reference.checkpoint import save_checkpoint
from iquest.reference.config import RopeScaling
from iquest.reference.model import KVCache, ReferenceModel
from iquest.tests.random_model import random_weights, small_config

W = 8  # sliding_window of small_config
N = 40  # > 3 windows, so sliding layers drop history




def assert_rel(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-12) -> None:
    err = (a - b).abs().max().item()
    assert err <= rel * b.abs().max().item(), f"max difference {err:.3e} exceeds {rel:g} relative"


CONFIGS = {
    "default": small_config(),
    # every optional branch at once: qk_norm, YaRN, full-attention MTP, unnormalized scaled routing
    "variants": small_config(qk_norm=True, rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=16),
                             mtp_layer_type="full_attention", norm_topk_prob=False, routed_scaling_factor=2.5),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request) -> ReferenceModel:
    config = CONFIGS[request.param]
    return ReferenceModel(config, random_weights(config, seed=0))


@pytest.fixture(scope="module")
def default_model() -> ReferenceModel:
    return ReferenceModel(CONFIGS["default"], random_weights(CONFIGS["default"], seed=0))


def tokens(n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))


def run_main(model, toks, block: int, cache=None):
    """Main model over toks[0..n) in blocks of `block` rows: (logits, hidden, cache)."""
    cache = cache or model.new_cache()
    outs = [model.forward(toks[i:i + block], torch.arange(i, min(i + block, len(toks))), cache)
            for i in range(0, len(toks), block)]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), cache


def run_draft(model, toks, hidden, block: int, cache):
    """Depth 0 over positions 1..n-1: row p takes token x_p and the main hidden of p-1."""
    outs = []
    for p in range(1, len(toks), block):
        end = min(p + block, len(toks))
        outs.append(model.draft(toks[p:end], hidden[p - 1:end - 1], torch.arange(p, end), cache))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


# ---- batch invariance -------------------------------------------------------------------------
@pytest.mark.parametrize("block", [1, 8, 5])
def test_main_model_is_batch_invariant(model, block):
    toks = tokens()
    logits, hidden, _ = run_main(model, toks, N)
    logits_b, hidden_b, _ = run_main(model, toks, block)
    assert logits.dtype == torch.float64 and logits.shape == (N, 64) and hidden.shape == (N, 32)
    assert_rel(logits_b, logits)
    assert_rel(hidden_b, hidden)


@pytest.mark.parametrize("block", [1, 8, 3])
def test_draft_layer_is_batch_invariant(model, block):
    toks = tokens()
    _, hidden, cache = run_main(model, toks, N)
    logits, h = run_draft(model, toks, hidden, N, copy.deepcopy(cache))
    logits_b, h_b = run_draft(model, toks, hidden, block, copy.deepcopy(cache))
    assert logits.shape == (N - 1, 64)
    assert_rel(logits_b, logits)
    assert_rel(h_b, h)


def test_rejected_rows_are_overwritten(default_model):
    """A verification block with wrong drafts, then the true tokens: same as never having seen them."""
    m, toks = default_model, tokens()
    clean_logits, clean_hidden, _ = run_main(m, toks, N)
    cache = m.new_cache()
    m.forward(toks[:20], torch.arange(20), cache)
    m.forward((toks[20:28] + 1) % 64, torch.arange(20, 28), cache)  # rejected: rows 20..27 are stale
    # Stale draft KV over 1..27, written from wrong hidden states (as deeper draft depths do).
    wrong_hidden = torch.randn(27, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    m.draft((toks[1:28] + 3) % 64, wrong_hidden, torch.arange(1, 28), cache)
    outs = [m.forward(toks[i:i + 8], torch.arange(i, min(i + 8, N)), cache) for i in range(20, N, 8)]
    assert_rel(torch.cat([o[0] for o in outs]), clean_logits[20:])
    # The draft layer too: depth 0 rewritten over 1..N-1 matches a clean draft pass.
    clean_draft, _ = run_draft(m, toks, clean_hidden, N, run_main(m, toks, N)[2])
    redo, _ = run_draft(m, toks, clean_hidden, 8, cache)
    assert_rel(redo, clean_draft)


# ---- what a query can see ---------------------------------------------------------------------
def perturbed_row(model, cache, layer: int, pos: int, t: int, toks, hidden=None):
    """Logits of the row at t (main, or draft when `hidden` is given) after corrupting K/V at `pos`."""
    cache = copy.deepcopy(cache)
    if pos is not None:
        cache.k[layer][pos] += 1.0
        cache.v[layer][pos] -= 1.0
    if hidden is None:
        return model.forward(toks[t:t + 1], torch.tensor([t]), cache)[0]
    return model.draft(toks[t:t + 1], hidden[t - 1:t], torch.tensor([t]), cache)[0]


@pytest.mark.parametrize("t", [W, 2 * W + 3, N - 1])
def test_sliding_layer_sees_exactly_its_window(default_model, t):
    m, toks = default_model, tokens()
    _, _, cache = run_main(m, toks[:t], N)
    base = perturbed_row(m, cache, 0, None, t, toks)
    for layer in (0, 1, 2):  # sliding layers: t-W is out, t-W+1 is in
        assert torch.equal(perturbed_row(m, cache, layer, t - W, t, toks), base)
        assert not torch.allclose(perturbed_row(m, cache, layer, t - W + 1, t, toks), base)
    # The full layer sees every earlier position, down to 0.
    for pos in (0, t - W, t - 1):
        assert not torch.allclose(perturbed_row(m, cache, 3, pos, t, toks), base)


def test_mtp_sliding_layer_sees_exactly_its_window(default_model):
    m, toks, t, mtp = default_model, tokens(), N - 1, CONFIGS["default"].num_hidden_layers
    _, hidden, cache = run_main(m, toks, N)
    run_draft(m, toks[:t], hidden, N, cache)  # draft KV for positions 1..t-1
    base = perturbed_row(m, cache, mtp, None, t, toks, hidden)
    assert torch.equal(perturbed_row(m, cache, mtp, t - W, t, toks, hidden), base)
    assert not torch.allclose(perturbed_row(m, cache, mtp, t - W + 1, t, toks, hidden), base)
    assert torch.equal(perturbed_row(m, cache, 0, t - 1, t, toks, hidden), base)  # main KV is not read


def test_sinks_enter_the_model(default_model):
    config, toks = CONFIGS["default"], tokens(24)
    weights = random_weights(config, seed=0)
    no_sink_config = small_config(attention_sinks=False)
    no_sink_weights = {k: v for k, v in weights.items() if not k.endswith("sinks")}
    without = run_main(ReferenceModel(no_sink_config, no_sink_weights), toks, 24)[0]
    with_sinks = run_main(default_model, toks, 24)[0]
    assert (with_sinks - without).abs().max() > 1e-3
    drowned = dict(weights, **{k: torch.full_like(v, -1e4) for k, v in weights.items() if k.endswith("sinks")})
    assert_rel(run_main(ReferenceModel(config, drowned), toks, 24)[0], without)


# ---- KV and row rules -------------------------------------------------------------------------
def test_reading_an_unwritten_position_is_an_error(default_model):
    m, toks = default_model, tokens()
    with pytest.raises(ValueError, match="never written"):
        m.forward(toks[:2], torch.tensor([3, 4]), m.new_cache())
    cache = m.new_cache()
    m.forward(toks[:3], torch.arange(3), cache)
    h = torch.zeros(1, 32, dtype=torch.float64)
    m.draft(toks[1:2], h, torch.tensor([1]), cache)  # the draft sequence starts at 1: fine
    with pytest.raises(ValueError, match="never written"):
        m.draft(toks[3:4], h, torch.tensor([3]), cache)  # position 2 of the draft KV is missing
    with pytest.raises(ValueError, match=">= 1"):
        m.draft(toks[:1], h, torch.tensor([0]), m.new_cache())
    with pytest.raises(ValueError, match="distinct"):
        m.forward(toks[:2], torch.tensor([0, 0]), m.new_cache())


def test_cache_grows_and_tracks_writes():
    cache = KVCache(CONFIGS["default"])
    k = torch.ones(2, 2, 8, dtype=torch.float64)
    cache.write(1, torch.tensor([0, 100]), k, 2 * k)
    keys, values, written = cache.read(1, 101)
    assert written.nonzero().flatten().tolist() == [0, 100]
    assert torch.equal(values[100], 2 * k[1]) and cache.read(0, 1)[2].sum() == 0


# ---- checkpoint round trip and taps -----------------------------------------------------------
def test_checkpoint_round_trip(tmp_path, default_model):
    config = CONFIGS["default"]
    save_checkpoint(tmp_path, config, random_weights(config, seed=0), max_shard_bytes=1 << 16)
    loaded = ReferenceModel.load(tmp_path)
    assert loaded.config == config
    assert loaded.w.keys() == default_model.w.keys()
    assert all(torch.equal(loaded.w[k], default_model.w[k]) for k in loaded.w)
    toks = tokens(12)
    assert torch.equal(run_main(loaded, toks, 12)[0], run_main(default_model, toks, 12)[0])


def test_taps_carry_the_documented_names(default_model):
    m, toks, L = default_model, tokens(12), 4
    taps: dict = {}
    cache = m.new_cache()
    logits, hidden = m.forward(toks, torch.arange(12), cache, taps)
    per_layer = ("attn_out", "moe_in", "router_scores", "experts", "moe_out", "hidden")
    assert set(taps) == {f"layer{l}.{n}" for l in range(L) for n in per_layer} | {"final_hidden", "logits"}
    assert torch.equal(taps["logits"], logits) and torch.equal(taps["final_hidden"], hidden)
    assert torch.equal(taps[f"layer{L - 1}.hidden"], hidden)
    # The residual stream is the sum of its parts.
    assert_rel(taps["layer0.hidden"] + taps["layer1.attn_out"] + taps["layer1.moe_out"], taps["layer1.hidden"])
    assert taps["layer2.experts"].dtype == torch.long and taps["layer2.experts"].shape == (12, 2)
    assert taps["layer2.router_scores"].shape == (12, 8)
    draft_taps: dict = {}
    m.draft(toks[1:], hidden[:-1], torch.arange(1, 12), cache, draft_taps)
    assert set(draft_taps) == {f"mtp.{n}" for n in per_layer + ("input", "logits")}
