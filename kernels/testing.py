"""Running kernel tests under Triton's CPU interpreter (TRITON_INTERPRET=1), for tests/test_kernel_*.py.

Triton reads TRITON_INTERPRET when it is imported (its own `tl.sum`, `tl.max`, ... are jit functions
decorated then), so interpreted kernels need a process of their own: a test module runs itself as a
worker subprocess with the variable set, once, and checks the per-case results it prints as JSON.

Triton 3.6's interpreter holds scalars as shape-(1,) NumPy arrays and turns them into loop bounds
with `int(array)`, which NumPy >= 2.3 refuses; `patch_interpreter()` makes that conversion take the
single element, so kernels may keep device-computed loop bounds (as they must on the GPU).

Interpreted cases are CPU-expensive (a case costs 0.1-30 s), so the worker also reports each case's seconds under
"_seconds": `python -m iquest.kernels.testing tests/test_kernel_X.py ...` prints them, slowest first.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import types


def patch_interpreter() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_iquest_patched", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _skip_relaunch_patching(interpreter)
    _xor_reduce_in_numpy(interpreter)
    _np_dtypes_looked_up(interpreter)
    _no_dead_overflow_checks(interpreter)
    _types_made_once(interpreter)
    interpreter._iquest_patched = True


def _skip_relaunch_patching(interpreter) -> None:
    """Triton 3.6's interpreter re-patches triton.language (`_patch_lang`: an `inspect.getmembers` walk of four modules,
    then every patched attribute set again) on every call of a @triton.jit helper, though within one kernel launch the
    modules a helper sees stay patched once patched: a quarter of an interpreted kernel's time. Here each launch
    patches each language module (triton.language, triton.language.core) the first time a function that sees it is
    called, as before, and skips the repeats."""
    import inspect

    patched: list[set] = []  # per active launch: the language modules patched in it
    seen: dict = {}  # function -> the language modules its globals hold

    def langs(fn) -> set:
        if fn not in seen:
            seen[fn] = {id(v) for v in fn.__globals__.values()
                        if inspect.ismodule(v) and v in (interpreter.tl, interpreter.tl.core)}
        return seen[fn]

    launch = interpreter.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        patched.append(langs(self.fn))  # the launch patches its kernel's own modules first
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call(self, *args, **kwargs):
        needed = langs(self.fn)
        if not patched or not needed <= patched[-1]:
            interpreter._patch_lang(self.fn)
            if patched:
                patched[-1] |= needed
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = grid_call
    interpreter.InterpretedFunction.__call__ = device_call


def _np_dtypes_looked_up(interpreter) -> None:
    """Triton 3.6's interpreter maps a Triton dtype to its NumPy storage dtype (`_get_np_dtype`) by building a
    20-entry dictionary on every call, several times an interpreted op: 8% of an interpreted kernel's time. Here each
    element dtype's answer is the interpreter's own, asked once and then looked up."""
    import triton.language as tl

    original = interpreter._get_np_dtype
    found: dict = {}

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(element, tl.pointer_type):  # unhashable: an address, whatever it points to
            return original(element)
        if element not in found:
            found[element] = original(element)
        return found[element]

    interpreter._get_np_dtype = get_np_dtype


def _no_dead_overflow_checks(interpreter) -> None:
    """Triton 3.6 builds an overflow check for every integer +, - and * of 32 bits or fewer
    (`binary_op_sanitize_overflow_impl`: both operands cast to int64, the operation redone, compared with the type's
    bounds) and hands it to `device_assert`, which does nothing unless the builder's options have `debug` on; the
    interpreter's builder never has (InterpreterOptions() as made, debug False). So under the interpreter each check
    was computed and thrown away: 40% of an interpreted kernel's time. Here the interpreter's builder skips it while
    its `debug` is off, as `device_assert` would have discarded it (the check's casts and comparisons make new values
    and change nothing); with `debug` on, or any other builder, the check is Triton's own."""
    from triton.language.semantic import TritonSemantic

    checked = TritonSemantic.binary_op_sanitize_overflow_impl
    TritonSemantic.checked_sanitize_overflow_impl = checked  # kept for the patch's own test

    def sanitize_overflow(self, lhs, rhs, binary_op):
        if isinstance(self.builder, interpreter.InterpreterBuilder) and not self.builder.options.debug:
            TritonSemantic.skipped_overflow_checks = getattr(TritonSemantic, "skipped_overflow_checks", 0) + 1
            return
        return checked(self, lhs, rhs, binary_op)

    TritonSemantic.binary_op_sanitize_overflow_impl = sanitize_overflow


