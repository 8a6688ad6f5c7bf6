"""kernels/philox.py against the torch path it replaces (`fast.philox.uniforms` of `fast.philox.offsets`).

Bit-exact float32 equality (compared as int32 bits), and against `reference.rng.rand` on the CPU as a
third leg, under Triton's CPU interpreter in one worker subprocess: several seeds (negative int64 seeds,
high bits set), positions 0, small and near `rng.MAX_POSITION`, all three purposes, int and per-element
tensor depths, out-of-range positions/depths (the int32 wrap), strided inputs and outputs, several
blocks; a hypothesis property (derandomized, so CI sees the same examples); and negative controls (the
slot off by one) that the same checks must reject. The interpreter takes three of the ten seeds in the positions x
slots grid (each seed is a launch; INTERPRETED_CASES); the GPU takes all ten. `@pytest.mark.gpu`: the same cases on CUDA, the
property on CUDA, and a CUDA-graph capture replayed under new seeds and positions.

Interpreter finding (Triton 3.6.0, torch 2.13 CPU): `tl.rand(tl.load(seed_ptr), offset)` equals
`reference.rng.rand` bit for bit for every seed and offset tried here (and tests/test_rng.py's golden
table and 10 seeds x 556 offsets); the interpreter computes umulhi in 64-bit NumPy integers, exactly.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.fast import philox
from iquest.kernels import philox as kp
from iquest.kernels.testing import interpreted_tests
from iquest.reference import rng
from iquest.reference.rng import MAX_POSITION, PURPOSE_ACCEPT, PURPOSE_COMMIT, PURPOSE_DRAFT

SEEDS = [0, 1, 12345, 2**31 - 1, 2**31, 2**32 + 7, 0x0123456789ABCDEF, 0xDEADBEEFCAFEF00D, 2**63, 2**64 - 1]
POSITIONS = {
    "pos0": [0],
    "small": list(range(8)),
    "near_max": list(range(MAX_POSITION - 7, MAX_POSITION + 1)),
    "mixed7": [5, 0, MAX_POSITION, 1000, 3, 2**20, MAX_POSITION - 1],  # N not a power of two
}
SLOTS = {  # name -> (purpose, depth); "tensor" = per-element depths 1 + i % 7
    "commit": (PURPOSE_COMMIT, 0), "accept": (PURPOSE_ACCEPT, 0), "draft_d1": (PURPOSE_DRAFT, 1),
    "draft_d4": (PURPOSE_DRAFT, 4), "draft_d7": (PURPOSE_DRAFT, 7), "draft_tensor": (PURPOSE_DRAFT, "tensor"),
}
# Outside the checked ranges: the torch path wraps (int64 arithmetic, low 32 bits); so must the kernel.
WRAP_POSITIONS = [MAX_POSITION + 1, 2**40 + 3, -1, -7, 2**62 + 5, -(2**63), 2**63 - 1, 2**28]

def torch_uniforms(seed: torch.Tensor, positions: torch.Tensor, purpose: int,
                   depth: int | torch.Tensor = 0) -> torch.Tensor:
    """The torch path the kernel replaces: `fast.philox.uniforms` of `fast.philox.offsets`."""
    return philox.uniforms(seed, philox.offsets(positions, purpose, depth))


BASE = dict(seeds=SEEDS, purpose=PURPOSE_COMMIT, depth=0, depth_dtype="int64", pos_stride=1, out="fresh",
            negative=False)
DTYPES = {"int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8}


def case(name: str, positions: list[int], **kw) -> dict:
    return dict(BASE, name=name, positions=positions, **kw)


CASES = [case(f"{p}_{s}", POSITIONS[p], purpose=SLOTS[s][0], depth=SLOTS[s][1]) for p in POSITIONS for s in SLOTS]
CASES += [
    # fast/round.py's draft call: positions n + depths, depths 1..7 (int64 from torch.arange).
    case("round_draft_n4095", [4095 + d for d in range(1, 8)], purpose=PURPOSE_DRAFT, depth=list(range(1, 8))),
    case("round_accept_n0", list(range(1, 8)), purpose=PURPOSE_ACCEPT),
    case("depth_int32", POSITIONS["mixed7"], purpose=PURPOSE_DRAFT, depth=[7, 6, 5, 4, 3, 2, 1], depth_dtype="int32"),
    case("depth_uint8", POSITIONS["small"], purpose=PURPOSE_DRAFT, depth=[3] * 8, depth_dtype="uint8"),
    case("depth_0dim", POSITIONS["mixed7"], purpose=PURPOSE_DRAFT, depth=[5], depth_dtype="int64_0dim"),
    case("depth_one_elem", POSITIONS["small"], purpose=PURPOSE_DRAFT, depth=[2]),
    case("strided_in_out", POSITIONS["mixed7"], pos_stride=3, out="strided", purpose=PURPOSE_ACCEPT),
    case("strided_depth_tensor", POSITIONS["small"], pos_stride=2, out="strided", purpose=PURPOSE_DRAFT,
         depth="tensor"),
    case("wrap_positions_commit", WRAP_POSITIONS),
    case("wrap_positions_draft_d6", WRAP_POSITIONS, purpose=PURPOSE_DRAFT, depth=6),
    case("wrap_positions_depth_tensor", WRAP_POSITIONS, purpose=PURPOSE_DRAFT, depth="tensor"),
    case("wrap_depths", [0, 9, 77, MAX_POSITION, 3, 4], purpose=PURPOSE_DRAFT,
         depth=[0, 8, -3, 2**33, 2**31, -(2**40)]),
    case("n37_accept", list(range(500, 537)), purpose=PURPOSE_ACCEPT, seeds=SEEDS[:3]),
    case("n2000_two_blocks", list(range(0, 2000 * 977, 977)), seeds=[0xDEADBEEFCAFEF00D]),
    case("n2000_depth_tensor", list(range(2000)), purpose=PURPOSE_DRAFT, depth="tensor", seeds=[2**64 - 1]),
    case("n0_empty", [], seeds=[1]),
]
# The interpreter runs the positions x slots cases with three of the seeds (0, the sign bit alone, every bit), each
# seed a launch; the other cases, the controls and the property with theirs. The GPU runs every case with every seed.
FEW_SEEDS = [0, 2**63, 2**64 - 1]
GRID = len(POSITIONS) * len(SLOTS)
INTERPRETED_CASES = [dict(c, seeds=FEW_SEEDS) for c in CASES[:GRID]] + CASES[GRID:]
# Negative controls: the kernel launched with the slot off by one must fail the same equality check.
NEGATIVE_CASES = [
    case("neg_commit_slot_plus1", POSITIONS["small"], negative=True),
    case("neg_draft_tensor_slot_minus1", POSITIONS["mixed7"], purpose=PURPOSE_DRAFT, depth="tensor", negative=True),
]
PROPERTY_EXAMPLES = 60  # under the interpreter; the GPU test runs 500
NEGATIVE_PROPERTY_EXAMPLES = 50


def _depth(c: dict, n: int, device: str):
    """The case's depth argument: an int, or a tensor on `device`."""
    d = c["depth"]
    if isinstance(d, int):
        return d
    values = [1 + i % 7 for i in range(n)] if d == "tensor" else d
    if c["depth_dtype"] == "int64_0dim":
        return torch.tensor(values[0], dtype=torch.int64, device=device)
    return torch.tensor(values, dtype=DTYPES[c["depth_dtype"]], device=device)


