"""What several commands share: `--device`, `--kernels`, `--weights`, `--json` and the prompt sources, each with its
check.

The checks run before an engine is built, so a value the machine cannot serve (`--device cuda` without a GPU,
`--kernels triton` on a CPU without Triton's interpreter) is one line naming the flag, not a traceback from deep
inside a kernel launch.

`--json` means one thing on every command: stdout carries one JSON object and nothing else. What the command prints
for a reader (qualify's and debug's tables) goes to stderr instead, or is left out where the object holds it all
(generate, info). A file is `> FILE`. The benchmarks keep `--out FILE`: their raw JSON is a file of record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEVICES = ("auto", "cuda", "cpu")
KERNELS = ("auto", "torch", "triton")  # fast/plan.py's CHOICES: what a user picks (plan.py imports torch)
WEIGHTS = ("auto", "bf16", "fp8")  # fast/weights.py's WEIGHT_FORMATS (weights.py imports torch)
WEIGHTS_HELP = ("what the fast engine's linear weights run as: auto (default) = an FP8 checkpoint as FP8; a BF16 "
                "checkpoint as FP8 on cuda (quantized once at load to 128x128 blocks, the kernels' format) and as BF16 "
                "elsewhere; bf16 = a BF16 checkpoint as stored (refused for an FP8 checkpoint: nothing to recover); "
                "fp8 = block FP8 (a BF16 checkpoint quantized at load)")
JSON_HELP = "print the result as JSON on stdout instead of as text"


def _user_error(message: str) -> Exception:
    from .main import UserError

    return UserError(message)


def model_folder(arg: str | None) -> Path:
    """`--model` (default: the shipped model), checked to be a folder with a config.json."""
    from .engines import default_model_dir

    path = Path(arg) if arg else default_model_dir()
    if not path.is_dir():
        raise _user_error(f"model folder {path} does not exist")
    if not (path / "config.json").exists():
        raise _user_error(f"model folder {path} has no config.json")
    return path


# ---- --device --------------------------------------------------------------------------------------------------

def add_device(p: argparse.ArgumentParser, default: str = "auto", what: str = "where the fast engine runs") -> None:
    p.add_argument("--device", choices=DEVICES, default=default,
                   help=f"{what}: auto (cuda when a GPU is visible, else cpu), cuda or cpu (default {default})")


def resolve_device(choice: str) -> str:
    """`--device` as "cuda" or "cpu"; cuda on a machine without a visible GPU is a one-line error."""
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise _user_error("--device cuda: this machine has no visible CUDA device; use --device cpu or auto")
    return choice


# ---- --kernels -------------------------------------------------------------------------------------------------

def add_kernels(p: argparse.ArgumentParser, what: str = "fast engine kernels") -> None:
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help=f"{what}: auto (default: triton on cuda, torch on cpu), torch (the torch form of every op) or "
                        "triton (the Triton kernels of kernels/; on cpu only under TRITON_INTERPRET=1)")


def check_kernels(choice: str, device: str) -> None:
    """`--kernels triton` needs the triton package, and on a CPU Triton's interpreter (TRITON_INTERPRET=1)."""
    if choice != "triton":
        return
    try:
        import triton
    except ImportError:
        raise _user_error("--kernels triton: the triton package is not installed (pip install triton==3.6.0), "
                          "or use --kernels auto or torch") from None
    if device == "cpu":
        try:
            interpreting = bool(triton.knobs.runtime.interpret)
        except AttributeError:  # a triton without knobs reads the variable itself
            interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        if not interpreting:
            raise _user_error("--kernels triton on cpu: the Triton kernels run on a CPU only under Triton's "
                              "interpreter (set TRITON_INTERPRET=1, slow); or use --kernels auto or torch")


def engine_target(device: str, kernels: str) -> str:
    """`--device` resolved and `--kernels` checked against it: the device the engine is built on."""
    resolved = resolve_device(device)
    check_kernels(kernels, resolved)
    return resolved


# ---- --weights -------------------------------------------------------------------------------------------------

def add_weights(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=WEIGHTS, default="auto", help=WEIGHTS_HELP)


def check_weights(choice: str, model_dir: Path, device: str) -> str:
    """`--weights` against the checkpoint and device (fast/weights.weight_format): what its linears will run as, or a
    one-line error (bf16 on an FP8 checkpoint) before anything loads."""
    from ..fast.weights import weight_format
    from ..reference.config import Config

    return weight_format(choice, Config.from_dir(model_dir), device)


# ---- --router-fold ----------------------------------------------------------------------------------------------

def add_router_fold(p: argparse.ArgumentParser) -> None:
    p.add_argument("--router-fold", action="store_true",
                   help="fast engine: compute each MoE layer's routing in its o-projection and attention tail instead "
                        "of the router's own pass (fewer launches a layer on a GPU; at TP 1 and rank slices). A "
                        "numerical change: the logits come from the unrounded normalized hidden state instead of the "
                        "bf16 one (docs/round.md, \"The router fold\"); qualify it with iquest qualify --router-fold")


