"""reference/model.py on a small random IQuest-Q1 (the published architecture): batch invariance (an incremental decode
equals a full forward), KV rollback, what each layer type's query sees, the sink key, KV and row rules, taps, the
checkpoint round trip. tests/test_architecture.py pins each architectural feature on its own."""

from __future__ import annotations

import copy

import pytest
import torch

from iquest.reference.checkpoint import DRAFT, draft_prefix, layer_prefix, save_checkpoint
from iquest.reference.layers import rms_norm
from iquest.reference.model import KVCache, ReferenceModel
from iquest.tests.random_model import SMALL_DRAFT_WINDOW, SMALL_WINDOW, random_weights, small_config

W, WD = SMALL_WINDOW, SMALL_DRAFT_WINDOW
N = 40  # > 4 windows, so sliding layers (and the draft) drop history
V, H = 64, 32
MTP = 4  # the draft's KV layer index (after the 4 target layers)


def assert_rel(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-12) -> None:
    err = (a - b).abs().max().item()
    assert err <= rel * b.abs().max().item(), f"max difference {err:.3e} exceeds {rel:g} relative"


CONFIGS = {
    "default": small_config(),
    # every optional branch at once: no sink, a no-RoPE layer, full rotary, a dense layer past 0 (MoE-free layer 2
    # with the normalized residual), softmax and logit scales, a full-attention draft (theta rope_theta)
    "variants": small_config(enable_sink_attention=False, no_rope_layers=[1], rotary_dim=16, mlp_only_layers=[0, 2],
                             softmax_scale=0.2, logit_scale=0.7, draft={"sliding_window": None}),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request) -> ReferenceModel:
    config = CONFIGS[request.param]
    return ReferenceModel(config, random_weights(config, seed=0))


@pytest.fixture(scope="module")
def default_model() -> ReferenceModel:
    return ReferenceModel(CONFIGS["default"], random_weights(CONFIGS["default"], seed=0))


def tokens(n: int = N, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(seed))


def run_main(model, toks, block: int, cache=None):
    """Main model over toks[0..n) in blocks of `block` rows: (logits, hidden, cache)."""
    cache = cache or model.new_cache()
    outs = [model.forward(toks[i:i + block], torch.arange(i, min(i + block, len(toks))), cache)
            for i in range(0, len(toks), block)]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs]), cache


def run_draft(model, toks, hidden, block: int, cache):
    """Depth 0 over positions 0..n-2: row p consumes the main hidden h_p and the token x_{p+1}."""
    outs = []
    for p in range(0, len(toks) - 1, block):
        end = min(p + block, len(toks) - 1)
        outs.append(model.draft(toks[p + 1:end + 1], hidden[p:end], torch.arange(p, end), cache))
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


# ---- batch invariance: an incremental decode equals a full forward ----------------------------
@pytest.mark.parametrize("block", [1, 8, 5])
def test_main_model_is_batch_invariant(model, block):
    toks = tokens()
    logits, hidden, _ = run_main(model, toks, N)
    logits_b, hidden_b, _ = run_main(model, toks, block)
    assert logits.dtype == torch.float64 and logits.shape == (N, V) and hidden.shape == (N, H)
    assert_rel(logits_b, logits)
    assert_rel(hidden_b, hidden)


@pytest.mark.parametrize("block", [1, 8, 3])
def test_draft_layer_is_batch_invariant(model, block):
    toks = tokens()
    _, hidden, cache = run_main(model, toks, N)
    logits, h = run_draft(model, toks, hidden, N, copy.deepcopy(cache))
    logits_b, h_b = run_draft(model, toks, hidden, block, copy.deepcopy(cache))
    assert logits.shape == (N - 1, V) and h.shape == (N - 1, H)
    assert_rel(logits_b, logits)
    assert_rel(h_b, h)