def _reference_offsets(positions: list[int], purpose: int, depth) -> torch.Tensor:
    """int32 counters computed independently in Python ints (wrap: low 32 bits, as two's complement)."""
    if isinstance(depth, torch.Tensor):
        ds = depth.cpu().to(torch.int64).reshape(-1).tolist()
        slots = [rng.offset(0, PURPOSE_DRAFT, 1) - 1 + ds[i if len(ds) > 1 else 0] for i in range(len(positions))]
    else:
        slots = [rng.offset(0, purpose, depth)] * len(positions)
    words = [(p * rng.SLOTS_PER_POSITION + s) & 0xFFFFFFFF for p, s in zip(positions, slots)]
    return torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32)


def _bits(t: torch.Tensor) -> list[int]:
    return t.detach().cpu().contiguous().view(torch.int32).tolist()


def _compare(got: torch.Tensor, want: torch.Tensor) -> tuple[int, str]:
    """(number of elements whose float32 bits differ, the first difference)."""
    g, w = _bits(got), _bits(want)
    bad = [i for i in range(len(w)) if i >= len(g) or g[i] != w[i]] + ([-1] if len(g) != len(w) else [])
    first = "" if not bad else f"element {bad[0]}: got {g[bad[0]] if 0 <= bad[0] < len(g) else None} want {w[bad[0]]}"
    return len(bad), first


