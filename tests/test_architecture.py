"""Each architectural feature of docs/model.md pinned on the float64 reference, one at a time.

For every feature there are two tests:
  * `test_broken_<feature>`: a deliberately broken variant built here (a function of reference.layers monkeypatched
    where reference/model.py calls it, or a ReferenceModel subclass overriding ONE method) runs the same scenario on
    the same random weights as the real model; its outputs must differ beyond float64 noise, its broken branch must
    have run (a counter inside the override), and the outputs the feature cannot reach must stay bit-identical
    (so the variant changes that one feature). Where an override copies a method of reference/model.py, the copy
    with its switch off reproduces the real model bit for bit (`test_copies_reproduce_the_real_model`), so the
    copy's only difference is the switch.
  * `test_<feature>_matches_explicit`: the real model against an independent float64 computation of that feature
    written out here from docs/model.md (loops over heads, keys and rotation pairs; no reference.layers function),
    for a small case: one row of one layer, fed the previous layer's output from the taps.

The model: tests/random_model.py's small_config (head_dim 16 with rotary_dim 4 < head_dim / 2, so rotating twice
as many dims is still partial; thetas 1e6 full / 1e4 sliding; window 8, the draft's 6), random weights.
Scenario: a prefill of N = 20 tokens (past both windows), depth 0 of the draft over positions 0..N-1, then two
recursive depths at N and N+1 with fixed tokens (so a broken variant follows the same path).
"""

from __future__ import annotations

import math

import pytest
import torch

import iquest.reference.model as model_mod
from iquest.reference.checkpoint import DRAFT, draft_prefix, layer_prefix
from iquest.reference.layers import apply_rope, attention, expert_mlp, rms_norm, rope_cos_sin, route, visible
from iquest.reference.model import ReferenceModel, _tap
from iquest.tests.random_model import SMALL_DRAFT_WINDOW, SMALL_WINDOW, random_weights, small_config

F64 = torch.float64
CONFIG = small_config()
N = 20
TOKENS = torch.randint(0, CONFIG.vocab_size, (N + 1,), generator=torch.Generator().manual_seed(11))
DEEPER = (torch.tensor([17]), torch.tensor([42]))  # the tokens fed to depths 1 and 2
NOISE = 1e-6  # a difference above this (relative to the output's range) is not float64 rounding
EXPLICIT_REL = 1e-10  # the explicit computations agree with the model to float64 accuracy
MTP = CONFIG.num_hidden_layers  # the draft's KV layer

assert CONFIG.rotary_dim < CONFIG.head_dim // 2 and CONFIG.rope_theta != CONFIG.swa_rope_theta
assert CONFIG.layer_types == ("full_attention", "sliding_attention", "sliding_attention", "full_attention")
assert CONFIG.mtp.layer_types == ("sliding_attention",) and CONFIG.mtp.sliding_window == SMALL_DRAFT_WINDOW


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(CONFIG, seed=5)


@pytest.fixture(scope="module")
def real(weights) -> ReferenceModel:
    return ReferenceModel(CONFIG, weights)


def scenario(m: ReferenceModel, taps: dict | None = None) -> dict[str, torch.Tensor]:
    """Target logits over the prefill, draft logits of depth 0 (all rows) and of depths 1 and 2."""
    cache = m.new_cache()
    logits, hidden = m.forward(TOKENS[:N], torch.arange(N), cache, taps)
    d0, out = m.draft(TOKENS[1:N + 1], hidden, torch.arange(N), cache)
    d1, out1 = m.draft(DEEPER[0], out[-1:], torch.tensor([N]), cache)
    d2, _ = m.draft(DEEPER[1], out1, torch.tensor([N + 1]), cache)
    return {"target": logits, "depth0": d0, "depth1": d1, "depth2": d2, "cache": cache}


@pytest.fixture(scope="module")
def real_run(real) -> dict:
    taps: dict = {}
    run = scenario(real, taps)
    run["taps"] = taps
    return run


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


def compare(broken: dict, real: dict, changed: tuple[str, ...]) -> None:
    """The outputs in `changed` differ beyond float64 noise; every other output is bit-identical."""
    for key in ("target", "depth0", "depth1", "depth2"):
        d = rel_diff(broken[key], real[key])
        print(f"{key}: relative difference {d:.3g}")
        if key in changed:
            assert d > NOISE, f"{key}: the broken variant is within float64 noise of the real model ({d:.3g})"
        else:
            assert torch.equal(broken[key], real[key]), f"{key} changed although the feature cannot reach it"


