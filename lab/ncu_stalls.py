"""Where a kernel's warps stalled, from Nsight Compute's source page (`ncu -i REPORT --page source --csv --print-source
sass`, as `ci/gpu_plan.sh ncumoe` writes it): the stall reasons' shares over the whole kernel, then the SASS lines
with the most samples and each line's two largest reasons.

    python -m iquest.lab.ncu_stalls FILE.csv [FILE.csv ...] [--top N]
"""

from __future__ import annotations

import argparse
import collections
import csv


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def report(path: str, top: int = 14) -> str:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header, lines = rows[1], rows[2:]  # row 0 names the kernel
    source, samples = header.index("Source"), header.index("Warp Stall Sampling (All Samples)")
    reasons = [i for i, name in enumerate(header) if name.startswith("stall_") and "Not Issued" not in name]
    total = sum(_number(r[samples]) for r in lines)
    by_reason = collections.Counter()
    for r in lines:
        for i in reasons:
            by_reason[header[i]] += _number(r[i])
    reason_total = sum(by_reason.values()) or 1.0
    out = [f"===== {path} samples {total:.0f}",
           "  reasons: " + ", ".join(f"{k[6:]} {v / reason_total:.1%}" for k, v in by_reason.most_common(8))]
    for r in sorted(lines, key=lambda r: -_number(r[samples]))[:top]:
        largest = sorted(((_number(r[i]), header[i][6:]) for i in reasons), reverse=True)[:2]
        out.append(f"  {_number(r[samples]) / (total or 1.0):6.1%}  {r[0]:>6} {r[source][:60]:60} {largest}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--top", type=int, default=14, help="SASS lines shown a kernel (default 14)")
    args = parser.parse_args(argv)
    for path in args.files:
        print(report(path, args.top))


if __name__ == "__main__":
    main()