def run_case(c: dict, device: str) -> dict:
    n = len(c["positions"])
    s = c["pos_stride"]
    pos_base = torch.full((n * s,), -12345, dtype=torch.int64)
    pos_base[::s] = torch.tensor(c["positions"], dtype=torch.int64)
    positions = pos_base.to(device)[::s]
    depth = _depth(c, n, device)
    compared = mismatches = ref_mismatches = untouched = 0
    first = ""
    for seed in c["seeds"]:
        seed_t = torch.tensor(rng.int64_bits(seed), dtype=torch.int64, device=device)
        want = torch_uniforms(seed_t, positions, c["purpose"], depth)
        if c["out"] == "strided":
            buf = torch.full((2 * n,), float("nan"), device=device)
            out = buf[::2]
        else:
            buf = out = torch.full((n,), float("nan"), device=device)
        if c["negative"]:  # the wrong slot, through the private launch (the wrapper would compute the right one)
            dt = None if isinstance(depth, int) else (depth.reshape(()) if depth.numel() == 1 else depth)
            good = kp._DRAFT_SLOT_1 - 1 if dt is not None else rng.offset(0, c["purpose"], depth)
            got = kp._launch(seed_t, positions, good + (1 if dt is None else -1), dt, out, 1)
        else:
            got = kp.uniforms(seed_t, positions, c["purpose"], depth, out=out)
        assert got is out, "the kernel did not return the given out"
        if c["out"] == "strided":
            untouched += int(torch.isnan(buf[1::2]).sum())  # the gaps must stay NaN
        k, f = _compare(got, want)
        # Third leg: the CPU reference on independently computed counters.
        k_ref, f_ref = _compare(got, rng.rand(seed, _reference_offsets(c["positions"], c["purpose"], depth)))
        compared += n
        mismatches += k
        ref_mismatches += k_ref
        first = first or (f and f"seed {seed:#x}: {f}") or (f_ref and f"seed {seed:#x} (vs rng.rand): {f_ref}")
    return {"compared": compared, "mismatches": mismatches, "ref_mismatches": ref_mismatches, "first": first,
            "strided_gaps_nan": untouched, "launches": len(c["seeds"])}


def _check_equal(c: dict, r: dict) -> None:
    n = len(c["positions"])
    assert r["launches"] == len(c["seeds"]) and r["compared"] == n * len(c["seeds"]), r
    assert r["mismatches"] == 0, f"{c['name']}: {r['mismatches']} uniforms differ from the torch path; {r['first']}"
    assert r["ref_mismatches"] == 0, f"{c['name']}: {r['ref_mismatches']} differ from rng.rand; {r['first']}"
    if c["out"] == "strided":
        assert r["strided_gaps_nan"] == n * len(c["seeds"]), "the kernel wrote outside the strided out"


def _check_negative(c: dict, r: dict) -> None:
    rejected = 0
    try:
        _check_equal(c, r)
    except AssertionError:
        rejected += 1  # the branch the control exists for
    assert rejected == 1, f"{c['name']}: a kernel with the slot off by one passed the equality check"
    assert r["launches"] == len(c["seeds"]) and r["mismatches"] == r["compared"] > 0, r


def _check(c: dict, r: dict) -> None:
    (_check_negative if c["negative"] else _check_equal)(c, r)


