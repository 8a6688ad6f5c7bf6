"""kernels/topk.py against fast.sampler.local_candidates (the rank keys, values and global ids).

The contract is exact: keys, ids and value bits must be identical. Small shapes run under Triton's CPU
interpreter in one worker subprocess: 1 and 8 rows, partial last tiles, fewer columns than k, k not a
power of two, exact ties (integer-valued logits, +-0.0, +-inf), a rank's vocabulary offset, strided
rows, and more tiles than the merge reads (the tile-maxima skip, checked against the full merge).
Outputs are pre-filled with NaN / -1. `@pytest.mark.gpu` cases use one TP8 rank: Vr = 20000, k = 20.
The interpreter runs INTERPRETED_CASES (every property above at one or two rows and a few tiles, the skip at k = 5)
and CASES (about 7 s: kernels/testing.py reduces the bitonic network's xor sums in NumPy); the GPU runs those and
GPU_CASES.
"""

from __future__ import annotations

import sys

import pytest
import torch

from iquest.fast import sampler
from iquest.kernels import topk as tk
from iquest.kernels.testing import interpreted_tests

BASE = dict(R=8, V=1000, k=20, tile=128, offset=0, data="randn", skip=True, stride=None, seed=0)


def case(name: str, **kw) -> dict:
    return dict(BASE, name=name, **kw)


CASES = [
    case("1row_4tiles", R=1, V=100, tile=32),
    case("8rows_partial_tile", V=1000),
    case("8rows_rank7_offset", V=700, offset=140000),
    case("ties_integers", R=4, V=600, data="ties"),
    case("ties_zero_inf", R=2, V=300, data="specials", tile=64),
    case("all_equal", R=2, V=200, data="equal", tile=32),
    case("fewer_columns_than_k", R=3, V=10, tile=32),
    case("k1", R=2, V=500, k=1, tile=16),
    case("k5", R=2, V=500, k=5),
    case("k32", R=2, V=500, k=32),
    case("strided_rows", R=3, V=400, stride=3),
    case("skip_79_tiles", R=1, V=5000, tile=64, data="ties"),
    case("skip_off_79_tiles", R=1, V=5000, tile=64, data="ties", skip=False),
    case("skip_peaked", R=1, V=5000, tile=64, data="peaked"),
    case("one_tile_5000", R=1, V=5000, tile=8192),
]

# The same properties at few rows and tiles: 1 and 8 rows, partial tiles, a rank's offset, ties, -0.0/inf, k = 1, 5
# (not a power of two), 32 and more than the columns, strided rows, one tile wider than the row, and the tile-maxima
# skip against the full merge with k = 5 (its KP = 8: more tiles than that take the skip). Both lists run on both.
def smaller(name: str, new_name: str, **over) -> dict:
    """Case `name` of CASES at the interpreter's sizes, as `new_name` (the full case stays in the GPU list)."""
    return dict(next(c for c in CASES if c["name"] == name), name=new_name, **over)


INTERPRETED_CASES = [
    dict(CASES[0], plain=True),  # 1row_4tiles
    smaller("8rows_partial_tile", "8rows_partial_tile_k5", V=100, k=5, tile=32),
    smaller("8rows_rank7_offset", "2rows_rank7_offset", R=2, V=150, tile=64),
    smaller("ties_integers", "ties_integers_2rows", R=2, V=200, tile=64),
    smaller("ties_zero_inf", "ties_zero_inf_1row", R=1),
    smaller("all_equal", "all_equal_1row", R=1),
    smaller("fewer_columns_than_k", "fewer_columns_than_k"),
    smaller("k1", "k1"),
    smaller("k5", "k5_1row", R=1),
    smaller("k32", "k32_1row", R=1, V=300),
    smaller("strided_rows", "strided_rows_2rows", R=2, V=200, tile=64),
    smaller("skip_79_tiles", "skip_11_tiles_k5", V=700, k=5),
    smaller("skip_off_79_tiles", "skip_off_11_tiles_k5", V=700, k=5),
    smaller("skip_peaked", "skip_peaked_k5", V=700, k=5),
    smaller("one_tile_5000", "one_tile_wider_than_the_row", V=300, tile=512),
]

_SMALL = {c["name"] for c in INTERPRETED_CASES}
INTERPRETED_AND_FULL = INTERPRETED_CASES + [c for c in CASES if c["name"] not in _SMALL]

GPU_CASES = [
    *[c for c in INTERPRETED_CASES if c["name"] not in {x["name"] for x in CASES}],
    case("gpu_8rows_tile2048", V=20000, tile=2048),
    case("gpu_1row_tile2048", R=1, V=20000, tile=2048),
    case("gpu_8rows_tile1024", V=20000, tile=1024),
    case("gpu_8rows_tile4096_ties", V=20000, tile=4096, data="ties"),
    case("gpu_8rows_tile8192", V=20000, tile=8192),
    case("gpu_8rows_tile256_skip", V=20000, tile=256, offset=140000),
    case("gpu_8rows_tile256_noskip", V=20000, tile=256, skip=False),
    case("gpu_8rows_specials", V=20000, tile=2048, data="specials"),
]


