"""`iquest debug chain`: where a recursive draft row's error comes from.

A draft at depth d >= 2 is the MTP layer applied to the previous depth's output. Against a reference that
recurses on its own outputs, the error at depth d is what this depth's rounding adds plus what the d - 1 earlier
depths carried in, passed through the layer (and through any router tie the two chains cross differently). For
every draft row of the qualification decodes this tool shows both:

  chain   fast against the reference recursing on its own outputs
  step    fast against the reference recursing on the fast engine's outputs: the error this depth adds
  scored  what qualify scores (qualify/replay.py): step, except that a swap of MTP experts the engine's own
          input explains (qualify/router.py) is scored against the reference under the engine's experts

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
from ..fast.rank import EngineOptions, EngineParts, RankEngine
from ..reference.config import Config
from . import tolerances
from .checks import record, reference, sliding_ring
from .replay import Block, StreamReference, recording_parts, router_checked, router_weight


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
    scored_hidden: float        # what qualify scores: step, or under the engine's experts for an explained swap
    router: float               # qualify's numerics.router value (<= 1: any swap explained)
    margin: float               # MTP router margin of the step reference (log score ratio, k-th / (k+1)-th)
    experts_fast: list[int]
    experts_step: list[int]
    experts_chain: list[int]


def _rel(fast: torch.Tensor, ref: torch.Tensor) -> float:
    return float((fast - ref).abs().max() / ref.abs().max())


def _margin(scores: torch.Tensor, k: int) -> float:
    s = torch.sort(scores.flatten(), descending=True).values
    return math.log(float(s[k - 1]) / float(s[k])) if s.numel() > k and float(s[k]) > 0 else math.inf


def _experts(experts: torch.Tensor) -> list[int]:
    return sorted(int(e) for e in experts)


class _Replay:
    """One StreamReference over the recorded blocks, keeping each draft block's last live row (the row the next
    depth starts from)."""

    def __init__(self, ref, stream, recursion: str):
        self.sr = StreamReference(ref, stream, recursion)

    def block(self, b: Block):
        """The reference's ("ok", logits, hidden, DraftRow) for the block's last live row, or None."""
        if b.kind != "draft":
            self.sr.main_block(b)
            return None
        got = self.sr.draft_block(b)
        last = max((i for i, x in enumerate(b.live) if x), default=None)
        r = got[last] if last is not None and last < len(got) else None
        return r if r is not None and r[0] == "ok" else None


def chain_rows(engine: RankEngine, model_dir: str, case, index: int, router_tol: float = 1.0) -> list[ChainRow]:
    """Decode one qualification case on `engine` (built with qualify.replay.recording_parts) and split every draft
    row's error: the reference replayed
    twice over the same recorded blocks, its recursion from its own outputs (chain) and from the engine's
    (step), and what qualify scores after its router check (`router_tol`: numerics.router's tolerance)."""
    _, steps, blocks = record(engine, case, taps=True)
    stream = list(case.prompt) + [t for s in steps for t in s.tokens]
    ref, k = reference(model_dir), engine.config.num_experts_per_tok
    chain, step = _Replay(ref, stream, "reference"), _Replay(ref, stream, "fast")
    router_w = router_weight(ref)
    rows: list[ChainRow] = []
    for b in blocks:
        c, s = chain.block(b), step.block(b)
        if c is None or s is None:
            continue
        last = max(i for i, x in enumerate(b.live) if x)
        fl, fh = b.logits[last], b.hidden[last]
        _, scored, ratio = router_checked(step.sr, router_w, b, last, s, router_tol)
        rows.append(ChainRow(index, b.round, b.depth, b.positions[last], _rel(fh, c[2]), _rel(fl, c[1]),
                             _rel(fh, s[2]), _rel(fl, s[1]), _rel(fh, scored), ratio,
                             _margin(s[3].tap("router_scores"), k),
                             _experts(b.taps["mtp.experts"][last]), _experts(s[3].tap("experts")),
                             _experts(c[3].tap("experts"))))
    return rows


def _case_rows(model_dir: str, options: EngineOptions, device: str, index: int, quick: bool = False,
               parts: EngineParts = EngineParts()) -> list[ChainRow]:
    from .run import qualify_cases

    with torch.inference_mode():  # no gradient here either (qualify/run.py's units say why)
        engine = RankEngine(model_dir, Parallel.single(device), options, recording_parts(parts))
        cases, _, _ = qualify_cases(engine.config.vocab_size, quick, sliding_ring(engine.config, options))
        tol = tolerances.value("numerics.router", tolerances.scheme(options.dtype))
        return chain_rows(engine, model_dir, cases[index], index, tol)


def chain_report(model_dir: str, dtype: str = "bf16", kernels: str = "auto", device: str = "cpu",
                 jobs: int = 1, quick: bool = False) -> list[ChainRow]:
    """Every recursive draft row of the qualification decodes (the cases of `iquest qualify`, or of `iquest qualify
    --quick` with `quick`; same engine options), one worker process per case when jobs > 1."""
    from .run import candidate_options, qualify_cases

    options = candidate_options(dtype, kernels, device)
    config = Config.from_dir(model_dir)
    n = len(qualify_cases(config.vocab_size, quick, sliding_ring(config, options))[0])
    if jobs <= 1:
        return [r for i in range(n) for r in _case_rows(model_dir, options, device, i, quick)]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(min(jobs, n), mp_context=multiprocessing.get_context("spawn"),
                             initializer=torch.set_num_threads, initargs=(1,)) as pool:  # one core per worker
        parts = list(pool.map(_case_rows, [model_dir] * n, [options] * n, [device] * n, range(n), [quick] * n))
    return [r for part in parts for r in part]


def swap(r: ChainRow) -> bool:
    """The fast engine's MTP experts differ from the step reference's (same input up to rounding)."""
    return bool(r.experts_fast) and bool(r.experts_step) and r.experts_fast != r.experts_step


def print_chain(rows: list[ChainRow], out=None) -> None:
    """Per depth: worst chain and step errors, routing disagreements; then the chain of the worst row."""
    out = out or sys.stdout
    f = "{:<6} {:>5} {:>12} {:>12} {:>12} {:>13} {:>12} {:>12} {:>8} {:>11} {:>7}"
    print(f.format("depth", "rows", "chain hidden", "step hidden", "same experts", "scored hidden", "chain logit",
                   "step logit", "swapped", "max margin", "router"), file=out)
    for d in sorted({r.depth for r in rows}):
        mine = [r for r in rows if r.depth == d]
        stepped = [r for r in mine if not math.isnan(r.step_hidden)]
        swapped = [r for r in stepped if swap(r)]
        mx = lambda xs: f"{max(xs):.3g}" if xs else "-"  # noqa: E731
        print(f.format(d, len(mine), mx([r.chain_hidden for r in mine]), mx([r.step_hidden for r in stepped]),
                       mx([r.step_hidden for r in stepped if not swap(r)]), mx([r.scored_hidden for r in mine]),
                       mx([r.chain_logits for r in mine]), mx([r.step_logits for r in stepped]), len(swapped),
                       mx([r.margin for r in swapped]), mx([r.router for r in mine if r.router is not None])),
              file=out)
    print("same experts: worst step error over rows whose fast experts equal the step reference's (rounding "
          "alone); swapped: the other rows; max margin: the widest router margin a swap crossed; scored hidden "
          "and router: what iquest qualify scores (explained swaps against the reference under the engine's "
          "experts; router <= 1: every swap explained)", file=out)
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
