"""`iquest debug chain`: where a recursive draft row's error comes from.

A draft at depth d >= 2 is the MTP layer applied to the previous depth's output, so qualify's
numerics.hidden/draft_depth{d} compares the ends of two chains: the fast engine's (its own hiddens) and the
reference's (its own). That error is what this depth's rounding adds plus what the d - 1 earlier depths carried
in, passed through the layer. For every recursive row of the qualification decodes this tool separates them:

  chain   fast against the reference's own chain (the value qualify scores)
  step    fast against the reference run from the fast engine's own previous-depth output at the same
          position (the error this depth adds)

beside the MTP router's top-k margin (log of the k-th over the (k+1)-th score; rounding can only swap experts
whose margin it can cross) and whether the fast engine chose the experts the step reference chose.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..fast.parallel import Parallel
from ..fast.rank import EngineOptions, RankEngine
from ..reference.config import Config
from .checks import record, reference, sliding_ring
from .replay import Block, StreamReference


@dataclass
class ChainRow:
    case: int
    chain: int                  # draft chain index (the verify round it feeds)
    depth: int                  # the q_d this row gives (1: last row of the depth-0 redraft block)
    position: int
    chain_hidden: float         # max |fast - ref chain| / max |ref chain| of h'
    chain_logits: float
    step_hidden: float          # the same against the reference run from the fast engine's previous output
    step_logits: float
    margin: float               # MTP router margin of the step reference (log score ratio, k-th / (k+1)-th)
    experts_fast: list[int]
    experts_step: list[int]
    experts_chain: list[int]


def _rel(fast: torch.Tensor, ref: torch.Tensor) -> float:
    return float((fast - ref).abs().max() / ref.abs().max())


def _margin(scores: torch.Tensor, k: int) -> float:
    s = torch.sort(scores.flatten(), descending=True).values
    return math.log(float(s[k - 1]) / float(s[k])) if s.numel() > k and float(s[k]) > 0 else math.inf


def _experts(taps: dict | None, row: int) -> list[int]:
    return sorted(int(e) for e in taps["mtp.experts"][row]) if taps else []


class _ChainReference(StreamReference):
    """StreamReference that also runs each recursive row from the fast engine's own previous-depth output.

    The step row runs before the chain row at the same position: both write the MTP K/V of that position and
    the chain's write must be the one left behind (later depths attend to it)."""

    def __init__(self, ref, stream, k: int):
        super().__init__(ref, stream)
        self.k, self.fast_prev, self.chain_taps = k, None, None
        draft = ref.draft

        def tapped(*args):
            self.chain_taps = {}
            return draft(*args, self.chain_taps)
        self.m = _Tapped(ref, tapped)

    def rows(self, b: Block, case: int) -> list[ChainRow]:
        out: list[ChainRow] = []
        step = None
        p = b.positions[0]
        if b.depth >= 2 and self.chain_h is not None and p == self.chain_pos + 1 and self.fast_prev is not None:
            taps: dict = {}
            sl, sh = self.m.ref.draft(torch.tensor([b.tokens[0]]), self.fast_prev[None], torch.tensor([p]),
                                      self.cache, taps)
            step = (sl[0], sh[0], taps)
        got = self.draft_block(b)
        live = [i for i, x in enumerate(b.live) if x]
        last = 0 if b.depth >= 2 else max(live)
        self.fast_prev = b.hidden[last]
        r = got[last] if last < len(got) else None
        if r is None or r[0] != "ok":
            self.fast_prev = None
            return out
        _, rl, rh = r
        fl, fh = b.logits[last], b.hidden[last]
        chain_experts = _experts(self.chain_taps, -1)  # the depth-0 block's reference rows end at this row
        if step is None:
            out.append(ChainRow(case, b.round, b.depth, b.positions[last], _rel(fh, rh), _rel(fl, rl), math.nan,
                                math.nan, math.nan, _experts(b.taps, last), [], chain_experts))
        else:
            sl, sh, taps = step
            out.append(ChainRow(case, b.round, b.depth, p, _rel(fh, rh), _rel(fl, rl), _rel(fh, sh), _rel(fl, sl),
                                _margin(taps["mtp.router_scores"][0], self.k), _experts(b.taps, 0),
                                _experts(taps, 0), chain_experts))
        return out


class _Tapped:
    """The reference model with `draft` replaced (the replay calls self.m.draft / self.m.forward)."""

    def __init__(self, ref, draft):
        self.ref, self.draft = ref, draft

    def __getattr__(self, name):
        return getattr(self.ref, name)


