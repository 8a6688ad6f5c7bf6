"""kernels/testing.py's interpreter patches: the NumPy xor reduction (what `tl.topk` and `tl.sort` spend their time
in) gives the interpreter's own per-element result, bit for bit, and is the path those reductions take; integer
arithmetic without the overflow checks that the interpreter's `device_assert` discards gives the checked path's bits,
and with `debug` on the check is Triton's own (it catches an overflow); the types made once are the types Triton makes,
shared, a tensor's shape is the one Triton builds, shapes compare as before, and a kernel gives the bits it gives with
Triton's own type code."""

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


def made_types(own: bool) -> dict:
    """Under the patched interpreter, or with Triton's own type code put back (`own`): a kernel of 2-D blocks that
    broadcasts, casts, does pointer arithmetic and reduces, with its outputs; and how the patch's block types, tensors
    and shape comparisons stand against Triton's own."""
    import triton
    import triton.language as tl
    import triton.language.core as core
    from triton.runtime import interpreter

    @triton.jit
    def mixed(x_ptr, y_ptr, out_ptr, sum_ptr, M: tl.constexpr, N: tl.constexpr):
        i, j = tl.arange(0, M), tl.arange(0, N)
        x = tl.load(x_ptr + i[:, None] * N + j[None, :])
        y = tl.load(y_ptr + j).to(tl.float32)
        z = x * y[None, :] + (i[:, None] - j[None, :]).to(tl.float32) * 0.5
        z = tl.where(z > 0, z, -z).to(tl.bfloat16).to(tl.float32)
        tl.store(out_ptr + i[:, None] * N + j[None, :], z)
        tl.store(sum_ptr + i, tl.sum(z, axis=1) + tl.max(x, axis=1))

    builder, block, tensor, tup = interpreter.InterpreterBuilder, core.block_type, core.tensor, core.tuple
    patched = builder.get_block_ty, block.with_element_ty, tensor.__init__, tup.__eq__
    if own:
        builder.get_block_ty, block.with_element_ty = builder.made_get_block_ty, block.made_with_element_ty
        tensor.__init__, tup.__eq__ = tensor.made_init, tup.made_eq
    try:
        g = torch.Generator().manual_seed(5)
        x, y = torch.randn(8, 16, generator=g), torch.randint(-4, 5, (16,), generator=g, dtype=torch.int32)
        out, sums = torch.empty(8, 16), torch.empty(8)
        mixed[(1,)](x, y, out, sums, M=8, N=16)
        r = {"out": out.view(torch.int32).tolist(), "sums": sums.view(torch.int32).tolist()}
    finally:
        builder.get_block_ty, block.with_element_ty, tensor.__init__, tup.__eq__ = patched
    b = interpreter.interpreter_builder
    made = [b.get_block_ty(tl.float32, [4, 8]), block(tl.int32, [4, 8]).with_element_ty(tl.float32)]
    own_made = block(tl.float32, [4, 8])
    ptr = tl.pointer_type(tl.float32)
    r["shared"] = made[0] is made[1] and b.get_block_ty(tl.int32, [4, 8]) is not made[0]
    r["same_as_own"] = all(m == own_made and m.name == own_made.name and m.numel == own_made.numel
                           and list(m.shape) == list(own_made.shape) for m in made)
    r["pointer_blocks"] = (b.get_block_ty(ptr, [8]) == b.made_get_block_ty(ptr, [8])
                           and b.get_block_ty(ptr, [8]).element_ty is ptr)
    handle = interpreter.TensorHandle(x.numpy(), tl.float32)
    t, o = core.tensor(handle, own_made), core.tensor.__new__(core.tensor)
    core.tensor.made_init(o, handle, own_made)
    scalar, oscalar = core.tensor(handle, tl.float32), core.tensor.__new__(core.tensor)
    core.tensor.made_init(oscalar, handle, tl.float32)
    r["tensors_as_own"] = all(
        a.handle is c.handle and a.type is c.type and a.dtype is c.dtype and a.numel.value == c.numel.value
        and [v.value for v in a.shape] == [v.value for v in c.shape] and a.shape.type.name == c.shape.type.name
        for a, c in ((t, o), (scalar, oscalar)))
    shape = own_made.shape
    others = [[4, 8], [4, 9], (4, 8), [8, 4], [4], [core.constexpr(4), 8], core.tuple([4, 8]), core.tuple([4, 7]),
              core.constexpr((4, 8)), core.constexpr([4, 9])]
    r["compares"] = [bool(shape == other) for other in others]
    r["compares_as_own"] = all(bool(shape == other) == bool(core.tuple.made_eq(shape, other))
                               and bool(shape != other) == (not core.tuple.made_eq(shape, other)) for other in others)
    return r


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


def test_types_made_once_are_tritons_own_and_keep_a_kernels_bits(interpreted):
    fast, slow = interpreted["made_types"], interpreted["own_types"]
    assert "error" not in fast and "error" not in slow, (fast, slow)
    assert fast["out"] == slow["out"] and fast["sums"] == slow["sums"], (fast, slow)
    assert fast["shared"] and fast["same_as_own"] and fast["pointer_blocks"] and fast["tensors_as_own"], fast
    assert fast["compares"] == [True, False, True, False, False, True, True, False, True, False], fast
    assert fast["compares_as_own"], fast


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([("patched", lambda: xor_and_topk(False)), ("generic", lambda: xor_and_topk(True)),
                 ("unchecked_ints", lambda: int_arithmetic(False)), ("checked_ints", lambda: int_arithmetic(True)),
                 ("made_types", lambda: made_types(False)), ("own_types", lambda: made_types(True))])
