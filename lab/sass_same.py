"""Whether a kernel refactor changed the product's machine code: the SASS of the decode kernels' product forms for
the H200 (sm_90a), compiled on any machine (no GPU), one SHA-256 per form.

    PYTHONPATH=<dir holding an `iquest` link to checkout A> python3 lab/sass_same.py --out a.json
    PYTHONPATH=<... checkout B> python3 lab/sass_same.py --out b.json
    python3 lab/sass_same.py --compare a.json b.json

The forms are bench/sass.py's (the MoE and FP8 linear kernels as the engine launches them) plus the MoE's finalize
(1 and 3 splits) and the router's select (packed and unpacked top-k, 256 and 64 experts): every kernel whose source a
negative-control move touched. `nvdisasm -c` text is hashed whole, so a form is "the same" only instruction for
instruction.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile


def _sass(kernel) -> str:
    from iquest.bench.sass import _tool

    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "kernel.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        return _tool("nvdisasm", cubin, "-c")


def forms() -> dict:
    from iquest.bench.sass import KernelSpec, specs
    from iquest.kernels import moe as mk, router as rk

    out = dict(specs())
    for split in (1, 3):
        out[f"moe_finalize_s{split}"] = KernelSpec(
            mk._moe_finalize_kernel,
            dict(part_ptr="*fp32", live_ptr="*u8", act_ptr="*u8", act_s_ptr="*fp32", h_ptr="*fp32",
                 count_ptr="*i32"),
            dict(K_TOP=8, LIVE_COUNT=False, SPLIT=split, GROUP=128, ROWS=mk.FINALIZE_ROWS, STORE_H=False, PDL=True),
            ("part_ptr", "act_ptr", "act_s_ptr", "I"), 4, 1, f"MoE finalize, {split} splits")
    for e in (256, 64):
        for packed in (True, False):
            out[f"router_select_e{e}_{'packed' if packed else 'unpacked'}"] = KernelSpec(
                rk._router_select_kernel,
                dict(part_ptr="*fp32", weights_ptr="*fp32", experts_ptr="*i64", scores_ptr="*fp32",
                     logits_ptr="*fp32", scaling="fp32"),
                dict(E_PAD=e, SPLIT_BLOCK=4, TOP_K=8, K_PAD=8, NORM=True, WRITE_LOGITS=False, ACCURATE_EXP=True,
                     PACKED_TOPK=packed, PDL=True),
                ("part_ptr", "weights_ptr", "experts_ptr", "scores_ptr", "logits_ptr"), 4, 1,
                f"router select, {e} experts")
    return out


# Checkouts before the controls left the kernels (up to dd04a0f) took these defect switches as constexprs without
# defaults; their product values, so such a checkout compiles its product forms too.
_SWITCHES = {"DEDUP": True, "DROP_LAST": False, "LOWER_TIES": True}


def hashes() -> dict:
    import inspect

    from iquest.bench.sass import compile_spec

    out = {}
    for name, spec in forms().items():
        params = inspect.signature(spec.fn.fn).parameters
        switches = {k: v for k, v in _SWITCHES.items() if k in params and k not in spec.constexprs}
        out[name] = hashlib.sha256(_sass(compile_spec(spec, **switches)).encode()).hexdigest()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write {form: sha256} here (default: stdout)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two --out files; exit 1 if they differ")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(p))["sha256"] for p in args.compare)
        differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        print(f"{len(a.keys() & b.keys()) - len(set(differ) & a.keys() & b.keys())} forms identical; "
              f"differ: {differ or 'none'}")
        return 1 if differ else 0
    import iquest

    got = {"iquest": os.path.dirname(os.path.realpath(iquest.__file__)), "sha256": hashes()}
    text = json.dumps(got, indent=1, sort_keys=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