def chain_rows(engine: RankEngine, model_dir: str, case, index: int) -> list[ChainRow]:
    """Decode one qualification case on `engine` and split every draft chain's error by depth."""
    _, steps, blocks = record(engine, case, taps=True)
    stream = list(case.prompt) + [t for s in steps for t in s.tokens]
    cr = _ChainReference(reference(model_dir), stream, engine.config.num_experts_per_tok)
    rows: list[ChainRow] = []
    for b in blocks:
        if b.kind == "draft":
            rows += cr.rows(b, index)
        else:
            cr.main_block(b)
    return rows


def _case_rows(model_dir: str, options: EngineOptions, device: str, index: int) -> list[ChainRow]:
    from .run import qualify_cases

    torch.set_num_threads(1)
    engine = RankEngine(model_dir, Parallel.single(device), options)
    cases, _, _ = qualify_cases(engine.config.vocab_size, False, sliding_ring(engine.config, options))
    return chain_rows(engine, model_dir, cases[index], index)


def chain_report(model_dir: str, dtype: str = "bf16", kernels: str = "auto", device: str = "cpu",
                 jobs: int = 1) -> list[ChainRow]:
    """Every recursive draft row of the qualification decodes (the cases of `iquest qualify`, same engine
    options), one worker process per case when jobs > 1."""
    from .run import qualify_cases

    options = EngineOptions(max_context=512, dtype=dtype, graphs=False,
                            kernels=EngineOptions(kernels=kernels).kernel_set(torch.device(device)))
    config = Config.from_dir(model_dir)
    n = len(qualify_cases(config.vocab_size, False, sliding_ring(config, options))[0])
    if jobs <= 1:
        return [r for i in range(n) for r in _case_rows(model_dir, options, device, i)]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(jobs, n), mp_context=multiprocessing.get_context("spawn")) as pool:
        parts = list(pool.map(_case_rows, [model_dir] * n, [options] * n, [device] * n, range(n)))
    return [r for part in parts for r in part]


def swap(r: ChainRow) -> bool:
    """The fast engine's MTP experts differ from the step reference's (same input up to rounding)."""
    return bool(r.experts_fast) and bool(r.experts_step) and r.experts_fast != r.experts_step


def print_chain(rows: list[ChainRow], out=None) -> None:
    """Per depth: worst chain and step errors, routing disagreements; then the chain of the worst row."""
    out = out or sys.stdout
    f = "{:<6} {:>5} {:>12} {:>12} {:>12} {:>12} {:>12} {:>8} {:>11}"
    print(f.format("depth", "rows", "chain hidden", "step hidden", "same experts", "chain logit", "step logit",
                   "swapped", "max margin"), file=out)
    for d in sorted({r.depth for r in rows}):
        mine = [r for r in rows if r.depth == d]
        stepped = [r for r in mine if not math.isnan(r.step_hidden)]
        swapped = [r for r in stepped if swap(r)]
        mx = lambda xs: f"{max(xs):.3g}" if xs else "-"  # noqa: E731
        print(f.format(d, len(mine), mx([r.chain_hidden for r in mine]), mx([r.step_hidden for r in stepped]),
                       mx([r.step_hidden for r in stepped if not swap(r)]), mx([r.chain_logits for r in mine]),
                       mx([r.step_logits for r in stepped]), len(swapped), mx([r.margin for r in swapped])),
              file=out)
    print("same experts: worst step error over rows whose fast experts equal the step reference's (rounding "
          "alone); swapped: the other rows; max margin: the widest router margin a swap crossed", file=out)
    if not rows:
        return
    worst = max(rows, key=lambda r: r.chain_hidden)
    print(f"\nworst chain hidden error: case {worst.case} chain {worst.chain} depth {worst.depth} position "
          f"{worst.position}; that chain by depth:", file=out)
    g = "{:>5} {:>8} {:>12} {:>12} {:>9}  {}"
    print(g.format("depth", "position", "chain hidden", "step hidden", "margin", "experts fast / step / chain"),
          file=out)
    for r in sorted((r for r in rows if r.case == worst.case and r.chain == worst.chain), key=lambda r: r.depth):
        print(g.format(r.depth, r.position, f"{r.chain_hidden:.3g}", f"{r.step_hidden:.3g}", f"{r.margin:.3g}",
                       f"{r.experts_fast} / {r.experts_step} / {r.experts_chain}"), file=out)


def write_json(rows: list[ChainRow], path: str) -> None:
    clean = lambda x: x if not isinstance(x, float) or math.isfinite(x) else str(x)  # noqa: E731
    Path(path).write_text(json.dumps([{k: clean(v) for k, v in asdict(r).items()} for r in rows], indent=0))