# ==== the explicit float64 computations (docs/model.md written out) ================================
def e_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * w for one vector."""
    return x / math.sqrt(sum(float(v) ** 2 for v in x) / x.numel() + eps) * w


def e_rope(x: torch.Tensor, t: int, rotary_dim: int, theta: float) -> torch.Tensor:
    """Pair j = (x[j], x[j + rotary_dim/2]) turns by t * theta^(-2j/rotary_dim); x[rotary_dim:] passes through."""
    out, half = x.clone(), rotary_dim // 2
    for j in range(half):
        angle = t * theta ** (-2.0 * j / rotary_dim)
        u, w = float(x[j]), float(x[j + half])
        out[j] = u * math.cos(angle) - w * math.sin(angle)
        out[j + half] = w * math.cos(angle) + u * math.sin(angle)
    return out


def e_silu(x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([v / (1.0 + math.exp(-v)) for v in x.tolist()], dtype=F64)


def e_swiglu(x, gate, up, down) -> torch.Tensor:
    return down @ (e_silu(gate @ x) * (up @ x))


class Explicit:
    """docs/model.md's formulas for one row, over a model's float64 weights (w) and its configs."""

    def __init__(self, m: ReferenceModel):
        self.w, self.c = m.w, m.config

    # step 1-6 of attn(a, t): `A` holds the attention inputs (attention_norm outputs) of rows 0..t at positions 0..t
    def qk(self, c, p: str, a: torch.Tensor, t: int, theta: float | None, which: str) -> list[torch.Tensor]:
        """Per head: q (or k) after its per-head norm and, when theta is given, the partial rotation at t."""
        D = c.head_dim
        n = c.num_attention_heads if which == "q" else c.num_key_value_heads
        proj = self.w[p + f"self_attn.{which}_proj.weight"] @ a
        out = []
        for h in range(n):
            x = e_rms(proj[h * D:(h + 1) * D], self.w[p + f"self_attn.{which}_norm.weight"], c.rms_norm_eps)
            out.append(x if theta is None else e_rope(x, t, c.rotary_dim, theta))
        return out

    def attn(self, c, p: str, A: torch.Tensor, t: int, theta: float | None, window: int | None) -> torch.Tensor:
        D, Nq, Nkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
        scale = c.softmax_scale if c.softmax_scale is not None else D ** -0.5
        first = 0 if window is None else max(0, t - window + 1)  # t - W + 1 <= j <= t
        keys = {j: self.qk(c, p, A[j], j, theta, "k") for j in range(first, t + 1)}
        vproj = {j: self.w[p + "self_attn.v_proj.weight"] @ A[j] for j in range(first, t + 1)}
        q = self.qk(c, p, A[t], t, theta, "q")
        heads = []
        for h in range(Nq):
            g = h // (Nq // Nkv)
            s = {j: scale * float(q[h] @ keys[j][g]) for j in keys}
            s_sink = scale * float(q[h] @ self.w[p + "self_attn.sink_k"][g]) if c.enable_sink_attention else None
            m = max(list(s.values()) + ([s_sink] if s_sink is not None else []))
            den = sum(math.exp(v - m) for v in s.values()) + (math.exp(s_sink - m) if s_sink is not None else 0.0)
            num = sum(math.exp(s[j] - m) * vproj[j][g * D:(g + 1) * D] for j in keys)
            heads.append(num / den)
        return self.w[p + "self_attn.o_proj.weight"] @ torch.cat(heads)

    def moe(self, c, p: str, b: torch.Tensor) -> tuple[torch.Tensor, list[float], list[int]]:
        r = [float(v) for v in self.w[p + "mlp.router.weight"] @ b]  # float64 logits of float64 hidden and weights
        mx = max(r)
        probs = [math.exp(v - mx) for v in r]
        probs = [v / sum(probs) for v in probs]
        top = sorted(range(c.num_experts), key=lambda e: (-probs[e], e))[:c.num_experts_per_tok]
        total = sum(probs[e] for e in top)
        out = sum(probs[e] / total * e_swiglu(b, *(self.w[f"{p}mlp.experts.{e}.{n}_proj.weight"]
                                                    for n in ("gate", "up", "down"))) for e in top)
        return out, probs, top

    def layer_theta(self, layer: int) -> float | None:
        c = self.c
        if layer in c.no_rope_layers:
            return None
        return c.swa_rope_theta if c.layer_types[layer] == "sliding_attention" else c.rope_theta

    def layer_window(self, layer: int) -> int | None:
        return self.c.sliding_window if self.c.layer_types[layer] == "sliding_attention" else None

    def layer(self, layer: int, X: torch.Tensor, t: int) -> dict[str, torch.Tensor]:
        """Target layer `layer` on row t, X = its inputs for rows 0..t."""
        c, w, p, eps = self.c, self.w, layer_prefix(layer), self.c.rms_norm_eps
        A = torch.stack([e_rms(X[j], w[p + "attention_norm.weight"], eps) for j in range(t + 1)])
        attn = self.attn(c, p, A, t, self.layer_theta(layer), self.layer_window(layer))
        dense = layer in c.mlp_only_layers

        def mlp(b):
            if dense:
                return e_swiglu(b, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                                w[p + "mlp.down_proj.weight"])
            return self.moe(c, p, b)[0]

        if layer == 0:  # raw residual, both output norms, first-layer scales
            h = X[t] + e_rms(attn, w[p + "attn_out_norm.weight"], eps) * c.first_layer_attn_out_scale
            b = e_rms(h, w[p + "feed_forward_norm.weight"], eps)
            out = h + e_rms(mlp(b), w[p + "ffn_out_norm.weight"], eps) * c.first_layer_ffn_out_scale
        else:  # the residual continues from the NORMALIZED input, no ffn_out_norm
            h = A[t] + e_rms(attn, w[p + "attn_out_norm.weight"], eps) * c.attn_out_scale
            b = e_rms(h, w[p + "feed_forward_norm.weight"], eps)
            out = h + mlp(b) * c.ffn_out_scale
        return {"attn_out": attn, "mlp_in": b, "hidden": out}

    def draft_input(self, token: int, hidden: torch.Tensor) -> torch.Tensor:
        """z = concat(rmsnorm(mtp.embed_tokens[token], enorm), rmsnorm(hidden, hnorm)) @ eh_proj^T."""
        d, w = self.c.mtp, self.w
        e = e_rms(w[DRAFT + "embed_tokens.weight"][token], w[DRAFT + "mtp.enorm.weight"], d.rms_norm_eps)
        g = e_rms(hidden, w[DRAFT + "mtp.hnorm.weight"], d.rms_norm_eps)
        return w[DRAFT + "mtp.eh_proj.weight"] @ torch.cat([e, g])  # the embedding first

    def draft_row(self, Z: torch.Tensor, t: int, window: int | None = None) -> dict[str, torch.Tensor]:
        """The draft block on the row at position t, Z = the draft inputs z of rows 0..t (positions 0..t); `window`
        replaces the draft's own (a control)."""
        d, w, p, eps = self.c.mtp, self.w, draft_prefix(), self.c.mtp.rms_norm_eps
        A = torch.stack([e_rms(Z[j], w[p + "attention_norm.weight"], eps) for j in range(t + 1)])
        attn = self.attn(d, p, A, t, d.swa_rope_theta, window or d.sliding_window)
        r = Z[t] + e_rms(attn, w[p + "attn_out_norm.weight"], eps) * d.first_layer_attn_out_scale
        b = e_rms(r, w[p + "feed_forward_norm.weight"], eps)
        r = r + e_rms(self.moe(d, p, b)[0], w[p + "ffn_out_norm.weight"], eps) * d.first_layer_ffn_out_scale
        out = e_rms(r, w[DRAFT + "mtp.final_layernorm.weight"], eps)
        return {"residual": r, "out": out, "logits": w[DRAFT + "lm_head.weight"] @ out}


