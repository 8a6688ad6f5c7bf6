"""kernels/settle.py (the round's settle step and the next drafting's inputs, one kernel) against settle_ref, the torch
sequence the engine's fallback runs.

Property test over the step's input space (position, committed count, accepted count and drafts, stop tokens anywhere
or nowhere, budgets that cut the log or end the request, a log or context near full): from one random state both
must leave every state tensor equal outside the trash entries, and the same drafting inputs. Under the interpreter on
the CPU (one worker subprocess) and on the GPU. Then whole decodes with and without the kernel must be the same.
"""

from __future__ import annotations

import sys

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as hs

from iquest.kernels import settle as sk
from iquest.kernels.testing import worker_fixture

CAPACITY, LOG = 64, 24


class State:
    """The DecodeState fields the step reads and writes."""

    def __init__(self, device, **t):
        for name, value in t.items():
            setattr(self, name, value.to(device))

    def clone(self):
        return State("cpu", **{k: v.clone() for k, v in vars(self).items()})

    def to(self, device):
        return State(device, **vars(self))


def make_case(n: int, a: int, k: int, stops: list[int], stop_at: int | None, budget: int, done_before: int,
              rounds: int, seed: int, rejected_kv: bool = False) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 1000, (CAPACITY + 1,), generator=gen)
    st = State("cpu", tokens=tokens, n=torch.tensor(n), stop_ids=torch.tensor(stops + [-1] * (8 - len(stops))),
               budget=torch.tensor(budget), emitted=torch.tensor(done_before),
               log_tokens=torch.randint(0, 1000, (LOG + 1,), generator=gen), log_logprobs=torch.randn(LOG + 1,
               generator=gen), log_rounds=torch.randint(0, 9, (LOG + 1, 4), generator=gen),
               rounds=torch.tensor(rounds), done=torch.tensor(0, dtype=torch.int32),
               product=torch.rand((), generator=gen), more=torch.randint(0, 2, (9,), generator=gen, dtype=torch.int32))
    emitted = torch.randint(10, 1000, (8,), generator=gen)
    if stop_at is not None and stops:
        emitted[stop_at] = stops[seed % len(stops)]
    count = torch.tensor(k + 1 if rejected_kv else a + 1)
    committed = torch.randint(10, 1000, (8,), generator=gen) if rejected_kv else emitted
    logprobs = -torch.rand(8, generator=gen) * 5
    return st, committed, count, emitted, torch.tensor(a + 1), logprobs, torch.tensor(k), torch.tensor(a)


def compare(case: tuple, device: str) -> dict:
    st, committed, count, emitted, n_emit, logprobs, k, a = case
    ref_st, ker_st = st.clone().to(device), st.clone().to(device)
    args = [t.to(device) for t in (committed, count, emitted, n_emit, logprobs, k, a)]
    want = sk.settle_ref(ref_st, *args, sk.DraftInputs.allocate(torch.device(device)))
    got = sk.settle(ker_st, *args, sk.DraftInputs.allocate(torch.device(device)))
    trash_free = {"tokens": slice(0, CAPACITY), "log_tokens": slice(0, LOG), "log_logprobs": slice(0, LOG),
                  "log_rounds": slice(0, LOG)}
    cut = lambda name, v: v[trash_free[name]] if name in trash_free else v
    diffs = [name for name, v in vars(ref_st).items() if not torch.equal(cut(name, v), cut(name, getattr(ker_st, name)))]
    diffs += [f"draft.{name}" for name, x, y in zip(sk.DraftInputs._fields, want, got) if not torch.equal(x, y)]
    keep = int(ref_st.emitted) - int(st.emitted)
    return {"diffs": diffs, "kept": keep, "cut_by_budget": keep < int(n_emit) and int(ref_st.emitted) >= int(st.budget),
            "done": int(ref_st.done)}


@hs.composite
def cases(draw):
    k = draw(hs.integers(0, 7))
    a = draw(hs.integers(0, k))
    n = draw(hs.integers(0, CAPACITY - 17))
    stops = draw(hs.lists(hs.integers(10, 999), max_size=8))
    stop_at = draw(hs.none() | hs.integers(0, 7))
    budget = draw(hs.integers(1, LOG))
    done_before = draw(hs.integers(0, budget))
    rounds = draw(hs.integers(0, LOG + 3))  # past the log's capacity: the record goes to the trash row
    return make_case(n, a, k, stops, stop_at, budget, done_before, rounds, draw(hs.integers(0, 2**16)),
                     rejected_kv=draw(hs.booleans()))


