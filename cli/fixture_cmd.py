"""`iquest make-fixture`: write a deterministic random checkpoint for tests and experiments."""

from __future__ import annotations

import argparse


class _Presets:
    """fixtures/make.py's preset names, read when argparse first asks (that module imports torch)."""

    def _names(self) -> list[str]:
        from ..fixtures.make import PRESETS

        return sorted(PRESETS)

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())


def register(sub) -> None:
    p = sub.add_parser("make-fixture", help="write a deterministic random IQuest-Q1 checkpoint",
                       description="Write a random-weight checkpoint in the published layout (config.json, "
                                   "safetensors and index, the MTP draft in mtp/, a tokenizer with the published "
                                   "special tokens when the vocabulary allows) that is byte-identical for the same "
                                   "preset, seed and flags.")
    p.add_argument("--preset", required=True, choices=_Presets(), metavar="PRESET",
                   help="model size and shape: one of %(choices)s")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="random seed for the weights (default 0)")
    p.add_argument("--weights", choices=("fp8", "bf16"), default="fp8",
                   help="fp8: block-FP8 (E4M3) projections with fp32 *_scale_inv and a quantization_config; bf16: "
                        "every projection stored bf16, no quantization_config (default fp8)")
    p.add_argument("--unpacked", action="store_true",
                   help="store each expert's gate/up/down matrices as their own tensors "
                        "(mlp.experts.E.{gate,up,down}_proj.weight) instead of packed experts.fc / experts.proj")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..fixtures.make import make_fixture

    out = make_fixture(args.preset, args.out, args.seed, packed=not args.unpacked, weights=args.weights)
    form = f"{args.weights.upper()}, experts {'per expert' if args.unpacked else 'packed'}"
    print(f"wrote {args.preset} (seed {args.seed}, {form}) to {out}")
    return 0