@pytest.fixture(scope="module")
def explicit(real) -> Explicit:
    return Explicit(real)


def layer_input(real_run, real, layer: int) -> torch.Tensor:
    taps = real_run["taps"]
    if layer == 0:
        return real.w["model.embed_tokens.weight"][TOKENS[:N]]
    return taps[f"layer{layer - 1}.hidden"]


def assert_close(a: torch.Tensor, b: torch.Tensor, rel: float = EXPLICIT_REL) -> None:
    d = rel_diff(a, b)
    assert d <= rel, f"relative difference {d:.3g} > {rel:g}"


def draft_depth0(m: ReferenceModel) -> tuple[dict, object]:
    """Depth 0's taps over positions 0..N-1 (plus "target.final_hidden": the prefill's post-norm hidden it read), and
    the cache after them."""
    taps: dict = {}
    cache = m.new_cache()
    _, hidden = m.forward(TOKENS[:N], torch.arange(N), cache)
    m.draft(TOKENS[1:N + 1], hidden, torch.arange(N), cache, taps)
    taps["target.final_hidden"] = hidden
    return taps, cache


def cached_k(run, layer: int, t: int) -> torch.Tensor:
    return run["cache"].k[layer][t]


def prefill_attention_input(real_run, real, layer: int) -> torch.Tensor:
    X = layer_input(real_run, real, layer)
    return torch.stack([e_rms(x, real.w[layer_prefix(layer) + "attention_norm.weight"], CONFIG.rms_norm_eps)
                        for x in X])


