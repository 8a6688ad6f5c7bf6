"""`iquest card`: measure a trained model's card figures with the reference engine."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

BEGIN, END = "<!-- decode-figures:begin -->", "<!-- decode-figures:end -->"


def register(sub) -> None:
    p = sub.add_parser("card", help="measure model-card figures (held-out loss, acceptance, expert spread)",
                       description="Measure a trained model's card figures with the float64 reference engine on "
                                   "its held-out files; write card.json and the README's decode-figures section.")
    p.add_argument("--model", help="checkpoint folder with corpus.json (default: the shipped mini model)")
    p.add_argument("--prompts", type=int, default=12, help="held-out function headers to decode (default 12)")
    p.add_argument("--tokens", type=int, default=48, help="tokens decoded per prompt and depth (default 48)")
    p.add_argument("--seed", type=int, default=0, help="seed of the first prompt (default 0)")
    p.add_argument("--no-write", action="store_true", help="print only; leave card.json and README.md alone")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..fixtures.card import make_card, render_markdown
    from .engines import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    card = make_card(model_dir, args.prompts, args.tokens, args.seed)
    command = f"iquest card --model {args.model or 'fixtures/iquest-q1-mini'} --prompts {args.prompts} " \
              f"--tokens {args.tokens} --seed {args.seed}"
    section = render_markdown(card, command)
    print(section)
    if not args.no_write:
        (model_dir / "card.json").write_text(json.dumps(card, indent=1) + "\n")
        readme = model_dir / "README.md"
        text = readme.read_text() if readme.exists() else ""
        block = f"{BEGIN}\n{section}{END}"
        if BEGIN in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
        else:
            text += f"\n## Decode figures\n\n{block}\n"
        readme.write_text(text)
    return 0
