"""`iquest bench prefetch`: how often the expert prefetch warms the experts a verification block reads
(EngineOptions.expert_prefetch; docs/round.md, "Expert prefetch").

The fast engine, with the prefetch on, runs each held-out real-code prompt (fixtures/fit_depth.py's `replay_prompts`)
through its target in consecutive blocks of R rows, as verification blocks of R live rows read the cache, for each
width R asked. Every sliding MoE layer's call taps the branch's prediction (fast/expert_prefetch.predict) beside the
router's choice, and `coverage` counts, per layer and width:

- row coverage: the share of a row's chosen experts that its own prediction holds;
- block coverage: the share of the block's distinct chosen experts that any row's prediction holds: what the MoE
  reads once, so what the branch must warm to save Gate/Up's HBM reads;
- experts warmed and needed a block (the bytes: one expert's Gate and Up each).

Only the prediction is measured: whether warming pays is `iquest bench step` with `+expert_prefetch` on the GPU.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from ..fast.expert_prefetch import coverage
from ..fast.parallel import Parallel
from ..fast.rank import EngineOptions, RankEngine
from ..provenance import commit

TAP = "predicted_experts"


def run(model_dir: Path, device: str, prompts: int, widths: tuple[int, ...], out: str | None) -> dict:
    from tokenizers import Tokenizer

    from ..fixtures.fit_depth import replay_prompts

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    chosen = replay_prompts(model_dir, tok, prompts)
    if not chosen:
        raise ValueError(f"no held-out function headers found for {model_dir}")
    longest = max(len(ids) for _, _, ids in chosen)
    engine = RankEngine(model_dir, Parallel.single(device),
                        EngineOptions(max_context=longest + 64, expert_prefetch=True, graphs=False))
    # (width, layer) -> [row hits, row slots, block hits, block experts, warmed, blocks]
    sums: dict = defaultdict(lambda: [0] * 6)
    for n, (_, _, ids) in enumerate(chosen):
        print(f"bench prefetch: prompt {n + 1}/{len(chosen)} ({len(ids)} tokens)", file=sys.stderr, flush=True)
        for R in widths:
            engine.cache.reset()
            for start in range(0, len(ids) - R + 1, R):
                taps: dict = {}
                pos = torch.arange(start, start + R, device=engine.par.device)
                live = torch.ones(R, dtype=torch.bool, device=engine.par.device)
                with torch.no_grad():
                    engine.model.forward(torch.tensor(ids[start:start + R], device=engine.par.device), pos, live, taps)
                for name, predicted in taps.items():
                    if not name.endswith(TAP):
                        continue
                    layer = name[:-len(TAP)]
                    s = sums[(R, layer)]
                    for i, v in enumerate(coverage(predicted, taps[layer + "experts"], live.cpu())):
                        s[i] += v
                    s[4] += len(set(predicted.flatten().tolist()) - {-1})
                    s[5] += 1
    rows = []
    for (R, layer), (hits, slots, bhits, bneed, warmed, blocks) in sorted(sums.items()):
        rows.append({"width": R, "layer": layer.rstrip("."), "row_coverage": hits / slots,
                     "block_coverage": bhits / bneed, "warmed_per_block": warmed / blocks,
                     "needed_per_block": bneed / blocks, "blocks": blocks})
    overall = {R: {"row_coverage": sum(r["row_coverage"] * r["blocks"] for r in rows if r["width"] == R)
                   / sum(r["blocks"] for r in rows if r["width"] == R),
                   "block_coverage": sum(r["block_coverage"] * r["blocks"] for r in rows if r["width"] == R)
                   / sum(r["blocks"] for r in rows if r["width"] == R)} for R in widths}
    result = {"schema": "iquest-bench-prefetch/1", "commit": commit(), "model": str(model_dir), "device": device,
              "prompts": len(chosen), "widths": list(widths), "experts": engine.config.num_experts,
              "top_k": engine.config.num_experts_per_tok, "layers": rows, "overall": overall}
    for r in rows:
        print(f"width {r['width']} {r['layer']:>8}: rows {r['row_coverage']:.3f}, block {r['block_coverage']:.3f} "
              f"({r['warmed_per_block']:.1f} warmed for {r['needed_per_block']:.1f} needed, {r['blocks']} blocks)")
    for R, o in overall.items():
        print(f"width {R}, all sliding MoE layers: rows {o['row_coverage']:.3f}, block {o['block_coverage']:.3f}")
    if out:
        Path(out).write_text(json.dumps(result, indent=1))
        print(f"wrote {out}", file=sys.stderr)
    return result
