"""`iquest serve`: an OpenAI-compatible HTTP server (completions, chat, streaming) over one engine."""

from __future__ import annotations

import argparse
import sys

from .generate_cmd import _drafts
from .options import add_device, add_router_fold, add_weights


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (streaming, cancellable, bounded queue)",
        description="Serve /v1/completions, /v1/chat/completions (streaming as server-sent events or not; the "
                    "reasoning apart as reasoning_content, thinking on unless chat_template_kwargs.enable_thinking "
                    "is false; tools and tool_choice, the model's calls parsed into tool_calls), "
                    "/v1/models, /tokenize, /detokenize, /health and /metrics (Prometheus). One request decodes "
                    "at a time; others wait in a bounded queue and are refused with 429 past it. A client that "
                    "disconnects mid-stream stops its decode at the engine's next log read (about every 32 "
                    "tokens). SIGTERM or SIGINT drains: 503 for the queued, an error event ending the running "
                    "stream at its next log read, then exit (status 0).")
    p.add_argument("--model", help="checkpoint folder with tokenizer.json and tokenizer_config.json "
                                   "(default: the shipped mini model)")
    p.add_argument("--served-model-name", help="the model id clients send and /v1/models lists "
                                               "(default: the model folder's name)")
    p.add_argument("--engine", choices=["reference", "fast"], default="fast",
                   help="fast = the optimized engine (default); reference = the float64 CPU ground truth")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, 1/2/4/8 (fast engine; default 1)")
    p.add_argument("--max-context", type=int, default=4096,
                   help="prompt + max_tokens limit in tokens; the fast engine sizes its KV caches to it "
                        "(default 4096, capped by the model's max_position_embeddings)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="fast engine compute dtype (default auto: bf16 on GPU, fp32 on CPU)")
    add_device(p, what="fast engine device")
    add_weights(p)
    add_router_fold(p)
    p.add_argument("--drafts", type=_drafts, default="auto",
                   help="auto (default) = the fitted depth controller where drafting pays on this device, else plain "
                        "sampling (round_costs.json beside the model); 3..7 = fixed drafts per round; 0 = plain")
    p.add_argument("--prefix-reuse", choices=["on", "off"], default="on",
                   help="on (default): keep the last request's prompt KV and prefill only past the prefix the next "
                        "prompt shares with it (an agent's next turn), with the tokens and logprobs of a full prefill; "
                        "reported as usage.prompt_tokens_details.cached_tokens (Anthropic: cache_read_input_tokens). "
                        "Costs one copy of the sliding-window caches per rank (fast engine; ignored by the reference)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize, "
                                     "/metrics, /docs and /openapi.json (401 otherwise); /health stays open")
    p.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait while one decodes; past that the server answers 429 (default 16)")
    p.add_argument("--max-body-size", type=int, metavar="BYTES",
                   help="largest request body accepted; past it the answer is 413 (default: 16 bytes per token "
                        "of --max-context, at least 1 MiB)")
    p.add_argument("--deadline", type=float, default=600.0,
                   help="seconds from arrival after which a request ends: 504 while it waits, an error event "
                        "mid-stream (default 600; 0 = no deadline)")
    p.add_argument("--log-level", choices=["critical", "error", "warning", "info", "debug"], default="info",
                   help="uvicorn log level (default info; debug also logs each request)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..serve.app import ServeOptions
    from ..serve.server import load_tokenizer, serve
    from .engines import load_engine
    from .main import UserError
    from .options import check_weights, model_folder, resolve_device

    model_dir = model_folder(args.model)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {args.port}")
    if args.queue_size < 0:
        raise UserError(f"--queue-size must be >= 0, got {args.queue_size}")
    if args.deadline < 0:
        raise UserError(f"--deadline must be >= 0 seconds, got {args.deadline}")
    if args.max_context < 2:
        raise UserError(f"--max-context must be >= 2, got {args.max_context}")
    if args.max_body_size is not None and args.max_body_size < 1:
        raise UserError(f"--max-body-size must be >= 1 byte, got {args.max_body_size}")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key is empty")
    tokenizer = load_tokenizer(model_dir)
    device = resolve_device(args.device) if args.engine == "fast" else "cpu"
    if args.engine == "fast":
        check_weights(args.weights, model_dir, device)
    elif args.router_fold:
        raise ValueError("--router-fold is a fast-engine option; the reference routes in float64 on its own input")
    engine = load_engine(args.engine, model_dir, args.tp, max_context=args.max_context, dtype=args.dtype,
                         device=device, weights=args.weights, prefix_reuse=args.prefix_reuse == "on",
                         router_fold=args.router_fold)
    policy = engine.policy(args.drafts)  # auto: plain sampling where drafting loses on this device
    ran = engine.describe()["text"] if hasattr(engine, "describe") else "reference (float64, CPU)"
    reuse = "off"
    if args.prefix_reuse == "on" and getattr(engine, "supports_prefix_reuse", False):
        reuse = f"on ({engine.prefix_snapshot_bytes / 2**20:.1f} MiB of ring copies per rank)"
    print(f"iquest serve: {ran}; depth policy {policy.label}; prefix reuse {reuse}", file=sys.stderr, flush=True)
    options = ServeOptions(model_name=args.served_model_name or model_dir.resolve().name, api_key=args.api_key,
                           queue_size=args.queue_size, deadline=args.deadline or None,
                           max_context=args.max_context, drafts=policy.drafts, max_body_size=args.max_body_size,
                           prefix_reuse=args.prefix_reuse == "on")
    serve(engine, tokenizer, options, args.host, args.port, args.log_level)
    return 0
