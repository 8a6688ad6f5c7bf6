"""`iquest bench step --config ... --tp-slice N`: synthetic rank slices, the byte count, the CPU smoke run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, strategies as st
import torch
import triton
import triton.language as tl

from iquest.bench import full_step
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


def _compare(loaded, made) -> int:
    """Assert two weight trees have the same structure, tensor shapes, dtypes and devices, and the same plain fields
    (a Weight's block, offset and compute dtype); returns the number of tensors compared."""
    count = 0
    for path, a, b in _pairs(loaded, made):
        if isinstance(a, torch.Tensor):
            assert (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device), path
            if a.is_floating_point() and a.dtype != torch.float8_e4m3fn:
                assert torch.isfinite(b).all(), path
            count += 1
        elif not path.endswith("_dense"):
            assert a == b, path
    return count


@pytest.mark.parametrize("folder, tp, rank", [(TINY, 1, 0), (TINY, 2, 1), (TINY_TP8, 8, 0), (TINY_TP8, 8, 3)])
def test_synthetic_weights_match_a_loaded_rank_slice(folder, tp, rank):
    """fast/synthetic.py's rank slice has exactly the structure load_weights gives: the dense layer 0, the MoE layers'
    fp32 routers and expert stacks, the draft's own embedding and bf16 head, every scale grid and, at TP 8, the expert
    shards that start inside a scale block (tiny-tp8: 6 rows a rank of 16-row blocks)."""
    config = Config.from_dir(folder)
    loaded = load_weights(folder, config, Parallel(rank, tp, torch.device("cpu")), torch.float32, progress=False)
    made = synthetic_weights(config, tp, rank, "cpu", torch.float32)
    assert _compare(loaded, made) > 100
    assert made.format == loaded.format == "fp8"
    assert isinstance(made.layers[0].mlp, fast_weights.DenseMLP) and isinstance(made.layers[1].mlp, fast_weights.MoE)
    assert made.layers[1].mlp.router.dtype == torch.float32
    assert made.lm_head.dtype == made.draft.lm_head.dtype == torch.bfloat16  # as the published checkpoint stores them
    if tp == 8:
        assert made.layers[1].mlp.gate.offset == loaded.layers[1].mlp.gate.offset == ((6 * rank) % 16, 0)
        assert made.layers[1].mlp.down.offset == ((0, (6 * rank) % 16))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_synthetic_weights_match_a_bf16_checkpoint_run_as_either_format(tmp_path, fmt):
    """A BF16 checkpoint runs as BF16, or as FP8 quantized at load over whole 128x128 blocks: the synthetic slice
    follows `--weights` the same way."""
    from iquest.fixtures.make import preset_config, random_weights
    from iquest.reference.checkpoint import save_checkpoint

    config = preset_config("tiny", "bf16")
    save_checkpoint(tmp_path, config, random_weights(config, 0))
    config = Config.from_dir(tmp_path)
    par = Parallel(1, 2, torch.device("cpu"))
    loaded = load_weights(tmp_path, config, par, torch.float32, progress=False, fmt=fmt)
    made = synthetic_weights(config, 2, 1, "cpu", torch.float32, fmt=fmt)
    assert _compare(loaded, made) > 80 and made.format == fmt
    q = made.layers[0].attn.wo.q
    assert q.dtype == (torch.bfloat16 if fmt == "bf16" else torch.float8_e4m3fn)


def test_byte_count_by_hand_tiny_tp2():
    # tiny: H 64, V 512, 4 layers (full, sliding, sliding, full; window 32, the draft's 16), layer 0 dense (F 96),
    # 4 q / 2 kv heads of 16, I 32, 8 experts top-2, FP8 blocks 16x16. Rank 0 of tp=2, context 100, depth 5,
    # bf16 activations; routers and sink_k held fp32, heads and norms bf16 (fast/memory.rank_tensor_bytes).
    c = Config.from_dir(TINY)
    bc = ByteCounter(c, 2, 0)
    p = "model.layers.1."
    q, kv, o, sink = 32 * 64 + 2 * 4 * 4, 16 * 64 + 1 * 4 * 4, 64 * 32 + 4 * 2 * 4, 16 * 4
    attention = q + 2 * kv + o + sink
    assert bc.attention_weights(p) == attention == 6304
    expert = 3 * (16 * 64 + 4 * 4)  # gate [16, 64], up [16, 64], down [64, 16]: 1024 bytes + 4 scales each
    assert bc.expert(p) == expert == 3120
    dense = 3 * (48 * 64 + 3 * 4 * 4)  # gate, up [48, 64] with 3 x 4 scales; down [64, 48] with 4 x 3
    assert bc.dense_mlp("model.layers.0.") == dense == 9360
    assert bc.kv(None, 100) == 2 * 100 * 1 * 16 * 2 and bc.kv(32, 100) == 2 * 32 * 1 * 16 * 2
    norm, qk = 64 * 2, 2 * 16 * 2
    router, lm_head = 8 * 64 * 4, 256 * 64 * 2
    eh_proj = 64 * 64 + 4 * 4 * 4  # [64, 128] split by columns: [64, 64] and 4 x 4 scales
    upper = round_bytes(c, 2, 100, 5)
    assert upper["verify"] == {"attention_weights": 4 * attention, "dense_mlp": dense, "router": 3 * router,
                               "experts": 3 * 8 * expert, "norms": (3 * 4 + 1) * norm + 4 * qk + norm,
                               "kv": 2 * 6400 + 2 * 2048, "lm_head": lm_head, "embedding_rows": 6 * norm}
    assert upper["draft"] == {"eh_proj": 5 * eh_proj, "attention_weights": 5 * attention, "dense_mlp": 0,
                              "router": 5 * router, "experts": (8 + 4 * 2) * expert,
                              "norms": 5 * (4 * norm + qk + 3 * norm), "kv": 5 * 1024, "lm_head": 5 * lm_head,
                              "embedding_rows": (6 + 4) * norm}
    assert upper["total"] == sum(upper["verify"].values()) + sum(upper["draft"].values())
    measured = round_bytes(c, 2, 100, 5, RoundRouting(verify=(4, 5, 6), draft=(3, 2, 2, 2, 2), accepted=1))
    assert measured["verify"]["experts"] == 15 * expert
    assert measured["draft"]["experts"] == 11 * expert
    assert measured["draft"]["embedding_rows"] == (2 + 4) * norm
    assert measured["total"] == upper["total"] - (24 - 15) * expert - (16 - 11) * expert - 4 * norm
    with pytest.raises(ValueError, match="expected 3 and 5"):  # one entry per MoE layer: layer 0 is dense
        round_bytes(c, 2, 100, 5, RoundRouting(verify=(4, 5, 6, 7), draft=(3, 2, 2, 2, 2), accepted=1))
    # per profiled stage: every item but the embedding rows, once
    per_stage = stage_bytes(measured)
    assert per_stage == {"attention": 9 * attention + 2 * 6400 + 2 * 2048 + 5 * 1024,
                         "mlp": dense + 8 * router + 26 * expert,
                         "norm": measured["verify"]["norms"] + measured["draft"]["norms"],
                         "lm_head": 6 * lm_head, "draft": 5 * eh_proj}
    assert sum(per_stage.values()) == measured["total"] - (6 + 6) * norm


def test_byte_count_replicated_kv_heads_and_straddling_blocks():
    c = Config.from_dir(TINY_TP8)  # 4 KV heads at tp=8: each rank holds one whole head; blocks 16x16
    bc = ByteCounter(c, 8, 3)
    assert bc.tensor("model.layers.0.self_attn.k_proj.weight") == 16 * 128 + 1 * 8 * 4
    assert bc.kv(None, 10) == 2 * 10 * 1 * 16 * 2
    # rank 3's 6 expert rows (18..23) sit inside one 16-row block; rank 2's (12..17) straddle two
    assert bc.tensor("model.layers.1.mlp.experts.0.gate_proj.weight") == 6 * 128 + 1 * 8 * 4
    assert ByteCounter(c, 8, 2).tensor("model.layers.1.mlp.experts.0.gate_proj.weight") == 6 * 128 + 2 * 8 * 4


def test_moe_gathers_only_selected_fp8_experts(monkeypatch):
    """The gathered-tile path (taken for large expert stacks) equals dense()[experts] bit for bit."""
    config = Config.from_dir(TINY)
    engine = RankEngine(TINY, Parallel.single(), EngineOptions(max_context=64, dtype="fp32"))
    ops, moe = engine.model.ops, engine.model.w.layers[1].mlp
    b = torch.randn(8, config.hidden_size, generator=torch.Generator().manual_seed(1))
    live = torch.ones(8, dtype=torch.bool)
    weights, experts, _ = ops.route(b, moe.router, config.num_experts_per_tok)
    dense = ops.moe(b, experts, weights, live, moe)
    for w in (moe.gate, moe.up, moe.down):
        w._dense = None
    monkeypatch.setattr(fast_weights, "KEEP_DENSE_BYTES", 0)
    gathered = ops.moe(b, experts, weights, live, moe)
    assert all(w._dense is None for w in (moe.gate, moe.up, moe.down))
    assert torch.equal(dense, gathered)


def test_engine_from_weights_decodes_like_the_checkpoint_engine():
    options = EngineOptions(max_context=96, dtype="fp32")
    a = RankEngine(TINY, Parallel.single(), options)
    b = RankEngine.from_weights(a.config, a.model.w, GenerationConfig.from_dir(TINY, a.config), Parallel.single(),
                                options)
    req = Request(tuple(range(2, 22)), 7, 1.0, 20, 0.95, 12, 3, ())
    steps = [[(s.tokens, s.drafts, s.accepted) for s in e.decode(req)] for e in (a, b)]
    assert steps[0] == steps[1] and steps[0]


def test_cpu_smoke_run(tmp_path, capsys):
    """A CPU run with an A' arm (`torch'`: the first variant again, an engine of its own), paired with the first."""
    out = tmp_path / "step.json"
    rc = main(["bench", "step", "--config", str(TINY / "config.json"), "--tp-slice", "2", "--device", "cpu",
               "--repeats", "2", "--context", "48", "--chunk-tokens", "6", "--kernels", "torch,torch'",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "torch'/eager against torch/eager, paired by repeat" in text
    assert "collectives replaced by local no-ops" in text and "bandwidth floor are skipped" in text
    r = json.loads(out.read_text())
    assert r["tp_slice"] == 2 and r["floor"] is None and "torch/graph" not in r["summary"]
    assert r["summary"]["torch/eager"]["median_round_us"] > 0 and r["main_variant"] == "torch/eager"
    b = r["bytes"]
    assert b["rounds_recorded"] >= 1 and 0 < b["measured_median"] <= b["upper_bound"]
    stages = r["stages_us_per_round"]["torch/eager"]
    assert stages["attention"] > 0 and stages["mlp"] > 0 and stages["sampling"] > 0
    assert set(b["stages"]) == {"attention", "mlp", "norm", "lm_head", "draft"} <= set(stages)
    assert all(v > 0 for v in b["stages"].values()) and b["stages"]["mlp"] < b["measured_median"]
    assert r["weights"] == "fp8"  # tiny is an FP8 checkpoint
    assert list(r["engines"]) == ["torch", "torch'"] and "torch'/eager" in r["summary"]
    p = r["paired"]["torch'/eager"]
    rounds = [(a["round_us"], b["round_us"]) for a, b in zip(r["runs"]["torch/eager"], r["runs"]["torch'/eager"])]
    assert p["n"] == 2 and p["median"] == pytest.approx(sum(b / a for a, b in rounds) / 2)
    assert p["min"] <= p["median"] <= p["max"] and "torch/eager" not in r["paired"]
    # no CUDA graph on the CPU: nothing captured, said so
    assert r["graphs"] == {"torch'": full_step.launches.compare([], [])}
    assert "captured graph of torch' against torch: nothing captured" in text


def test_paired_ratios_by_hand():
    runs = {"a/graph": [{"round_us": 100.0}, {"round_us": 200.0}, {"round_us": 100.0}],
            "b/graph": [{"round_us": 90.0}, {"round_us": 200.0}, {"round_us": 120.0}],
            "a/eager": [{"round_us": 1.0}] * 3}
    assert full_step.paired_ratios(runs, "a/graph") == {"b/graph": {"median": 1.0, "min": 0.9, "max": 1.2, "n": 3}}


def test_routing_recorder_counts_every_moe_call_of_eager_rounds():
    """The byte count's routing comes from wrapping the model's MLP calls and its ops' routing: every round must show
    one call per main MoE layer (not the dense layer 0) and one per draft depth, with distinct experts within what the
    rows can choose."""
    from iquest.bench.full_step import RoutingRecorder

    engine = RankEngine(str(TINY), Parallel.single("cpu"), EngineOptions(max_context=256, dtype="fp32", graphs=False))
    c, drafts = engine.config, 3
    runner, _ = engine.runner(drafts, 20)
    engine.start(Request(tuple(range(5, 25)), 3, 1.0, 20, 0.95, 24, drafts, ()), runner)
    with RoutingRecorder(engine, runner) as rec:
        engine.decode_chunk(runner, None)
    moe_layers = c.num_hidden_layers - len(c.mlp_only_layers)
    routings = rec.routings(moe_layers, drafts)
    assert routings, "no complete round was recorded"
    for r in routings:
        assert len(r.verify) == moe_layers and len(r.draft) == drafts
        assert all(1 <= n <= min(c.num_experts, (drafts + 1) * c.num_experts_per_tok) for n in r.verify)
        assert all(1 <= n <= c.num_experts_per_tok * (drafts + 1) for n in r.draft)
    assert "mlp" not in vars(engine.model) and "route" not in vars(engine.model.ops)  # unwrapped on exit


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


def test_triton_overrides_keep_their_stage_labels():
    """A kernel launched from a TritonOps method that overrides a labelled TorchOps method (fast/profiling.stage) would
    lose its stage in the breakdown unless the override is labelled too: none may drop the label."""
    from iquest.fast.torch_ops import TorchOps
    from iquest.fast.triton_ops import TritonOps

    labelled = [n for n, f in vars(TorchOps).items()
                if hasattr(f, "__wrapped__") and not isinstance(f, (staticmethod, classmethod))]
    assert "norm" in labelled
    dropped = [n for n in labelled if n in vars(TritonOps) and not hasattr(vars(TritonOps)[n], "__wrapped__")]
    assert not dropped, f"TritonOps overrides labelled ops without their label: {dropped}"


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
    assert cut.mtp == c.mtp and cut.hidden_size == c.hidden_size and cut.mlp_only_layers == (0,)
    with pytest.raises(Exception, match="layers must be in"):
        c.first_layers(c.num_hidden_layers + 1)
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--config", str(TINY / "config.json"), "--tp-slice", "2", "--device", "cpu",
                 "--repeats", "1", "--context", "48", "--chunk-tokens", "6", "--layers", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["layers"] == 1 and r["bytes"]["rounds_recorded"] >= 1


def test_captured_graphs_are_compared_by_compiled_kernel():
    """bench/launches.py: Triton's launch hook records (name, compiled handle) while active, and only then; two captures
    compare identical only launch for launch, and the printed verdict says which arm should have been identical."""
    from triton import knobs

    from iquest.bench import launches

    class Lazy:  # what Triton hands the hook
        def __init__(self, **data):
            self.data = data

        def get(self):
            return self.data

    with launches.recorded() as rec:
        knobs.runtime.launch_enter_hook(Lazy(name="gate_up", function=11, stream=0))
        knobs.runtime.launch_enter_hook(Lazy(name="down", function=12, stream=0))
    knobs.runtime.launch_enter_hook(Lazy(name="after", function=13, stream=0))
    assert rec.kernels == [("gate_up", 11), ("down", 12)] and rec not in knobs.runtime.launch_enter_hook.calls
    main = rec.kernels
    same = launches.compare(main, list(main))
    assert same["identical"] and same["differing"] == 0 and same["first"] is None
    retuned = launches.compare(main, [("gate_up", 21), ("down", 12)])  # another binary of one kernel
    assert not retuned["identical"] and retuned["differing"] == 1 and retuned["kernels_changed"] == ["gate_up"]
    longer = launches.compare(main, main + [("tail", 14)])  # a launch added
    assert longer["differing"] == 1 and longer["first"] == 2 and longer["first_kernels"] == [None, "tail"]
    assert "identical" in launches.verdict("triton'", "triton", same) and "WARNING" not in launches.verdict(
        "triton'", "triton", same)
    assert "WARNING: its substitution changed no kernel" in launches.verdict("triton@lm_head.block_v=8", "triton", same)
    assert "WARNING: an A' arm" in launches.verdict("triton'", "triton", retuned)
    assert "differs at 1 of 2" in launches.verdict("triton@x.y=1", "triton", retuned)
    assert "nothing captured" in launches.verdict("torch'", "torch", launches.compare([], []))


@pytest.mark.gpu
def test_the_launch_hook_tells_compiled_kernels_apart_on_the_gpu():
    """On the GPU, through Triton's own launcher: one specialization launched twice carries one handle, another
    constexpr another (what `bench step`'s graph comparison rests on)."""
    from iquest.bench import launches

    x = torch.empty(16, device="cuda")
    with launches.recorded() as rec:
        for value in (1, 1, 2):
            _fill[(1,)](x, V=value)
    (n1, h1), (n2, h2), (n3, h3) = rec.kernels
    assert n1 == n2 == n3 and h1 == h2 != h3, rec.kernels
    assert x.eq(2).all()


@triton.jit
def _fill(x_ptr, V: tl.constexpr):
    tl.store(x_ptr + tl.arange(0, 16), tl.full((16,), V, tl.float32))
