"""`iquest generate`: decode one request, streaming text, then a summary (or one JSON object)."""

from __future__ import annotations

import argparse
import sys
import time

from ..reference.config import check_sampling
from .options import (add_chat, add_device, add_json, add_kernels, add_prompt, add_router_fold, add_weights,
                      check_chat, check_weights, engine_target, load_tokenizer, model_folder, print_json, prompt_ids)

DEFAULT_PROMPT = "def fibonacci(n):\n"


def _drafts(value: str):
    if value == "auto":
        return "auto"
    try:
        k = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--drafts must be auto, 0 or 3..7, got {value!r}") from None
    if k != 0 and not 3 <= k <= 7:
        raise argparse.ArgumentTypeError(f"--drafts must be auto, 0 or 3..7, got {k}")
    return k


def register(sub) -> None:
    from ..reference.config import GenerationConfig as G

    p = sub.add_parser("generate", help="decode one prompt with speculative rounds",
                       description="Decode one request. Text streams to stdout as it is produced; a summary "
                                   "(the engine, device, TP, compute dtype, weight format, the kernel plan with the "
                                   "op groups still on their torch forms, and the depth policy that ran; tokens, "
                                   "rounds, mean accepted length; start-up, prefill and decode times) follows on "
                                   "stderr.")
    p.add_argument("--model", help="checkpoint folder (default: the shipped mini model)")
    p.add_argument("--engine", choices=["reference", "fast"], default="fast",
                   help="fast = the optimized engine (default); reference = the float64 CPU ground truth")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks, 1/2/4/8 (fast engine: one process per rank; default 1)")
    p.add_argument("--max-context", type=int, default=4096,
                   help="fast engine: positions its static KV caches hold (default 4096)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="fast engine compute dtype (default auto: bf16 on GPU, fp32 on CPU)")
    add_device(p, what="fast engine device")
    add_kernels(p)
    add_weights(p)
    add_router_fold(p)
    add_prompt(p, DEFAULT_PROMPT)
    add_chat(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help="output budget in tokens (default 64)")
    p.add_argument("--seed", type=int, default=0, help="request seed: same seed, same tokens (default 0)")
    p.add_argument("--drafts", type=_drafts, default="auto",
                   help="auto (default) = the model's fitted depth controller where drafting pays on this device, plain "
                        "sampling where it does not (measured costs in round_costs.json beside the model: on CPU "
                        "plain wins); 3..7 = fixed drafts per round; 0 = plain sampling")
    gen = "default: the model's generation_config.json, {} in the shipped model and where the file has none"
    p.add_argument("--temperature", type=float, help=f"sampling temperature, 0 = greedy ({gen.format(G.temperature)})")
    p.add_argument("--top-k", type=int, help=f"keep the k most likely tokens ({gen.format(G.top_k)})")
    p.add_argument("--top-p", type=float, help=f"nucleus mass in (0, 1] ({gen.format(G.top_p)})")
    add_json(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..reference.sampling import SamplingParams
    from .engines import load_engine
    from .main import UserError

    check_chat(args)
    model_dir = model_folder(args.model)
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    tok = load_tokenizer(model_dir)
    prompt = prompt_ids(args, tok, model_dir)
    device = engine_target(args.device, args.kernels) if args.engine == "fast" else "cpu"
    if args.engine == "fast":
        check_weights(args.weights, model_dir, device)
    elif args.router_fold:
        raise ValueError("--router-fold is a fast-engine option; the reference routes in float64 on its own input")
    started = time.perf_counter()
    engine = load_engine(args.engine, model_dir, args.tp, max_context=args.max_context, dtype=args.dtype,
                         device=device, kernels=args.kernels, weights=args.weights, router_fold=args.router_fold)
    cfg, gen = engine.config, engine.generation
    params = SamplingParams(
        temperature=gen.temperature if args.temperature is None else args.temperature,
        top_k=gen.top_k if args.top_k is None else args.top_k,
        top_p=gen.top_p if args.top_p is None else args.top_p)
    check_sampling(params.temperature, params.top_k, params.top_p)
    if not prompt:
        raise UserError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < cfg.vocab_size]
    if bad:
        raise UserError(f"token id {bad[0]} is outside the vocabulary (0..{cfg.vocab_size - 1})")
    if len(prompt) + args.max_new_tokens + 8 > cfg.max_position_embeddings:
        raise UserError(f"prompt ({len(prompt)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceed the "
                        f"model context of {cfg.max_position_embeddings} positions")
    policy = engine.policy(args.drafts)
    run_info = _describe(args, engine) | {"depth_policy": policy.label}
    if args.engine == "fast" and engine.kernels != "torch":
        print(f"[{args.engine}] compiling kernels and capturing the decode loop (the first run on a machine takes "
              "~30 s; later runs read Triton's cache)...", file=sys.stderr, flush=True)
        engine.warm_up(prompt, policy.drafts, params)
    startup = time.perf_counter() - started

    stop = tuple(gen.eos_token_id)
    if args.chat:  # the answer's markup (</think>, tool calls) shown as text; the stop token ends it unshown
        def text_of(ids: list[int]) -> str:
            return tok.decode([t for t in ids if t not in stop], skip_special_tokens=False)
    else:
        def text_of(ids: list[int]) -> str:
            return tok.decode(ids)
    out_ids: list[int] = []
    rounds: list[dict] = []
    printed = ""
    t0 = time.perf_counter()
    first_at = None
    for step in engine.generate(prompt, seed=args.seed, params=params, max_new_tokens=args.max_new_tokens,
                                drafts=policy.drafts, stop_ids=stop):
        if first_at is None:  # the token drawn from the prefill: what came before it is prefill, not decode
            first_at = time.perf_counter()
        out_ids += step.tokens
        rounds.append({"tokens": step.tokens, "logprobs": step.logprobs, "drafts": step.drafts,
                       "accepted": step.accepted, "served_probs": step.served_probs, "bonus": step.bonus})
        if not args.json and tok is not None:
            text = text_of(out_ids)
            if not text.endswith("\ufffd"):  # hold back a partial UTF-8 character
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
        elif not args.json:
            sys.stdout.write(" ".join(map(str, step.tokens)) + " ")
            sys.stdout.flush()
    end = time.perf_counter()
    prefill, decode = (first_at or end) - t0, end - (first_at or end)
    decoded = max(len(out_ids) - 1, 0)  # every token after the prefill's own
    spec = [r for r in rounds if r["drafts"] > 0]
    summary = {
        "tokens": len(out_ids),
        "rounds": len(rounds) - 1,  # the first entry is the token drawn from the prefill
        "mean_accepted": sum(r["accepted"] for r in spec) / len(spec) if spec else 0.0,
        "mean_emitted_per_round": sum(len(r["tokens"]) for r in spec) / len(spec) if spec else 0.0,
        "mean_drafts": sum(r["drafts"] for r in spec) / len(spec) if spec else 0.0,
        "startup_seconds": startup, "prefill_seconds": prefill, "decode_seconds": decode,
        "decode_tokens_per_second": decoded / decode if decode > 0 else None,
        **run_info,
    }
    if args.json:
        print_json({"engine": args.engine, "model": str(model_dir), "seed": args.seed,
                    "prompt_ids": prompt, "output_ids": out_ids,
                    "text": text_of(out_ids) if tok is not None else None,
                    "rounds": rounds, "summary": summary})
    else:
        sys.stdout.write("\n")
        speed = f"{summary['decode_tokens_per_second']:.1f} tok/s" if decode > 0 else "no decode"
        spec_line = (f"mean accepted {summary['mean_accepted']:.2f} of {summary['mean_drafts']:.2f} drafts, "
                     f"{summary['mean_emitted_per_round']:.2f} tokens/round" if spec else "one token a round")
        print(f"[{args.engine}] {summary['tokens']} tokens in {summary['rounds']} rounds, {spec_line}\n"
              f"  ran: {run_info['engine_run']}; depth policy: {run_info['depth_policy']}\n"
              f"  start-up {startup:.2f} s ({run_info['startup_what']}); prefill {prefill:.3f} s "
              f"({len(prompt)} prompt tokens); decode {decode:.3f} s for {decoded} tokens ({speed})", file=sys.stderr)
    return 0


def _describe(args: argparse.Namespace, engine) -> dict:
    """What ran, in words (`engine_run`) and as fields: the engine, its device, TP, compute dtype, the weight format
    (and whether a BF16 checkpoint was quantized at load), the kernel plan with the op groups on their torch forms."""
    if args.engine == "reference":
        fmt = "fp8" if engine.config.quantized else "bf16"
        return {"engine_run": f"reference (float64, CPU; the checkpoint's {fmt} weights, dequantized exactly)",
                "startup_what": "load", "device": "cpu", "tp": 1, "dtype": "fp64", "weights": fmt}
    info = engine.describe()
    return {"engine_run": info.pop("text"), **info,
            "startup_what": "load" if engine.kernels == "torch" else "load, kernel compilation, graph capture"}
