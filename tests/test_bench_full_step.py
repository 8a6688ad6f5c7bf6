"""`iquest bench step --config ... --tp-slice N`: synthetic rank slices, the byte count, the CPU smoke run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, strategies as st
import torch

from iquest.bench.bytes import ByteCounter, RoundRouting, round_bytes, stage_bytes
from iquest.cli.main import main
from iquest.fast import weights as fast_weights
from iquest.fast.parallel import Parallel
from iquest.fast.rank import EngineOptions, RankEngine, Request
from iquest.fast.synthetic import synthetic_weights
from iquest.fast.weights import load_weights
from iquest.reference.config import Config, GenerationConfig

ROOT = Path(__file__).resolve().parent.parent
TINY, TINY_TP8 = ROOT / "fixtures" / "tiny", ROOT / "fixtures" / "tiny-tp8"


def _pairs(a, b, path=""):
    """Yield (path, a, b) for every tensor and plain field of two weight trees."""
    if isinstance(a, torch.Tensor) or a is None:
        yield path, a, b
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _pairs(x, y, f"{path}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            yield from _pairs(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    else:
        yield path, a, b


def test_synthetic_weights_match_a_loaded_rank_slice():
    config = Config.from_dir(TINY_TP8)
    loaded = load_weights(TINY_TP8, config, Parallel(3, 8, torch.device("cpu")), torch.float32, progress=False)
    made = synthetic_weights(config, 8, 3, "cpu", torch.float32)
    count = 0
    for path, a, b in _pairs(loaded, made):
        if isinstance(a, torch.Tensor):
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), path
            if a.is_floating_point() and a.dtype != torch.float8_e4m3fn:
                assert torch.isfinite(b).all(), path
            count += 1
        elif not path.endswith("_dense"):
            assert a == b, path
    assert count > 90
    assert loaded.layers[0].router.dtype == torch.bfloat16  # as stored, also in an fp32 engine (routed in fp32)


def test_byte_count_by_hand_tiny_tp2():
    # tiny: H 64, V 512, 4 layers (3 sliding W=32, 1 full), 4 q / 2 kv heads of 16, I 32, 8 experts top-2,
    # blocks 16x16. Rank 0 of tp=2, context 100, depth 5, bf16 activations, bf16 router.
    c = Config.from_dir(TINY)
    bc = ByteCounter(c, 2, 0)
    attention = (32 * 64 + 2 * 4 * 4) + 2 * (16 * 64 + 1 * 4 * 4) + (64 * 32 + 4 * 2 * 4) + 2 * 4  # q, k+v, o, sinks
    assert bc.attention_weights(0) == attention == 6248
    expert = 3 * (16 * 64 + 4 * 4)  # gate [16, 64], up [16, 64], down [64, 16]: 1024 bytes + 4 scales each
    assert bc.expert(0) == expert == 3120
    assert bc.kv(0, 100) == 2 * 32 * 1 * 16 * 2 and bc.kv(3, 100) == 2 * 100 * 1 * 16 * 2
    eh_proj = 64 * 64 + 4 * 4 * 4  # [64, 128] split by columns: [64, 64] and 4 x 4 scales
    lm_head, router, norm = 256 * 64 * 2, 8 * 64 * 2, 64 * 2
    upper = round_bytes(c, 2, 100, 5)
    assert upper["verify"] == {"attention_weights": 4 * 6248, "router": 4 * router, "experts": 4 * 8 * expert,
                               "norms": 9 * norm, "kv": 3 * 2048 + 6400, "lm_head": lm_head,
                               "embedding_rows": 6 * norm}
    assert upper["draft"] == {"eh_proj": 5 * eh_proj, "attention_weights": 5 * 6248, "router": 5 * router,
                              "experts": (8 + 4 * 2) * expert, "norms": 25 * norm, "kv": 5 * 2048,
                              "lm_head": 5 * lm_head, "embedding_rows": (6 + 4) * norm}
    assert upper["total"] == 176160 + 285640
    measured = round_bytes(c, 2, 100, 5, RoundRouting(verify=(3, 4, 5, 6), draft=(3, 2, 2, 2, 2), accepted=1))
    assert measured["verify"]["experts"] == 18 * expert
    assert measured["draft"]["experts"] == 11 * expert
    assert measured["draft"]["embedding_rows"] == (2 + 4) * norm
    assert measured["total"] == upper["total"] - (32 - 18) * expert - (16 - 11) * expert - 4 * norm
    # per profiled stage: every item but the embedding rows, once
    per_stage = stage_bytes(measured)
    assert per_stage == {"attention": 9 * 6248 + 3 * 2048 + 6400 + 5 * 2048, "moe": 9 * router + 29 * expert,
                         "norm": 34 * norm, "lm_head": 6 * lm_head, "draft": 5 * eh_proj}
    assert sum(per_stage.values()) == measured["total"] - (6 + 6) * norm


def test_byte_count_replicated_kv_heads():
    c = Config.from_dir(TINY_TP8)  # 4 KV heads at tp=8: each rank holds one whole head, blocks 8x8
    bc = ByteCounter(c, 8, 3)
    assert bc.slice_bytes("model.layers.0.self_attn.k_proj.weight") == 16 * 128 + 2 * 16 * 4
    assert bc.kv(3, 10) == 2 * 10 * 1 * 16 * 2


def test_moe_gathers_only_selected_fp8_experts(monkeypatch):
    """The gathered-tile path (taken for large expert stacks) equals dense()[experts] bit for bit."""
    config = Config.from_dir(TINY)
    engine = RankEngine(TINY, Parallel.single(), EngineOptions(max_context=64, dtype="fp32"))
    lw = engine.model.w.layers[1]
    b32 = torch.randn(8, config.hidden_size, generator=torch.Generator().manual_seed(1))
    live = torch.ones(8, dtype=torch.bool)
    dense = engine.model.moe(lw, b32, live)
    for w in (lw.gate, lw.up, lw.down):
        w._dense = None
    monkeypatch.setattr(fast_weights, "KEEP_DENSE_BYTES", 0)
    gathered = engine.model.moe(lw, b32, live)
    assert all(w._dense is None for w in (lw.gate, lw.up, lw.down))
    for x, y in zip(dense, gathered):
        assert torch.equal(x, y)


def test_engine_from_weights_decodes_like_the_checkpoint_engine():
    options = EngineOptions(max_context=96, dtype="fp32")
    a = RankEngine(TINY, Parallel.single(), options)
    b = RankEngine.from_weights(a.config, a.model.w, GenerationConfig.from_dir(TINY, a.config), Parallel.single(),
                                options)
    req = Request(tuple(range(2, 22)), 7, 1.0, 20, 0.95, 12, 3, ())
    steps = [[(s.tokens, s.drafts, s.accepted) for s in e.decode(req)] for e in (a, b)]
    assert steps[0] == steps[1] and steps[0]


def test_cpu_smoke_run(tmp_path, capsys):
    out = tmp_path / "step.json"
    rc = main(["bench", "step", "--config", str(TINY / "config.json"), "--tp-slice", "2", "--device", "cpu",
               "--repeats", "1", "--context", "48", "--chunk-tokens", "6", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "collectives replaced by local no-ops" in text and "bandwidth floor are skipped" in text
    r = json.loads(out.read_text())
    assert r["tp_slice"] == 2 and r["floor"] is None and "torch/graph" not in r["summary"]
    assert r["summary"]["torch/eager"]["median_round_us"] > 0 and r["main_variant"] == "torch/eager"
    b = r["bytes"]
    assert b["rounds_recorded"] >= 1 and 0 < b["measured_median"] <= b["upper_bound"]
    stages = r["stages_us_per_round"]["torch/eager"]
    assert stages["attention"] > 0 and stages["moe"] > 0 and stages["sampling"] > 0
    assert set(b["stages"]) == {"attention", "moe", "norm", "lm_head", "draft"} <= set(stages)
    assert all(v > 0 for v in b["stages"].values()) and b["stages"]["moe"] < b["measured_median"]


def test_routing_recorder_counts_every_moe_call_of_eager_rounds():
    """The byte count's routing comes from wrapping the model's decoder layers and MoE calls: every round must
    show one call per main layer and one per draft depth, with distinct experts within what the rows can choose."""
    from iquest.bench.full_step import RoutingRecorder

    engine = RankEngine(str(TINY), Parallel.single("cpu"), EngineOptions(max_context=256, dtype="fp32", graphs=False))
    c, drafts = engine.config, 3
    runner, _ = engine.runner(drafts, 20)
    engine.start(Request(tuple(range(5, 25)), 3, 1.0, 20, 0.95, 24, drafts, ()), runner)
    with RoutingRecorder(engine, runner) as rec:
        engine.decode_chunk(runner, None)
    routings = rec.routings(c.num_hidden_layers, drafts)
    assert routings, "no complete round was recorded"
    for r in routings:
        assert len(r.verify) == c.num_hidden_layers and len(r.draft) == drafts
        assert all(1 <= n <= min(c.n_routed_experts, (drafts + 1) * c.num_experts_per_tok) for n in r.verify)
        assert all(1 <= n <= c.num_experts_per_tok * (drafts + 1) for n in r.draft)
    assert "decoder_layer" not in vars(engine.model) and "moe" not in vars(engine.model)  # unwrapped on exit


def _launched(ops, t: float, us: float, name: str = "_triton_kernel"):
    """A kernel of `us` launched from Python at host time `t` with no torch op open (a Triton launch), as the
    profiler records it on the GPU: a device event, and the kernel tied to the innermost of the host events `ops`
    open at the launch, where a user annotation (a record_function range) takes none; with none open it is tied to
    nothing. That rule was read on the H200 (torch 2.11, Triton 3.6): a Triton kernel launched inside a
    record_function range, with or without PDL, was in no event's kernels, and inside an op of function scope in
    that op's."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    open_ops = [e for e in ops if not e.is_user_annotation and e.time_range.start <= t <= e.time_range.end]
    if open_ops:
        max(open_ops, key=lambda e: e.time_range.start).append_kernel(name, 0, us)
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, is_user_annotation=False,
                           time_range=Interval(t + 1, t + 1 + us))


