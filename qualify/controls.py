"""Negative controls: deliberately broken fast engines that qualification must reject.

Each control is a broken piece substituted when its candidate is built (`EngineParts`: a subclass of the weight
loader, the cache, the model or the round runner, defined here), with the check and position class(es) that should
catch it; no product file carries a branch for it, and no product object is edited at run time. A control proves
something only if its broken code actually ran on an input where it matters, so each one also counts those occasions
from the recorded run (`branch`); a control with a zero count is reported as not caught. A control that cannot apply
to the candidate at all (`applies`: e.g. transposed FP8 scales on a model whose scale grids are all symmetric) is
reported as not applicable, with the reason, and is not run.

The published architecture's own features each have one (docs/model.md): partial RoPE over the wrong dims, a
query-independent sink, the raw residual past layer 0, a draft reading the target's embedding, a draft window of
the target's size (4096), a router rounded to bf16.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace
from typing import Callable

import torch

from ..fast import sampler
from ..fast.cache import LayerKV, StaticKV, layer_slots
from ..fast.model import Block, FastModel, _tap, rope_table
from ..fast.rank import EngineParts
from ..fast.router_fold import PendingProjection
from ..fast.round import RoundRunner
from ..fast.state import VERIFY_ROWS
from ..fast.torch_ops import TorchOps
from ..fast.weights import LOAD_BLOCK, MoE, WeightLoader
from ..reference.checkpoint import DRAFT, CheckpointReader, Shard, shard_range
from ..reference.config import Config
from ..reference.fp8 import quantize
from ..reference.layers import route
from ..reference.rng import PURPOSE_ACCEPT, PURPOSE_COMMIT

VERIFY = [f"verify_row{i}" for i in range(8)]
DRAFT_DEPTHS = [f"draft_depth{d}" for d in range(1, 8)]
WRONG_DRAFT_WINDOW = 4096  # the target's published window, where the draft's is 512


@dataclass(frozen=True)
class Control:
    name: str
    what: str
    parts: EngineParts              # the candidate's pieces, one of them broken
    catches: tuple[tuple[str, str], ...]  # (check, class): caught when any of these fails
    family: str                     # "decode" (recorded sessions) or "lossless"
    branch: Callable                # (sessions or lossless info, model_dir) -> times the broken path mattered
    branch_what: str
    applies: Callable | None = None  # (model_dir, weights format, options, tp) -> None, or why the control cannot apply


# ---- branch counters --------------------------------------------------------------------------------------------
def _verify_blocks(sessions, pred=lambda b: True) -> int:
    return sum(1 for s in sessions for b in s.blocks if b.kind == "verify" and pred(b))


def _rounds(sessions, pred) -> int:
    return sum(1 for s in sessions for st in s.steps[1:] if pred(st))


def _rows(sessions, pred=lambda b, i: True, kinds=("prefill", "verify", "draft")) -> int:
    """Live rows of the recorded blocks of these kinds for which pred(block, row) holds."""
    return sum(1 for s in sessions for b in s.blocks if b.kind in kinds
               for i, live in enumerate(b.live) if live and pred(b, i))


def _forward_rows(sessions) -> int:
    return _rows(sessions, kinds=("prefill", "verify"))


def _draft_rows(sessions) -> int:
    return _rows(sessions, kinds=("draft",))


def _rotated_rows(sessions) -> int:
    """Target rows past position 0 (at position 0 every rotation is the identity)."""
    return _rows(sessions, lambda b, i: b.positions[i] > 0, ("prefill", "verify"))


def _scale_grid(reader: CheckpointReader, name: str) -> torch.Tensor:
    """The whole scale grid the engine runs `name` with: stored, or made when it is quantized at load."""
    if reader.is_quantized(name):
        return reader.read(reader.specs[name].scale_name)
    return quantize(reader.read(name), LOAD_BLOCK)[1]


def _scale_grids(model_dir, fmt: str):
    """(name, whole scale grid) of every linear the candidate runs as FP8: stored, or quantized at load."""
    reader = CheckpointReader(model_dir)
    for name, spec in reader.specs.items():
        if spec.quantized and (reader.is_quantized(name) or fmt == "fp8"):
            yield name, _scale_grid(reader, name)


def _asymmetric_square(s: torch.Tensor) -> bool:
    return s.shape[-1] == s.shape[-2] and not bool((s == s.transpose(-1, -2)).all())


def _square_scales(model_dir, fmt: str = "auto") -> int:
    return sum(1 for _, s in _scale_grids(model_dir, fmt) if _asymmetric_square(s))


def _scales_apply(model_dir, fmt: str, options, tp: int) -> str | None:
    if fmt != "fp8":
        return "the candidate runs no FP8 weights (a BF16 checkpoint run as BF16)"
    if not _square_scales(model_dir, fmt):
        return "no FP8 weight of this model has a square, asymmetric scale grid (transposing changes nothing)"
    return None


def _cut_rows(sessions) -> int:
    """Sampled rows where docs/round.md's top-p keeps more than one token (so there is a crossing token to drop)."""
    from ..reference import sampling

    return sum(1 for s in sessions for b in s.blocks for _, _, _, logits in b.dists
               if sampling.dist(logits, s.params).ids.numel() >= 2)


