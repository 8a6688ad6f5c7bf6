"""`iquest info`: a config's size, what one speculative round must read, and the memory a rank needs.

Everything is computed from the config and the checkpoint layout (`tensor_specs`, fast/memory.py's per-rank tensor
bytes), never from weights, so it works on the full-size `configs/iquest-q1.json` (with its draft config,
`configs/iquest-q1-mtp.json`). Byte counts are per tensor-parallel rank (rank 0) at `--tp`, as the fast engine holds
the tensors on a GPU: linear weights in the format `--weights` gives them (E4M3 + fp32 block scales, or bf16), norms,
embeddings and caches bf16, the routers and both LM heads fp32. At --tp 1 they are the whole model's.

The largest round (docs/round.md) verifies 8 rows (x_n and 7 drafts) through every target layer, and drafts 7 tokens:
the draft layer runs once over up to 8 rows (depth 0) and once more per further depth (6 single rows), each pass
reading the draft's own weights, LM head included. What it reads:
  dense:   every target tensor but the experts and the embedding (attention with its norms and sink keys, the dense
           MLP layers, the routers, the final norm, the bf16 LM head), 8 embedding rows; per draft pass every draft
           tensor but its experts and embedding (eh_proj, norms, attention, router, its bf16 LM head) and its rows;
  experts: at most every expert of every MoE layer and of each draft pass ("all experts"), or at most the distinct
           experts the rows can choose: min(E, 8 x top-k) per target MoE layer and for the depth-0 pass, top-k for
           each single-row pass ("distinct");
  KV:      K and V of every target layer at the context (sliding layers min(context, window), full layers the whole
           context) and, per draft pass, the draft's min(context, draft window).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import WEIGHTS, add_json, print_json

VERIFY_ROWS = 8
DRAFTS = 7  # the largest round: 7 drafts, 7 passes of the draft layer


def register(sub) -> None:
    p = sub.add_parser("info", help="config summary, parameter count, bytes per round, memory per rank",
                       description="Summarize a model config: layers (full and sliding, dense and MoE), dimensions, "
                                   "experts, the draft's window, the weight format, the parameter count (from the "
                                   "checkpoint layout), the bytes the largest speculative round reads at a context "
                                   "(dense weights, experts, KV cache; target and draft passes) and the memory a rank "
                                   "needs at a TP degree and context. With --model it checks the checkpoint's "
                                   "safetensors headers (names, shapes, dtypes, complete files) against the layout it "
                                   "counts; --config reads a config file alone (the draft's from mtp/config.json or "
                                   "NAME-mtp.json beside it), so it works on configs/iquest-q1.json (never "
                                   "materialized).")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a checkpoint folder (default: the shipped mini model)")
    src.add_argument("--config", help="a config file alone instead, e.g. configs/iquest-q1.json (its draft's config "
                                      "beside it: mtp/config.json next to a config.json, else NAME-mtp.json)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree 1/2/4/8: bytes are per rank (default 1)")
    p.add_argument("--context", type=int, default=None,
                   help="tokens in the KV cache for bytes per round and memory (default: min(32768, "
                        "max_position_embeddings))")
    p.add_argument("--weights", choices=WEIGHTS, default="auto",
                   help="the linear weights' format on the GPU the figures describe, as the fast engine's --weights: "
                        "auto (default) = fp8 (an FP8 checkpoint as stored, a BF16 one quantized at load), bf16 (a "
                        "BF16 checkpoint only) or fp8")
    p.add_argument("--bandwidth", type=float, default=4.8,
                   help="memory bandwidth in TB/s for the round-time lower bound (default 4.8, an H200)")
    add_json(p)
    p.set_defaults(run=run)


def config_with_draft(path: str | Path):
    """A target config file with its draft's: mtp/config.json beside a config.json, else NAME-mtp.json beside
    NAME.json (configs/iquest-q1.json and configs/iquest-q1-mtp.json)."""
    from ..reference.config import Config, ConfigError

    path = Path(path)
    for draft in (path.parent / "mtp" / "config.json", path.with_name(f"{path.stem}-mtp{path.suffix}")):
        if draft.exists():
            return Config.from_file(path, draft)
    if not path.exists():
        raise ConfigError(f"no config file at {path}")
    raise ConfigError(f"{path}: no draft config beside it (mtp/config.json or {path.stem}-mtp{path.suffix})")


def kv_read_bytes(config, tp: int, context: int, dtype_bytes: int = 2, draft_passes: int = DRAFTS) -> int:
    """K and V bytes one round reads per rank: each target layer its visible span (sliding min(context, window),
    full the context), and each of `draft_passes` draft passes the draft's min(context, its window)."""
    from ..fast.cache import windows

    kv_heads = max(config.num_key_value_heads // tp, 1)
    per_key = 2 * kv_heads * config.head_dim * dtype_bytes
    *target, draft = windows(config)
    spans = [context if w is None else min(context, w) for w in target]
    draft_span = context if draft is None else min(context, draft)
    return per_key * (sum(spans) + draft_passes * draft_span)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def weight_description(config, fmt: str) -> str:
    """The checkpoint's weight format and what it runs as, in words."""
    from ..fast.weights import LOAD_BLOCK

    if config.quantized:
        b0, b1 = config.weight_block_size
        return f"fp8 (E4M3, {b0}x{b1} blocks, as stored)"
    if fmt == "fp8":
        return f"fp8 (quantized at load from bf16, {LOAD_BLOCK[0]}x{LOAD_BLOCK[1]} blocks)"
    return "bf16 (as stored)"


def summarize(config, tp: int, context: int, bandwidth_tbs: float = 4.8, weights: str = "auto") -> dict:
    from ..fast.cache import StaticKV
    from ..fast.memory import rank_tensor_bytes
    from ..fast.weights import weight_format
    from ..reference.checkpoint import DRAFT, tensor_specs

    config.check_tp(tp)
    c, d = config, config.mtp
    fmt = weight_format(weights, c, "cuda")
    specs = tensor_specs(c)
    is_expert = lambda name: ".mlp.experts." in name  # noqa: E731
    is_draft = lambda name: name.startswith(DRAFT)  # noqa: E731
    numel = {n: _numel(s.shape) for n, s in specs.items()}
    target_params = sum(v for n, v in numel.items() if not is_draft(n))
    draft_params = sum(v for n, v in numel.items() if is_draft(n))
    expert_params = sum(v for n, v in numel.items() if is_expert(n) and not is_draft(n))
    moe_layers = [i for i in range(c.num_hidden_layers) if not c.is_dense(i)]
    per_expert = 3 * c.intermediate_size * c.hidden_size
    active = (target_params - expert_params - c.vocab_size * c.hidden_size + c.hidden_size
              + len(moe_layers) * c.num_experts_per_tok * per_expert)

    tb = rank_tensor_bytes(c, tp, 0, fmt)
    H, K, E = c.hidden_size, c.num_experts_per_tok, c.num_experts
    row_bytes = H * 2  # one bf16 embedding row
    target_experts = sum(b for n, b in tb.items() if is_expert(n) and not is_draft(n))
    draft_experts = sum(b for n, b in tb.items() if is_expert(n) and is_draft(n))
    target_dense = (sum(b for n, b in tb.items() if not is_expert(n) and not is_draft(n))
                    - tb["model.embed_tokens.weight"] + VERIFY_ROWS * row_bytes)
    draft_dense = sum(b for n, b in tb.items() if not is_expert(n) and is_draft(n)) - tb[DRAFT + "embed_tokens.weight"]
    draft_rows = VERIFY_ROWS + (DRAFTS - 1)  # the depth-0 pass's rows, then one a deeper pass
    distinct = min(E, VERIFY_ROWS * K)
    one_target_expert = target_experts // (len(moe_layers) * E) if moe_layers else 0
    one_draft_expert = draft_experts // E
    dense = target_dense + DRAFTS * draft_dense + draft_rows * row_bytes
    experts_all = target_experts + DRAFTS * draft_experts
    draft_distinct = (distinct + (DRAFTS - 1) * min(E, K)) * one_draft_expert
    experts_distinct = len(moe_layers) * distinct * one_target_expert + draft_distinct
    kv = kv_read_bytes(c, tp, context)
    round_all, round_distinct = dense + experts_all + kv, dense + experts_distinct + kv
    weight_bytes = sum(tb.values())
    kv_cache = StaticKV.bytes_needed(c, max(c.num_key_value_heads // tp, 1), context, 2)
    types = c.layer_types
    return {
        "config": {
            "vocab_size": c.vocab_size, "hidden_size": H, "num_hidden_layers": c.num_hidden_layers,
            "full_layers": sum(t == "full_attention" for t in types),
            "sliding_layers": sum(t == "sliding_attention" for t in types),
            "sliding_window": c.sliding_window, "dense_layers": list(c.mlp_only_layers), "moe_layers": len(moe_layers),
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rotary_dim": c.rotary_dim, "rope_theta": c.rope_theta,
            "swa_rope_theta": c.swa_rope_theta, "sink_attention": c.enable_sink_attention,
            "num_experts": E, "num_experts_per_tok": K, "intermediate_size": c.intermediate_size,
            "dense_intermediate_size": c.dense_intermediate_size,
            "draft_window": d.sliding_window, "draft_rope_theta": d.rope_theta_for(0),
            "draft_fp32_residual": d.fp32_residual_connection, "num_draft_slots": d.num_draft_slots,
            "max_position_embeddings": c.max_position_embeddings,
            "checkpoint_weights": "fp8" if c.quantized else "bf16",
            "weight_block_size": list(c.weight_block_size) if c.quantized else None,
        },
        "weights": {"format": fmt, "quantized_at_load": fmt == "fp8" and not c.quantized,
                    "description": weight_description(c, fmt)},
        "parameters": {"total": target_params + draft_params, "target": target_params, "draft": draft_params,
                       "experts": expert_params, "active_per_token": active},
        "tp": tp, "context": context,
        "round_bytes": {
            "verify_rows": VERIFY_ROWS, "drafts": DRAFTS,
            "dense": dense, "kv": kv,
            "experts_all": experts_all, "experts_distinct": experts_distinct,
            "distinct_experts_per_layer": distinct,
            "target": {"dense": target_dense, "experts_all": target_experts,
                       "experts_distinct": len(moe_layers) * distinct * one_target_expert,
                       "kv": kv_read_bytes(c, tp, context, draft_passes=0)},
            "draft": {"passes": DRAFTS, "dense_per_pass": draft_dense, "experts_all_per_pass": draft_experts,
                      "experts_distinct": draft_distinct, "kv": kv - kv_read_bytes(c, tp, context, draft_passes=0)},
            "total_all_experts": round_all, "total_distinct_experts": round_distinct,
            "bandwidth_tbs": bandwidth_tbs,
            "seconds_lower_bound_all": round_all / (bandwidth_tbs * 1e12),
            "seconds_lower_bound_distinct": round_distinct / (bandwidth_tbs * 1e12),
        },
        "memory_per_rank": {"weights": weight_bytes, "kv_cache": kv_cache, "total": weight_bytes + kv_cache},
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
    files covering what their headers describe; no weight bytes read): its safetensors files (target and mtp/), its
    logical tensors (each expert matrix one, whether stored packed or not; scales counted) and bytes on disk."""
    from ..reference.checkpoint import CheckpointReader
    from ..reference.config import MTP_DIR

    reader = CheckpointReader(model_dir, config)
    files = sorted(model_dir.glob("*.safetensors")) + sorted((model_dir / MTP_DIR).glob("*.safetensors"))
    return {"files": len(files), "tensors": sum(1 + reader.is_quantized(n) for n in reader.names()),
            "bytes": sum(f.stat().st_size for f in files)}


def run(args: argparse.Namespace) -> int:
    from ..reference.config import Config
    from .main import UserError
    from .options import model_folder

    checkpoint = None
    if args.config:
        config, source = config_with_draft(args.config), args.config
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
    info = summarize(config, args.tp, context, args.bandwidth, args.weights)
    info["source"] = source
    info["checkpoint"] = checkpoint
    if args.json:
        print_json(info)
        return 0
    c, p, r, m, w = info["config"], info["parameters"], info["round_bytes"], info["memory_per_rank"], info["weights"]
    print(f"{source}")
    if checkpoint is not None:
        print(f"  checkpoint    {checkpoint['tensors']} tensors (experts counted one by one, scales included) in "
              f"{checkpoint['files']} safetensors "
              f"file{'s' if checkpoint['files'] != 1 else ''}, "
              f"{_size(checkpoint['bytes'])} on disk: headers match the layout")
    dense = ", ".join(map(str, c["dense_layers"])) or "none"
    print(f"  layers        {c['num_hidden_layers']} target layers: {c['full_layers']} full, {c['sliding_layers']} "
          f"sliding (window {c['sliding_window']} tokens); dense MLP in layer {dense}, MoE in {c['moe_layers']} "
          f"layers")
    print(f"  draft         1 MTP layer, window {c['draft_window']} tokens, up to {c['num_draft_slots']} drafts a "
          f"round")
    print(f"  attention     hidden {c['hidden_size']} dims, {c['num_attention_heads']} heads x {c['head_dim']} dims, "
          f"{c['num_key_value_heads']} KV heads, RoPE on {c['rotary_dim']} dims")
    print(f"  experts       {c['num_experts']} routed, top-{c['num_experts_per_tok']} a token, "
          f"{c['intermediate_size']} dims each; dense MLP {c['dense_intermediate_size']} dims")
    print(f"  vocabulary    {c['vocab_size']} tokens, max positions {c['max_position_embeddings']} tokens")
    print(f"  weights       {w['description']}")
    print(f"  parameters    {_count(p['total'])} total ({_count(p['draft'])} in the draft), {_count(p['experts'])} "
          f"in target experts, {_count(p['active_per_token'])} active per token")
    print(f"the largest round at a context of {context} tokens, per rank at tp={args.tp} ({r['verify_rows']} verify "
          f"rows, {r['drafts']} draft passes):")
    print(f"  dense weights {_size(r['dense'])}   (attention, dense MLP, routers, bf16 LM heads; the draft's each "
          f"pass)")
    print(f"  experts       {_size(r['experts_all'])} all experts | {_size(r['experts_distinct'])} "
          f"for {r['distinct_experts_per_layer']} distinct per layer (8 rows x top-k)")
    print(f"  KV cache      {_size(r['kv'])}")
    print(f"  total         {_size(r['total_all_experts'])} (all experts) | {_size(r['total_distinct_experts'])} "
          f"(distinct): >= {_duration(r['seconds_lower_bound_all'])} | "
          f"{_duration(r['seconds_lower_bound_distinct'])} at {args.bandwidth:g} TB/s")
    print(f"memory per rank at tp={args.tp}, --max-context {context} tokens: {_size(m['total'])} "
          f"(weights {_size(m['weights'])}, KV caches {_size(m['kv_cache'])}; plus ~15% headroom)")
    return 0
