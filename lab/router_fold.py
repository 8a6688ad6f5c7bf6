"""The numerics of the "router fold" (issue 52's design), measured before anyone builds its kernels.

A MoE layer's router reads b = feed_forward_norm(h), h = r + s * t, t = attn_out_norm(o) (docs/model.md, "Forward";
r is the layer's residual: a = attention_norm(x) at layers >= 1, the raw input x at layer 0). The fold computes the
router logits without materializing b: with W' = W_r * w_ffn (the router's columns scaled by the norm's weight),

    logits = rstd_h * (W' r + s * W' t),   rstd_h = 1 / sqrt(mean(h^2) + eps)

so W' r can be made from r before attention, W' t's partial sums by the o-projection's programs, and rstd_h and the
selection in the tail. This probe runs the float64 reference (reference/model.py, its taps) over held-out prompts
(fixtures/fit_depth.replay_prompts; prefill positions only: every row of a prefill is routed exactly as a decode step
at its position would be, the reference being causal and row by row exact) and computes, per MoE layer and position,
three logit vectors from the same float64 inputs (r, o = the attn_out tap, the weights):

  ref   the reference's own: b @ W_r^T in float64 (b its mlp_in tap)
  path  the fast engine's roundings (fast/torch_ops.py add_norm, route): r and o as bf16 tensors, t = bf16(norm(o)),
        h = bf16(r + bf16(t * s)) (a scale of 1 rounds nowhere extra), b = bf16(norm(h)), fp32(b) @ fp32(W_r)^T in fp32
  fold  fp32 throughout from bf16 r and o, no rounding of t, h, b: t = o * rstd_o * w_attn_out, h = r + s t,
        rstd_h from that h, W' = fp32(W_r) * fp32(w_ffn), logits = rstd_h * (W' r + s * W' t)
  branch the fold with its o term made from the attention's heads a (before the o-projection) instead of o:
        B = F a in fp32, F = fp32(W' diag(w_attn_out) W_o) composed in float64, a rounded to bf16; rstd_o and rstd_h
        still of the bf16 o (lab/fold_branch.py: the form that lets B run beside the o-projection)

Reported per layer and overall: max and median |logit - ref| (absolute and relative to the row's max |ref logit|),
the fraction of positions whose top-k expert set differs (path vs ref, fold vs ref, fold vs path; floor vs ref and
fold vs floor split the fold's error into its inputs' bf16 rounding and its own fp32 arithmetic), the reference's
k-th/(k+1)-th logit gap at the flipped positions, and the max |routing weight - ref| over positions whose sets agree.
For the fold and the branch, qualification's router check on every flipped row (qualify/router.py `swap_ratio` with
each form's exact input and band: `fast.router_fold.exact_input`, `branch_input`): how many flips it would not explain.

    python -m iquest.lab.router_fold --prompts N --out FILE [--model DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..reference.layers import route

BF16 = torch.bfloat16
PAIRS = (("path", "ref"), ("fold", "ref"), ("fold", "path"), ("floor", "ref"), ("fold", "floor"), ("fold64", "ref"),
         ("branch", "ref"), ("branch", "fold"), ("branch64", "ref"))


def bf16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bf16 (round to nearest even), returned in fp32: exact, bf16 values fit fp32."""
    return x.to(BF16).float()


def norm32(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The engine's rmsnorm before its rounding: fp32 x * rsqrt(mean(x^2) + eps) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def path_logits(r: torch.Tensor, o: torch.Tensor, w_out: torch.Tensor, w_ffn: torch.Tensor, router: torch.Tensor,
                s: float, eps: float) -> torch.Tensor:
    """The fast engine's router logits from float64 r and o, with its bf16 rounding points (fast/torch_ops.py)."""
    r, o, w_out, w_ffn, router = bf16(r), bf16(o), w_out.float(), w_ffn.float(), router.float()
    t = bf16(norm32(o, w_out, eps))
    h = bf16(r + (t if s == 1.0 else bf16(t * s)))
    b = bf16(norm32(h, w_ffn, eps))
    return b @ router.T


