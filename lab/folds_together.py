"""The router fold and Down ending in the tail on together, under the Triton interpreter (run with TRITON_INTERPRET=1):
what `ci/gpu_plan.sh folds7` times on the GPU, checked first to build, to run both folds' launches, and to give the
fold alone's bits (Down's tail is the same bits as the combine it replaces).

The tiny model, every op group on its kernels, over tests/test_fast_kernels.py's three blocks (a prefill block, a
verification block with padding rows, a draft block). Arms: the fold alone, the fold with Down's tail, and the default
plan without the fold, whose outputs must differ from the fold's (the fold is a numerical change), so a comparison
that cannot see a difference would show here. Prints each arm's launches and each pair's largest difference.
"""
import sys

from iquest.fast.plan import KernelPlan
from iquest.tests.test_fast_kernels import _forget_capture, engine, two_blocks

ARMS = {"fold": dict(router_fold=True), "fold+tail": dict(router_fold=True, down_tail=True), "default": {}}
LIVE = [None, None, 6, 6, 6, 6]  # the verification and draft blocks' padding rows are no one's output


def main() -> int:
    plan = KernelPlan(linear=True, norm=True, moe=True, attention=True)
    outputs, launches = {}, {}
    for name, options in ARMS.items():
        e = engine(plan, "cpu", **options)
        _forget_capture(e)
        outputs[name] = [t[:n] for block in two_blocks(e, "cpu") for t, n in zip(block, LIVE)]
        launches[name] = {k: v for k, v in e.model.ops.calls.items() if v}
        print(f"{name}: launches {launches[name]}; fallbacks {dict(e.model.ops.fallbacks)}")

    def largest(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(outputs[a], outputs[b]))
    both, control = largest("fold", "fold+tail"), largest("fold", "default")
    print(f"fold+tail against fold: largest difference {both:.3g}; default against fold (control): {control:.3g}")
    ran = launches["fold+tail"]
    both_ran = ran.get("o_proj_router", 0) > 0 and ran.get("down_add_norm", 0) > 0 and "combine_add_norm" not in ran
    ok = both == 0.0 and control > 0.0 and both_ran
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