# ---- the property (hypothesis), run in the worker (interpreter) and on the GPU -------------------------------
def _property_job(device: str, slot_shift: int = 0, max_examples: int = PROPERTY_EXAMPLES) -> dict:
    """Run the property: kernel == torch path == rng.rand for drawn (seed, positions, purpose, depth).

    slot_shift != 0 is the negative control: the kernel gets the slot shifted, and hypothesis must find a
    counterexample. Returns how many examples ran and whether (and where) it failed."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    position = st.one_of(st.integers(0, MAX_POSITION), st.integers(0, 64), st.integers(-(2**63), 2**63 - 1))

    @st.composite
    def decisions(draw):
        positions = draw(st.lists(position, min_size=1, max_size=8))
        kind = draw(st.sampled_from(["commit", "accept", "draft_int", "draft_tensor"]))
        if kind == "draft_tensor":
            depth = draw(st.lists(st.integers(1, 7), min_size=len(positions), max_size=len(positions)))
            return positions, PURPOSE_DRAFT, depth
        if kind == "draft_int":
            return positions, PURPOSE_DRAFT, draw(st.integers(1, 7))
        return positions, PURPOSE_COMMIT if kind == "commit" else PURPOSE_ACCEPT, 0

    ran = {"examples": 0}

    # The negative control skips shrinking: any counterexample will do (shrinking one costs ~40 s interpreted).
    phases = [Phase.explicit, Phase.generate] if slot_shift else [Phase.explicit, Phase.generate, Phase.shrink]

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True, print_blob=False,
              suppress_health_check=list(HealthCheck), phases=phases)
    @given(seed=st.integers(0, 2**64 - 1), decision=decisions())
    def prop(seed, decision):
        ran["examples"] += 1
        positions_l, purpose, depth = decision
        positions = torch.tensor(positions_l, dtype=torch.int64, device=device)
        if isinstance(depth, list):
            depth = torch.tensor(depth, dtype=torch.int64, device=device)
        seed_t = torch.tensor(rng.int64_bits(seed), dtype=torch.int64, device=device)
        if slot_shift:
            dt = depth if isinstance(depth, torch.Tensor) else None
            slot = kp._DRAFT_SLOT_1 - 1 if dt is not None else rng.offset(0, purpose, depth)
            out = torch.empty(len(positions_l), device=device)
            got = kp._launch(seed_t, positions, slot + slot_shift, dt, out, 1)
        else:
            got = kp.uniforms(seed_t, positions, purpose, depth)
        k, first = _compare(got, torch_uniforms(seed_t, positions, purpose, depth))
        assert k == 0, f"torch path: {first}"
        k, first = _compare(got, rng.rand(seed, _reference_offsets(positions_l, purpose, depth)))
        assert k == 0, f"rng.rand: {first}"

    try:
        prop()
    except Exception as e:  # an AssertionError, or hypothesis's group of several distinct failures
        return {"examples": ran["examples"], "failed": True, "message": f"{type(e).__name__}: {str(e)[:500]}"}
    return {"examples": ran["examples"], "failed": False, "message": ""}


def test_property_interpreted(interpreted):
    r = interpreted["property"]
    assert "error" not in r, r.get("error")
    assert not r["failed"], r["message"]
    assert r["examples"] >= PROPERTY_EXAMPLES, r


def test_property_negative_control_interpreted(interpreted):
    r = interpreted["property_negative"]
    assert "error" not in r, r.get("error")
    caught = 0
    if r["failed"]:
        caught += 1  # hypothesis found the off-by-one slot
    assert caught == 1 and r["examples"] >= 1, f"the property did not catch a slot off by one: {r}"


interpreted, test_interpreted = interpreted_tests(__file__, INTERPRETED_CASES + NEGATIVE_CASES, _check)


# ---- argument checks (no launch) ---------------------------------------------------------------------------
def _ok_args() -> dict:
    return dict(seed=torch.tensor(5, dtype=torch.int64), positions=torch.arange(4), purpose=PURPOSE_COMMIT, depth=0)


@pytest.mark.parametrize("over, message", [
    (dict(seed=torch.tensor([5])), "seed must be a 0-dim int64"),
    (dict(seed=torch.tensor(5, dtype=torch.int32)), "seed must be a 0-dim int64"),
    (dict(seed=torch.tensor(5, dtype=torch.int64, device="meta")), "share a device"),
    (dict(positions=torch.arange(4, dtype=torch.int32)), "positions must be an int64"),
    (dict(positions=torch.arange(4).view(2, 2)), "1-dimensional"),
    (dict(purpose=3), "purpose"),
    (dict(purpose=True), "purpose"),
    (dict(purpose=PURPOSE_ACCEPT, depth=1), "depth is only meaningful"),
    (dict(purpose=PURPOSE_DRAFT, depth=0), "depth must be an int in"),
    (dict(purpose=PURPOSE_DRAFT, depth=8), "depth must be an int in"),
    (dict(purpose=PURPOSE_COMMIT, depth=torch.ones(4, dtype=torch.int64)), "only meaningful for PURPOSE_DRAFT"),
    (dict(purpose=PURPOSE_DRAFT, depth=torch.ones(4)), "integer tensor"),
    (dict(purpose=PURPOSE_DRAFT, depth=torch.ones(4, dtype=torch.bool)), "integer tensor"),
    (dict(purpose=PURPOSE_DRAFT, depth=torch.ones(3, dtype=torch.int64)), r"depth must be \[4\]"),
    (dict(purpose=PURPOSE_DRAFT, depth=torch.ones(4, 1, dtype=torch.int64)), r"depth must be \[4\]"),
    (dict(purpose=PURPOSE_DRAFT, depth=torch.ones(4, dtype=torch.int64, device="meta")), "share a device"),
    (dict(out=torch.empty(4, dtype=torch.float64)), "out must be float32"),
    (dict(out=torch.empty(5)), "out must be float32"),
    (dict(out=torch.empty(4, device="meta")), "out is on"),
])
def test_rejects_bad_inputs(over, message):
    a = _ok_args()
    out = over.pop("out", None)
    a.update(over)
    with pytest.raises(ValueError, match=message):
        kp.uniforms(**a, out=out)


def test_reference_offsets_match_fast_offsets():
    """The tests' independent counters agree with fast.philox.offsets (so the third leg checks the same thing)."""
    for c in CASES:
        pos = torch.tensor(c["positions"], dtype=torch.int64)
        depth = _depth(c, len(c["positions"]), "cpu")
        assert philox.offsets(pos, c["purpose"], depth).tolist() == \
            _reference_offsets(c["positions"], c["purpose"], depth).tolist(), c["name"]