def fold_logits(r: torch.Tensor, o: torch.Tensor, w_out: torch.Tensor, w_ffn: torch.Tensor, router: torch.Tensor,
                s: float, eps: float, dtype: torch.dtype = torch.float32, round_inputs: bool = True) -> torch.Tensor:
    """The fold in `dtype`, from r and o rounded to bf16 first as the engine holds them (round_inputs=False with
    float64: the exact inputs, the algebra's check): rstd_h * (W' r + s * W' t), nothing of t, h, b rounded."""
    if round_inputs:
        r, o = bf16(r), bf16(o)
    r, o, w_out, w_ffn, router = (v.to(dtype) for v in (r, o, w_out, w_ffn, router))
    wp = router * w_ffn                                  # W': exact in fp32 for bf16 operands
    t = norm32(o, w_out, eps)
    h = r + s * t
    rstd_h = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return rstd_h * (r @ wp.T + s * (t @ wp.T))


def branch_logits(r: torch.Tensor, o: torch.Tensor, heads: torch.Tensor, w_out: torch.Tensor, w_ffn: torch.Tensor,
                  router: torch.Tensor, wo: torch.Tensor, s: float, eps: float, dtype: torch.dtype = torch.float32,
                  round_inputs: bool = True) -> torch.Tensor:
    """The branch form in `dtype`: rstd_h * (W' r + s * rstd_o * F a), F = W' diag(w_out) W_o (composed in float64,
    then held in `dtype`), a the heads [T, Nq * D]; the norms of o as the fold's (round_inputs: r, o, a in bf16)."""
    if round_inputs:
        r, o, heads = bf16(r), bf16(o), bf16(heads)
    wp64 = router.double() * w_ffn.double()
    f = ((wp64 * w_out.double()) @ wo.double()).to(dtype)
    r, o, heads, w_out, wp = (v.to(dtype) for v in (r, o, heads, w_out, wp64))
    rstd_o = torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    h = r + s * (o * rstd_o * w_out)
    rstd_h = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return rstd_h * (r @ wp.T + s * rstd_o * (heads @ f.T))


def branch_input(r: torch.Tensor, o: torch.Tensor, heads: torch.Tensor, w_out: torch.Tensor, w_ffn: torch.Tensor,
                 wo: torch.Tensor, s: float, eps: float):
    """What the branch form's fp32 logits evaluate, as qualification scores a router input (qualify/router.py
    `RouterInput`), from the engine's bf16 r, heads a and o-projection output y (the norms' source), in float64:
    b = w_ffn * rstd_h * (r + s * rstd_o * w_out * (W_o a)), with router @ b = the branch's logits; mag >= |b| term by
    term, F a's terms bounded through |W_o| |a| (|F_ek| <= sum_j |W'_ej w_out_j W_o_jk|); n = 2 max(H, K + 1) + 16
    roundings (qualify/router.py `fold_terms` with the longer of the two dots, F's own storage one more)."""
    from ..qualify.router import RouterInput

    r, y, a = (bf16(v).double() for v in (r, o, heads))
    w_out, w_ffn, wo = (v.double() for v in (w_out, w_ffn, wo))
    rstd_o = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    rstd_h = torch.rsqrt((r + s * y * rstd_o * w_out).pow(2).mean(-1, keepdim=True) + eps)
    b = w_ffn * rstd_h * (r + s * rstd_o * w_out * (a @ wo.T))
    mag = w_ffn.abs() * rstd_h * (r.abs() + abs(s) * rstd_o * w_out.abs() * (a.abs() @ wo.abs().T))
    return RouterInput(b, mag, 2 * max(r.shape[-1], a.shape[-1] + 1) + 16)