# ==== the broken variants ===========================================================================
class Counter:
    def __init__(self):
        self.n = 0


def run_broken(m: ReferenceModel) -> dict:
    """The scenario on a broken variant."""
    return scenario(m)


# ---- copies of reference/model.py methods, each with one switch ------------------------------------
class Switchable(ReferenceModel):
    """ReferenceModel whose _attention, _decoder_layer and _moe are copies with one switch each (all off: the real
    model, checked bit for bit). A broken variant turns ONE switch on."""

    rope_before_norm = False     # apply RoPE to q/k and THEN their per-head norms
    raw_residual_everywhere = False  # every layer continues the residual from its raw input
    bf16_router = False          # router logits from bf16-rounded hidden and router weights

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.count = Counter()

    def _attention(self, c, layer, p, kv_layer, a, positions, cache):
        R, D, eps = a.shape[0], c.head_dim, c.rms_norm_eps
        q = (a @ self.w[p + "self_attn.q_proj.weight"].T).view(R, c.num_attention_heads, D)
        k = (a @ self.w[p + "self_attn.k_proj.weight"].T).view(R, c.num_key_value_heads, D)
        v = (a @ self.w[p + "self_attn.v_proj.weight"].T).view(R, c.num_key_value_heads, D)
        qn, kn = self.w[p + "self_attn.q_norm.weight"], self.w[p + "self_attn.k_norm.weight"]
        theta = c.rope_theta_for(layer)
        if self.rope_before_norm and theta is not None:
            self.count.n += 1
            cos, sin = rope_cos_sin(positions, c.rotary_dim, theta, self.dtype)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
        else:
            q, k = rms_norm(q, qn, eps), rms_norm(k, kn, eps)
            if theta is not None:
                cos, sin = rope_cos_sin(positions, c.rotary_dim, theta, self.dtype)
                q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache.write(kv_layer, positions, k, v)
        end = int(positions.max()) + 1
        keys, values, written = cache.read(kv_layer, end)
        mask = visible(positions, torch.arange(end), c.layer_type(layer), c.sliding_window)
        sink_k = self.w[p + "self_attn.sink_k"] if c.enable_sink_attention else None
        out = attention(q, keys, values, mask, c.scale, sink_k)
        return out.reshape(R, -1) @ self.w[p + "self_attn.o_proj.weight"].T

    def _decoder_layer(self, c, layer, p, kv_layer, x, positions, cache, taps, tag, experts=None):
        w, eps = self.w, c.rms_norm_eps
        attn_scale, mlp_scale = c.out_scales(layer)
        a = rms_norm(x, w[p + "attention_norm.weight"], eps)
        attn_out = self._attention(c, layer, p, kv_layer, a, positions, cache)
        if self.raw_residual_everywhere and layer != 0:
            self.count.n += 1
            residual = x
        else:
            residual = x if layer == 0 else a
        h = residual + rms_norm(attn_out, w[p + "attn_out_norm.weight"], eps) * attn_scale
        b = rms_norm(h, w[p + "feed_forward_norm.weight"], eps)
        if c.is_dense(layer):
            mlp_out = expert_mlp(b, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                                 w[p + "mlp.down_proj.weight"])
        else:
            mlp_out, scores, chosen = self._moe(c, p, b, experts)
            _tap(taps, tag + "router_scores", scores)
            _tap(taps, tag + "experts", chosen)
        y = rms_norm(mlp_out, w[p + "ffn_out_norm.weight"], eps) if layer == 0 else mlp_out
        out = h + y * mlp_scale
        _tap(taps, tag + "attn_out", attn_out)
        _tap(taps, tag + "mlp_in", b)
        _tap(taps, tag + "mlp_out", mlp_out)
        _tap(taps, tag + "hidden", out)
        return out

    def _moe(self, c, p, b, experts=None):
        router = self.w[p + "mlp.router.weight"]
        if self.bf16_router:
            self.count.n += 1
            logits = b.to(torch.bfloat16).to(b.dtype) @ router.to(torch.bfloat16).to(b.dtype).T
        else:
            logits = b @ router.T
        weights, experts, scores = route(logits, c.num_experts_per_tok, experts)
        out = torch.zeros_like(b)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            q = f"{p}mlp.experts.{e}."
            y = expert_mlp(b[rows], self.w[q + "gate_proj.weight"], self.w[q + "up_proj.weight"],
                           self.w[q + "down_proj.weight"])
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out, scores, experts


