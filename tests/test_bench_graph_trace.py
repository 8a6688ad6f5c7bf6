"""bench/graph_trace.py's attribution (CPU, synthetic traces): what each kernel adds is its end minus the previous
end, grouped by transition; replays are cut at host-sync gaps. The GPU run itself is `iquest bench graph-trace`."""

import pytest

from iquest.bench.graph_trace import (LAYER_MARK, attribute, layer_kernels, layer_times, merge, short_name,
                                      split_replays)
from iquest.cli.main import main


def chain(t0: float) -> list[tuple[str, float, float]]:
    # PDL: b starts while a runs and ends 3 us after it; c ends 2 us after b; d (the same kernel as b) 4 us after c
    return [("void a_kernel<1>(int)", t0, t0 + 5.0), ("b_kernel", t0 + 1.0, t0 + 8.0),
            ("c_kernel", t0 + 7.0, t0 + 10.0), ("b_kernel", t0 + 9.0, t0 + 14.0)]


def test_increments_add_up_to_the_span_and_split_by_transition():
    r = attribute(list(reversed(chain(100.0))))  # any order in, ends sorted
    assert r["span_us"] == pytest.approx(14.0) and r["kernels"] == 4
    assert sum(s["us"] for s in r["by_transition"].values()) == pytest.approx(r["span_us"])
    assert r["by_transition"]["start -> a_kernel"]["us"] == pytest.approx(5.0)
    assert r["by_transition"]["a_kernel -> b_kernel"]["us"] == pytest.approx(3.0)
    assert r["by_transition"]["c_kernel -> b_kernel"]["us"] == pytest.approx(4.0)
    assert r["by_kernel"]["b_kernel"] == {"count": 2, "us": pytest.approx(7.0)}
    # own spans (start to end), apart from the increments
    assert r["by_transition"]["a_kernel -> b_kernel"]["own_us"] == pytest.approx(7.0)  # b parked from t0 + 1
    assert r["by_transition"]["b_kernel -> c_kernel"]["own_us"] == pytest.approx(3.0)
    # not the kernels' own durations (which overlap under PDL): b ran 7 us and 5 us
    assert r["by_kernel"]["b_kernel"]["us"] != pytest.approx(12.0)


def test_replays_are_cut_at_sync_gaps_and_merged_by_median():
    events = chain(0.0) + chain(100.0) + [(n, s, e + (1.0 if n == "c_kernel" else 0.0)) for n, s, e in chain(200.0)]
    parts = split_replays(events)
    assert [len(p) for p in parts] == [4, 4, 4]
    m = merge([attribute(p) for p in parts])
    assert m["by_transition"]["b_kernel -> c_kernel"]["us"] == pytest.approx(2.0)  # median of 2, 2, 3
    assert m["span_us"] == pytest.approx(14.0)
    with pytest.raises(ValueError, match="no kernels"):
        attribute([])


def test_kernels_a_layer_are_counted_between_attention_splits():
    """A lead-in, three attention splits and a tail: the kernels from each split to the next (the next layer's q/k/v
    projection included), 6 and 5, whatever order the trace lists them in."""
    names = ["embed", "qkv", LAYER_MARK, "combine", "o", "norm", "moe",
             "qkv", LAYER_MARK, "combine", "o", "norm",
             "qkv", LAYER_MARK, "combine", "o", "norm", "router", "moe", "lm_head"]
    kernels = [(n, float(i), float(i) + 0.5) for i, n in enumerate(names)]
    assert layer_kernels(list(reversed(kernels))) == [6, 5]
    assert layer_kernels([("a", 0.0, 1.0)]) == []


def test_a_layer_is_timed_from_one_attention_split_to_the_next_by_their_ends():
    """Under PDL a split starts early and parks: its end, not its start, marks where the chain is, so a layer is the
    time between two splits' ends (here 7 and 12 us), not between their starts (6 and 8)."""
    kernels = [("qkv", 0.0, 2.0), (LAYER_MARK, 1.0, 3.0), ("o", 2.5, 6.0), ("qkv", 5.0, 9.0),
               (LAYER_MARK, 7.0, 10.0), ("o", 9.5, 15.0), ("moe", 14.0, 20.0), (LAYER_MARK, 15.0, 22.0),
               ("lm_head", 21.0, 30.0)]
    assert layer_times(list(reversed(kernels))) == [7.0, 12.0]
    assert layer_times([("a", 0.0, 1.0), (LAYER_MARK, 1.0, 2.0)]) == []


def test_short_names():
    assert short_name("void at::native::vectorized_elementwise_kernel<4, float>(int, float)") == \
        "at::native::vectorized_elementwise_kernel"
    assert short_name("_moe_down_kernel") == "_moe_down_kernel"
    assert short_name("Memcpy DtoD (Device -> Device)") == "Memcpy DtoD"


def test_cli_refuses_bad_arguments_before_needing_a_gpu():
    assert main(["bench", "graph-trace", "--rows", "0"]) != 0
    assert main(["bench", "graph-trace", "--kernels", ","]) != 0
