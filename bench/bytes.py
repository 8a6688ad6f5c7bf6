"""Bytes one speculative round must read on one rank: the numerator of the byte floor (docs/model.md's model).

A round at context `c` with fixed depth `k` is
  * one verification over k+1 rows: every main layer's attention weights (q/k/v/o and this rank's `sink_k` rows),
    its MLP (the dense MLP's gate/up/down slices in `mlp_only_layers`; elsewhere the fp32 router and the DISTINCT
    experts the k+1 rows route to, this rank's slice of each), its norms (attention, attention-output and
    feed-forward norms, layer 0's MLP-output norm, the q/k norms), the KV history the rows can see (sliding layers
    min(c, W) positions, full layers c; K and V of this rank's KV heads); then the final norm, this rank's bf16 LM
    head rows and the rows' embeddings;
  * k draft passes through the draft block: depth 0 over the a+1 newly committed rows, then k-1 single rows; each
    pass reads eh_proj (this rank's input columns), the block (attention, router, its distinct experts, its four
    norms and q/k norms), enorm, hnorm and final_layernorm, the draft's KV (min(c, Wd) positions), the draft's own
    bf16 LM head rows and the rows of its own embedding.
Activations, sampling state and writes are not counted (each is under 1 MB per round at full size).
Distinct experts come from the run's routing (`RoundRouting`); without it, the upper bounds min(E, rows * top-k)
are used. Weights are counted as the engine holds them (fast/memory.rank_tensor_bytes: E4M3 + fp32 scales where the
linears run as FP8, bf16 otherwise, the heads too; the routers fp32), not as the torch forms read them (they
dequantize to compute-dtype copies), so the floor is what kernels reading the held weights once would need.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..fast.memory import rank_tensor_bytes
from ..reference.checkpoint import draft_prefix, expert_name, layer_prefix
from ..reference.config import Config

DRAFT = "mtp/"


@dataclass(frozen=True)
class RoundRouting:
    """Distinct experts per MoE call of one round, from the run (verification live rows only)."""

    verify: tuple[int, ...]   # one per main MoE layer (layers outside mlp_only_layers), in order
    draft: tuple[int, ...]    # one per draft pass: depth 0 (a+1 rows), then the k-1 single rows
    accepted: int             # a: drafts accepted by the verification that preceded depth 0


class ByteCounter:
    def __init__(self, config: Config, tp: int, rank: int = 0, act_bytes: int = 2, fmt: str | None = None):
        """act_bytes: bytes per element of the KV cache and the embedding rows (the compute dtype); fmt: what the
        linears run as (fp8 or bf16; default the checkpoint's own format)."""
        self.c, self.tp, self.rank, self.act_bytes = config, tp, rank, act_bytes
        self.held = rank_tensor_bytes(config, tp, rank, fmt)
        self.kv_heads = max(config.num_key_value_heads // tp, 1)
        self.moe_layers = tuple(i for i in range(config.num_hidden_layers) if not config.is_dense(i))

    def tensor(self, name: str) -> int:
        """This rank's bytes of one logical tensor as held (with its scales)."""
        return self.held[name]

    # ---- per layer (p: a target layer's prefix or the draft block's) ----------------------------------
    def attention_weights(self, p: str) -> int:
        a = p + "self_attn."
        return sum(self.held.get(a + n, 0) for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight",
                                                     "o_proj.weight", "sink_k"))

    def dense_mlp(self, p: str) -> int:
        return sum(self.held[f"{p}mlp.{w}.weight"] for w in ("gate_proj", "up_proj", "down_proj"))

    def router(self, p: str) -> int:
        return self.held[p + "mlp.router.weight"]

    def expert(self, p: str) -> int:
        """One expert's gate, up and down slices with scales."""
        return sum(self.held[expert_name(p, 0, w)] for w in ("gate_proj", "up_proj", "down_proj"))

    def layer_norms(self, p: str) -> int:
        names = ("attention_norm.weight", "attn_out_norm.weight", "feed_forward_norm.weight", "ffn_out_norm.weight",
                 "self_attn.q_norm.weight", "self_attn.k_norm.weight")
        return sum(self.held.get(p + n, 0) for n in names)

    def kv(self, window: int | None, context: int) -> int:
        visible = context if window is None else min(context, window)
        return 2 * visible * self.kv_heads * self.c.head_dim * self.act_bytes

    def embed_rows(self, rows: int) -> int:
        return rows * self.c.hidden_size * self.act_bytes

    def upper_bound_experts(self, rows: int, config: Config | None = None) -> int:
        c = config or self.c
        return min(c.num_experts, rows * c.num_experts_per_tok)

    # ---- a round ----------------------------------------------------------------------------------
    def upper_routing(self, k: int) -> RoundRouting:
        """Every row on different experts; depth 0 over k+1 rows (all drafts accepted)."""
        d = self.c.mtp
        return RoundRouting(verify=(self.upper_bound_experts(k + 1),) * len(self.moe_layers),
                            draft=(self.upper_bound_experts(k + 1, d),) + (self.upper_bound_experts(1, d),) * (k - 1),
                            accepted=k)

    def round(self, context: int, k: int, routing: RoundRouting | None = None) -> dict:
        """{"verify": {item: bytes}, "draft": {item: bytes}, "total": bytes} for one round."""
        c, d = self.c, self.c.mtp
        routing = routing or self.upper_routing(k)
        if len(routing.verify) != len(self.moe_layers) or len(routing.draft) != k:
            raise ValueError(f"routing has {len(routing.verify)} MoE layers and {len(routing.draft)} draft passes; "
                             f"expected {len(self.moe_layers)} and {k}")
        layers = [layer_prefix(i) for i in range(c.num_hidden_layers)]
        verify = {
            "attention_weights": sum(self.attention_weights(p) for p in layers),
            "dense_mlp": sum(self.dense_mlp(layer_prefix(i)) for i in c.mlp_only_layers),
            "router": sum(self.router(layer_prefix(i)) for i in self.moe_layers),
            "experts": sum(n * self.expert(layer_prefix(i)) for i, n in zip(self.moe_layers, routing.verify)),
            "norms": sum(self.layer_norms(p) for p in layers) + self.held["model.norm.weight"],
            "kv": sum(self.kv(c.window(i), context) for i in range(c.num_hidden_layers)),
            "lm_head": self.held["lm_head.weight"],
            "embedding_rows": self.embed_rows(k + 1),
        }
        b = draft_prefix()
        rows = [routing.accepted + 1] + [1] * (k - 1)
        moe = not d.is_dense(0)
        draft = {
            "eh_proj": k * self.held[DRAFT + "mtp.eh_proj.weight"],
            "attention_weights": k * self.attention_weights(b),
            "dense_mlp": 0 if moe else k * self.dense_mlp(b),
            "router": k * self.router(b) if moe else 0,
            "experts": sum(n * self.expert(b) for n in routing.draft) if moe else 0,
            "norms": k * (self.layer_norms(b) + sum(self.held[DRAFT + f"mtp.{n}.weight"]
                                                   for n in ("enorm", "hnorm", "final_layernorm"))),
            "kv": k * self.kv(d.window(0), context),
            "lm_head": k * self.held[DRAFT + "lm_head.weight"],
            "embedding_rows": sum(self.embed_rows(r) for r in rows),
        }
        return {"verify": verify, "draft": draft, "total": sum(verify.values()) + sum(draft.values())}


def round_bytes(config: Config, tp: int, context: int, k: int, routing: RoundRouting | None = None,
                rank: int = 0, act_bytes: int = 2, fmt: str | None = None) -> dict:
    return ByteCounter(config, tp, rank, act_bytes, fmt).round(context, k, routing)


# Which of a round's byte items each profiled stage of bench/full_step.py reads (its labels in fast/model.py,
# fast/round.py and fast/torch_ops.py; the innermost label counts, so every norm, q/k norms included, is "norm", and
# the draft's own layer is "attention" / "mlp" / "norm" like the target's): the per-stage floors. The embedding rows
# (a few KB) belong to no labelled stage.
STAGE_ITEMS = {"attention": ("attention_weights", "kv"), "mlp": ("dense_mlp", "router", "experts"),
               "norm": ("norms",), "lm_head": ("lm_head",), "draft": ("eh_proj",)}


def stage_bytes(breakdown: dict) -> dict[str, int]:
    """Bytes per profiled stage of one round's `ByteCounter.round` breakdown (verification and drafting together)."""
    return {stage: sum(part.get(item, 0) for part in (breakdown["verify"], breakdown["draft"]) for item in items)
            for stage, items in STAGE_ITEMS.items()}
