"""A timeline of one MoE Gate/Up launch at one TP8 rank's decode shape (`iquest bench moe-timeline`, GPU).

Why: Gate/Up streams ~41 MB at about half the device's bandwidth, and neither E4M3 operands on the tensor cores (no
conversions at all) nor tile-contiguous weights changed its time (docs/PERF.md). Each program records the global
timer (ns) when it starts, when its owner check is known and after its last tile's products, and its SM
(`moe(stamps=)`). The inputs are `iquest bench tune`'s (6 rows, 13 distinct experts a routing); the stamped calls
rotate over the routings, so the weights come from HBM, each call plainly launched (no PDL) after a sync.

Prints, per call and as medians over the calls: the launch's span, when the owners start and finish, how long an
owner streams, the achieved bandwidth over the owners' window, and how many owners each SM ran. Writes JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from ..kernels import moe as mk
from ..provenance import commit
from ..reference.config import Config
from . import tune
from .kernels_micro import FULL_CONFIG


def _q(values: list[float]) -> dict:
    s = sorted(values)
    pick = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]
    return {"min": s[0], "p25": pick(0.25), "median": pick(0.5), "p75": pick(0.75), "max": s[-1]}


def one_call(stamps: torch.Tensor, expert_bytes: int, distinct: int) -> dict:
    """The timeline of one stamped call: offsets from the first program's start, us."""
    t = stamps.cpu().tolist()
    t0 = min(r[0] for r in t)
    owners = [r for r in t if r[2] > 0]
    others = [r for r in t if r[2] == 0]
    us = lambda ns: (ns - t0) / 1e3
    end = max(max(r[2] for r in owners), max(r[1] for r in t))
    first, last = min(r[0] for r in owners), max(r[2] for r in owners)
    per_sm: dict[int, int] = {}
    for r in owners:
        per_sm[r[3]] = per_sm.get(r[3], 0) + 1
    return {
        "programs": len(t), "owners": len(owners),
        "span_us": us(end),
        "owner_start_us": _q([us(r[0]) for r in owners]),
        "owner_known_us": _q([us(r[1]) for r in owners]),
        "owner_done_us": _q([us(r[2]) for r in owners]),
        "owner_stream_us": _q([(r[2] - r[1]) / 1e3 for r in owners]),
        "other_exit_us": _q([us(r[1]) for r in others]) if others else None,
        "owners_window_us": (last - first) / 1e3,
        "window_tb_s": distinct * expert_bytes * 2 / 3 / ((last - first) * 1e-9) / 1e12,  # Gate and Up: 2/3 of it
        "owners_per_sm": {str(k): v for k, v in sorted(_counts(per_sm).items())},
    }


def _counts(per_sm: dict[int, int]) -> dict[int, int]:
    """SMs by the number of owner programs they ran (SMs that ran none not counted)."""
    out: dict[int, int] = {}
    for n in per_sm.values():
        out[n] = out.get(n, 0) + 1
    return out


def main(argv: list[str]) -> None:
    out_path = argv[0] if argv else None
    dev = torch.device("cuda")
    shape = tune.tune_shape(Config.from_file(FULL_CONFIG))
    case = tune.moe_case(shape, dev)
    n = mk.gate_up_programs(shape.rows, shape.top_k, shape.experts, shape.hidden, shape.inter, shape.block, dev)
    stamps = torch.zeros(n, 4, dtype=torch.int64, device=dev)
    for i in range(case.copies):  # compile and warm up (plain launches)
        case.run({}, i)
    calls = []
    for i in range(case.copies):
        torch.cuda.synchronize()
        case.run({"stamps": stamps}, i)
        torch.cuda.synchronize()
        calls.append(one_call(stamps, case.facts["expert_bytes"], case.facts["distinct_experts"][i]))
    keys = ("span_us", "owners_window_us", "window_tb_s")
    summary = {k: statistics.median(c[k] for c in calls) for k in keys}
    for k in ("owner_start_us", "owner_known_us", "owner_done_us", "owner_stream_us"):
        summary[k] = {q: statistics.median(c[k][q] for c in calls) for q in calls[0][k]}
    report = {"bench": "moe-timeline", "commit": commit(), "device": torch.cuda.get_device_name(dev),
              "programs": n, "calls": len(calls), "summary": summary, "per_call": calls}
    print(f"moe Gate/Up timeline, {n} programs, {len(calls)} calls (routings of {case.facts['distinct_experts']} "
          f"distinct experts), commit {report['commit']}")
    print(f"  launch span {summary['span_us']:.2f} us; owners' window {summary['owners_window_us']:.2f} us at "
          f"{summary['window_tb_s']:.2f} TB/s of Gate/Up weight")
    for k in ("owner_start_us", "owner_known_us", "owner_done_us", "owner_stream_us"):
        q = summary[k]
        print(f"  {k:16} " + "  ".join(f"{name} {v:6.2f}" for name, v in q.items()))
    print(f"  owners per SM (call 0): {calls[0]['owners_per_sm']}; owners {calls[0]['owners']}")
    if calls[0]["other_exit_us"]:
        print(f"  non-owners exit (call 0): " + "  ".join(f"{k} {v:.2f}" for k, v in calls[0]["other_exit_us"].items()))
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
