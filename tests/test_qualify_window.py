"""qualify/window.py: the structural check that every row's sliding window is still in the ring after its block ran.

Oracle: positions 0..p-1 then a block of R rows written through a ring of S slots leave exactly the positions
>= p + R - S (and below them nothing), so row i at q = p + i misses max(0, p + R - S - max(0, q - W + 1)) of its
window (q - W, q], at most the whole window. With S = W that is R - 1 - i once the window is full; with the engine's
W + 64 slots, none for blocks of up to 65 rows. The window is the config's: the target's for target layers, the
draft's own (mtp/config.json) for the draft layer."""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import given, settings, strategies as st

from iquest.fast.cache import RING_SLACK, StaticKV
from iquest.qualify.window import sliding_layers, window_missing
from iquest.reference.config import Config
from iquest.tests.helpers import TINY


def _config(window: int, draft_window: int) -> Config:
    c = Config.from_dir(TINY)
    return replace(c, sliding_window=window, mtp=replace(c.mtp, sliding_window=draft_window))


def _expected(p: int, rows: int, slots: int, window: int) -> list[int]:
    out = []
    for i in range(rows):
        lo = max(0, p + i - window + 1)
        size = p + i + 1 - lo
        out.append(min(size, max(0, p + rows - slots - lo)))
    return out


def _ring(slack: int) -> type[StaticKV]:
    """The engine's cache with `slack` spare ring slots (ring_exact_w's substitution is slack 0)."""
    return type(f"Ring{slack}", (StaticKV,), {"ring_slack": slack})


@settings(max_examples=150, deadline=None)
@given(window=st.integers(4, 40), draft_window=st.integers(4, 40), rows=st.integers(1, 8), p=st.integers(0, 120),
       slack=st.sampled_from([0, 3, 7, 64]), draft=st.booleans())
def test_missing_window_positions_match_the_ring_arithmetic(window, draft_window, rows, p, slack, draft):
    config = _config(window, draft_window)
    cache = _ring(slack)(config, 1, 256, torch.float32, torch.device("cpu"))
    layer, w = sliding_layers(config, draft=draft)[0]
    assert w == (draft_window if draft else window) and (layer == config.num_hidden_layers) == draft
    kv = cache[layer]
    history = torch.arange(0, p)
    if history.numel():
        kv.write(history, torch.ones_like(history, dtype=torch.bool), torch.zeros(history.numel(), 1, config.head_dim),
                 torch.zeros(history.numel(), 1, config.head_dim))
    block = torch.arange(p, p + rows)
    kv.write(block, torch.ones(rows, dtype=torch.bool), torch.zeros(rows, 1, config.head_dim),
             torch.zeros(rows, 1, config.head_dim))
    got = window_missing(cache, [(layer, w)], block.tolist(), [True] * rows)
    assert [g[0] for g in got] == _expected(p, rows, kv.slots, w)
    for n, why in got:
        assert (n > 0) == bool(why)
    if slack == RING_SLACK:  # the engine's ring: nothing missing, ever
        assert all(n == 0 for n, _ in got)


def test_padding_rows_and_full_layers_are_not_counted():
    config = _config(8, 4)
    cache = _ring(0)(config, 1, 64, torch.float32, torch.device("cpu"))
    layers = sliding_layers(config, draft=False)
    assert layers and all(config.layer_type(i) == "sliding_attention" and w == 8 for i, w in layers)
    assert config.num_hidden_layers not in [i for i, _ in layers]  # the draft layer is a draft forward's
    # nothing written: a live row at position 5 misses its whole window (0..5), a padding row counts nothing
    got = window_missing(cache, layers, [5, 6], [True, False])
    assert got[0][0] == 6 and got[1] == (0, "")


def test_the_config_window_not_the_caches():
    """A cache that claims a wider window (draft_window_4096) is still held to the config's: what the check counts is
    the contract's window, so a ring too small for the config's window is caught whatever the cache believes."""
    config = _config(8, 4)
    cache = _ring(0)(config, 1, 64, torch.float32, torch.device("cpu"))
    layer, w = sliding_layers(config, draft=True)[0]
    cache[layer].window = 64  # what a broken cache might claim; the check never reads it
    got = window_missing(cache, [(layer, w)], [10], [True])
    assert got[0][0] == 4  # nothing written: the config's 4 keys (7..10) are missing, not 11