def _types_made_once(interpreter) -> None:
    """Triton 3.6's interpreter makes a new `block_type` for every value an op returns (`get_block_ty`,
    `with_element_ty`), gives every tensor a new `tl.tuple` of its shape with a `tuple_type` built element by element,
    and compares two shapes (`tl.tuple.__eq__`, each block type equality and each broadcast) by first building a third
    `tl.tuple` of the other side: a quarter to two fifths of an interpreted kernel test's time, in Python objects made
    again for every op. Types are values (Triton never assigns to one once made), so here a block type is made once for
    each (element type, shape) and shared (an unhashable element, a pointer type, is made each time as before), a
    tensor's shape is a new `tl.tuple` on its shape's `tuple_type` made once, and a shape compared with a list or a
    tuple compares the unwrapped elements, which `__eq__` built the third tuple to hold. The originals are kept for the
    patch's own test (tests/test_kernel_testing.py)."""
    import math

    import triton.language.core as core

    made: dict = {}

    def block_type(element_ty, shape):
        dims = tuple(shape)
        if all(type(d) is int for d in dims):  # constexpr dims (unwrapped by block_type) are made each time
            try:
                found = made.get((element_ty, dims))
            except TypeError:  # an unhashable element type
                return core.block_type(element_ty, shape)
            if found is None:
                found = made[(element_ty, dims)] = core.block_type(element_ty, shape)
            return found
        return core.block_type(element_ty, shape)

    builder, block = interpreter.InterpreterBuilder, core.block_type
    builder.made_get_block_ty, block.made_with_element_ty = builder.get_block_ty, block.with_element_ty
    builder.get_block_ty = lambda self, dtype, shape: block_type(dtype, shape)
    block.with_element_ty = lambda self, scalar_ty: block_type(scalar_ty, self.shape)

    shapes: dict = {}  # shape -> (its constexprs, their tuple_type, numel)
    core.tensor.made_init = core.tensor.__init__

    def tensor_init(self, handle, type):  # tensor.__init__'s assignments, the shape's types made once
        self.handle = handle
        dims = tuple(type.shape) if type.is_block() else ()
        found = shapes.get(dims)
        if found is None:
            values = [core.constexpr(s) for s in dims]
            found = shapes[dims] = (values, core._type_for_tuple_values(values), core.constexpr(math.prod(dims)))
        self.numel = found[2]
        self.type = type
        self.dtype = type.scalar
        self.shape = core.tuple(found[0], found[1])

    core.tensor.__init__ = tensor_init

    equal = core.tuple.made_eq = core.tuple.__eq__
    unwrap = core._unwrap_if_constexpr

    def tuple_eq(self, other):
        if type(other) in (list, tuple, core.tuple):  # what _normalize_tuple(other).values holds, without the tuple
            return core.constexpr(self.values == [unwrap(x) for x in other])
        return equal(self, other)

    core.tuple.__eq__ = tuple_eq


def _xor_reduce_in_numpy(interpreter) -> None:
    """`tl.topk` and `tl.sort` (a bitonic network) reduce with `xor_sum` at every compare-and-swap, and Triton 3.6's
    interpreter has no NumPy form for that combine: it calls the jit combine once an element, in Python, which was 98%
    of an interpreted round's time (tests/test_round_kernels.py: 220 of 227 s). Here that one combine reduces with
    `np.bitwise_xor`, the same bits (xor is exact and order-free); every other combine keeps the interpreter's path."""
    import numpy as np
    import triton.language as tl

    ops = interpreter.ReduceOps
    generic = ops.generic_apply_impl = ops.apply_impl  # kept for the patch's own test (tests/test_kernel_testing.py)

    def apply_impl(self, input):
        if self.combine_fn != tl.standard._xor_combine:
            return generic(self, input)
        ops.numpy_xor_calls = getattr(ops, "numpy_xor_calls", 0) + 1
        (x,) = input
        data = x.handle.data
        if self.axis is None:
            out = np.bitwise_xor.reduce(data.reshape(-1))
            out = out.reshape((1,) * data.ndim) if self.keep_dims else out
        else:
            out = np.bitwise_xor.reduce(data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(out, x.dtype)

    ops.apply_impl = apply_impl


def substitute(kernel, **pieces):
    """A copy of jit `kernel` whose calls to the named module-level jit functions go to `pieces` instead: how the
    kernels' negative controls put a broken piece in (tests/kernel_controls.py), so the product kernel carries no
    switch for it. The product kernel, and what it compiled, are untouched: the copy resolves its globals in a
    dictionary of its own (Triton's compiler and interpreter both read a kernel's globals from `fn.__globals__`)."""
    fn = kernel.fn
    unknown = sorted(set(pieces) - set(fn.__code__.co_names))
    if unknown:
        raise ValueError(f"{fn.__name__} calls no {', '.join(unknown)}")
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **pieces}, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__module__, copy.__qualname__, copy.__kwdefaults__ = fn.__module__, fn.__qualname__, fn.__kwdefaults__
    copy.__annotations__ = dict(fn.__annotations__)  # Triton finds the constexpr parameters by their annotations
    if hasattr(kernel, "kwargs"):  # the interpreter's InterpretedFunction
        return type(kernel)(copy, **kernel.kwargs)
    return type(kernel)(copy, version=kernel.version, do_not_specialize=kernel.do_not_specialize,
                        do_not_specialize_on_alignment=kernel.do_not_specialize_on_alignment, debug=kernel.debug,
                        noinline=kernel.noinline, repr=kernel._repr, launch_metadata=kernel.launch_metadata)