# ---- GPU ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + NEGATIVE_CASES, ids=[c["name"] for c in CASES + NEGATIVE_CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


@pytest.mark.gpu
def test_gpu_property():
    r = _property_job("cuda", max_examples=500)
    assert not r["failed"], r["message"]
    neg = _property_job("cuda", slot_shift=1, max_examples=NEGATIVE_PROPERTY_EXAMPLES)
    assert neg["failed"], "the property did not catch a slot off by one on the GPU"


@pytest.mark.gpu
def test_gpu_no_host_sync():
    seed = torch.tensor(rng.int64_bits(2**64 - 3), dtype=torch.int64, device="cuda")
    pos = torch.arange(100, 108, device="cuda")
    depth = torch.arange(1, 8, device="cuda")
    out = torch.empty(8, device="cuda")
    kp.uniforms(seed, pos, PURPOSE_ACCEPT, out=out)  # compile outside the check
    kp.uniforms(seed, pos[:7], PURPOSE_DRAFT, depth, out=out[:7])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        kp.uniforms(seed, pos, PURPOSE_ACCEPT, out=out)
        kp.uniforms(seed, pos[:7], PURPOSE_DRAFT, depth, out=out[:7])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gpu_graph_capture_replay():
    """Capture the round's three uses (accept, commit at one position, draft with a depth tensor) once; replay
    under new seeds and positions written into the captured tensors; each replay equals the torch path."""
    dev = "cuda"
    seed = torch.zeros((), dtype=torch.int64, device=dev)
    n = torch.zeros(1, dtype=torch.int64, device=dev)
    depths = torch.arange(1, 8, device=dev)
    u_accept, u_commit, u_draft = (torch.full((k,), float("nan"), device=dev) for k in (7, 1, 7))

    def body():
        kp.uniforms(seed, n + depths, PURPOSE_ACCEPT, out=u_accept)
        kp.uniforms(seed, n + 3, PURPOSE_COMMIT, out=u_commit)
        kp.uniforms(seed, n + depths, PURPOSE_DRAFT, depths, out=u_draft)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compile) outside the capture
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    replays = 0
    for s, pos in [(0, 0), (1, 5), (2**63, 4095), (2**64 - 1, MAX_POSITION - 10), (0xDEADBEEFCAFEF00D, 123456)]:
        seed.fill_(rng.int64_bits(s))
        n.fill_(pos)
        for u in (u_accept, u_commit, u_draft):
            u.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got, want in [(u_accept, torch_uniforms(seed, n + depths, PURPOSE_ACCEPT)),
                          (u_commit, torch_uniforms(seed, n + 3, PURPOSE_COMMIT)),
                          (u_draft, torch_uniforms(seed, n + depths, PURPOSE_DRAFT, depths))]:
            k, first = _compare(got, want)
            assert k == 0, f"replay seed={s:#x} n={pos}: {first}"
        replays += 1
    assert replays == 5


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    jobs = [(c["name"], lambda c=c: run_case(c, "cpu")) for c in INTERPRETED_CASES + NEGATIVE_CASES]
    jobs += [("property", lambda: _property_job("cpu")),
             ("property_negative", lambda: _property_job("cpu", slot_shift=1, max_examples=NEGATIVE_PROPERTY_EXAMPLES))]
    worker_main(jobs)