def test_copies_reproduce_the_real_model(weights, real_run):
    """All switches off, the copied methods ARE the real model (bit for bit): a broken variant differs only by its
    switch."""
    m = Switchable(CONFIG, weights)
    run = scenario(m)
    for key in ("target", "depth0", "depth1", "depth2"):
        assert torch.equal(run[key], real_run[key]), key
    assert m.count.n == 0


# ---- 1. partial RoPE: rotary_dim dims rotate, not twice as many --------------------------------------
def test_broken_rotary_dims(monkeypatch, weights, real_run):
    count = Counter()

    def rope_twice_as_many(positions, rotary_dim, theta, dtype):
        count.n += 1
        return rope_cos_sin(positions, 2 * rotary_dim, theta, dtype)  # apply_rope rotates cos.shape[-1] dims

    monkeypatch.setattr(model_mod, "rope_cos_sin", rope_twice_as_many)
    broken = run_broken(ReferenceModel(CONFIG, weights))
    assert count.n > 0
    compare(broken, real_run, ("target", "depth0", "depth1", "depth2"))


def test_partial_rotary_matches_explicit(real, real_run, explicit):
    """The cached keys: per-head k_norm, then pairs (j, j + 2) of dims 0..3 rotate by t * theta^(-2j/4); dims 4..15
    pass through."""
    t, rd = N - 1, CONFIG.rotary_dim
    for layer in (1, 3):
        A = prefill_attention_input(real_run, real, layer)
        normed = explicit.qk(CONFIG, layer_prefix(layer), A[t], t, None, "k")
        rotated = explicit.qk(CONFIG, layer_prefix(layer), A[t], t, explicit.layer_theta(layer), "k")
        for g in range(CONFIG.num_key_value_heads):
            k = cached_k(real_run, layer, t)[g]
            assert_close(k, rotated[g])
            assert torch.equal(k[rd:], normed[g][rd:]) or rel_diff(k[rd:], normed[g][rd:]) < 1e-15
            assert rel_diff(k[:rd], normed[g][:rd]) > 1e-3  # the first rotary_dim dims did turn
        # the attention output of the row, from the explicit partial rotation of q and every key
        assert_close(real_run["taps"][f"layer{layer}.attn_out"][t],
                     explicit.attn(CONFIG, layer_prefix(layer), A, t, explicit.layer_theta(layer),
                                   explicit.layer_window(layer)))


# ---- 2. one theta per layer type (sliding: swa_rope_theta) ----------------------------------------
def test_broken_one_theta_for_every_layer(monkeypatch, weights, real_run):
    count = Counter()

    def rope_theta_only(positions, rotary_dim, theta, dtype):
        if theta == CONFIG.swa_rope_theta:  # a sliding layer (or the draft): swa_rope_theta ignored
            count.n += 1
            theta = CONFIG.rope_theta
        return rope_cos_sin(positions, rotary_dim, theta, dtype)

    monkeypatch.setattr(model_mod, "rope_cos_sin", rope_theta_only)
    broken = run_broken(ReferenceModel(CONFIG, weights))
    assert count.n > 0
    compare(broken, real_run, ("target", "depth0", "depth1", "depth2"))


