"""lab/op_bound.py: the round's bounds composed from raw files, on made-up reports whose arithmetic is known."""

import pytest

from iquest.lab import op_bound


def _ring(distinct, layer_us, flat_layer_us, tiny_us_per_op=None, commit="abc"):
    rows = [{"streams": "round", "form": "chain-pdl-preload", "ops": 52, "floor_us": 4 * flat_layer_us,
             "median_us": 4 * layer_us + 8.0},
            {"streams": "round", "stages": 13, "chunk_kb": 16, "ops": 52, "floor_us": 4 * flat_layer_us + 1.0,
             "ring": {"median_us": 4 * layer_us}, "ring-poll": {"median_us": 4 * layer_us + 4.0},
             "ring-oracle": {"median_us": 1.0}}]  # an oracle form is never the bound: it knows the experts early
    if tiny_us_per_op is not None:
        rows.append({"streams": "1 KB", "stages": 8, "chunk_kb": 1, "ops": 52, "floor_us": 2.0,
                     "ring": {"median_us": 52 * tiny_us_per_op}, "ring-poll": {"median_us": 52 * tiny_us_per_op + 9},
                     "ring-oracle": {"median_us": 0.5}})
    return {"probe": "ring", "commit": commit, "layers": 4, "distinct": distinct, "rows": rows}


def _step(launches=1197):
    return {"layers": 88, "drafts": 5, "floor": {"launches": launches},
            "floors_by_variant": {"triton": {"floor_us": 2000.0, "distinct_experts_verify_mean": 12.9,
                                             "median_round_us": 5800.0},
                                  "triton~route:38": {"floor_us": 4400.0, "distinct_experts_verify_mean": 38,
                                                      "median_round_us": 8000.0}}}


def test_bounds_add_layers_heads_and_other_launches():
    rings = [_ring(38, 70.0, 40.0), _ring(13, 40.0, 17.0, tiny_us_per_op=1.5)]
    rows = op_bound.bounds(_step(), {"flat_us": {"lm_head": 60.0}}, rings, layer_kernels=12)
    assert [r["distinct"] for r in rows] == [13, 38]
    other = 1197 - 93 * 12 - 6
    fixed = 6 * 60.0 + other * 1.5
    low, high = rows
    assert low["variant"] == "triton" and high["variant"] == "triton~route:38"
    assert low["form"] == "ring, 13 x 16 KB"  # the fastest form that does not know the experts early
    assert low["structure_us"] == pytest.approx(93 * (40.0 - 1 * 1.5) + fixed)  # one bare op a layer taken off
    assert low["flat_us"] == pytest.approx(93 * 17.0 + fixed)
    assert low["structure_x"] == pytest.approx(low["structure_us"] / 2000.0)
    assert high["structure_us"] == pytest.approx(93 * (70.0 - 1.5) + fixed)
    # the layer time a target leaves, in the probe's terms (its spare op added back): the bound at it meets the target
    assert 93 * (low["needed_layer_us"] - 1.5) + fixed == pytest.approx(2.0 * 2000.0)
    assert 93 * (high["needed_layer_us"] - 1.5) + fixed == pytest.approx(1.35 * 4400.0)


def test_bounds_need_the_1kb_run_and_room_for_the_layers():
    with pytest.raises(ValueError, match="1 KB"):
        op_bound.bounds(_step(), {"flat_us": {"lm_head": 60.0}}, [_ring(13, 40.0, 17.0)], 12)
    with pytest.raises(ValueError, match="cannot hold"):
        op_bound.bounds(_step(launches=500), {"flat_us": {"lm_head": 60.0}},
                        [_ring(13, 40.0, 17.0, tiny_us_per_op=1.5)], 12)


def test_main_rejects_a_report_without_its_routing(tmp_path, capsys):
    import json

    ring = _ring(13, 40.0, 17.0, tiny_us_per_op=1.5)
    del ring["distinct"]
    paths = {name: tmp_path / f"{name}.json" for name in ("ring", "step", "probe")}
    for name, obj in (("ring", ring), ("step", _step()), ("probe", {"flat_us": {"lm_head": 60.0}})):
        paths[name].write_text(json.dumps(obj))
    with pytest.raises(SystemExit):
        op_bound.main([str(paths["ring"]), "--step", str(paths["step"]), "--stream-probe", str(paths["probe"])])
    assert "routing" in capsys.readouterr().err
    ring["distinct"] = 13
    paths["ring"].write_text(json.dumps(ring))
    out = tmp_path / "bound.json"
    op_bound.main([str(paths["ring"]), "--step", str(paths["step"]), "--stream-probe", str(paths["probe"]),
                   "--json", str(out)])
    assert "target    2.00x" in capsys.readouterr().out
    assert json.loads(out.read_text())["rows"][0]["distinct"] == 13