def swaps(model, i: int, inp: dict, logits: dict) -> dict:
    """Per variant (fold, branch): the rows whose fp32 routing differs from the reference's, and each one's
    qualification ratio (qualify/router.py `swap_ratio`: the reference's margin over the band its own exact input and
    fp32 rounding allow; <= 1 explained), as `iquest qualify` would score the router at this layer."""
    from ..fast.router_fold import exact_input
    from ..qualify.router import RouterInput, fold_terms, swap_ratio
    from ..reference.checkpoint import layer_prefix

    c, w, p = model.config, model.w, layer_prefix(i)
    s, eps, k = c.out_scales(i)[0], c.rms_norm_eps, c.num_experts_per_tok
    w_out, w_ffn, router, wo = (w[p + n] for n in ("attn_out_norm.weight", "feed_forward_norm.weight",
                                                    "mlp.router.weight", "self_attn.o_proj.weight"))
    y = bf16(inp["o"]).double()
    fold_b, fold_mag = exact_input(bf16(inp["r"]).double(), y, w_out, w_ffn, s, eps)
    inputs = {"fold": RouterInput(fold_b, fold_mag, fold_terms(fold_b.shape[-1])),
              "branch": branch_input(inp["r"], inp["o"], inp["heads"], w_out, w_ffn, wo, s, eps)}
    out = {}
    for name, fin in inputs.items():
        experts = route(logits[name], k)[1]
        ratios = [swap_ratio(router, RouterInput(fin.b[t], fin.mag[t], fin.terms), inp["b"][t], experts[t],
                             inp["experts"][t]) for t in range(experts.shape[0])]
        out[name] = [ratio for swapped, ratio in ratios if swapped]
    return out


def heads_recorded(model, forward):
    """forward() with every attention's heads output (reference.layers.attention's [R, Nq, D], in call order: the
    target's layers 0..L-1) kept as [R, Nq * D]: (forward's result, the list)."""
    from unittest import mock

    from ..reference import model as reference_model

    kept, real = [], reference_model.attention

    def keep(*args, **kwargs):
        out = real(*args, **kwargs)
        kept.append(out.reshape(out.shape[0], -1).clone())
        return out

    with mock.patch.object(reference_model, "attention", keep):
        return forward(), kept