def test_recursive_depths_equal_one_block_with_the_same_inputs(default_model):
    """A deeper depth is an ordinary draft row: feeding depth 0's output and a token at the next position gives the
    row a one-block pass with those inputs gives."""
    m, toks = default_model, tokens(12)
    _, hidden, cache = run_main(m, toks, 12)
    c1, c2 = copy.deepcopy(cache), copy.deepcopy(cache)
    _, out = m.draft(toks[1:12], hidden[:11], torch.arange(11), c1)  # rows 0..10, the last consumes x_11
    nxt = torch.tensor([5])
    step, _ = m.draft(nxt, out[-1:], torch.tensor([11]), c1)
    block, _ = m.draft(torch.cat([toks[1:12], nxt]), torch.cat([hidden[:11], out[-1:]]), torch.arange(12), c2)
    assert_rel(step, block[-1:])


def test_rejected_rows_are_overwritten(default_model):
    """A verification block with wrong drafts, then the true tokens: same as never having seen them."""
    m, toks = default_model, tokens()
    clean_logits, clean_hidden, clean_cache = run_main(m, toks, N)
    cache = m.new_cache()
    m.forward(toks[:20], torch.arange(20), cache)
    m.forward((toks[20:28] + 1) % V, torch.arange(20, 28), cache)  # rejected: rows 20..27 are stale
    # Stale draft KV over 0..27, written from wrong hidden states (as deeper draft depths do).
    wrong_hidden = torch.randn(28, H, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    m.draft((toks[1:29] + 3) % V, wrong_hidden, torch.arange(28), cache)
    outs = [m.forward(toks[i:i + 8], torch.arange(i, min(i + 8, N)), cache) for i in range(20, N, 8)]
    assert_rel(torch.cat([o[0] for o in outs]), clean_logits[20:])
    # The draft layer too: depth 0 rewritten over 0..N-2 matches a clean draft pass.
    clean_draft, _ = run_draft(m, toks, clean_hidden, N, clean_cache)
    redo, _ = run_draft(m, toks, clean_hidden, 8, cache)
    assert_rel(redo, clean_draft)


# ---- what a query can see ---------------------------------------------------------------------
def perturbed_row(model, cache, layer, pos, t: int, toks, hidden=None):
    """Logits of the row at t (main, or a draft row consuming h_t and x_{t+1} when `hidden` is given) after
    corrupting K/V of `layer` at `pos`."""
    cache = copy.deepcopy(cache)
    if pos is not None:
        cache.k[layer][pos] += 1.0
        cache.v[layer][pos] -= 1.0
    if hidden is None:
        return model.forward(toks[t:t + 1], torch.tensor([t]), cache)[0]
    return model.draft(toks[t + 1:t + 2], hidden[t:t + 1], torch.tensor([t]), cache)[0]


@pytest.mark.parametrize("t", [W, 2 * W + 3, N - 1])
def test_sliding_layer_sees_exactly_its_window(default_model, t):
    m, toks = default_model, tokens()
    _, _, cache = run_main(m, toks[:t], N)
    base = perturbed_row(m, cache, 0, None, t, toks)
    for layer in (1, 2):  # sliding layers: t-W is out, t-W+1 is in (W keys, the query's own counted)
        assert torch.equal(perturbed_row(m, cache, layer, t - W, t, toks), base)
        assert not torch.allclose(perturbed_row(m, cache, layer, t - W + 1, t, toks), base)
    # The full layers see every earlier position, down to 0.
    for layer in (0, 3):
        for pos in (0, t - W, t - 1):
            assert not torch.allclose(perturbed_row(m, cache, layer, pos, t, toks), base)


@pytest.mark.parametrize("t", [WD, N - 2])
def test_draft_layer_sees_exactly_its_own_window(default_model, t):
    m, toks = default_model, tokens()
    _, hidden, cache = run_main(m, toks, N)
    run_draft(m, toks[:t + 1], hidden, N, cache)  # draft KV for positions 0..t-1
    base = perturbed_row(m, cache, MTP, None, t, toks, hidden)
    assert torch.equal(perturbed_row(m, cache, MTP, t - WD, t, toks, hidden), base)
    assert not torch.allclose(perturbed_row(m, cache, MTP, t - WD + 1, t, toks, hidden), base)
    for layer in range(4):  # the target's KV is not read by the draft
        assert torch.equal(perturbed_row(m, cache, layer, t - 1, t, toks, hidden), base)


def test_full_attention_draft_sees_everything():
    config = CONFIGS["variants"]
    m, toks, t = ReferenceModel(config, random_weights(config, seed=0)), tokens(), N - 2
    assert config.mtp.layer_types == ("full_attention",)
    _, hidden, cache = run_main(m, toks, N)
    run_draft(m, toks[:t + 1], hidden, N, cache)
    base = perturbed_row(m, cache, MTP, None, t, toks, hidden)
    for pos in (0, t - WD, t - 1):
        assert not torch.allclose(perturbed_row(m, cache, MTP, pos, t, toks, hidden), base)


def test_sink_key_enters_the_model(default_model):
    config, toks = CONFIGS["default"], tokens(24)
    weights = random_weights(config, seed=0)
    no_sink_config = small_config(enable_sink_attention=False)
    no_sink_weights = {k: v for k, v in weights.items() if not k.endswith("sink_k")}
    plain = ReferenceModel(no_sink_config, no_sink_weights)
    assert not any(k.endswith("sink_k") for k in plain.w)
    without, h_without, c_without = run_main(plain, toks, 24)
    with_sink, h_with, c_with = run_main(default_model, toks, 24)
    assert (with_sink - without).abs().max() > 1e-3
    d_without, _ = run_draft(plain, toks, h_with, 24, c_without)
    d_with, _ = run_draft(default_model, toks, h_with, 24, c_with)
    assert (d_with - d_without).abs().max() > 1e-3


# ---- KV and row rules -------------------------------------------------------------------------
def test_row_rules(default_model):
    m, toks = default_model, tokens()
    with pytest.raises(ValueError, match="never written"):
        m.forward(toks[:2], torch.tensor([3, 4]), m.new_cache())
    cache = m.new_cache()
    m.forward(toks[:3], torch.arange(3), cache)
    h = torch.zeros(1, H, dtype=torch.float64)
    m.draft(toks[1:2], h, torch.tensor([0]), cache)  # the row at position 0 is an ordinary row
    with pytest.raises(ValueError, match="never written"):
        m.draft(toks[3:4], h, torch.tensor([2]), cache)  # position 1 of the draft KV is missing
    with pytest.raises(ValueError, match=">= 0"):
        m.draft(toks[:1], h, torch.tensor([-1]), m.new_cache())
    with pytest.raises(ValueError, match="distinct"):
        m.forward(toks[:2], torch.tensor([0, 0]), m.new_cache())
    with pytest.raises(ValueError, match="token ids"):
        m.forward(torch.tensor([V]), torch.tensor([0]), m.new_cache())
    with pytest.raises(ValueError, match="hidden has shape"):
        m.draft(toks[:2], h, torch.arange(2), m.new_cache())


def test_row_at_position_zero_uses_its_embedding(default_model):
    """docs/model.md: the draft row at position 0 is not special (its embedding is not zeroed)."""
    m, c = default_model, CONFIGS["default"].mtp
    hidden = torch.randn(1, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    taps: dict = {}
    m.draft(torch.tensor([9]), hidden, torch.tensor([0]), m.new_cache(), taps)
    e = rms_norm(m.w[DRAFT + "embed_tokens.weight"][9], m.w[DRAFT + "mtp.enorm.weight"], c.rms_norm_eps)
    g = rms_norm(hidden[0], m.w[DRAFT + "mtp.hnorm.weight"], c.rms_norm_eps)
    assert_rel(taps["mtp.input"][0], m.w[DRAFT + "mtp.eh_proj.weight"] @ torch.cat([e, g]))


def test_fp8_weights_need_their_scales():
    config = CONFIGS["default"]
    weights = random_weights(config, seed=0)
    name = layer_prefix(1) + "self_attn.q_proj.weight"
    del weights[name + "_scale_inv"]
    with pytest.raises(ValueError, match="_scale_inv"):
        ReferenceModel(config, weights)


def test_cache_grows_and_tracks_writes():
    cache = KVCache(CONFIGS["default"])
    assert len(cache.k) == 5  # 4 target layers + the draft's
    k = torch.ones(2, 2, 16, dtype=torch.float64)
    cache.write(1, torch.tensor([0, 100]), k, 2 * k)
    keys, values, written = cache.read(1, 101)
    assert written.nonzero().flatten().tolist() == [0, 100]
    assert torch.equal(values[100], 2 * k[1]) and cache.read(0, 1)[2].sum() == 0


# ---- checkpoint round trip and taps -----------------------------------------------------------
@pytest.mark.parametrize("packed", [True, False])
def test_checkpoint_round_trip(tmp_path, default_model, packed):
    config = CONFIGS["default"]
    save_checkpoint(tmp_path, config, random_weights(config, seed=0), max_shard_bytes=1 << 16, packed=packed)
    loaded = ReferenceModel.load(tmp_path)
    assert loaded.config == config
    assert loaded.w.keys() == default_model.w.keys()
    assert all(torch.equal(loaded.w[k], default_model.w[k]) for k in loaded.w)
    toks = tokens(12)
    assert torch.equal(run_main(loaded, toks, 12)[0], run_main(default_model, toks, 12)[0])


def test_taps_carry_the_documented_names(default_model):
    m, toks, L, c = default_model, tokens(12), 4, CONFIGS["default"]
    taps: dict = {}
    cache = m.new_cache()
    logits, hidden = m.forward(toks, torch.arange(12), cache, taps)
    common, moe = ("attn_out", "mlp_in", "mlp_out", "hidden"), ("router_scores", "experts")
    want = {f"layer{l}.{n}" for l in range(L) for n in common + (moe if l else ())} | {"final_hidden", "logits"}
    assert set(taps) == want
    assert torch.equal(taps["logits"], logits) and torch.equal(taps["final_hidden"], hidden)
    assert_rel(rms_norm(taps[f"layer{L - 1}.hidden"], m.w["model.norm.weight"], c.rms_norm_eps), hidden)
    # Layer 1's residual stream from its parts (normalized residual, no ffn_out_norm).
    p, eps = layer_prefix(1), c.rms_norm_eps
    a = rms_norm(taps["layer0.hidden"], m.w[p + "attention_norm.weight"], eps)
    h = a + rms_norm(taps["layer1.attn_out"], m.w[p + "attn_out_norm.weight"], eps) * c.attn_out_scale
    assert_rel(rms_norm(h, m.w[p + "feed_forward_norm.weight"], eps), taps["layer1.mlp_in"])
    assert_rel(h + taps["layer1.mlp_out"] * c.ffn_out_scale, taps["layer1.hidden"])
    assert taps["layer2.experts"].dtype == torch.long and taps["layer2.experts"].shape == (12, 2)
    assert taps["layer2.router_scores"].shape == (12, 8)
    draft_taps: dict = {}
    d_logits, out = m.draft(toks[1:], hidden[:-1], torch.arange(11), cache, draft_taps)
    assert set(draft_taps) == {f"mtp.{n}" for n in common + moe + ("input", "final_hidden", "logits")}
    assert torch.equal(draft_taps["mtp.logits"], d_logits) and torch.equal(draft_taps["mtp.final_hidden"], out)
    assert_rel(rms_norm(draft_taps["mtp.hidden"], m.w[DRAFT + "mtp.final_layernorm.weight"], eps), out)


def test_logit_scale_is_the_targets_only():
    config = CONFIGS["variants"]
    m, toks = ReferenceModel(config, random_weights(config, seed=0)), tokens(10)
    taps: dict = {}
    logits, hidden, cache = run_main(m, toks, 10)
    assert_rel(logits, hidden @ m.w["lm_head.weight"].T * 0.7)
    d_logits, out = m.draft(toks[1:], hidden[:-1], torch.arange(9), cache, taps)
    assert_rel(d_logits, out @ m.w[DRAFT + "lm_head.weight"].T)


def test_draft_takes_forced_experts(default_model):
    m, toks = default_model, tokens(6)
    _, hidden, cache = run_main(m, toks, 6)
    forced = torch.tensor([[7, 6]] * 5)
    taps: dict = {}
    m.draft(toks[1:], hidden[:-1], torch.arange(5), copy.deepcopy(cache), taps, experts=forced)
    assert torch.equal(taps["mtp.experts"], forced)
    free: dict = {}
    m.draft(toks[1:], hidden[:-1], torch.arange(5), copy.deepcopy(cache), free)
    assert not torch.equal(free["mtp.experts"], forced)
    assert draft_prefix() + "mlp.router.weight" in m.w