def _ring_wrapped(sessions) -> int:
    return sum(1 for s in sessions for b in s.blocks if b.kind == "verify" and b.positions[0] >= s.ring)


def _past_draft_window(sessions) -> int:
    """Draft rows at positions >= the config's draft window: the broken window lets in keys the config's excludes."""
    window = _draft_window(sessions)
    return _rows(sessions, lambda b, i: b.positions[i] >= window, ("draft",))


def _draft_window(sessions) -> int:
    w = sessions[0].geometry.draft_window if sessions else None
    return w if w is not None else 1 << 62


def _embedding_differs(sessions, model_dir) -> int:
    """Draft rows whose token's row in the draft's embedding differs from the target's."""
    reader = CheckpointReader(model_dir)
    own, target = reader.read(DRAFT + "embed_tokens.weight"), reader.read("model.embed_tokens.weight")
    differs = (own != target).any(-1)
    return _rows(sessions, lambda b, i: bool(differs[b.tokens[i]]), ("draft",))


def _router_rows(sessions, model_dir) -> int:
    """Rows through an MoE layer whose router is not already bf16-exact (every row of a model with an MoE layer)."""
    reader = CheckpointReader(model_dir)
    routers = [reader.read(n) for n in reader.specs if n.endswith("mlp.router.weight")]
    if all(bool((r.float() == r.to(torch.bfloat16).float()).all()) for r in routers):
        return _rows(sessions, lambda b, i: b.taps is not None and any(
            not bool((v[i] == v[i].to(torch.bfloat16).double()).all())
            for k, v in b.taps.items() if k.endswith("mlp_in")))
    return _rows(sessions)


# ---- the broken pieces ---------------------------------------------------------------------------------------
class ExactWindowRing(StaticKV):
    """ring_exact_w: sliding-window rings of exactly W slots, no 64-slot slack."""

    ring_slack = 0


class OpenMaskKV(LayerKV):
    causal = False


class OpenCausalMask(StaticKV):
    """open_causal_mask: every verification row sees the whole block, later rows included."""

    layer_kv = OpenMaskKV


class WideDraftWindow(StaticKV):
    """draft_window_4096: the draft layer's cache keeps, and its queries read, a window of 4096 keys (the target's
    published window) instead of mtp/config.json's."""

    def __init__(self, config: Config, kv_heads: int, max_context: int, dtype: torch.dtype, device: torch.device):
        super().__init__(config, kv_heads, max_context, dtype, device)
        slots = layer_slots(WRONG_DRAFT_WINDOW, max_context, self.ring_slack)
        shape = (slots + 1, kv_heads, config.head_dim)
        self.layers[config.num_hidden_layers] = self.layer_kv(
            k=torch.zeros(shape, dtype=dtype, device=device), v=torch.zeros(shape, dtype=dtype, device=device),
            slot_pos=torch.full((slots + 1,), -1, dtype=torch.int64, device=device), slots=slots,
            window=WRONG_DRAFT_WINDOW)