def make_logits(c: dict, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(c["seed"])
    R, V = c["R"], c["V"]
    shape = (R, V * (c["stride"] or 1))
    if c["data"] == "ties":  # few distinct values: most of the top-k is decided by the id
        x = torch.randint(-4, 5, shape, generator=gen).float()
    elif c["data"] == "specials":
        x = torch.randint(-2, 2, shape, generator=gen).float()
        pick = torch.randint(0, 6, shape, generator=gen)
        x = torch.where(pick == 0, torch.tensor(-0.0), x)
        x = torch.where(pick == 1, torch.tensor(float("-inf")), x)
        x[:, ::97] = float("inf")
    elif c["data"] == "equal":
        x = torch.full(shape, -1.5)
    elif c["data"] == "peaked":  # the top-k concentrated in two tiles, the rest far below
        x = torch.randn(shape, generator=gen) - 20
        a, b = V // 5, 3 * V // 5  # 1000 and 3000 at V = 5000
        x[:, a:a + 10] += 40
        x[:, b:b + 15] += 35
    else:
        x = torch.randn(shape, generator=gen) * 3
    return x.to(device)[:, :V]


def settings(c: dict) -> tk.TopKSettings:
    return tk.TopKSettings(tile=c["tile"], skip=c["skip"])


def run_case(c: dict, device: str) -> dict:
    logits = make_logits(c, device)
    R, K = c["R"], min(c["k"], c["V"])
    out = (torch.full((R, K), -1, dtype=torch.int64, device=device),
           torch.full((R, K), float("nan"), device=device), torch.full((R, K), -1, dtype=torch.int64, device=device))
    keys, values, ids = tk.local_topk_keys(logits, c["k"], c["offset"], out=out, settings=settings(c))
    assert keys is out[0] and values is out[1] and ids is out[2]
    r_keys = sampler._local_keys(logits, c["k"], c["offset"])  # the contract
    r_values, r_ids = sampler.unkey(r_keys)
    r = {"keys": torch.equal(keys, r_keys), "ids": torch.equal(ids, r_ids),
         "value_bits": torch.equal(values.view(torch.int32), r_values.view(torch.int32)), "shape": list(values.shape)}
    if c.get("plain") or device != "cpu":  # local_topk, the wrapper without keys: once under the interpreter
        v2, i2 = tk.local_topk(logits, c["k"], c["offset"], settings=settings(c))
        r["plain_api"] = torch.equal(v2.view(torch.int32), r_values.view(torch.int32)) and torch.equal(i2, r_ids)
    return r


def _check(c: dict, r: dict) -> None:
    assert r["shape"] == [c["R"], min(c["k"], c["V"])]
    for what in ("keys", "ids", "value_bits", "plain_api"):
        assert r.get(what, True), f"{c['name']}: {what} differ from fast.sampler.local_candidates"


# ---- interpreter tests ---------------------------------------------------------------------------------
interpreted, test_interpreted = interpreted_tests(__file__, INTERPRETED_AND_FULL, _check)


@pytest.mark.parametrize("kw, message", [
    (dict(logits=torch.randn(2, 50, dtype=torch.float64)), "float32"),
    (dict(logits=torch.randn(50, 2).T), "unit stride"),
    (dict(k=0), "k must be"),
    (dict(k=65), "k must be"),
    (dict(settings=dict(tile=16)), "tile 16 must be a power of two >= 32"),  # k = 20: the call's check
    (dict(settings=dict(tile=96)), "tile 96 must be a power of two >= 16"),
    (dict(settings=dict(tile=8)), "tile 8 must be a power of two >= 16"),
    (dict(settings=dict(num_warps=3)), "num_warps 3"),
    (dict(settings=dict(num_warps=32)), "num_warps 32"),
    (dict(settings=dict(skip=1)), "skip must be a bool"),
    (dict(settings=object()), "must be a TopKSettings"),
    (dict(vocab_offset=2**31), "below 2\\*\\*31"),
    (dict(out=(torch.empty(2, 20, dtype=torch.int64),) * 3), "out tensors"),
])
def test_rejects_bad_inputs(kw, message):
    """The call's checks, and the settings' (on construction, and at the call for what is not a TopKSettings)."""
    args = dict(logits=torch.randn(2, 50), k=20, vocab_offset=0)
    args.update(kw)
    with pytest.raises(ValueError, match=message):
        if isinstance(args.get("settings"), dict):
            args["settings"] = tk.TopKSettings(**args["settings"])
        tk.local_topk_keys(**args)


def test_settings_defaults_are_the_measured_launch():
    assert tk.TopKSettings() == tk.TopKSettings(tile=1024, num_warps=4, skip=True)
    with pytest.raises(Exception):  # frozen
        tk.TopKSettings().tile = 512


# ---- GPU tests (one TP8 rank) ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES + GPU_CASES, ids=[c["name"] for c in CASES + GPU_CASES])
def test_gpu(c):
    _check(c, run_case(c, "cuda"))


if __name__ == "__main__" and "--interpret-worker" in sys.argv:
    from iquest.kernels.testing import worker_main

    worker_main([(c["name"], lambda c=c: run_case(c, "cpu")) for c in INTERPRETED_AND_FULL])
