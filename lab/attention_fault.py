"""Probe: which attention launches fault in `bench tune --context 4096` (an illegal memory access or instruction on an
H200 at 53974e4, while 1K, 2K and the engine's own rounds at 4K ran clean). Each variant runs in its own process (a
fault ends the CUDA context): `python -m iquest.lab.attention_fault` prints one line a variant, ok or the error."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

VARIANTS = {  # name: (op, context, pdl, settings overrides)
    "sliding-2k": ("attention_sliding", 2048, True, {}),
    "sliding-4k": ("attention_sliding", 4096, True, {}),
    "sliding-4k-nopdl": ("attention_sliding", 4096, False, {}),
    "sliding-4k-noearly": ("attention_sliding", 4096, True, {"early": False}),
    "sliding-4k-nopreload": ("attention_sliding", 4096, True, {"preload": False}),
    "sliding-4k-neither": ("attention_sliding", 4096, True, {"early": False, "preload": False}),
    "sliding-4k-comb128": ("attention_sliding", 4096, True, {"combine_splits": 128}),
    "full-4k": ("attention_full", 4096, True, {}),
    "full-4k-nopdl": ("attention_full", 4096, False, {}),
    "full-4k-noearly": ("attention_full", 4096, True, {"early": False}),
    "full-4k-nopreload": ("attention_full", 4096, True, {"preload": False}),
}


def one(name: str) -> None:
    import torch

    from ..bench import tune

    op, context, pdl, overrides = VARIANTS[name]
    dev = torch.device("cuda")
    case = tune.build(op, tune.rank_shapes(0), 6, context, 9, dev, 0, pdl)
    st = dataclasses.replace(tune.default_settings(op), **overrides)
    calls = case.calls(st)
    for call in calls[:4] + calls[-2:]:  # the first copies, and the last (the rotation's far end)
        call()
        torch.cuda.synchronize()
    print(f"{name}: ok ({len(calls)} copies)", flush=True)


def main() -> None:
    if len(sys.argv) > 1:
        return one(sys.argv[1])
    for name in VARIANTS:
        p = subprocess.run([sys.executable, "-m", "iquest.lab.attention_fault", name], capture_output=True, text=True,
                           timeout=120)
        err = [ln for ln in p.stderr.splitlines() if "Error" in ln][-1:] or [p.stderr.strip()[-200:]]
        print(p.stdout.strip() or f"{name}: FAILED rc={p.returncode} {err[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