def run_property(device: str, examples: int) -> dict:
    failures, seen = [], {"stop_cut": 0, "budget_cut": 0, "done": 0, "full": 0}

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(cases())
    @example(make_case(CAPACITY - 17, 3, 5, [77], 1, LOG, 0, 0, 1))  # context full after the commit
    @example(make_case(5, 7, 7, [], None, 3, 1, 2, 2))  # budget cuts the log
    def prop(case):
        r = compare(case, device)
        if r["diffs"]:
            failures.append(r)
        seen["budget_cut"] += r["cut_by_budget"]
        seen["done"] += r["done"]
        seen["stop_cut"] += r["kept"] < int(case[4]) and not r["cut_by_budget"]
        seen["full"] += int(case[0].n) + int(case[2]) + 16 >= CAPACITY

    prop()
    return {"failures": failures[:3], "n_failures": len(failures), "seen": seen}


def negative_control(device: str) -> dict:
    """The comparison catches a settle step that ignores the budget (the kernel given a larger one), on a case the
    budget cuts."""
    st, *rest = make_case(5, 7, 7, [], None, 3, 1, 2, 2)
    bigger = st.clone()
    bigger.budget = bigger.budget + 4
    ref = compare((st, *rest), device)
    broken_st, ker_st = st.clone().to(device), bigger.clone().to(device)
    args = [t.to(device) for t in rest]
    sk.settle_ref(broken_st, *args, sk.DraftInputs.allocate(torch.device(device)))
    sk.settle(ker_st, *args, sk.DraftInputs.allocate(torch.device(device)))
    return {"cut_by_budget": ref["cut_by_budget"], "log_equal": bool(torch.equal(broken_st.log_rounds[:LOG],
                                                                                 ker_st.log_rounds[:LOG])),
            "emitted_equal": bool(torch.equal(broken_st.emitted, ker_st.emitted))}


def decodes(device: str, dtype: str = "fp32") -> dict:
    """Whole decodes (tiny model, depths 0, 3 and 7) with the settle kernel against the torch sequence."""
    from iquest.tests.test_fast_kernels import decode

    calls, original = [], sk.settle
    sk.settle = lambda *a, **kw: calls.append(1) or original(*a, **kw)  # TritonOps takes it when built
    try:
        fused = decode("settle", device, dtype)
    finally:
        sk.settle = original
    return {"equal": fused == decode("torch", device, dtype), "kernel_calls": len(calls)}


def _check_property(r: dict) -> None:
    assert "error" not in r, r.get("error")
    assert r["n_failures"] == 0, r["failures"]
    seen = r["seen"]
    assert seen["stop_cut"] > 0 and seen["budget_cut"] > 0 and seen["done"] > 0 and seen["full"] > 0, seen


def _check_negative(r: dict) -> None:
    assert "error" not in r, r.get("error")
    assert r["cut_by_budget"], "the control's case must be one the budget cuts"
    assert not (r["log_equal"] and r["emitted_equal"]), "the comparison missed a settle step that ignores the budget"


interpreted = worker_fixture(__file__)


def test_interpreted_property(interpreted):
    _check_property(interpreted["property"])


def test_interpreted_negative_control(interpreted):
    _check_negative(interpreted["negative"])


def test_interpreted_decodes(interpreted):
    r = interpreted["decodes"]
    assert "error" not in r, r.get("error")
    assert r["kernel_calls"] > 0 and r["equal"], r


@pytest.mark.gpu
def test_gpu_property():
    _check_property(run_property("cuda", 200))
    _check_negative(negative_control("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_cuda_decodes_with_and_without_the_settle_kernel(dtype):
    """The default kernels through the captured decode loop: the same tokens, logprobs and rounds with and without
    the settle kernel, which ran."""
    from iquest.fast.ops import STAGES
    from iquest.tests.test_kernel_launch import decode_with_logprobs

    on = decode_with_logprobs("triton", dtype)
    off = decode_with_logprobs("+".join(s for s in STAGES if s != "settle"), dtype)
    assert on["settle_calls"] > 0 and off["settle_calls"] == 0
    assert on["steps"] == off["steps"]


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([("property", lambda: run_property("cpu", 60)), ("negative", lambda: negative_control("cpu")),
                 ("decodes", lambda: decodes("cpu"))])