# ---- --json ----------------------------------------------------------------------------------------------------

def add_json(p: argparse.ArgumentParser, text_to_stderr: bool = False) -> None:
    extra = " (the table goes to stderr; > FILE keeps the JSON)" if text_to_stderr else " (> FILE keeps it)"
    p.add_argument("--json", action="store_true", help=JSON_HELP + extra)


def print_json(obj) -> None:
    print(json.dumps(obj))


def print_json_file(write):
    """Print on stdout the JSON that `write(path)` writes to a file (qualify/'s writers take a path); return what
    `write` returns."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.json"
        value = write(str(path))
        print_json(json.loads(path.read_text()))
    return value


# ---- prompts ---------------------------------------------------------------------------------------------------

def add_prompt(p: argparse.ArgumentParser, default: str) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=default, metavar="TEXT",
                     help=f"prompt text; - reads it from stdin (default {default!r})")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from this UTF-8 file")
    src.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids instead of text, e.g. 1,2,3")


def load_tokenizer(model_dir: Path):
    """The model's tokenizer.json, or None where it has none; an unreadable one is a one-line error."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception
        raise _user_error(f"{path} is not a readable tokenizer ({str(e).splitlines()[0] if str(e) else e!r})") \
            from None


def prompt_ids(args: argparse.Namespace, tokenizer, model_dir: Path) -> list[int]:
    """The prompt as token ids, from --prompt-ids, --prompt-file, --prompt - (stdin) or --prompt TEXT; with --chat
    (generate), that text as a user message in the model's chat template."""
    if getattr(args, "chat", False):
        return chat_prompt_ids(args, model_dir)
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise _user_error(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    if tokenizer is None:
        raise _user_error(f"{model_dir} has no tokenizer.json: pass --prompt-ids")
    return tokenizer.encode(prompt_text(args)).ids


# ---- chat (generate --chat, --no-think) -------------------------------------------------------------------------

CHAT_HELP = ("treat the prompt text as one user message: render it with the model's chat template (its "
             "tokenizer_config.json) and the template's generation prompt, so the model answers as the assistant; "
             "text in the prompt that spells a special token stays plain text, and the answer is shown with its "
             "markup (</think>, tool calls) as text (default: off, the prompt is raw text)")
NO_THINK_HELP = ("with --chat: thinking off (the template's enable_thinking=false: the prompt ends <think></think>, so "
                 "the answer comes without reasoning) (default: thinking on, the prompt ends <think>)")


def add_chat(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action="store_true", help=CHAT_HELP)
    p.add_argument("--no-think", action="store_true", help=NO_THINK_HELP)


def check_chat(args: argparse.Namespace) -> None:
    """--no-think only with --chat; --chat only with prompt text. Runs before anything is loaded."""
    if args.no_think and not args.chat:
        raise _user_error("--no-think turns thinking off in the chat template, so it needs --chat")
    if args.chat and args.prompt_ids is not None:
        raise _user_error("--chat renders prompt text as a user message: give --prompt or --prompt-file, "
                          "not --prompt-ids")


def load_chat_tokenizer(model_dir: Path):
    """The model's tokenizer with its chat template (transformers); a one-line error where there is none."""
    if not (model_dir / "tokenizer.json").exists():
        raise _user_error(f"--chat: {model_dir} has no tokenizer.json (nor a chat template)")
    import warnings

    import transformers
    from transformers import AutoTokenizer

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # it reads config.json and warns that iquest_q1 is unknown to it
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:
        raise _user_error(f"--chat: the tokenizer in {model_dir} does not load "
                          f"({str(e).splitlines()[0] if str(e) else e!r})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    if not getattr(tokenizer, "chat_template", None):
        raise _user_error(f"--chat: {model_dir / 'tokenizer_config.json'} has no chat_template")
    return tokenizer


def chat_prompt_ids(args: argparse.Namespace, model_dir: Path) -> list[int]:
    """The prompt text as one user message, rendered with the chat template and its generation prompt (thinking off
    with --no-think), encoded as the server encodes chat: the message's text is plain text, only the template makes
    special tokens."""
    from ..serve.prepare import Encoder
    from ..serve.protocol import APIError

    text = prompt_text(args)
    encoder = Encoder(load_chat_tokenizer(model_dir))
    try:
        return encoder.chat_ids([{"role": "user", "content": text}], enable_thinking=not args.no_think)
    except APIError as e:
        raise _user_error(f"--chat: {e.message}") from None


def prompt_text(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        try:
            data = Path(args.prompt_file).read_bytes()
        except OSError as e:
            raise _user_error(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from None
        return _utf8(data, f"--prompt-file {args.prompt_file}")
    if args.prompt == "-":
        stdin = getattr(sys.stdin, "buffer", None)
        return _utf8(stdin.read(), "--prompt - (stdin)") if stdin is not None else sys.stdin.read()
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise _user_error(f"--prompt is not UTF-8 text (an undecodable byte at character {e.start}); "
                          "pass UTF-8, or the text in a file with --prompt-file") from None
    return args.prompt


def _utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _user_error(f"{source} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
