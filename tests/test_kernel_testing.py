"""kernels/testing.py's interpreter patches: the NumPy xor reduction (what `tl.topk` and `tl.sort` spend their time
in) gives the interpreter's own per-element result, bit for bit, and is the path those reductions take; integer
arithmetic without the overflow checks that the interpreter's `device_assert` discards gives the checked path's bits,
and with `debug` on the check is Triton's own (it catches an overflow)."""

from __future__ import annotations

import sys

import torch

from iquest.kernels.testing import worker_fixture

DTYPES = ("int32", "int64", "uint32")


def xor_and_topk(generic: bool) -> dict:
    """tl.xor_sum over each axis and the whole block, keep_dims or not, at three integer dtypes, and a bitonic tl.topk
    of random keys, under the patched interpreter, or with its own generic reduction put back (`generic`)."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def xors(x_ptr, out0_ptr, out1_ptr, all_ptr, keep_ptr, M: tl.constexpr, N: tl.constexpr):
        i, j = tl.arange(0, M), tl.arange(0, N)
        x = tl.load(x_ptr + i[:, None] * N + j[None, :])
        tl.store(out0_ptr + j, tl.xor_sum(x, axis=0))
        tl.store(out1_ptr + i, tl.xor_sum(x, axis=1))
        tl.store(all_ptr, tl.xor_sum(x))
        tl.store(keep_ptr + i[:, None], tl.xor_sum(x, axis=1, keep_dims=True))

    @triton.jit
    def top(x_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, K), tl.topk(tl.load(x_ptr + tl.arange(0, N)), K))

    ops = interpreter.ReduceOps
    patched = ops.apply_impl
    if generic:
        ops.apply_impl = ops.generic_apply_impl
    before = getattr(ops, "numpy_xor_calls", 0)
    try:
        out, g = {}, torch.Generator().manual_seed(7)
        for dtype in DTYPES:
            t = getattr(torch, dtype)
            info = torch.iinfo(t)
            x = torch.randint(max(info.min, -2 ** 62), min(info.max, 2 ** 62), (4, 8), generator=g,
                              dtype=torch.int64).to(t)
            o0, o1, a, k = torch.empty(8, dtype=t), torch.empty(4, dtype=t), torch.empty(1, dtype=t), torch.empty(4, dtype=t)
            xors[(1,)](x, o0, o1, a, k, M=4, N=8)
            out[dtype] = [v.to(torch.int64).tolist() for v in (o0, o1, a, k)]
        keys = torch.randint(-2 ** 62, 2 ** 62, (64,), generator=g, dtype=torch.int64)
        best = torch.empty(8, dtype=torch.int64)
        top[(1,)](keys, best, N=64, K=8)
        out["topk"] = best.tolist()
        out["topk_want"] = torch.topk(keys, 8).values.tolist()
    finally:
        ops.apply_impl = patched
    out["numpy_xor_calls"] = getattr(ops, "numpy_xor_calls", 0) - before
    return out


def int_arithmetic(checked: bool) -> dict:
    """int32 and int64 +, - and * of random values (some wrapping around), and the interpreter's builder's `debug`
    option, under the patched interpreter, or with Triton's checked path put back (`checked`); then, with `debug` on,
    whether an int32 overflow is caught."""
    import dataclasses

    import triton
    import triton.language as tl
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    @triton.jit
    def arith(x_ptr, y_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        x, y = tl.load(x_ptr + i), tl.load(y_ptr + i)
        tl.store(out_ptr + i, x + y)
        tl.store(out_ptr + N + i, x - y)
        tl.store(out_ptr + 2 * N + i, x * y)

    patched = TritonSemantic.binary_op_sanitize_overflow_impl
    if checked:
        TritonSemantic.binary_op_sanitize_overflow_impl = TritonSemantic.checked_sanitize_overflow_impl
    before = getattr(TritonSemantic, "skipped_overflow_checks", 0)
    builder = interpreter.interpreter_builder
    out, g = {"debug": builder.options.debug}, torch.Generator().manual_seed(11)
    try:
        for dtype in ("int32", "int64"):
            t = getattr(torch, dtype)
            x, y = (torch.randint(-2 ** 31, 2 ** 31, (16,), generator=g, dtype=torch.int64).to(t) for _ in range(2))
            o = torch.empty(48, dtype=t)
            arith[(1,)](x, y, o, N=16)
            out[dtype] = o.tolist()
            if dtype == "int32":
                exact = [a + b for a, b in zip(x.tolist(), y.tolist())] + [a * b for a, b in zip(x.tolist(), y.tolist())]
                out["int32_wrapped"] = any(not -2 ** 31 <= v < 2 ** 31 for v in exact)
        options = builder.options
        builder.options = dataclasses.replace(options, debug=True)
        try:
            big = torch.full((16,), 2 ** 30, dtype=torch.int32)
            arith[(1,)](big, big, torch.empty(48, dtype=torch.int32), N=16)
            out["debug_caught"] = ""
        except Exception as e:
            out["debug_caught"] = repr(e)
        finally:
            builder.options = options
    finally:
        TritonSemantic.binary_op_sanitize_overflow_impl = patched
    out["skipped_checks"] = getattr(TritonSemantic, "skipped_overflow_checks", 0) - before
    return out


interpreted = worker_fixture(__file__)


def test_numpy_xor_reduction_equals_the_interpreters_own(interpreted):
    fast, slow = interpreted["patched"], interpreted["generic"]
    assert "error" not in fast and "error" not in slow, (fast, slow)
    for dtype in DTYPES:
        assert fast[dtype] == slow[dtype], (dtype, fast[dtype], slow[dtype])
    assert fast["topk"] == slow["topk"] == fast["topk_want"]
    # the patched run took the NumPy path (4 xor_sum calls a dtype, and the top-k's network); the generic run none
    assert fast["numpy_xor_calls"] > 4 * len(DTYPES) and slow["numpy_xor_calls"] == 0, (fast, slow)


def test_integer_arithmetic_without_the_discarded_overflow_checks_keeps_its_bits(interpreted):
    fast, slow = interpreted["unchecked_ints"], interpreted["checked_ints"]
    assert "error" not in fast and "error" not in slow, (fast, slow)
    assert fast["debug"] is False and slow["debug"] is False, (fast, slow)  # the premise: the checks were discarded
    assert fast["int32"] == slow["int32"] and fast["int64"] == slow["int64"], (fast, slow)
    assert fast["int32_wrapped"], fast  # some int32 results wrapped around: what a check would be about
    # the patched run skipped its int32 checks (3 operations; the int64 ones have none), the checked run none; with
    # debug on, both catch the int32 overflow as Triton's own check does
    assert fast["skipped_checks"] >= 3 and slow["skipped_checks"] == 0, (fast, slow)
    for r in (fast, slow):
        assert "int32 overflow detected" in r["debug_caught"], r


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([("patched", lambda: xor_and_topk(False)), ("generic", lambda: xor_and_topk(True)),
                 ("unchecked_ints", lambda: int_arithmetic(False)), ("checked_ints", lambda: int_arithmetic(True))])
