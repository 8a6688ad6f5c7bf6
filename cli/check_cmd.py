"""`iquest check-checkpoint DIR`: what a model folder holds and whether it is a valid IQuest-Q1 checkpoint.

The report: the target's and the draft's configs summarised (layers, full/sliding, experts, dimensions), the weight
format (BF16, or block FP8 and its block size), whether experts are packed (`experts.fc` / `experts.proj`) or stored
one by one, the stored tensors, files and bytes, the tensor-parallel degrees the dimensions divide into, the tokenizer
(its special tokens, when transformers loads it) and the chat template. What is wrong is the first ConfigError or
CheckpointError the loaders raise (reference/config.py, reference/checkpoint.py), one line naming the key or tensor.

By default every tensor is read (memory-mapped, one at a time) and its values checked: finite bf16/fp32 values,
positive finite FP8 scales. `--headers-only` stops after the safetensors headers (names, shapes, dtypes, files).
Exit status: 0 valid, 1 not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .options import add_json, print_json


def register(sub) -> None:
    p = sub.add_parser("check-checkpoint", help="report what a model folder holds and whether it is valid",
                       description="Check a model folder against the published IQuest-Q1 layout (config.json and "
                                   "mtp/config.json, every tensor's name, shape and dtype, FP8 scale grids, files, "
                                   "values) and report what it holds: both configs summarised, the weight format, "
                                   "packed or per-expert experts, tensors and bytes, the tokenizer's special tokens "
                                   "and the chat template. Exit status 0 when valid, 1 when not (the first problem "
                                   "is one line naming the key or tensor).")
    p.add_argument("model", metavar="DIR", help="the model folder (holding config.json and mtp/)")
    p.add_argument("--headers-only", action="store_true",
                   help="check names, shapes, dtypes and files from the safetensors headers only, reading no weight "
                        "bytes (skips the value checks: non-finite values, non-positive scales)")
    add_json(p)
    p.set_defaults(run=run)


def summarize_config(c) -> dict:
    """One config's figures (target or draft)."""
    types = c.layer_types
    return {"layers": c.num_hidden_layers, "full_layers": types.count("full_attention"),
           "sliding_layers": types.count("sliding_attention"),
           "sliding_window": c.sliding_window if "sliding_attention" in types else None,
           "dense_layers": list(c.mlp_only_layers), "moe_layers": c.num_hidden_layers - len(c.mlp_only_layers),
           "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "rotary_dim": c.rotary_dim,
           "num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
           "intermediate_size": c.intermediate_size, "dense_intermediate_size": c.dense_intermediate_size,
           "vocab_size": c.vocab_size, "max_position_embeddings": c.max_position_embeddings,
           "sink": c.enable_sink_attention}


def _inventory(model_dir: Path) -> dict:
    """Stored tensors, safetensors files and their bytes in the folder and mtp/, from the indexes (or the files'
    headers); never raises (a broken folder still gets counted as far as it can be)."""
    from safetensors import safe_open

    tensors = files = size = 0
    for folder in (model_dir, model_dir / "mtp"):
        index = folder / "model.safetensors.index.json"
        names: set[str] = set()
        paths: set[Path] = set()
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map)
            paths = {folder / f for f in weight_map.values() if isinstance(f, str)}
        except (OSError, ValueError, KeyError, TypeError):
            paths = set(folder.glob("*.safetensors")) if folder.is_dir() else set()
            for path in paths:
                try:
                    with safe_open(path, framework="pt") as f:
                        names.update(f.keys())
                except Exception:  # a damaged file: the checks below name it
                    pass
        tensors += len(names)
        existing = [p for p in paths if p.is_file()]
        files += len(existing)
        size += sum(p.stat().st_size for p in existing)
    return {"tensors": tensors, "files": files, "bytes": size}


