"""Long-context benchmarks start from a filled cache: `RankEngine.start(..., history=H)` and bench/history.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from iquest.bench.history import fill_history, history_for
from iquest.fast.parallel import Parallel
from iquest.fast.rank import PREFILL_BLOCK, EngineOptions, RankEngine, Request
from iquest.tests.helpers import RING_SEQ

TINY = Path(__file__).resolve().parent.parent / "fixtures" / "tiny"


def _engine() -> RankEngine:
    return RankEngine(TINY, Parallel.single(), EngineOptions(max_context=256, dtype="fp32"))


def _decode(engine: RankEngine, req: Request, history: int = 0, before=None) -> list[int]:
    runner, _ = engine.runner(req.drafts, req.top_k)
    if before:
        before(engine)
    engine.start(req, runner, history=history)
    st = engine.state
    while not bool(st.done):
        engine.decode_chunk(runner, None)
    return st.log_tokens[:int(st.emitted)].tolist()


def _request(prompt, drafts=3) -> Request:
    return Request(tuple(prompt), 11, 1.0, 20, 0.95, 24, drafts, ())


@pytest.mark.parametrize("drafts", [3, 0])
def test_start_after_history_equals_a_full_prefill(drafts):
    """The prompt's first 128 positions copied from a full prefill, then start(history=128): same tokens, bit for bit
    (the remaining prefill and depth-0 blocks have the same shapes as in the full prefill)."""
    prompt, H = RING_SEQ[:150], 2 * PREFILL_BLOCK
    full = _engine()
    runner, _ = full.runner(drafts, 20)
    full.start(_request(prompt, drafts), runner)
    saved = [(kv.k.clone(), kv.v.clone(), kv.slot_pos.clone()) for kv in full.cache.layers]
    want = _decode(full, _request(prompt, drafts))

    def copy_history(engine):
        for kv, (k, v, sp) in zip(engine.cache.layers, saved):  # the draft's cache too: its rows sit at 0..H-1
            kv.k.copy_(k)
            kv.v.copy_(v)
            kv.slot_pos.copy_(torch.where(sp < H, sp, torch.full_like(sp, -1)))

    engine, rows = _engine(), []
    forward = engine.model.forward
    engine.model.forward = lambda tokens, *a, **k: rows.append(tokens.shape[0]) or forward(tokens, *a, **k)
    got = _decode(engine, _request(prompt, drafts), history=H, before=copy_history)
    assert got == want and len(got) == 24
    assert rows[0] == len(prompt) - H  # only the tail was prefilled: the first H positions came from the cache
    # ... and the cache was read: random history instead of the real one changes the output.
    assert _decode(_engine(), _request(prompt, drafts), history=H, before=lambda e: fill_history(e, H)) != want


def test_fill_history_labels_positions_as_a_prefill_leaves_them():
    engine = _engine()
    H = history_for(200)
    assert H == 192 and H % PREFILL_BLOCK == 0
    fill_history(engine, H, seed=1)
    assert len(engine.cache.layers) == engine.config.num_hidden_layers + 1  # the draft's cache last
    for i, kv in enumerate(engine.cache.layers):
        labels = sorted(p for p in kv.slot_pos.tolist() if p >= 0)
        assert labels == list(range(max(0, H - kv.slots), H)), i  # rings keep their last `slots` positions
        assert all(kv.slot_pos[p % kv.slots] == p for p in labels)
    # A decode from there runs, reads the whole history and emits tokens.
    got = _decode(engine, _request(RING_SEQ[:200]), history=H, before=lambda e: fill_history(e, H, seed=1))
    assert len(got) == 24


def test_history_must_leave_a_tail_to_prefill():
    engine = _engine()
    runner, _ = engine.runner(3, 20)
    with pytest.raises(ValueError, match="history"):
        engine.start(_request(RING_SEQ[:64]), runner, history=64)


def test_bench_step_with_synthetic_history(tmp_path, capsys):
    """The rank-slice bench at a context it fills synthetically (tiny at TP2 on CPU), and the real-TP bench."""
    import json

    from iquest.cli.main import main

    out = tmp_path / "s.json"
    assert main(["bench", "step", "--config", str(TINY / "config.json"), "--tp-slice", "2", "--device", "cpu",
                 "--repeats", "1", "--context", "200", "--chunk-tokens", "4", "--history", "synthetic",
                 "--out", str(out)]) == 0
    assert "synthetic history: positions 0..191" in capsys.readouterr().out
    r = json.loads(out.read_text())
    assert r["synthetic_history"] == 192 and r["summary"]["torch/eager"]["median_round_us"] > 0
    assert main(["bench", "step", "--config", str(TINY / "config.json"), "--tp", "2", "--device", "cpu",
                 "--repeats", "1", "--context", "200", "--chunk-tokens", "4", "--history", "synthetic",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["synthetic_history"] == 192
    assert main(["bench", "step", "--config", str(TINY / "config.json"), "--tp-slice", "2", "--device", "cpu",
                 "--repeats", "1", "--context", "48", "--chunk-tokens", "4", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["synthetic_history"] == 0  # auto: short contexts are prefilled
