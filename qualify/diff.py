"""`iquest debug diff`: both engines' activation taps at one position, per layer and stage, side by side.

Taps are the shared contract of reference/model.py and fast/model.py (same names). The target runs the
prompt; the draft layer then runs depth 0 over positions 0..n-2 from each engine's own target hiddens (the row at p
reads h_p and the token at p+1). For each (layer, stage) the row at --position is compared (the draft's: the row at
--position, or at n-2 when --position is the prompt's last): relative L2 error ||fast - ref|| / ||ref|| (experts: count of
differing chosen experts), against the `diff` tolerances in qualify/tolerances.json. The first layer and stage
over its tolerance is named; a PNG plots error by layer for each stage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..fast.parallel import Parallel
from ..fast.rank import PREFILL_BLOCK, EngineOptions, EngineParts, RankEngine
from ..reference.model import ReferenceModel
from . import tolerances

STAGES = ("attn_out", "mlp_in", "router_scores", "experts", "mlp_out", "hidden")  # router_*: MoE layers only


@dataclass
class StageDiff:
    layer: str       # "0".."L-1", "final", "mtp"
    stage: str
    ref_norm: float
    fast_norm: float
    error: float
    tol: float

    @property
    def over(self) -> bool:
        return self.error > self.tol


@dataclass
class DiffResult:
    position: int
    tokens: int
    stages: list[StageDiff]
    first: StageDiff | None
    plot: str


def _blocks(n: int, start: int = 0):
    for s in range(start, n, PREFILL_BLOCK):
        yield s, min(s + PREFILL_BLOCK, n)


def _fast_taps(engine: RankEngine, ids: list[int], P: int) -> tuple[dict, dict]:
    main, mtp, hiddens = {}, {}, []
    engine.cache.reset()
    dev = engine.par.device
    toks = torch.tensor(ids, device=dev)
    for s, e in _blocks(len(ids)):
        pos = torch.arange(s, e, device=dev)
        taps = {} if s <= P < e else None
        logits, h = engine.model.forward(toks[pos], pos, torch.ones_like(pos, dtype=torch.bool), taps)
        hiddens.append(h)
        if taps is not None:
            main = {k: v[P - s] for k, v in taps.items()}
            main["logits"] = logits[P - s].double().cpu()
    hidden = torch.cat(hiddens)
    D = _draft_row(len(ids), P)
    if D is not None:
        for s, e in _blocks(len(ids) - 1):
            pos = torch.arange(s, e, device=dev)
            taps = {} if s <= D < e else None
            logits, _ = engine.model.draft(toks[pos + 1], hidden[s:e], pos, torch.ones_like(pos, dtype=torch.bool),
                                           taps)
            if taps is not None:
                mtp = {k: v[D - s] for k, v in taps.items()}
                mtp["mtp.logits"] = logits[D - s].double().cpu()
    return main, mtp


def _draft_row(n: int, P: int) -> int | None:
    """The draft row compared: the one at P, or at n-2 when P is the last position (a row needs the next token)."""
    return min(P, n - 2) if n >= 2 else None


def _ref_taps(ref: ReferenceModel, ids: list[int], P: int) -> tuple[dict, dict]:
    cache, taps = ref.new_cache(), {}
    _, hidden = ref.forward(torch.tensor(ids), torch.arange(len(ids)), cache, taps)
    main = {k: v[P] for k, v in taps.items()}
    mtp = {}
    D = _draft_row(len(ids), P)
    if D is not None:
        taps = {}
        ref.draft(torch.tensor(ids[1:]), hidden[:-1], torch.arange(len(ids) - 1), cache, taps)
        mtp = {k: v[D] for k, v in taps.items()}
    return main, mtp


def _compare(layer: str, stage: str, r: torch.Tensor, f: torch.Tensor, dtype: str) -> StageDiff:
    if stage == "experts":
        err = float(len(set(r.tolist()) ^ set(f.tolist())) // 2)
        return StageDiff(layer, stage, float(r.numel()), float(f.numel()), err, tolerances.value("diff", dtype, "experts"))
    r, f = r.double().flatten(), f.double().flatten()
    rn = float(r.norm())
    err = float((f - r).norm()) / rn if rn > 0 else float((f - r).norm())
    return StageDiff(layer, stage, rn, float(f.norm()), err, tolerances.value("diff", dtype))


def diff(model_dir, ids: list[int], position: int, dtype: str = "fp32", parts: EngineParts = EngineParts(),
         plot: str = "debug-diff.png", json_out: str | None = None, device: str = "cpu",
         kernels: str = "auto") -> DiffResult:
    """`parts`: the candidate's engine pieces (a negative control's, to see where its defect shows)."""
    if not ids:
        raise ValueError("the prompt is empty")
    P = position if position >= 0 else len(ids) + position
    if not 0 <= P < len(ids):
        raise ValueError(f"--position {position} is outside the prompt's {len(ids)} positions")
    ref = ReferenceModel.load(model_dir)
    engine = RankEngine(model_dir, Parallel.single(device),
                        EngineOptions(max_context=max(len(ids) + 16, 64), dtype=dtype, kernels=kernels), parts)
    tol = tolerances.scheme(dtype)
    rm, rt = _ref_taps(ref, ids, P)
    fm, ft = _fast_taps(engine, ids, P)
    stages = []
    for layer in range(ref.config.num_hidden_layers):
        for st in STAGES:
            name = f"layer{layer}.{st}"
            if name in rm and name in fm:  # a dense layer has no router
                stages.append(_compare(str(layer), st, rm[name], fm[name], tol))
    for st in ("final_hidden", "logits"):
        stages.append(_compare("final", st, rm[st], fm[st], tol))
    if rt:
        for st in ("input",) + STAGES + ("final_hidden", "logits"):
            stages.append(_compare("mtp", st, rt[f"mtp.{st}"], ft[f"mtp.{st}"], tol))
    first = next((s for s in stages if s.over), None)
    _plot(stages, P, plot, tol)
    result = DiffResult(P, len(ids), stages, first, plot)
    if json_out:
        Path(json_out).write_text(json.dumps({
            "position": P, "tokens": len(ids), "plot": plot,
            "first_over": None if first is None else {"layer": first.layer, "stage": first.stage},
            "stages": [s.__dict__ for s in stages]}, indent=1))
    return result


def _plot(stages: list[StageDiff], P: int, path: str, dtype: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = list(dict.fromkeys(s.layer for s in stages))
    x = {name: i for i, name in enumerate(layers)}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for st in ("attn_out", "mlp_in", "router_scores", "mlp_out", "hidden", "final_hidden", "logits", "input"):
        pts = [(x[s.layer], max(s.error, 1e-18)) for s in stages if s.stage == st]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=st)
    tol = tolerances.value("diff", dtype)
    ax.axhline(tol, color="red", linestyle="--", label=f"tolerance {tol:.2g}")
    first = next((s for s in stages if s.over), None)
    if first is not None:
        ax.axvline(x[first.layer], color="gray", linestyle=":", label=f"first over: {first.layer}/{first.stage}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(layers)), layers)
    ax.set_xlabel("layer")
    ax.set_ylabel("relative L2 error (fast vs float64 reference)")
    ax.set_title(f"iquest debug diff: position {P}, fast {dtype}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_diff(res: DiffResult) -> None:
    w = "{:<6} {:<14} {:>12} {:>12} {:>10} {:>9}  {}"
    print(w.format("layer", "stage", "|ref|", "|fast|", "rel.err", "tol", ""))
    for s in res.stages:
        print(w.format(s.layer, s.stage, f"{s.ref_norm:.4g}", f"{s.fast_norm:.4g}", f"{s.error:.3g}", f"{s.tol:.2g}",
                       "OVER" if s.over else ""))
    if res.first is None:
        print(f"\nposition {res.position}: every layer and stage within tolerance")
    else:
        print(f"\nposition {res.position}: first over tolerance at layer {res.first.layer}, stage {res.first.stage} "
              f"(error {res.first.error:.3g} > {res.first.tol:.2g})")
    print(f"plot: {res.plot}")