def _tokenizer(model_dir: Path, vocab_size: int | None) -> tuple[dict, list[str]]:
    """The tokenizer's presence and special tokens (when transformers loads it), and warnings about it."""
    present = (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file()
    info: dict = {"present": present, "special_tokens": None, "eos_token": None, "bos_token": None,
                  "pad_token": None, "size": None}
    warnings: list[str] = []
    config_file = model_dir / "tokenizer_config.json"
    template = (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file()
    if config_file.is_file():
        try:
            template = template or bool(json.loads(config_file.read_text()).get("chat_template"))
        except (OSError, ValueError, AttributeError) as exc:
            warnings.append(f"tokenizer_config.json is not readable JSON: {exc}")
    info["chat_template"] = template
    if not present:
        return info, warnings
    try:
        import transformers
        from transformers import AutoTokenizer
    except ImportError:
        info["error"] = "transformers is not installed: special tokens not read"
        return info, warnings
    import warnings as py_warnings

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it reads config.json and warns that iquest_q1 is unknown to it
    try:
        with py_warnings.catch_warnings():
            py_warnings.simplefilter("ignore", FutureWarning)
            tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as exc:  # any loader failure is a report line, not a traceback
        line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        info["error"] = f"the tokenizer does not load: {line}"
        warnings.append(info["error"])
        return info, warnings
    finally:
        transformers.logging.set_verbosity(verbosity)
    special = sorted({t.content: i for i, t in tok.added_tokens_decoder.items() if t.special}.items(),
                     key=lambda kv: kv[1])
    info.update(special_tokens={name: i for name, i in special}, size=len(tok),
                eos_token=_token(tok, "eos"), bos_token=_token(tok, "bos"), pad_token=_token(tok, "pad"))
    if vocab_size is not None and len(tok) > vocab_size:
        warnings.append(f"the tokenizer has {len(tok)} tokens, more than vocab_size={vocab_size}")
    return info, warnings


def _token(tok, kind: str):
    name = getattr(tok, f"{kind}_token", None)
    return None if name is None else {"token": str(name), "id": getattr(tok, f"{kind}_token_id", None)}


def check(model_dir: str | Path, values: bool = True) -> dict:
    """The report of a model folder (see the module docstring); `valid` is False and `error` one line at the first
    ConfigError or CheckpointError."""
    from ..reference.checkpoint import CheckpointError, CheckpointReader
    from ..reference.config import TP_DEGREES, Config, ConfigError

    model_dir = Path(model_dir)
    report: dict = {"path": str(model_dir), "valid": False, "error": None, "target": None, "draft": None,
                    "weights": None, "experts": None, "logical_tensors": None, "tp_degrees": None,
                    "values_checked": False, **_inventory(model_dir)}
    config = None
    try:
        if not model_dir.is_dir():
            raise CheckpointError(f"model folder {model_dir} does not exist")
        config = Config.from_dir(model_dir)
        report["target"], report["draft"] = summarize_config(config), summarize_config(config.mtp)
        block = config.weight_block_size
        report["weights"] = {"format": "FP8" if block else "BF16", "block": list(block) if block else None}
        report["tp_degrees"] = [tp for tp in TP_DEGREES if _shards(config, tp)]
        reader = CheckpointReader(model_dir, config)
        forms = set(reader.packed.values())
        report["experts"] = "packed" if forms == {True} else "per-expert" if forms == {False} else \
            "mixed" if forms else "none"
        report["logical_tensors"] = len(reader.specs)
        if values:
            for name in reader.names():
                reader.read_weight(name)
            report["values_checked"] = True
        report["valid"] = True
    except (ConfigError, CheckpointError) as exc:
        report["error"] = " ".join(str(exc).split())  # one line
    tokenizer, warnings = _tokenizer(model_dir, config.vocab_size if config else None) if model_dir.is_dir() \
        else ({"present": False, "chat_template": False}, [])
    report["chat_template"] = tokenizer.pop("chat_template")
    report["tokenizer"] = tokenizer
    report["warnings"] = warnings
    return report


def _shards(config, tp: int) -> bool:
    from ..reference.config import ConfigError

    try:
        config.check_tp(tp)
        return True
    except ConfigError:
        return False


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _config_line(s: dict) -> str:
    layers = f"{s['layers']} layer{'s' if s['layers'] != 1 else ''}"
    kinds = f"{s['full_layers']} full, {s['sliding_layers']} sliding"
    if s["sliding_window"] is not None:
        kinds += f" (window {s['sliding_window']})"
    mlp = (f"MoE {s['num_experts']} experts top-{s['num_experts_per_tok']} x {s['intermediate_size']}")
    if s["dense_layers"]:
        mlp += f", dense {s['dense_layers']} x {s['dense_intermediate_size']}"
    return (f"{layers}: {kinds}; hidden {s['hidden_size']}, {s['num_attention_heads']} heads x {s['head_dim']} "
            f"({s['num_key_value_heads']} KV, rotary {s['rotary_dim']}); {mlp}; vocab {s['vocab_size']}")


def print_report(r: dict) -> None:
    print(f"{r['path']}: {'valid' if r['valid'] else 'NOT VALID'}")
    if r["error"]:
        print(f"  problem        {r['error']}")
    if r["target"]:
        print(f"  target         {_config_line(r['target'])}")
    if r["draft"]:
        print(f"  draft (mtp/)   {_config_line(r['draft'])}")
    if r["weights"]:
        w = r["weights"]
        form = "BF16" if w["format"] == "BF16" else f"FP8 E4M3, {w['block'][0]}x{w['block'][1]} scale blocks"
        experts = {"packed": "packed (experts.fc / experts.proj)", "per-expert": "one tensor per expert matrix",
                   "mixed": "packed in some layers, per expert in others", "none": "none",
                   None: "not determined"}[r["experts"]]
        print(f"  weights        {form}; experts {experts}")
    print(f"  stored         {r['tensors']} tensors in {r['files']} safetensors file{'s' if r['files'] != 1 else ''}"
          f", {_size(r['bytes'])}" + (f" ({r['logical_tensors']} logical weights)" if r["logical_tensors"] else ""))
    if r["tp_degrees"] is not None:
        print(f"  shards at TP   {', '.join(map(str, r['tp_degrees'])) or 'none of 1, 2, 4, 8'}")
    if r["valid"]:
        print(f"  values         {'checked (finite, scales positive)' if r['values_checked'] else 'not read'}")
    t = r["tokenizer"]
    if not t["present"]:
        print("  tokenizer      absent")
    elif t.get("special_tokens") is not None:
        names = " ".join(f"{k}={v}" for k, v in t["special_tokens"].items())
        eos = t["eos_token"]["token"] if t["eos_token"] else "none"
        bos = t["bos_token"]["token"] if t["bos_token"] else "none"
        print(f"  tokenizer      {t['size']} tokens; eos {eos}, bos {bos}; special: {names}")
    else:
        print(f"  tokenizer      present ({t.get('error', 'not loaded')})")
    print(f"  chat template  {'present' if r['chat_template'] else 'absent'}")
    for w in r["warnings"]:
        print(f"  warning        {w}")


def run(args: argparse.Namespace) -> int:
    import sys

    report = check(args.model, values=not args.headers_only)
    if args.json:
        print_json(report)
    else:
        print_report(report)
    if not report["valid"]:
        print(f"iquest check-checkpoint: error: {report['error']}", file=sys.stderr)
        return 1
    return 0