def layer_inputs(model, tokens: list[int], taps: dict | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """One float64 forward over `tokens`; per MoE layer: the residual r, o (attn_out tap), the attention's heads
    before the o-projection, b (mlp_in tap), the reference's logits b @ W_r^T (what its _moe routes on), its experts
    and scores."""
    from .moe_taps import moe_layers

    w, taps, out = model.w, {} if taps is None else taps, {}
    layers, heads = heads_recorded(model, lambda: list(moe_layers(model, tokens, taps)))
    for i, p, x, a in layers:
        r = x if i == 0 else a  # what the layer's residual continues from (docs/model.md)
        b = taps[f"layer{i}.mlp_in"]
        out[i] = {"r": r, "o": taps[f"layer{i}.attn_out"], "heads": heads[i], "b": b,
                  "ref": b @ w[p + "mlp.router.weight"].T,
                  "experts": taps[f"layer{i}.experts"], "scores": taps[f"layer{i}.router_scores"]}
    return out


def logits_of(model, i: int, inp: dict[str, torch.Tensor]) -> dict:
    """Logits [T, E] of MoE layer i: ref (float64), path and fold (fp32, as the engine would route them), floor (the
    fold in float64 from the bf16 r, o: the error the inputs' rounding alone leaves), fold64 (the fold in float64
    from the exact inputs: equals ref but for float64 rounding, the algebra's check), branch (fp32, its o term from
    the heads through F) and branch64 (the branch in float64 from the exact inputs: F's algebra's check)."""
    from ..reference.checkpoint import layer_prefix

    c, w, p = model.config, model.w, layer_prefix(i)
    s = c.out_scales(i)[0]
    lw = (w[p + "attn_out_norm.weight"], w[p + "feed_forward_norm.weight"], w[p + "mlp.router.weight"])
    args = (inp["o"], *lw, s, c.rms_norm_eps)
    branch = (inp["r"], inp["o"], inp["heads"], *lw, w[p + "self_attn.o_proj.weight"], s, c.rms_norm_eps)
    return {"ref": inp["ref"], "path": path_logits(inp["r"], *args), "fold": fold_logits(inp["r"], *args),
            "floor": fold_logits(inp["r"], *args, dtype=torch.float64),
            "fold64": fold_logits(inp["r"], *args, dtype=torch.float64, round_inputs=False),
            "branch": branch_logits(*branch),
            "branch64": branch_logits(*branch, dtype=torch.float64, round_inputs=False)}


def compare(logits: dict[str, torch.Tensor], k: int) -> dict:
    """Per-position figures [T] of each variant against ref and of fold against path."""
    routed = {n: route(v, k) for n, v in logits.items()}  # softmax and top-k in each variant's dtype (fp32: engine)
    T, E = logits["ref"].shape
    dense = {n: torch.zeros(T, E, dtype=torch.float64).scatter_(1, e, wt.double()) for n, (wt, e, _) in routed.items()}
    sets = {n: torch.zeros(T, E, dtype=torch.bool).scatter_(1, e, True) for n, (_, e, _) in routed.items()}
    logits = {n: v.double() for n, v in logits.items()}
    srt = torch.sort(logits["ref"], dim=-1, descending=True).values
    out = {"scale": logits["ref"].abs().amax(-1), "gap": srt[:, k - 1] - srt[:, k] if k < E else srt[:, 0] * 0}
    for a, b in PAIRS:
        differs = (sets[a] != sets[b]).any(-1)
        out[f"{a}_vs_{b}"] = {"err": (logits[a] - logits[b]).abs().amax(-1), "differs": differs,
                              "weight_err": (dense[a] - dense[b]).abs().amax(-1)}
    return out


def summarize(rows: list[dict]) -> dict:
    """Figures over positions (concatenated `compare` outputs)."""
    scale = torch.cat([r["scale"] for r in rows])
    gap = torch.cat([r["gap"] for r in rows])
    out = {"positions": int(scale.numel()), "ref_logit_scale_median": float(scale.median())}
    for a, b in PAIRS:
        name = f"{a}_vs_{b}"
        err = torch.cat([r[name]["err"] for r in rows])
        rel = err / scale
        differs = torch.cat([r[name]["differs"] for r in rows])
        agree_w = torch.cat([r[name]["weight_err"] for r in rows])[~differs]
        out[name] = {"max_abs": float(err.max()), "median_abs": float(err.median()),
                     "max_rel": float(rel.max()), "median_rel": float(rel.median()),
                     "topk_set_differs": float(differs.double().mean()), "topk_set_differs_count": int(differs.sum()),
                     "ref_gap_at_flips_max": float(gap[differs].max()) if differs.any() else None,
                     "max_weight_err_agreeing": float(agree_w.max()) if agree_w.numel() else None}
    return out


def verdict(overall: dict) -> str:
    p, f, fp = overall["path_vs_ref"], overall["fold_vs_ref"], overall["fold_vs_path"]
    br, bf = overall["branch_vs_ref"], overall["branch_vs_fold"]
    closer = f["median_abs"] < p["median_abs"] and f["max_abs"] <= p["max_abs"]
    return (f"the fold is {'CLOSER to' if closer else 'NOT closer to'} the reference than the engine's path: median "
            f"|logit - ref| {f['median_abs']:.3g} (fold) vs {p['median_abs']:.3g} (path), max {f['max_abs']:.3g} vs "
            f"{p['max_abs']:.3g}; top-k set differs from ref at {f['topk_set_differs']:.2%} (fold) vs "
            f"{p['topk_set_differs']:.2%} (path) of positions, fold vs path at "
            f"{fp['topk_set_differs']:.2%}; the branch form (B = F a): median {br['median_abs']:.3g}, max "
            f"{br['max_abs']:.3g}, set differs from ref at {br['topk_set_differs']:.2%}, from the fold at "
            f"{bf['topk_set_differs']:.2%}")


def swap_summary(ratios: dict[str, list[float]]) -> dict:
    """Per variant: rows whose expert set differs from the reference's, the largest qualification ratio among them,
    and how many pass 1 (a swap the band does not explain)."""
    return {n: {"swapped_rows": len(r), "max_ratio": max(r) if r else None, "unexplained": sum(x > 1.0 for x in r)}
            for n, r in ratios.items()}


def run(model_dir: Path, n_prompts: int, progress=None) -> dict:
    """The report (JSON-ready)."""
    from tokenizers import Tokenizer

    from ..fixtures.fit_depth import replay_prompts
    from ..provenance import commit
    from ..reference.model import ReferenceModel

    say = progress or (lambda msg: None)
    model = ReferenceModel.load(model_dir)
    c = model.config
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prompts = replay_prompts(Path(model_dir), tok, n_prompts)
    layers = [i for i in range(c.num_hidden_layers) if not c.is_dense(i)]
    rows: dict[int, list[dict]] = {i: [] for i in layers}
    swapped: dict[int, dict[str, list[float]]] = {i: {"fold": [], "branch": []} for i in layers}
    t0 = time.time()
    for j, (_, _, ids) in enumerate(prompts):
        for i, inp in layer_inputs(model, list(ids)).items():
            logits = logits_of(model, i, inp)
            rows[i].append(compare(logits, c.num_experts_per_tok))
            for name, ratios in swaps(model, i, inp, logits).items():
                swapped[i][name] += ratios
        say(f"prompt {j + 1}/{len(prompts)}: {len(ids)} positions ({time.time() - t0:.0f} s)")
    per_layer = {str(i): dict(summarize(rows[i]), residual="x" if i == 0 else "a", attn_scale=c.out_scales(i)[0],
                              qualify_swaps=swap_summary(swapped[i])) for i in layers}
    every = {n: [x for i in layers for x in swapped[i][n]] for n in ("fold", "branch")}
    overall = dict(summarize([r for i in layers for r in rows[i]]), qualify_swaps=swap_summary(every))
    return {"commit": commit(), "model": str(model_dir), "engine": "reference (float64) taps; path/fold recomputed",
            "prompts": len(prompts), "positions": sum(len(ids) for _, _, ids in prompts), "positions_kind": "prefill",
            "experts": c.num_experts, "top_k": c.num_experts_per_tok, "moe_layers": layers,
            "variants": {"ref": "float64 b @ W_r^T (the reference's own)",
                         "path": "bf16 r, o; t, h, b rounded to bf16; fp32(b) @ fp32(W_r)^T",
                         "fold": "bf16 r, o; fp32 rstd_h * (W' r + s W' t), W' = W_r * w_ffn; t, h, b unrounded",
                         "floor": "the fold in float64 from bf16 r, o: what the inputs' bf16 rounding alone costs",
                         "fold64": "the fold in float64 from the exact r, o: the algebra's check (= ref)",
                         "branch": "the fold with B = F a: bf16 heads a, fp32 F = W' diag(w_out) W_o; norms of bf16 o",
                         "branch64": "the branch in float64 from the exact r, o, a: F's algebra's check (= ref)"},
            "per_layer": per_layer, "overall": overall, "verdict": verdict(overall)}


def table(report: dict) -> str:
    lines = [f"router fold vs engine path vs float64 ref: {report['prompts']} prompts, {report['positions']} "
             f"{report['positions_kind']} positions, E={report['experts']} K={report['top_k']}",
             f"{'layer':6s} {'pair':15s} {'max|d|':>9s} {'med|d|':>9s} {'max rel':>9s} {'med rel':>9s} "
             f"{'set diff':>9s} {'maxgap@flip':>11s} {'max|dw|':>9s}"]
    for name, fig in [*report["per_layer"].items(), ("all", report["overall"])]:
        for a, b in PAIRS:
            f = fig[f"{a}_vs_{b}"]
            gap = f"{f['ref_gap_at_flips_max']:.2e}" if f["ref_gap_at_flips_max"] is not None else "-"
            dw = f"{f['max_weight_err_agreeing']:.2e}" if f["max_weight_err_agreeing"] is not None else "-"
            lines.append(f"{name:6s} {a + ' vs ' + b:15s} {f['max_abs']:9.2e} {f['median_abs']:9.2e} "
                         f"{f['max_rel']:9.2e} {f['median_rel']:9.2e} {f['topk_set_differs']:9.4f} {gap:>11s} "
                         f"{dw:>9s}")
    for n, q in report["overall"]["qualify_swaps"].items():
        ratio = f"{q['max_ratio']:.3f}" if q["max_ratio"] is not None else "-"
        lines.append(f"qualification's router check ({n}): {q['swapped_rows']} rows swapped against the reference, "
                     f"largest margin/band {ratio}, {q['unexplained']} unexplained")
    lines.append("verdict: " + report["verdict"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..cli.engines import default_model_dir

    ap = argparse.ArgumentParser(prog="python -m iquest.lab.router_fold", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the shipped mini model)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    model = args.model or default_model_dir()
    report = run(model, args.prompts, progress=lambda m: print(m, file=sys.stderr))
    text = json.dumps(report, indent=1)
    args.out.write_text(text + "\n")
    print(table(json.loads(text)))
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
