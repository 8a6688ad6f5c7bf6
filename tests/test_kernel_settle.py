"""kernels/settle.py (the round's settle step and the next drafting's inputs, one kernel) against fast/torch_ops.settle, the torch
sequence the engine's fallback runs.

Property test over the step's input space (position, committed count, accepted count and drafts, stop tokens anywhere
or nowhere, budgets that cut the log or end the request, a log or context near full): from one random state both
must leave every state tensor equal outside the trash entries, and the same drafting inputs. Under the interpreter on
the CPU (one worker subprocess, 60 examples: integer bookkeeping, ~1 s) and on the GPU (200), with a negative control
(a settle step that ignores the budget).
"""

from __future__ import annotations

import sys
from dataclasses import fields

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as hs

from iquest.fast.state import DecodeState, DraftInputs
from iquest.fast import torch_ops
from iquest.kernels import settle as sk
from iquest.kernels.testing import worker_fixture

CAPACITY, LOG = 64, 24


def state_on(st: DecodeState, device: str) -> DecodeState:
    """A copy of the decode state on `device`."""
    return DecodeState(**{f.name: t.clone().to(device) for f in fields(DecodeState)
                          if (t := getattr(st, f.name)) is not None})


def make_case(n: int, a: int, k: int, stops: list[int], stop_at: int | None, budget: int, done_before: int,
              rounds: int, seed: int, rejected_kv: bool = False) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    st = DecodeState.allocate(CAPACITY, LOG, hidden=4, top_k=4, dtype=torch.float32, device=torch.device("cpu"))
    st.tokens.copy_(torch.randint(10, 1000, (CAPACITY + 1,), generator=gen))
    st.n.fill_(n)
    st.stop_ids[: len(stops)] = torch.tensor(stops, dtype=torch.int64)
    st.budget.fill_(budget)
    st.emitted.fill_(done_before)
    st.log_tokens.copy_(torch.randint(0, 1000, (LOG + 1,), generator=gen))
    st.log_logprobs.copy_(torch.randn(LOG + 1, generator=gen))
    st.log_rounds.copy_(torch.randint(0, 9, (LOG + 1, 4), generator=gen))
    st.rounds.fill_(rounds)
    st.product.fill_(float(torch.rand((), generator=gen)))
    st.more.copy_(torch.randint(0, 2, st.more.shape, generator=gen, dtype=torch.int32))
    emitted = torch.randint(10, 1000, (8,), generator=gen)
    if stop_at is not None and stops:
        emitted[stop_at] = stops[seed % len(stops)]
    count = torch.tensor(k + 1 if rejected_kv else a + 1)
    committed = torch.randint(10, 1000, (8,), generator=gen) if rejected_kv else emitted
    logprobs = -torch.rand(8, generator=gen) * 5
    return st, committed, count, emitted, torch.tensor(a + 1), logprobs, torch.tensor(k), torch.tensor(a)


def compare(case: tuple, device: str) -> dict:
    st, committed, count, emitted, n_emit, logprobs, k, a = case
    ref_st, ker_st = state_on(st, device), state_on(st, device)
    args = [t.to(device) for t in (committed, count, emitted, n_emit, logprobs, k, a)]
    want = torch_ops.settle(ref_st, *args, DraftInputs.allocate(torch.device(device)))
    got = sk.settle(ker_st, *args, DraftInputs.allocate(torch.device(device)))
    trash_free = {"tokens": slice(0, CAPACITY), "log_tokens": slice(0, LOG), "log_logprobs": slice(0, LOG),
                  "log_rounds": slice(0, LOG)}
    cut = lambda name, v: v[trash_free[name]] if name in trash_free else v
    diffs = [f.name for f in fields(DecodeState) if getattr(ref_st, f.name) is not None
             and not torch.equal(cut(f.name, getattr(ref_st, f.name)), cut(f.name, getattr(ker_st, f.name)))]
    diffs += [f"draft.{name}" for name, x, y in zip(DraftInputs._fields, want, got) if not torch.equal(x, y)]
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
    @example(make_case(10, 5, 6, [77], 2, LOG, 0, 0, 3))  # a stop token at row 2 of 6 emitted
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
    ref = compare((st, *rest), device)
    broken_st, ker_st = state_on(st, device), state_on(st, device)
    ker_st.budget.add_(4)
    args = [t.to(device) for t in rest]
    torch_ops.settle(broken_st, *args, DraftInputs.allocate(torch.device(device)))
    sk.settle(ker_st, *args, DraftInputs.allocate(torch.device(device)))
    return {"cut_by_budget": ref["cut_by_budget"], "log_equal": bool(torch.equal(broken_st.log_rounds[:LOG],
                                                                                 ker_st.log_rounds[:LOG])),
            "emitted_equal": bool(torch.equal(broken_st.emitted, ker_st.emitted))}


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


@pytest.mark.gpu
def test_gpu_property():
    _check_property(run_property("cuda", 200))
    _check_negative(negative_control("cuda"))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([("property", lambda: run_property("cpu", 60)), ("negative", lambda: negative_control("cpu"))])
