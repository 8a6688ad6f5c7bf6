"""Bytes one speculative round must read on one rank: the numerator of the byte floor.

A round at context `c` with fixed depth `k` is
  * one verification over k+1 rows: every main layer's attention weights (q/k/v/o E4M3 + fp32 block
    scales, sinks), its router (as held: bf16), the DISTINCT experts the k+1 rows route to (gate/up/down
    E4M3 + scales, this rank's slice of each), its two norms, the KV history the rows can see (sliding
    layers min(c, W) positions, full layers c; K and V of this rank's KV heads); then the final norm,
    this rank's LM head rows and the rows' embeddings;
  * k draft passes through the MTP layer: depth 0 over the a+1 newly committed rows, then k-1 single
    rows; each pass reads eh_proj (this rank's input columns), the MTP block (attention, router, its
    distinct experts, norms, its KV), enorm/hnorm/shared_head.norm, the LM head again, and the rows'
    embeddings.
Activations, sampling state and writes are not counted (each is under 1 MB per round at full size).
Distinct experts come from the run's routing (`RoundRouting`); without it, the upper bounds
min(E, rows * top-k) are used. Weights are counted as stored (E4M3 + scales), not as the torch
fallback reads them (it dequantizes to bf16 copies), so the floor is what a fused FP8 kernel would need.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..reference.checkpoint import layer_prefix, shard_range, tensor_specs
from ..reference.config import Config

SCALE_BYTES = 4  # fp32 block scales


@dataclass(frozen=True)
class RoundRouting:
    """Distinct experts per MoE call of one round, from the run (verification live rows only)."""

    verify: tuple[int, ...]   # one per main layer, over the k+1 verification rows
    draft: tuple[int, ...]    # one per draft pass: depth 0 (a+1 rows), then the k-1 single rows
    accepted: int             # a: drafts accepted by the verification that preceded depth 0


class ByteCounter:
    def __init__(self, config: Config, tp: int, rank: int = 0, act_bytes: int = 2, router_bytes: int = 2):
        """act_bytes: bytes per element of tensors held in the compute dtype (norms, embedding, LM head, KV);
        router_bytes: per router element as held (bf16 in fast/weights.py, as stored)."""
        self.c, self.tp, self.rank = config, tp, rank
        self.act_bytes, self.router_bytes = act_bytes, router_bytes
        self.specs = tensor_specs(config)
        self.kv_heads = max(config.num_key_value_heads // tp, 1)

    # ---- one tensor's rank slice ------------------------------------------------------------------
    def slice_bytes(self, name: str) -> int:
        """This rank's E4M3 slice of a quantized tensor plus its fp32 scales (as CheckpointReader slices)."""
        spec = self.specs[name]
        assert spec.quantized, name
        shape = list(spec.shape)
        scale = [-(-d // b) for d, b in zip(spec.shape, self.c.weight_block_size)]
        part = shard_range(spec, self.c, self.tp, self.rank)
        if part is not None:
            dim, start, stop = part
            shape[dim] = stop - start
            b = self.c.weight_block_size[dim]
            scale[dim] = -(-stop // b) - start // b
        return shape[0] * shape[1] + scale[0] * scale[1] * SCALE_BYTES

    # ---- per layer ------------------------------------------------------------------------------
    def attention_weights(self, layer: int) -> int:
        p = layer_prefix(layer) + "self_attn."
        total = sum(self.slice_bytes(f"{p}{w}_proj.weight") for w in "qkvo")
        if self.c.attention_sinks:
            total += self.c.num_attention_heads // self.tp * 4
        if self.c.qk_norm:
            total += 2 * self.c.head_dim * self.act_bytes
        return total

    def router(self) -> int:
        return self.c.n_routed_experts * self.c.hidden_size * self.router_bytes

    def expert(self, layer: int) -> int:
        """One expert's gate, up and down slices with scales."""
        p = f"{layer_prefix(layer)}mlp.experts.0."
        return sum(self.slice_bytes(f"{p}{w}_proj.weight") for w in ("gate", "up", "down"))

    def norms(self, count: int) -> int:
        return count * self.c.hidden_size * self.act_bytes

    def kv(self, layer: int, context: int) -> int:
        visible = min(context, self.c.sliding_window) if self.c.layer_type(layer) == "sliding_attention" else context
        return 2 * visible * self.kv_heads * self.c.head_dim * self.act_bytes

    def lm_head(self) -> int:
        return self.c.vocab_size // self.tp * self.c.hidden_size * self.act_bytes

    def embed_rows(self, rows: int) -> int:
        return rows * self.c.hidden_size * self.act_bytes

    def upper_bound_experts(self, rows: int) -> int:
        return min(self.c.n_routed_experts, rows * self.c.num_experts_per_tok)

    # ---- a round ----------------------------------------------------------------------------------
    def upper_routing(self, k: int) -> RoundRouting:
        """Every row on different experts; depth 0 over k+1 rows (all drafts accepted)."""
        return RoundRouting(verify=(self.upper_bound_experts(k + 1),) * self.c.num_hidden_layers,
                            draft=(self.upper_bound_experts(k + 1),) + (self.upper_bound_experts(1),) * (k - 1),
                            accepted=k)

    def round(self, context: int, k: int, routing: RoundRouting | None = None) -> dict:
        """{"verify": {item: bytes}, "draft": {item: bytes}, "total": bytes} for one round."""
        c = self.c
        routing = routing or self.upper_routing(k)
        if len(routing.verify) != c.num_hidden_layers or len(routing.draft) != k:
            raise ValueError(f"routing has {len(routing.verify)} layers and {len(routing.draft)} draft passes; "
                             f"expected {c.num_hidden_layers} and {k}")
        layers = range(c.num_hidden_layers)
        verify = {
            "attention_weights": sum(self.attention_weights(i) for i in layers),
            "router": c.num_hidden_layers * self.router(),
            "experts": sum(n * self.expert(i) for i, n in zip(layers, routing.verify)),
            "norms": self.norms(2 * c.num_hidden_layers + 1),
            "kv": sum(self.kv(i, context) for i in layers),
            "lm_head": self.lm_head(),
            "embedding_rows": self.embed_rows(k + 1),
        }
        m = c.mtp_layer_index
        rows = [routing.accepted + 1] + [1] * (k - 1)
        draft = {
            "eh_proj": k * self.slice_bytes(layer_prefix(m) + "eh_proj.weight"),
            "attention_weights": k * self.attention_weights(m),
            "router": k * self.router(),
            "experts": sum(n * self.expert(m) for n in routing.draft),
            "norms": k * self.norms(5),  # enorm, hnorm, input and post-attention norms, shared_head.norm
            "kv": k * self.kv(m, context),
            "lm_head": k * self.lm_head(),
            "embedding_rows": sum(self.embed_rows(r) for r in rows),
        }
        return {"verify": verify, "draft": draft, "total": sum(verify.values()) + sum(draft.values())}


def round_bytes(config: Config, tp: int, context: int, k: int, routing: RoundRouting | None = None,
                rank: int = 0, act_bytes: int = 2, router_bytes: int = 2) -> dict:
    return ByteCounter(config, tp, rank, act_bytes, router_bytes).round(context, k, routing)


# Which of a round's byte items each profiled stage of bench/full_step.py reads (its labels in fast/model.py and
# fast/round.py): the per-stage floors. The embedding rows (a few KB) belong to no labelled stage.
STAGE_ITEMS = {"attention": ("attention_weights", "kv"), "moe": ("router", "experts"), "norm": ("norms",),
               "lm_head": ("lm_head",), "draft": ("eh_proj",)}


def stage_bytes(breakdown: dict) -> dict[str, int]:
    """Bytes per profiled stage of one round's `ByteCounter.round` breakdown (verification and drafting together)."""
    return {stage: sum(part.get(item, 0) for part in (breakdown["verify"], breakdown["draft"]) for item in items)
            for stage, items in STAGE_ITEMS.items()}

