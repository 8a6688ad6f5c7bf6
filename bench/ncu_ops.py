"""One call of each hot-path op at one TP8 rank's decode shapes, for Nsight Compute (`bash ci/gpu.sh ncu OPS`).

The inputs are `iquest bench tune`'s (bench/tune.py: 6 rows, 13 distinct experts, 1K context), each op is run a few
times to compile and warm up, and only the last call of each is inside cudaProfilerStart/Stop, so
`ncu --profile-from-start off` reports exactly one launch per kernel of the op with its default settings.
"""

from __future__ import annotations

import sys

import torch

from ..kernels.device import sm_count
from ..reference.config import Config
from . import tune

OPS = ("moe", "router", "linear_qkv", "linear_o", "attention_sliding", "attention_full", "norm")


def main(argv: list[str]) -> None:
    ops = argv[0].split(",") if argv else list(OPS)
    dev = torch.device("cuda")
    shape = tune.tune_shape(Config.from_file("configs/iquest-q1.json"))
    runs = []
    for op in ops:
        case = tune.build_case(op, shape, dev, sm_count(dev))
        extra = case.prepare({}) if case.prepare else {}
        for i in range(3):
            case.run({}, i % case.copies, **extra)
        runs.append((case, extra))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for case, extra in runs:
        case.run({}, 1 % case.copies, **extra)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled", ", ".join(ops))


if __name__ == "__main__":
    main(sys.argv[1:])