@contextlib.contextmanager
def substituted(module, substitutions: dict):
    """Within the block, `module`'s kernels named in `substitutions` ({kernel name: {piece name: broken jit
    function}}) are `substitute`d copies; restored after. A test's own patch: not thread-safe."""
    saved = {name: getattr(module, name) for name in substitutions}
    try:
        for name, pieces in substitutions.items():
            setattr(module, name, substitute(saved[name], **pieces))
        yield
    finally:
        for name, kernel in saved.items():
            setattr(module, name, kernel)


def run_worker(script: str, timeout: float = 1200) -> dict:
    """Run `python script --interpret-worker` with TRITON_INTERPRET=1; return the JSON it prints last."""
    # The interpreter evaluates tl.dot with numpy, so its bits are OpenBLAS's: the kernel that OpenBLAS picks for the
    # CPU blocks (and fuses multiply-adds) by matrix shape, and on an AMD EPYC two kernels' equal dots of different
    # tile shapes came out unequal (moe 8rows_random). The plain SSE2 kernel makes them a property of the code, not of
    # the CI machine.
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_CORETYPE="Prescott")
    done = subprocess.run([sys.executable, script, "--interpret-worker"], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"interpreter worker failed:\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def worker_main(jobs) -> None:
    """A test module's worker body: run each (name, job) under the interpreter, print the results as
    JSON (an exception is reported per case, so one broken case does not hide the others), with each case's
    seconds under "_seconds"."""
    import traceback

    patch_interpreter()
    results, seconds = {}, {}
    for name, job in jobs:
        start = time.process_time()
        try:
            results[name] = job()
        except Exception as e:
            results[name] = {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"}
        seconds[name] = round(time.process_time() - start, 3)
    results["_seconds"] = seconds
    print(json.dumps(results))


def worker_fixture(script: str):
    """The module-scoped pytest fixture `interpreted`: the worker's results for test module `script`."""
    import pytest

    @pytest.fixture(scope="module")
    def interpreted() -> dict:
        return run_worker(os.path.abspath(script))

    return interpreted


def interpreted_tests(script: str, cases: list[dict], check, summary=None):
    """(`interpreted` fixture, `test_interpreted`) for a kernel test module: one test per case of `cases` (dicts
    with a "name"), each taking the worker's result for that case, failing on a reported error, then
    `check(case, result)`; `summary(case, result)`, if given, is printed (shown with -s)."""
    import pytest

    fixture = worker_fixture(script)

    @pytest.mark.parametrize("c", cases, ids=[c["name"] for c in cases])
    def test_interpreted(interpreted, c):
        r = interpreted[c["name"]]
        assert "error" not in r, r.get("error")
        check(c, r)
        if summary is not None:
            print(summary(c, r))

    return fixture, test_interpreted



def main(argv: list[str]) -> int:
    """Run each test module's worker and print its cases' CPU seconds, slowest first, and the worker's totals (CPU
    time with start-up and imports, and wall time)."""
    import resource

    for script in argv:
        start, cpu = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds = run_worker(os.path.abspath(script))["_seconds"]
        used = resource.getrusage(resource.RUSAGE_CHILDREN)
        total = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime
        print(f"{script}: {sum(seconds.values()):.1f} s in cases, worker {total:.1f} s CPU, "
              f"{time.perf_counter() - start:.1f} s wall")
        for name, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            print(f"  {s:8.2f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
