"""`iquest info`: a config's size, what one speculative round must read, and the memory a rank needs.

Everything is computed from the config and the checkpoint layout (`tensor_specs`), never from weights,
so it works on the full-size `configs/iquest-q1.json`. Byte counts are per tensor-parallel rank
(rank 0) at `--tp`; at --tp 1 they are the whole model's.

A round verifies up to 8 rows (1 committed token + up to 7 drafts) through every main layer, and the
MTP layer drafts. What it reads:
  dense:   attention (q/k/v/o + scales, sinks, norms) and the router of every main layer, the final
           norm, the LM head, the MTP layer's attention, router, eh_proj and norms, 8 embedding rows;
  experts: at most every expert of every layer ("all experts"), or at most min(E, 8 x top-k)
           distinct experts per layer ("8 rows x top-k");
  KV:      K and V of every layer at the context: sliding layers min(context, window), full layers
           the whole context.
"""

from __future__ import annotations

import argparse

from .options import add_json, print_json

VERIFY_ROWS = 8


def register(sub) -> None:
    p = sub.add_parser("info", help="config summary, parameter count, bytes per round, memory per rank",
                       description="Summarize a model config: parameter count (from the checkpoint layout), the "
                                   "bytes one speculative round reads at a context (dense weights, experts, KV "
                                   "cache) and the memory a rank needs at a TP degree and context. With --model it "
                                   "checks the checkpoint's safetensors headers (names, shapes, dtypes, complete "
                                   "files) against the layout it counts; --config reads a config alone, so it works "
                                   "on configs/iquest-q1.json (never materialized).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a checkpoint folder (default: the shipped mini model)")
    src.add_argument("--config", help="a config file alone instead, e.g. configs/iquest-q1.json")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree 1/2/4/8: bytes are per rank (default 1)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens in the KV cache for bytes per round and memory (default: min(32768, "
                        "max_position_embeddings))")
    p.add_argument("--bandwidth", type=float, default=4.8,
                   help="memory bandwidth in TB/s for the round-time lower bound (default 4.8, an H200)")
    add_json(p)
    p.set_defaults(run=run)


def kv_read_bytes(config, tp: int, context: int, dtype_bytes: int = 2) -> int:
    """K and V bytes one round reads per rank: sliding layers min(context, window), full layers context."""
    kv_heads = max(config.num_key_value_heads // tp, 1)
    total = 0
    for layer in range(config.num_hidden_layers + 1):  # + the MTP layer
        span = min(context, config.sliding_window) if config.layer_type(layer) == "sliding_attention" else context
        total += 2 * span * kv_heads * config.head_dim * dtype_bytes
    return total


def summarize(config, tp: int, context: int, bandwidth_tbs: float = 4.8) -> dict:
    from ..fast.memory import rank_bytes, rank_tensor_bytes
    from ..reference.checkpoint import tensor_specs

    config.check_tp(tp)
    c = config
    params = 0
    expert_params = 0
    for spec in tensor_specs(c).values():
        numel = 1
        for d in spec.shape:
            numel *= d
        params += numel
        if ".mlp.experts." in spec.name:
            expert_params += numel
    per_expert_params = 3 * c.moe_intermediate_size * c.hidden_size
    layers = c.num_hidden_layers + c.num_nextn_predict_layers
    active = params - expert_params - c.vocab_size * c.hidden_size + layers * c.num_experts_per_tok * per_expert_params

    tb = rank_tensor_bytes(c, tp)
    expert_bytes = sum(b for n, b in tb.items() if ".mlp.experts." in n)
    embed = tb["model.embed_tokens.weight"]
    dense = sum(tb.values()) - expert_bytes - embed + VERIFY_ROWS * c.hidden_size * 2  # 8 bf16 embedding rows
    one_expert = expert_bytes // (layers * c.n_routed_experts)
    distinct = min(c.n_routed_experts, VERIFY_ROWS * c.num_experts_per_tok)
    kv = kv_read_bytes(c, tp, context)
    round_all = dense + expert_bytes + kv
    round_distinct = dense + layers * distinct * one_expert + kv
    weights = sum(tb.values())
    memory = rank_bytes(c, tp, context)
    return {
        "config": {
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers,
            "sliding_layers": sum(t == "sliding_attention" for t in c.layer_types),
            "full_layers": sum(t == "full_attention" for t in c.layer_types),
            "sliding_window": c.sliding_window, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "n_routed_experts": c.n_routed_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size, "mtp_layers": c.num_nextn_predict_layers,
            "max_position_embeddings": c.max_position_embeddings,
            "weight_block_size": list(c.weight_block_size),
        },
        "parameters": {"total": params, "experts": expert_params, "active_per_token": active},
        "tp": tp, "context": context,
        "round_bytes": {
            "dense": dense, "kv": kv,
            "experts_all": expert_bytes, "experts_distinct": layers * distinct * one_expert,
            "distinct_experts_per_layer": distinct,
            "total_all_experts": round_all, "total_distinct_experts": round_distinct,
            "bandwidth_tbs": bandwidth_tbs,
            "seconds_lower_bound_all": round_all / (bandwidth_tbs * 1e12),
            "seconds_lower_bound_distinct": round_distinct / (bandwidth_tbs * 1e12),
        },
        "memory_per_rank": {"weights": weights, "kv_cache": memory - weights, "total": memory},
    }


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    for unit, scale in (("billion", 1e9), ("million", 1e6), ("thousand", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return str(n)


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} us"


def check_checkpoint(model_dir, config) -> dict:
    """The checkpoint's headers against the layout `summarize` counts (CheckpointReader: names, shapes, dtypes,
    files covering what their headers describe; no weight bytes read)."""
    from ..reference.checkpoint import CheckpointReader, expected_dtypes_and_shapes

    CheckpointReader(model_dir, config)
    files = sorted(model_dir.glob("*.safetensors"))
    return {"files": len(files), "tensors": len(expected_dtypes_and_shapes(config)),
            "bytes": sum(f.stat().st_size for f in files)}


def run(args: argparse.Namespace) -> int:
    from ..reference.config import Config
    from .main import UserError
    from .options import model_folder

    checkpoint = None
    if args.config:
        config, source = Config.from_file(args.config), args.config
    else:
        model_dir = model_folder(args.model)
        config, source = Config.from_dir(model_dir), str(model_dir)
        checkpoint = check_checkpoint(model_dir, config)
    context = args.context if args.context is not None else min(32768, config.max_position_embeddings)
    if not 1 <= context <= config.max_position_embeddings:
        raise UserError(f"--context must be in 1..{config.max_position_embeddings} (max_position_embeddings), "
                        f"got {context}")
    if not args.bandwidth > 0:
        raise UserError(f"--bandwidth must be > 0 TB/s, got {args.bandwidth}")
    info = summarize(config, args.tp, context, args.bandwidth)
    info["source"] = source
    info["checkpoint"] = checkpoint
    if args.json:
        print_json(info)
        return 0
    c, p, r, m = info["config"], info["parameters"], info["round_bytes"], info["memory_per_rank"]
    print(f"{source}")
    if checkpoint is not None:
        print(f"  checkpoint    {checkpoint['tensors']} tensors in {checkpoint['files']} safetensors "
              f"file{'s' if checkpoint['files'] != 1 else ''}, "
              f"{_size(checkpoint['bytes'])} on disk: headers match the layout")
    print(f"  layers        {c['num_hidden_layers']} main ({c['sliding_layers']} sliding, window {c['sliding_window']} "
          f"tokens; {c['full_layers']} full) + {c['mtp_layers']} MTP layer")
    print(f"  attention     hidden {c['hidden_size']} dims, {c['num_attention_heads']} heads x {c['head_dim']} dims, "
          f"{c['num_key_value_heads']} KV heads")
    print(f"  experts       {c['n_routed_experts']} routed, top-{c['num_experts_per_tok']} a token, "
          f"intermediate {c['moe_intermediate_size']} dims")
    print(f"  vocabulary    {c['vocab_size']} tokens, max positions {c['max_position_embeddings']} tokens")
    print(f"  parameters    {_count(p['total'])} total, {_count(p['experts'])} in experts, "
          f"{_count(p['active_per_token'])} active per token")
    print(f"one round at a context of {context} tokens, per rank at tp={args.tp} (8 verify rows):")
    print(f"  dense weights {_size(r['dense'])}   (attention, routers, LM head, MTP layer)")
    print(f"  experts       {_size(r['experts_all'])} all experts | {_size(r['experts_distinct'])} "
          f"for {r['distinct_experts_per_layer']} distinct per layer (8 rows x top-k)")
    print(f"  KV cache      {_size(r['kv'])}")
    print(f"  total         {_size(r['total_all_experts'])} (all experts) | {_size(r['total_distinct_experts'])} "
          f"(distinct): >= {_duration(r['seconds_lower_bound_all'])} | "
          f"{_duration(r['seconds_lower_bound_distinct'])} at {args.bandwidth:g} TB/s")
    print(f"memory per rank at tp={args.tp}, --max-context {context} tokens: {_size(m['total'])} "
          f"(weights {_size(m['weights'])}, KV caches {_size(m['kv_cache'])}; plus ~15% headroom)")
    return 0
