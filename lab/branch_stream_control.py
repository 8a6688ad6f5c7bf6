"""The expert prefetch's branch on a pooled stream, the form before e884b73, as a control for
`test_cuda_the_branch_forks_onto_a_stream_of_its_own` (docs/PERF.md, the capture crash). Run each mode in a process
of its own: a fault ends the process.

  check  the test, with the branch's stream pooled again: it must fail, on its "none of the pooled streams" check or
         before it (on H100s at f490d67 and 37acc66 the engine's build, which captures the decode loop, ended in a
         segmentation fault: exit 139)
  crash  the engine built with the branch on the pool's capture stream, the test's check skipped, and its captured
         loop decoded against the engine without the branch

Each pooled stream handed to the branch is printed and counted, so that a pass cannot come from the control not
running.
"""
import sys

import torch

import iquest.fast.triton_ops as triton_ops
from iquest.tests import test_expert_prefetch as t


def main(mode: str) -> int:
    taken = []

    def pooled(device):
        taken.append(torch.cuda.Stream(device))
        print(f"pooled stream handed to the branch: {taken[-1].cuda_stream:#x}", flush=True)
        return taken[-1]

    triton_ops.private_stream = pooled
    triton_ops.destroy_stream = lambda stream: None  # torch owns its pooled streams
    print(f"mode {mode}", flush=True)
    if mode == "check":
        try:
            t.test_cuda_the_branch_forks_onto_a_stream_of_its_own()
        except AssertionError as e:
            print(f"control caught: pooled streams handed to the branch {len(taken)}; {str(e).splitlines()[0]}")
            return 0 if taken else 1
        print(f"control NOT caught: pooled streams handed to the branch {len(taken)}")
        return 1
    capture = t._pool_at_the_capture_stream()
    on = t._engine(True, "cuda")
    same = on.rank0.model.ops._side.cuda_stream == capture
    print(f"branch on the capture stream: {same}; pooled streams handed to the branch {len(taken)}", flush=True)
    same_tokens = t._decode(on, 3, 40) == t._decode(t._engine(False, "cuda"), 3, 40)
    print(f"captured loop ran; same tokens: {same_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "check"))