def test_theta_per_layer_type_matches_explicit(real, real_run, explicit):
    t = N - 1
    for layer, theta, other in ((1, 1e4, 1e6), (2, 1e4, 1e6), (0, 1e6, 1e4), (3, 1e6, 1e4)):
        A = prefill_attention_input(real_run, real, layer)
        k = cached_k(real_run, layer, t)
        for g, want in enumerate(explicit.qk(CONFIG, layer_prefix(layer), A[t], t, theta, "k")):
            assert_close(k[g], want)
        wrong = explicit.qk(CONFIG, layer_prefix(layer), A[t], t, other, "k")[0]
        assert rel_diff(k[0], wrong) > 1e-3  # the other theta would have given another key
    # The draft's one sliding layer turns by swa_rope_theta too: its key at position N-1 (depth 0's last row).
    taps, cache = draft_depth0(real)
    a = e_rms(taps["mtp.input"][N - 1], real.w[draft_prefix() + "attention_norm.weight"], CONFIG.rms_norm_eps)
    want = explicit.qk(CONFIG.mtp, draft_prefix(), a, N - 1, 1e4, "k")
    for g in range(CONFIG.num_key_value_heads):
        assert_close(cache.k[MTP][N - 1][g], want[g])
    assert rel_diff(cache.k[MTP][N - 1][0], explicit.qk(CONFIG.mtp, draft_prefix(), a, N - 1, 1e6, "k")[0]) > 1e-3


# ---- 3. q/k norm BEFORE RoPE ------------------------------------------------------------------------
def test_broken_rope_before_qk_norm(weights, real_run):
    m = Switchable(CONFIG, weights)
    m.rope_before_norm = True
    broken = run_broken(m)
    assert m.count.n > 0
    compare(broken, real_run, ("target", "depth0", "depth1", "depth2"))


def test_qk_norm_then_rope_matches_explicit(real, real_run, explicit):
    t, layer = N - 1, 2
    p, eps, D = layer_prefix(layer), CONFIG.rms_norm_eps, CONFIG.head_dim
    A = prefill_attention_input(real_run, real, layer)
    k_raw = real.w[p + "self_attn.k_proj.weight"] @ A[t]
    for g in range(CONFIG.num_key_value_heads):
        kg = k_raw[g * D:(g + 1) * D]
        norm_then_rope = e_rope(e_rms(kg, real.w[p + "self_attn.k_norm.weight"], eps), t, 4, 1e4)
        rope_then_norm = e_rms(e_rope(kg, t, 4, 1e4), real.w[p + "self_attn.k_norm.weight"], eps)
        assert_close(cached_k(real_run, layer, t)[g], norm_then_rope)
        assert rel_diff(cached_k(real_run, layer, t)[g], rope_then_norm) > 1e-4
    assert_close(real_run["taps"][f"layer{layer}.attn_out"][t], explicit.attn(CONFIG, p, A, t, 1e4, SMALL_WINDOW))