def test_kernels_launched_inside_a_stage_count_for_it():
    """The per-stage breakdown of `bench step` on the GPU: every stage label of a real eager round (tiny, CPU) gets a
    kernel launched inside it between its ops, as a Triton kernel is launched, and one more is launched outside every
    label; each must count for its label's stage (the innermost), the last for "other". While the labels were
    record_function ranges, the profiler tied no such kernel to them and all of it was "other"."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from iquest.bench.full_step import STAGES, breakdown

    engine = RankEngine(str(TINY), Parallel.single("cpu"), EngineOptions(max_context=256, dtype="fp32", graphs=False))
    runner, _ = engine.runner(3, 20)
    engine.start(Request(tuple(range(5, 25)), 3, 1.0, 20, 0.95, 12, 3, ()), runner)
    engine.state.budget.copy_(engine.state.emitted + 2)  # a round or two: a small trace
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.decode_chunk(runner, None)
    events = list(prof.events())
    host = [e for e in events if e.device_type == DeviceType.CPU]
    labels = [e for e in host if e.name in STAGES]
    assert {e.name for e in labels} == set(STAGES)  # every stage is labelled in a round
    us, kernels = 7.0, []
    for label in labels:  # between the label's opening and its first op: no torch op open there
        first = min((c.time_range.start for c in label.cpu_children), default=label.time_range.end)
        kernels.append(_launched(host, (label.time_range.start + first) / 2, us))
    kernels.append(_launched(host, min(e.time_range.start for e in host) - 10, us))  # before any label
    b = breakdown(events + kernels, wall_us=1e6, rounds=1, cuda=True)
    for s in STAGES:
        assert b[s] == pytest.approx(us * sum(label.name == s for label in labels)), s
        assert b["launches_by_stage"][s] == sum(label.name == s for label in labels), s
    assert b["other"] == pytest.approx(us) and b["busy"] == pytest.approx(us * len(kernels))
    # the kernel launched outside every op is tied to no event: a launch of the round, but of no stage
    assert b["launches"] == len(kernels) and sum(b["launches_by_stage"].values()) == len(kernels) - 1


def test_step_bound_by_hand():
    from iquest.bench.full_step import step_bound

    # 10 kernels at 1 us; the MoE's 4 of them must also move 10 us of bytes, the norm's none: 10 + (10 - 4)
    assert step_bound(1.0, 10, {"moe": 4, "norm": 3}, {"moe": 10.0, "norm": 0.0}) == pytest.approx(16.0)
    # bytes that fit under their own stage's steps add nothing
    assert step_bound(2.0, 10, {"moe": 4}, {"moe": 5.0}) == pytest.approx(20.0)


@given(step=st.floats(0.0, 10.0), counts=st.lists(st.integers(0, 50), min_size=1, max_size=6),
       floors=st.lists(st.floats(0.0, 1e4), min_size=6, max_size=6), other=st.integers(0, 50))
def test_step_bound_covers_steps_and_bytes(step, counts, floors, other):
    """The bound is at least every kernel's step and at least every stage's bytes (their sum), and it grows with the
    step: it never claims a round could beat either floor."""
    from iquest.bench.full_step import step_bound

    by_stage = {f"s{i}": float(n) for i, n in enumerate(counts)}
    stage_floor = {f"s{i}": floors[i] for i in range(len(counts))}
    launches = sum(counts) + other
    bound = step_bound(step, launches, by_stage, stage_floor)
    assert bound >= step * launches - 1e-9 and bound >= sum(stage_floor.values()) - 1e-6
    assert step_bound(step + 0.5, launches, by_stage, stage_floor) >= bound - 1e-9


def test_triton_norms_run_inside_the_norm_label(monkeypatch):
    """TritonOps' norm, residual_norm and add_norm override TorchOps' labelled methods: what they launch must be
    inside the "norm" label too (the kernels stand in as a torch op, to see which label encloses the launch)."""
    from torch.profiler import ProfilerActivity, profile

    from iquest.bench.full_step import _stage_of
    from iquest.fast import triton_ops
    from iquest.fast.plan import KernelPlan

    ops = triton_ops.TritonOps(KernelPlan(norm=True))
    monkeypatch.setattr(triton_ops.rmsnorm_residual, "rmsnorm", lambda x, weight, eps, **kw: torch.zeros_like(x))
    monkeypatch.setattr(triton_ops.rmsnorm_residual, "rmsnorm_residual",
                        lambda residual, x, weight, eps, **kw: (torch.zeros_like(x), torch.zeros_like(x)))
    x, w = torch.randn(4, 16), torch.ones(16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ops.norm(x, w, 1e-6)
        ops.residual_norm(x, x, w, 1e-6)
        ops.add_norm(x, x, w, 1e-6)
    launches = [e for e in prof.events() if e.name == "aten::zeros_like"]
    assert len(launches) == 5 and all(_stage_of(e) == "norm" for e in launches)


def test_a_pinned_routing_variant_is_counted_with_its_own_routing(tmp_path):
    """`--kernels torch,torch~route:3`: the pinned variant's recorded routing shows its 3 distinct experts a main
    layer (the healthy one whatever the router chose), and each variant's floor comes from its own bytes."""
    from iquest.bench.full_step import variant_floors

    out = tmp_path / "step.json"
    assert main(["bench", "step", "--config", str(TINY / "config.json"), "--tp-slice", "2", "--device", "cpu",
                 "--repeats", "1", "--context", "48", "--chunk-tokens", "6", "--kernels", "torch,torch~route:3",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    pinned, healthy = r["bytes_by_variant"]["torch~route:3"], r["bytes_by_variant"]["torch"]
    assert pinned["distinct_experts_verify_mean"] == 3.0
    assert healthy["distinct_experts_verify_mean"] != 3.0 and healthy["measured_median"] != pinned["measured_median"]
    floors = variant_floors({k: {**b} for k, b in r["bytes_by_variant"].items()}, r["summary"], "eager", 1e9, 1e12)
    for k, b in r["bytes_by_variant"].items():
        assert floors[k]["floor_us"] == pytest.approx(b["measured_median"] / 1e12 * 1e6)
        assert floors[k]["ratio"] == pytest.approx(r["summary"][f"{k}/eager"]["median_round_us"] / floors[k]["floor_us"])


def test_layers_cut_the_model_to_its_first_main_layers(tmp_path):
    c = Config.from_file(TINY / "config.json")
    cut = c.first_layers(1)
    assert cut.num_hidden_layers == 1 and cut.layer_types == c.layer_types[:1]
    assert cut.mtp_layer_type == c.mtp_layer_type and cut.hidden_size == c.hidden_size
    with pytest.raises(Exception, match="layers must be in"):
        c.first_layers(c.num_hidden_layers + 1)
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--config", str(TINY / "config.json"), "--tp-slice", "2", "--device", "cpu",
                 "--repeats", "1", "--context", "48", "--chunk-tokens", "6", "--layers", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["layers"] == 1 and r["bytes"]["rounds_recorded"] >= 1
