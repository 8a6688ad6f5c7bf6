"""What the round could take at best with today's dependent ops: issue 37's round targets against measured limits.

Runs no kernel (CPU): it composes raw files that the device wrote.
  * One ring probe JSON per routing (`lab/ring_probe.py`, C23, `--distinct D`). Each holds four layers of one rank's
    weight streams at that routing, each layer 13 dependent ops. They run through the fastest structure measured (a
    persistent chain, TMA into a shared-memory ring, counter waits) and the best one-kernel-per-op chain, with no
    arithmetic. The same bytes are also read as one flat read. One of the files also holds the 1 KB-an-op run: what a
    dependent op costs when nothing streams.
  * bench step's JSON (C12): each variant's byte floor, the round's launches, its layer calls and LM heads.
  * bench stream-probe's JSON (C4): the LM head's flat read.

For each routing it prints three bounds on the round, in us and against the variant's own floor:
  * **flat**: every layer's bytes as one flat read. No dependency between ops: what the stream sizes alone allow.
  * **structure**: every layer as the probe's fastest form ran it (arithmetic-free, so below any real kernel).
    The probe's layer has one bare op more than the engine's (13 against `--layer-kernels`), so one 1 KB-an-op cost
    per extra op is taken off.
  * **needed**: the layer time each target leaves, beside the probe's.

Both bounds add the LM heads at their flat read, and every other launch of the round at the 1 KB-an-op cost.

    python3 -m iquest.lab.op_bound --step STEP.json --stream-probe PROBE.json RING.json [RING.json ...] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RING_FORMS = ("ring", "ring-poll")  # the forms the round could run: the oracle forms know the experts too early
TARGETS = {13: 2.0, 38: 1.35}  # issue 37: the prefilled history (12.9 experts) and real-request routing


def probe_layers(ring: dict) -> dict:
    """(us a layer of the fastest round-stream form, its name, us a layer of the flat read, ops a layer) of one
    ring probe report."""
    layers = ring["layers"]
    best, form, flat, ops = None, None, None, None
    for row in ring["rows"]:
        if row["streams"] != "round":
            continue
        if "form" in row:  # a one-kernel-per-op chain (overlap_probe's forms)
            candidates = {row["form"]: row["median_us"]}
        else:
            candidates = {f"{f}, {row['stages']} x {row['chunk_kb']} KB": row[f]["median_us"] for f in RING_FORMS}
        for name, us in candidates.items():
            if best is None or us < best:
                best, form = us, name
        flat = row["floor_us"] if flat is None else min(flat, row["floor_us"])
        ops = row["ops"] // layers
    if best is None:
        raise ValueError(f"ring probe {ring.get('commit')}: no row of the round's streams")
    return {"layer_us": best / layers, "form": form, "flat_layer_us": flat / layers, "ops_per_layer": ops}


def op_cost(rings: list[dict]) -> float:
    """us a dependent op costs with 1 KB an op (the fastest form of the probe's 1 KB run)."""
    costs = []
    for ring in rings:
        for row in ring["rows"]:
            if row["streams"] == "1 KB":
                us = row["median_us"] if "form" in row else min(row[f]["median_us"] for f in RING_FORMS)
                costs.append(us / row["ops"])
    if not costs:
        raise ValueError("no ring probe holds the 1 KB-an-op run (ring_probe without --no-tiny)")
    return min(costs)


def variant_for(step: dict, distinct: int) -> str:
    """bench step's variant whose routing is nearest `distinct` distinct experts a main layer."""
    floors = step["floors_by_variant"]
    return min(floors, key=lambda v: abs(floors[v]["distinct_experts_verify_mean"] - distinct))


def bounds(step: dict, probe: dict, rings: list[dict], layer_kernels: int) -> list[dict]:
    layer_calls = step["layers"] + step["drafts"]
    lm_heads = step["drafts"] + 1
    launches = int(step["floor"]["launches"])
    other = launches - layer_calls * layer_kernels - lm_heads
    if other < 0:
        raise ValueError(f"{launches} launches cannot hold {layer_calls} layers of {layer_kernels} and {lm_heads} heads")
    cost = op_cost(rings)
    fixed = lm_heads * probe["flat_us"]["lm_head"] + other * cost
    out = []
    for ring in sorted(rings, key=lambda r: r["distinct"]):
        layer = probe_layers(ring)
        variant = variant_for(step, ring["distinct"])
        floor = step["floors_by_variant"][variant]["floor_us"]
        spare = layer["ops_per_layer"] - layer_kernels  # the probe's bare ops beyond the engine's kernels a layer
        structure = layer_calls * (layer["layer_us"] - spare * cost) + fixed
        flat = layer_calls * layer["flat_layer_us"] + fixed
        row = {"distinct": ring["distinct"], "ring_commit": ring["commit"], "variant": variant, "floor_us": floor,
               "measured_us": step["floors_by_variant"][variant]["median_round_us"], "form": layer["form"],
               "probe_layer_us": layer["layer_us"], "flat_layer_us": layer["flat_layer_us"],
               "structure_us": structure, "structure_x": structure / floor, "flat_us": flat, "flat_x": flat / floor,
               "op_cost_us": cost, "other_launches": other, "layer_calls": layer_calls}
        target = TARGETS.get(ring["distinct"])
        if target is not None:
            row["target_x"] = target
            row["needed_layer_us"] = (target * floor - fixed) / layer_calls + spare * cost
        out.append(row)
    return out


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python3 -m iquest.lab.op_bound", description=__doc__.split("\n")[0])
    p.add_argument("rings", nargs="+", help="ring probe JSON files (lab/ring_probe.py), one per --distinct")
    p.add_argument("--step", required=True, help="bench step JSON with both routings (C12)")
    p.add_argument("--stream-probe", required=True, help="bench stream-probe JSON (its LM head flat read)")
    p.add_argument("--layer-kernels", type=int, default=12,
                   help="the engine's kernels a layer call (default 12: bench graph-trace's captured forward)")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    load = lambda path: json.loads(Path(path).read_text())
    rings = [load(r) for r in args.rings]
    for path, ring in zip(args.rings, rings):
        if ring.get("probe") != "ring" or "distinct" not in ring:
            p.error(f"{path}: not a ring probe report with its routing (ring_probe.py --distinct, from this commit on)")
    rows = bounds(load(args.step), load(args.stream_probe), rings, args.layer_kernels)
    for r in rows:
        print(f"{r['distinct']} experts ({r['variant']}, floor {r['floor_us']:,.1f} us, measured round "
              f"{r['measured_us']:,.1f} us = {r['measured_us'] / r['floor_us']:.2f}x):")
        print(f"  flat      {r['flat_us']:8,.1f} us  {r['flat_x']:.2f}x  (a layer {r['flat_layer_us']:.1f} us: its "
              f"bytes as one flat read)")
        print(f"  structure {r['structure_us']:8,.1f} us  {r['structure_x']:.2f}x  (a layer {r['probe_layer_us']:.1f} "
              f"us in the probe, {r['form']}; {r['op_cost_us']:.2f} us an op at 1 KB)")
        if "target_x" in r:
            print(f"  target    {r['target_x']:.2f}x leaves {r['needed_layer_us']:.1f} us a layer "
                  f"(probe's layer: {r['probe_layer_us']:.1f})")
    if args.json:
        inputs = {"step": args.step, "stream_probe": args.stream_probe, "rings": args.rings,
                  "layer_kernels": args.layer_kernels}
        Path(args.json).write_text(json.dumps({"bench": "op-bound", "inputs": inputs, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