# ---- 4. the sink is a KEY: its logit depends on the query ---------------------------------------------
def test_broken_sink_logit_ignores_the_query(monkeypatch, weights, real_run):
    count = Counter()

    def scalar_sink_attention(q, k, v, mask, scale, sink_k):
        group = q.shape[1] // k.shape[1]
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = (torch.einsum("rhd,thd->hrt", q, kk) * scale).masked_fill(~mask[None], float("-inf"))
        if sink_k is not None:
            count.n += 1
            per_head = sink_k.sum(dim=-1).repeat_interleave(group) * scale  # one scalar per head, no q
            scores = torch.cat([scores, per_head[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]
        return torch.einsum("hrt,thd->rhd", probs, vv)

    monkeypatch.setattr(model_mod, "attention", scalar_sink_attention)
    broken = run_broken(ReferenceModel(CONFIG, weights))
    assert count.n > 0
    compare(broken, real_run, ("target", "depth0", "depth1", "depth2"))


def test_sink_key_matches_explicit(real, real_run, explicit):
    """out_h = sum_j e^{s_j} v_j / (e^{s_sink} + sum_j e^{s_j}), s_sink = scale * q_h . sink_k[g] (q after norm and
    RoPE, sink_k not rotated); the sink logits of different rows of one head differ."""
    layer, p = 1, layer_prefix(1)
    A = prefill_attention_input(real_run, real, layer)
    for t in (3, N - 1):
        assert_close(real_run["taps"][f"layer{layer}.attn_out"][t], explicit.attn(CONFIG, p, A, t, 1e4, SMALL_WINDOW))
    s_sink = [float(explicit.qk(CONFIG, p, A[t], t, 1e4, "q")[0] @ real.w[p + "self_attn.sink_k"][0])
              for t in range(N)]
    assert max(s_sink) - min(s_sink) > 0.1


# ---- 5. layers >= 1 continue the residual from the NORMALIZED input --------------------------------
def test_broken_raw_residual_in_later_layers(weights, real_run):
    m = Switchable(CONFIG, weights)
    m.raw_residual_everywhere = True
    broken = run_broken(m)
    assert m.count.n > 0
    compare(broken, real_run, ("target", "depth0", "depth1", "depth2"))


@pytest.mark.parametrize("layer", [0, 1, 2, 3])
@pytest.mark.parametrize("t", [2, N - 1])
def test_one_layer_forward_matches_explicit(real, real_run, explicit, layer, t):
    """A hand-written layer for one row (layer 0: raw residual, ffn_out_norm; later: normalized residual)."""
    X = layer_input(real_run, real, layer)
    want = explicit.layer(layer, X[:t + 1], t)
    taps = real_run["taps"]
    for name in ("attn_out", "mlp_in", "hidden"):
        assert_close(taps[f"layer{layer}.{name}"][t], want[name])


def test_normalized_residual_matches_explicit(real, real_run, explicit):
    """Layer 2's hidden is rmsnorm(x) + ..., not x + ...: the explicit layer with the raw residual is far off."""
    t, layer, p, eps = N - 1, 2, layer_prefix(2), CONFIG.rms_norm_eps
    X = layer_input(real_run, real, layer)
    taps = real_run["taps"]
    a = e_rms(X[t], real.w[p + "attention_norm.weight"], eps)
    h = a + e_rms(taps["layer2.attn_out"][t], real.w[p + "attn_out_norm.weight"], eps) * CONFIG.attn_out_scale
    assert_close(taps["layer2.hidden"][t], h + taps["layer2.mlp_out"][t] * CONFIG.ffn_out_scale)
    h_raw = X[t] + e_rms(taps["layer2.attn_out"][t], real.w[p + "attn_out_norm.weight"], eps)
    assert rel_diff(taps["layer2.hidden"][t], h_raw + taps["layer2.mlp_out"][t] * CONFIG.ffn_out_scale) > 1e-2


# ---- 6. a sliding window of W keys (the query's own counted) -----------------------------------------
def test_broken_window_of_w_plus_one_keys(monkeypatch, weights, real_run):
    count = Counter()

    def visible_one_more(q_pos, k_pos, layer_type, window):
        if layer_type == "sliding_attention":
            count.n += 1
            window = window + 1
        return visible(q_pos, k_pos, layer_type, window)

    monkeypatch.setattr(model_mod, "visible", visible_one_more)
    broken = run_broken(ReferenceModel(CONFIG, weights))
    assert count.n > 0
    compare(broken, real_run, ("target", "depth0", "depth1", "depth2"))


def test_window_matches_explicit(real, real_run, explicit):
    """Row t of a sliding layer reads keys t-W+1..t: the explicit sum over exactly those W keys; one more key
    (t-W) would change it."""
    t, layer, p = N - 1, 2, layer_prefix(2)
    A = prefill_attention_input(real_run, real, layer)
    got = real_run["taps"][f"layer{layer}.attn_out"][t]
    assert_close(got, explicit.attn(CONFIG, p, A, t, 1e4, SMALL_WINDOW))
    assert rel_diff(got, explicit.attn(CONFIG, p, A, t, 1e4, SMALL_WINDOW + 1)) > 1e-4
    # The draft's window (6 keys): its row at N-1 from the explicit draft block over the same inputs.
    taps, _ = draft_depth0(real)
    assert_close(taps["mtp.logits"][N - 1], explicit.draft_row(taps["mtp.input"], N - 1)["logits"])
    assert rel_diff(taps["mtp.logits"][N - 1],
                    explicit.draft_row(taps["mtp.input"], N - 1, SMALL_DRAFT_WINDOW + 1)["logits"]) > 1e-4


# ---- 7. an fp32 (here float64) router: no bf16 rounding of its inputs -----------------------------------
def test_broken_bf16_router(weights, real_run):
    m = Switchable(CONFIG, weights)
    m.bf16_router = True
    broken = run_broken(m)
    assert m.count.n > 0
    compare(broken, real_run, ("target", "depth0", "depth1", "depth2"))


def test_router_matches_explicit(real, real_run, explicit):
    """softmax over all experts of float64 logits of the float64 mlp input and router weights; top 2 (ties: lower
    index); weights renormalized over the chosen."""
    taps = real_run["taps"]
    for layer in (1, 2, 3):
        p = layer_prefix(layer)
        for t in (0, 7, N - 1):
            b = taps[f"layer{layer}.mlp_in"][t]
            out, probs, top = explicit.moe(CONFIG, p, b)
            assert_close(taps[f"layer{layer}.router_scores"][t], torch.tensor(probs, dtype=F64))
            assert taps[f"layer{layer}.experts"][t].tolist() == top
            assert_close(taps[f"layer{layer}.mlp_out"][t], out)
    # bf16 inputs would move the router's probabilities far beyond float64 noise
    b = taps["layer1.mlp_in"][N - 1]
    router = real.w[layer_prefix(1) + "mlp.router.weight"]
    bf = torch.softmax(b.bfloat16().double() @ router.bfloat16().double().T, -1)
    assert rel_diff(bf, taps["layer1.router_scores"][N - 1]) > 1e-4


# ---- 8. the draft embeds with its own mtp/embed_tokens ----------------------------------------------------
class TargetEmbeddingDraft(ReferenceModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.count = Counter()

    def draft(self, tokens, hidden, positions, cache, taps=None, experts=None):
        self.count.n += 1
        own = self.w[DRAFT + "embed_tokens.weight"]
        self.w[DRAFT + "embed_tokens.weight"] = self.w["model.embed_tokens.weight"]
        try:
            return super().draft(tokens, hidden, positions, cache, taps, experts)
        finally:
            self.w[DRAFT + "embed_tokens.weight"] = own


def test_broken_draft_uses_the_targets_embedding(weights, real_run):
    m = TargetEmbeddingDraft(CONFIG, weights)
    broken = run_broken(m)
    assert m.count.n > 0
    compare(broken, real_run, ("depth0", "depth1", "depth2"))


def test_draft_embedding_matches_explicit(real, real_run, explicit):
    taps, _ = draft_depth0(real)
    hidden = taps["target.final_hidden"]
    for p in (0, N - 1):  # row p: the token x_{p+1} (mtp/embed_tokens), the hidden h_p
        tok = int(TOKENS[p + 1])
        assert_close(taps["mtp.input"][p], explicit.draft_input(tok, hidden[p]))
        e = e_rms(real.w["model.embed_tokens.weight"][tok], real.w[DRAFT + "mtp.enorm.weight"], CONFIG.rms_norm_eps)
        g = e_rms(hidden[p], real.w[DRAFT + "mtp.hnorm.weight"], CONFIG.rms_norm_eps)
        assert rel_diff(taps["mtp.input"][p], real.w[DRAFT + "mtp.eh_proj.weight"] @ torch.cat([e, g])) > 1e-2


# ---- 9. the next depth's hidden is the POST-norm output (final_layernorm) ---------------------------------
class PreNormRecursion(ReferenceModel):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.count = Counter()

    def draft(self, tokens, hidden, positions, cache, taps=None, experts=None):
        own = {} if taps is None else taps
        logits, _ = super().draft(tokens, hidden, positions, cache, own, experts)
        self.count.n += 1
        return logits, own["mtp.hidden"]  # the fp32 residual before final_layernorm


def test_broken_draft_fed_its_pre_norm_output(weights, real_run):
    m = PreNormRecursion(CONFIG, weights)
    broken = run_broken(m)
    assert m.count.n > 0
    compare(broken, real_run, ("depth1", "depth2"))  # depth 0 reads the target's hidden


def test_draft_recursion_matches_explicit(real, explicit):
    """Depth 0's last row (position N-1, x_N, h_{N-1}) written out, then depth 1 at position N consuming its
    POST-norm output (through hnorm again) and the token just drafted."""
    cache = real.new_cache()
    _, hidden = real.forward(TOKENS[:N], torch.arange(N), cache)
    d0, out = real.draft(TOKENS[1:N + 1], hidden, torch.arange(N), cache)
    Z = torch.stack([explicit.draft_input(int(TOKENS[p + 1]), hidden[p]) for p in range(N)])
    row = explicit.draft_row(Z, N - 1)
    assert_close(d0[N - 1], row["logits"])
    assert_close(out[N - 1], row["out"])
    assert rel_diff(out[N - 1], row["residual"]) > 1e-2  # the output is not the pre-norm residual
    deep: dict = {}
    d1, _ = real.draft(DEEPER[0], out[-1:], torch.tensor([N]), cache, deep)
    z1 = explicit.draft_input(int(DEEPER[0]), row["out"])
    assert_close(deep["mtp.input"][0], z1)
    assert_close(d1[0], explicit.draft_row(torch.cat([Z, z1[None]]), N)["logits"])