class TransposedScales(WeightLoader):
    """fp8_scales_transposed: square FP8 scale grids indexed transposed, scale[c // B1, r // B0], in the whole
    matrix's coordinates: under tensor parallelism each rank takes its slice of the transposed grid (a rank's own
    slice of a square grid is seldom square, so transposing that would leave most weights healthy). Stored scales, or
    the scales a BF16 checkpoint gets when quantized at load."""

    def _read_linear(self, name: str) -> tuple[Shard, tuple[int, int] | None]:
        s, block = super()._read_linear(name)
        if s.scale is None:
            return s, block
        whole = _scale_grid(self.reader, name)
        if not _asymmetric_square(whole):
            return s, block
        scale = whole.transpose(-1, -2)
        part = shard_range(self.reader.specs[name], self.reader.config_of(name), self.par.world, self.par.rank)
        if part is not None:
            dim, start, stop = part
            b = block[dim]
            scale = scale.narrow(dim, start // b, -(-stop // b) - start // b)
        return Shard(s.weight, scale.contiguous().to(s.scale.dtype), s.offset), block


class DraftTargetEmbedding(WeightLoader):
    """draft_target_embedding: the draft reads the target's embedding table instead of its own (mtp/'s)."""

    def plain(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return super().plain("model.embed_tokens.weight" if name == DRAFT + "embed_tokens.weight" else name, dtype)


def _without_sink(attn):
    """The attention weights with no sink key (a view: the same tensors, sink_k None)."""
    return SimpleNamespace(**dict({f.name: getattr(attn, f.name) for f in fields(attn)}, sink_k=None))


class NoSinkModel(FastModel):
    """drop_sink: attention without the sink logit in the softmax denominator."""

    def attention(self, c, index, attn, kv, a, blk):
        return super().attention(c, index, _without_sink(attn), kv, a, blk)


def scalar_sink_attention(q, k, v, mask, scale, sink_k):
    """Softmax attention whose sink logit is one constant per head, scale * sum_d sink_k[g, d] (the retired guess's
    "one scalar logit per head"), instead of scale * q_h . sink_k[g]: q [R, Nq, D], k/v [T, Nkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("rhd,thd->hrt", q, k) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    sink = (sink_k.float().sum(-1) * scale).repeat_interleave(group)  # [Nq]: the same for every query
    scores = torch.cat([scores, sink[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hrt,thd->rhd", probs, v)


class ScalarSinkModel(FastModel):
    """scalar_sink: a query-independent sink, one constant logit per head (scalar_sink_attention)."""

    def attention(self, c, index, attn, kv, a, blk):
        R, D, eps = a.shape[0], c.head_dim, c.rms_norm_eps
        q, k, v = (t.view(R, -1, D) for t in self.ops.qkv(attn, a))
        theta = c.rope_theta_for(index)
        cos, sin = blk.rope[theta] if theta is not None else (None, None)
        q = self.ops.qk_rope_write(kv, q, k, v, attn.q_norm, attn.k_norm, eps, cos, sin, blk.positions, blk.live)
        out = scalar_sink_attention(q.float(), kv.k.float(), kv.v.float(), kv.visible(blk.positions), c.scale,
                                    attn.sink_k).to(q.dtype)
        return self.ops.o_proj(attn, out.to(self.dtype).reshape(R, -1))


class ShiftedRopeModel(FastModel):
    """rope_shift_rows: rows after a block's first rotated one position too far."""

    def _block(self, positions: torch.Tensor, live: torch.Tensor, thetas: set) -> Block:
        shifted = positions + (torch.arange(positions.shape[0], device=positions.device) > 0)
        return Block(positions, live, self.rope_rows(shifted, thetas))


class DoubleRotaryModel(FastModel):
    """rope_double_dims: RoPE over 2 x rotary_dim dims (pair j at theta^(-2j / 2R)), e.g. a partial_rotary_factor
    applied twice over."""

    def __init__(self, config, weights, cache, par, dtype, ops=None):
        super().__init__(config, weights, cache, par, dtype, ops)
        rows = cache.max_context + VERIFY_ROWS
        self.rope_table = rope_table(2 * config.rotary_dim, self.rope_thetas, rows, par.device)


class LastDimsRopeModel(FastModel):
    """rope_last_dims: RoPE over the head's last rotary_dim dims instead of its first. Rotating q and k rolled by
    rotary_dim and attending with them rolled (the sink key too) is exactly that: a dot product is unchanged when
    both of its factors are permuted alike, so the cache may hold the rolled keys."""

    def attention(self, c, index, attn, kv, a, blk):
        R, D, eps, n = a.shape[0], c.head_dim, c.rms_norm_eps, c.rotary_dim
        q, k, v = (t.view(R, -1, D) for t in self.ops.qkv(attn, a))
        theta = c.rope_theta_for(index)
        cos, sin = blk.rope[theta] if theta is not None else (None, None)
        q, k = q.roll(n, -1), k.roll(n, -1)  # the last n dims first, where the rotation acts (the norms commute)
        q = self.ops.qk_rope_write(kv, q, k, v, attn.q_norm.roll(n, -1), attn.k_norm.roll(n, -1), eps, cos, sin,
                                   blk.positions, blk.live)
        sink = attn.sink_k.roll(n, -1) if attn.sink_k is not None else None
        out = self.ops.attention(q, kv, blk.positions, c.scale, sink)
        return self.ops.o_proj(attn, out.to(self.dtype).reshape(R, -1))


class RawResidualModel(FastModel):
    """raw_residual: every layer continues the residual from its raw input x (layer 0's form), where layers >= 1
    continue it from the normalized input a."""

    @staticmethod
    def residual_of(index, x, a):
        return x  # x, not a, in every layer


class _RoutedModel(FastModel):
    """A model whose MoE layers route by `self._route(b, router, k, tag)` (the taps as the product's)."""

    def mlp(self, c, mlp, b, live, taps, tag):
        if not isinstance(mlp, MoE):
            return super().mlp(c, mlp, b, live, taps, tag)
        weights, experts, scores = self._route(b, mlp.router, c.num_experts_per_tok, tag)
        if taps is not None:
            _tap(taps, tag + "router_scores", scores)
            _tap(taps, tag + "experts", experts)
        return self.ops.moe(b, experts, weights, live, mlp)  # as the product's: the ops' pending or combined output


class ShiftedDraftRouterModel(_RoutedModel):
    """mtp_router_shift: the draft layer's router skips its best expert (ranks 2..k+1 chosen)."""

    def _route(self, b, router, k, tag):
        weights, experts, scores = self.ops.route(b, router, k)
        if tag != "mtp.":
            return weights, experts, scores
        experts = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, 1:k + 1]
        weights = scores.gather(-1, experts)
        return weights / weights.sum(-1, keepdim=True), experts, scores


class Bf16RouterModel(_RoutedModel):
    """router_bf16: router logits from the bf16-rounded MoE input and bf16-rounded router (then fp32 as usual)."""

    def _route(self, b, router, k, tag):
        b16, r16 = b.to(torch.bfloat16).float(), router.to(torch.bfloat16).float()
        return route(b16 @ r16.T, k)


class FoldWithoutOutNorm(FastModel):
    """router_fold_w_out: the router fold's output partials W' (w_out * o) without the attn_out_norm weight, W' o:
    the router reading an attention branch its norm's weight never scaled."""

    def attention(self, c, index, attn, kv, a, blk):
        out = super().attention(c, index, attn, kv, a, blk)
        if not isinstance(out, PendingProjection):
            return out
        return out._replace(fold=out.fold._replace(w_out=torch.ones_like(out.fold.w_out)))


def _fold_applies(model_dir, fmt: str, options, tp: int) -> str | None:
    return None if options.router_fold else "the candidate routes with the router's own pass (no --router-fold)"


def _folded_rows(sessions, model_dir) -> int:
    """Rows through a MoE layer whose routing was folded (the blocks recorded the fold's router_in taps)."""
    return _rows(sessions, lambda b, i: b.taps is not None and any(k.endswith("router_in") for k in b.taps))


class KeepRejectedKV(RoundRunner):
    """keep_rejected_kv: the rejected drafts stay in the context (no rollback): d_1..d_k and x committed. (Where no
    draft was verified, k = 0: prefill's first token and plain rounds commit what they would anyway.)"""

    def settle(self, committed, count, emitted, n_emit, logprobs, k, a):
        x = emitted.index_select(0, a.view(1))
        committed = torch.where(self.rows < k, torch.cat([self.st.drafts, self.st.drafts[:1]]), x)
        return super().settle(committed, k + 1, emitted, n_emit, logprobs, k, a)


class SkipRedraft(RoundRunner):
    """skip_redraft: depth 0 drafts only the round's last committed row, so the accepted positions keep the draft
    KV written from draft hiddens."""

    def settle(self, committed, count, emitted, n_emit, logprobs, k, a):
        nxt = super().settle(committed, count, emitted, n_emit, logprobs, k, a)
        return nxt._replace(live=self.rows == nxt.last)


class ReplacementFromP(RoundRunner):
    """replacement_from_p: at a rejection the replacement is drawn from p_a itself, not normalize(max(0, p - q))."""

    def accept(self, p_ids, p_probs, n, k):
        st, ops, j = self.st, self.m.ops, self.rows
        p_d = sampler.prob_of(p_ids[:-1], p_probs[:-1], st.drafts)
        q_d = sampler.prob_of(st.q_ids, st.q_probs, st.drafts)
        _, a = sampler.acceptance(p_d, q_d, ops.uniforms(st.seed, n + self.depths, PURPOSE_ACCEPT), self.depths <= k)
        f_ids, f_probs = p_ids.index_select(0, a.view(1)), p_probs.index_select(0, a.view(1))
        x = sampler.draw(f_ids, f_probs, ops.uniforms(st.seed, (n + a + 1).view(1), PURPOSE_COMMIT))
        emitted = torch.where(j < a, torch.cat([st.drafts, st.drafts[:1]]), x)
        return a, x[0], emitted


class TopPDropsCrossing(RoundRunner):
    """top_p_drops_crossing: top-p also drops the token that crosses the threshold (every distribution the round
    samples or verifies with, drafts included: their draws then come from the edited distribution, by the torch form
    of the draw)."""

    @staticmethod
    def _drop_crossing(ids, probs):
        last = (probs > 0).sum(-1, keepdim=True) - 1  # Dist order: the crossing token is the last one kept
        probs = torch.where((torch.arange(probs.shape[-1], device=probs.device) == last) & (last > 0), 0.0, probs)
        return ids, probs / probs.sum(-1, keepdim=True)

    def dist(self, local_logits):
        return self._drop_crossing(*super().dist(local_logits))

    def sample(self, local_logits, u, out, chain=None):
        edited = SimpleNamespace(dist=lambda *args: self._drop_crossing(*self.m.ops.dist(*args)))
        return TorchOps.sample(edited, local_logits, *self._sampling_args(), u, out, chain)


class TemperedLogprobs(RoundRunner):
    """logprobs_tempered: a token's reported log-probability from the tempered logits (logits / temperature, as the
    sampling distribution tempers them) instead of the model's own."""

    def logprobs(self, local_logits, tokens):
        t = self.st.temperature
        return super().logprobs(torch.where(t > 0, local_logits / t, local_logits), tokens)


def _logprobs_apply(model_dir, fmt: str, options, tp: int) -> str | None:
    return None if tp == 1 else "decode.logprobs needs the whole vocabulary's logits (rank 0 records its slice)"


def _tempered_tokens(sessions) -> int:
    """Emitted tokens of sessions sampled at a temperature other than 0 and 1 (where tempering moves a logprob)."""
    return sum(len(st.tokens) for s in sessions if s.params.temperature not in (0.0, 1.0) for st in s.steps)


def _all(check: str, classes) -> tuple[tuple[str, str], ...]:
    return tuple((check, c) for c in classes)


REGISTRY: list[Control] = [
    Control("ring_exact_w", "sliding-window ring of exactly W slots (no 64-slot slack)",
            EngineParts(cache=ExactWindowRing),
            # The structural check holds it in every dtype (the evicted keys can move bf16 logits by less than their
            # tolerance); the numerical one is kept, and its margin reported.
            (("cache.window", "ring_reused"), ("numerics.logits", "ring_reused"), ("cache.window", "draft_ring_reused")),
            "decode", lambda s, d: _ring_wrapped(s), "verification blocks written after the W-slot ring wrapped"),
    Control("drop_sink", "attention sink logit dropped from the softmax denominator", EngineParts(model=NoSinkModel),
            (("numerics.logits", "prefill"),), "decode", lambda s, d: _forward_rows(s),
            "target rows whose attention ran without the sink"),
    Control("scalar_sink", "query-independent sink: one constant logit per head (scale x sum of sink_k)",
            EngineParts(model=ScalarSinkModel), (("numerics.logits", "prefill"),), "decode",
            lambda s, d: _forward_rows(s), "target rows whose sink logit ignored the query"),
    Control("rope_shift_rows", "rotary position off by one for rows after a block's first",
            EngineParts(model=ShiftedRopeModel), _all("numerics.logits", VERIFY[1:]), "decode",
            lambda s, d: _verify_blocks(s, lambda b: sum(b.live) > 1), "verification blocks with more than one row"),
    Control("rope_double_dims", "partial RoPE over 2 x rotary_dim dims instead of rotary_dim",
            EngineParts(model=DoubleRotaryModel), (("numerics.logits", "prefill"),), "decode",
            lambda s, d: _rotated_rows(s), "target rows past position 0 (rotated)"),
    Control("rope_last_dims", "partial RoPE over the head's last rotary_dim dims instead of its first",
            EngineParts(model=LastDimsRopeModel), (("numerics.logits", "prefill"),), "decode",
            lambda s, d: _rotated_rows(s), "target rows past position 0 (rotated)"),
    Control("raw_residual", "layers >= 1 continue the residual from the raw input x (layer 0's form), not from a",
            EngineParts(model=RawResidualModel), (("numerics.logits", "prefill"),), "decode",
            lambda s, d: _forward_rows(s), "target rows through a layer >= 1"),
    Control("open_causal_mask", "causal mask open inside the verification block", EngineParts(cache=OpenCausalMask),
            _all("numerics.logits", VERIFY[:7]), "decode",
            lambda s, d: _verify_blocks(s, lambda b: sum(b.live) > 1), "verification blocks with a later live row"),
    Control("keep_rejected_kv", "rejected rows' KV left valid (no rollback)", EngineParts(runner=KeepRejectedKV),
            (("numerics.logits", "verify_row0"),), "decode",
            lambda s, d: _rounds(s, lambda st: st.accepted < st.drafts), "rounds with a rejected draft"),
    Control("skip_redraft", "depth-0 redraft skipped (draft KV of accepted positions from draft hiddens)",
            EngineParts(runner=SkipRedraft),
            (("decode.acceptance", "first_divergence"),) + _all("numerics.logits", DRAFT_DEPTHS), "decode",
            lambda s, d: _rounds(s, lambda st: st.accepted >= 1), "rounds with an accepted draft (redraft > 1 row)"),
    Control("draft_target_embedding", "the draft reads the target's embedding table instead of its own",
            EngineParts(loader=DraftTargetEmbedding), _all("numerics.logits", DRAFT_DEPTHS), "decode",
            _embedding_differs, "draft rows whose token's two embedding rows differ"),
    Control("draft_window_4096", f"the draft layer's window is {WRONG_DRAFT_WINDOW} keys instead of mtp/config.json's",
            EngineParts(cache=WideDraftWindow), (("numerics.logits", "draft_past_window"),), "decode",
            lambda s, d: _past_draft_window(s), "draft rows at positions >= the config's draft window"),
    Control("mtp_router_shift", "draft layer's router skips its best expert (ranks 2..k+1 chosen)",
            EngineParts(model=ShiftedDraftRouterModel),
            _all("numerics.router", DRAFT_DEPTHS) + _all("numerics.router_scores", DRAFT_DEPTHS), "decode",
            lambda s, d: _draft_rows(s), "live draft rows (each routed by the shifted router)"),
    Control("router_bf16", "router logits from the bf16-rounded MoE input and router",
            EngineParts(model=Bf16RouterModel),
            _all("numerics.router_scores", ["prefill"] + VERIFY + DRAFT_DEPTHS), "decode",
            _router_rows, "rows through an MoE layer whose router (or input) is not bf16-exact"),
    Control("router_fold_w_out", "router fold: the o-projection's partials without the attn_out_norm weight",
            EngineParts(model=FoldWithoutOutNorm),
            _all("numerics.router_scores", ["prefill"] + VERIFY + DRAFT_DEPTHS), "decode",
            _folded_rows, "rows through an MoE layer whose routing was folded", applies=_fold_applies),
    Control("fp8_scales_transposed", "FP8 scale blocks indexed transposed (scale[c//B1, r//B0])",
            EngineParts(loader=TransposedScales), (("numerics.logits", "prefill"),), "decode",
            lambda s, d: _square_scales(d, "fp8"), "FP8 weights whose square scale grid is not symmetric",
            applies=_scales_apply),
    Control("logprobs_tempered", "reported logprobs from the tempered logits, not the model's own",
            EngineParts(runner=TemperedLogprobs), (("decode.logprobs", "emitted"),), "decode",
            lambda s, d: _tempered_tokens(s), "emitted tokens sampled at a temperature other than 0 and 1",
            applies=_logprobs_apply),
    Control("top_p_drops_crossing", "top-p drops the token that crosses the threshold",
            EngineParts(runner=TopPDropsCrossing), _all("numerics.sampler", VERIFY + DRAFT_DEPTHS),
            "decode", lambda s, d: _cut_rows(s), "sampled rows"),
    Control("replacement_from_p", "replacement drawn from p instead of normalize(max(0, p - q))",
            EngineParts(runner=ReplacementFromP), (("lossless", "speculative_token"),), "lossless",
            lambda info, d: info["replacement_drew_tested_token"],
            "requests whose tested token came from the replacement branch"),
]


def control(name: str) -> Control:
    """The registered control called `name` (a clear error naming the known ones otherwise)."""
    for c in REGISTRY:
        if c.name == name:
            return c
    raise ValueError(f"unknown negative control {name!r}; known: {', '.join(c.name for c in REGISTRY)}")
