"""How well can a MoE layer's experts be predicted before its attention finishes? (issue 52: expert L2 prefetch)

A prefetch side branch would warm the Gate/Up weights of the experts it predicts while the layer's attention runs;
the router's choice on b_i = feed_forward_norm(h_i) stays final. This probe measures, on CPU with the float64
reference (reference/model.py, its taps), the coverage of candidate predictors over held-out real-code prompts
(fixtures/fit_depth.replay_prompts) and a sampled continuation of each (the generation config's sampling, drafts
off). The continuation's routing is read from one forward over prompt + continuation: the reference is causal and
row by row exact, so a position's experts are those its decode step chose.

Predictors, each a ranked expert list at layer i and position t from what exists before layer i's attention ends:
  P1   router_i(a_i), a_i = attention_norm_i(x_i): the layer's normalized input, which the published forward makes
       first (it is also the residual of layers >= 1), so it is there when the layer starts
  P1f  router_i(a_i * feed_forward_norm_i.weight): P1 through the layer's own MLP norm weight (b_i as if the
       attention branch added nothing; RMS scaling does not change a ranking)
  P2   router_i(b_{i-1}): the previous layer's MLP input, one whole layer of lead time
  P3   the router's ranking at layer i one verification block earlier (position t - R; R = 1: the previous
       position, as a decode step has it; its top-K are that position's actual experts)
  P4   P1 and P3 merged round-robin (P1 first), duplicates dropped
  P0   the layer's experts by how often the router chose them over this whole run: a static list, in-sample
       (optimistic for it), the baseline a learned predictor must beat; chance is k'/E

coverage@k' = mean over positions of |top-k'(prediction) & actual top-K| / K, for k' = K, 1.5K, 2K, 3K (8, 12, 16,
24 at the published K = 8) and E (every expert: 1.0 by construction). Live rows: a verification block of R
consecutive rows needs the union of its rows' experts; the prefetch warms the union of their top-k' predictions
(P3: the rows of the previous block). Reported: the fraction of needed experts warmed, the experts warmed and
needed (the bytes: one expert's Gate/Up each), averaged over every block start.

Caveat: the shipped mini model (E = 16, K = 4, three MoE layers) is small and trained briefly, so its coverage is a
proxy for the published model's (E = 256, K = 8, 87 MoE layers); those weights are not available here. Chance
coverage is k'/E: 0.5 at k' = 2K on the mini model but 0.0625 on the published one, so compare predictors by how
far they lift coverage above chance, not by the raw figures.

    python -m iquest.lab.expert_prediction --model DIR --prompts N --out FILE [--decode T]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

CAVEAT = ("the mini model is small (E=16, K=4, 3 MoE layers) and trained briefly: its coverage is a proxy for the "
          "published model's (E=256, K=8); the published weights are not available here. Chance coverage is k'/E")
K_MULTIPLES = (1.0, 1.5, 2.0, 3.0)  # k' = 8, 12, 16, 24 at the published K = 8
ROWS = (1, 4, 5, 8)
PREDICTORS = {
    "P0": "static: the layer's experts by how often the router chose them in this run (in-sample)",
    "P1": "router_i(attention_norm_i(x_i)): the layer's normalized input",
    "P1f": "router_i(attention_norm_i(x_i) * feed_forward_norm_i.weight)",
    "P2": "router_i(b_{i-1}): the previous layer's MLP input (one layer of lead time)",
    "P3": "the router's ranking at layer i, R rows earlier (R=1: the previous position)",
    "P4": "P1 and P3 merged round-robin (P1 first), duplicates dropped",
}


def k_primes(k: int, e: int) -> list[int]:
    return sorted({min(e, round(m * k)) for m in K_MULTIPLES} | {e})


def ranked(logits: torch.Tensor) -> torch.Tensor:
    """[T, E] expert ids by descending logit, ties to the lower id (as reference.layers.route orders them)."""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices


def merged(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Round-robin merge of two rankings [T, E] (first, second, first, ...), each expert at its earliest place."""
    place = torch.empty_like(first)
    slots = torch.arange(first.shape[1], device=first.device).expand_as(first)
    key = torch.minimum(place.scatter(1, first, 2 * slots), place.scatter(1, second, 2 * slots + 1))
    return torch.sort(key, dim=-1).indices


def trace(model, tokens: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """One forward over `tokens` (positions 0..T-1): per MoE layer i, the actual experts [T, K] (the model's own
    routing, its `experts` tap), the router's ranking [T, E] at each position ("now") and the rankings of P1, P1f,
    P2 (P2 absent at layer 0)."""
    from .moe_taps import moe_layers

    w, taps, out = model.w, {}, {}
    for i, p, x, a in moe_layers(model, tokens, taps):
        router = w[p + "mlp.router.weight"]
        layer = {"actual": taps[f"layer{i}.experts"], "now": ranked(taps[f"layer{i}.router_scores"]),
                 "P1": ranked(a @ router.T), "P1f": ranked((a * w[p + "feed_forward_norm.weight"]) @ router.T)}
        if i > 0:
            layer["P2"] = ranked(taps[f"layer{i - 1}.mlp_in"] @ router.T)
        out[i] = layer
    return out


def top_mask(order: torch.Tensor, k: int) -> torch.Tensor:
    return torch.zeros(order.shape, dtype=torch.bool).scatter_(1, order[:, :k], True)


def block_union(mask: torch.Tensor, rows: int) -> torch.Tensor:
    """[T, E] -> [T - rows + 1, E]: the union over rows s..s+rows-1 for every start s."""
    return mask.unfold(0, rows, 1).any(-1)


def block_stats(orders: dict[str, torch.Tensor], actual: torch.Tensor, rows: int, k: int,
                first: int) -> dict[str, torch.Tensor]:
    """For blocks of `rows` rows starting at s = first..T-rows: per predictor, (hits, warmed) [blocks] and the needed
    count [blocks]. orders[name] [T, E] is row t's ranking; P3's ranking for row t is orders["now"][t - rows]."""
    T, E = orders["now"].shape
    need = block_union(torch.zeros(T, E, dtype=torch.bool).scatter_(1, actual, True), rows)[first:]
    lagged = torch.cat([orders["now"][:1].expand(rows, E), orders["now"][:T - rows]])  # rows < first are unused
    preds = {n: o for n, o in orders.items() if n not in ("now", "actual")}
    preds["P3"] = lagged
    preds["P4"] = merged(orders["P1"], lagged)
    out = {"needed": need.sum(1)}
    for name, order in preds.items():
        warm = block_union(top_mask(order, k), rows)[first:]
        out[name] = torch.stack([(warm & need).sum(1), warm.sum(1)])
    return out


class Tally:
    """Sums over blocks per (subset, R, layer, predictor, k'): hit fraction, warmed, needed, blocks."""

    def __init__(self):
        self.sums: dict[tuple, list[float]] = {}

    def add(self, key: tuple, hits: torch.Tensor, warmed: torch.Tensor, needed: torch.Tensor) -> None:
        s = self.sums.setdefault(key, [0.0, 0.0, 0.0, 0])
        s[0] += float((hits / needed).sum())
        s[1] += float(warmed.sum())
        s[2] += float(needed.sum())
        s[3] += hits.numel()

    def means(self, key: tuple) -> dict[str, float] | None:
        s = self.sums.get(key)
        if not s or not s[3]:
            return None
        return {"warmed_fraction": s[0] / s[3], "warmed": s[1] / s[3], "needed": s[2] / s[3], "blocks": s[3]}


def measure(traces: list[dict], top_k: int, experts: int, layer_types: dict[int, str]) -> dict:
    """traces: per sequence {"layers": trace(...), "prompt": its prompt length, "tokens": its tokens}. Blocks start
    at s >= R (P3 needs the block before) and are tallied under "all", and under "prompt" / "decoded" when every row
    is of that kind."""
    counts = {i: torch.zeros(experts, dtype=torch.float64) for i in layer_types}
    for tr in traces:
        for i, layer in tr["layers"].items():
            counts[i] += torch.bincount(layer["actual"].flatten(), minlength=experts).double()
    static = {i: torch.sort(-counts[i], stable=True).indices for i in layer_types}
    ks, tally = k_primes(top_k, experts), Tally()
    for tr in traces:
        n_prompt = tr["prompt"]
        for i, layer in tr["layers"].items():
            T = layer["actual"].shape[0]
            orders = dict(layer, P0=static[i].expand(T, experts))
            for R in ROWS:
                if T < 2 * R:
                    continue
                starts = torch.arange(R, T - R + 1)
                kinds = {"all": slice(None), "prompt": starts + R <= n_prompt, "decoded": starts >= n_prompt}
                for k in ks:
                    st = block_stats(orders, layer["actual"], R, k, R)
                    for name in PREDICTORS:
                        if name in st:
                            for kind, sel in kinds.items():
                                tally.add((kind, R, i, name, k), st[name][0][sel], st[name][1][sel],
                                          st["needed"][sel])
    result: dict = {}
    for kind in ("all", "prompt", "decoded"):
        cov, live = {}, {}
        for name in PREDICTORS:
            per = {i: {k: tally.means((kind, 1, i, name, k)) for k in ks} for i in layer_types}
            per = {i: v for i, v in per.items() if all(v.values())}
            if not per:
                continue
            cov[name] = {str(i): {str(k): v[k]["warmed_fraction"] for k in ks} for i, v in per.items()}
            cov[name]["mean"] = {str(k): sum(v[k]["warmed_fraction"] for v in per.values()) / len(per) for k in ks}
            live[name] = {}
            for R in ROWS:
                rows = {i: {k: tally.means((kind, R, i, name, k)) for k in ks} for i in per}
                rows = {i: v for i, v in rows.items() if all(v.values())}
                if rows:
                    entry = {str(i): {str(k): v[k] for k in ks} for i, v in rows.items()}
                    entry["mean"] = {str(k): {f: sum(v[k][f] for v in rows.values()) / len(rows)
                                              for f in ("warmed_fraction", "warmed", "needed")} for k in ks}
                    live[name][str(R)] = entry
        result[kind] = {"coverage": cov, "live_rows": live,
                        "positions": tally.sums.get((kind, 1, next(iter(layer_types)), "P1", ks[0]), [0] * 4)[3]}
    return result


def run(model_dir: Path, n_prompts: int, decode: int, seed: int = 0, progress=None) -> tuple[dict, list]:
    """The report (JSON-ready) and the traces it was computed from (see `measure`)."""
    from tokenizers import Tokenizer

    from ..fixtures.fit_depth import replay_prompts
    from ..provenance import commit
    from ..reference.config import GenerationConfig
    from ..reference.model import ReferenceModel
    from ..reference.sampling import SamplingParams
    from ..reference.speculative import generate

    say = progress or (lambda msg: None)
    model = ReferenceModel.load(model_dir)
    c = model.config
    gen = GenerationConfig.from_dir(model_dir, c)
    params = SamplingParams(gen.temperature, gen.top_k, gen.top_p)
    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    prompts = replay_prompts(Path(model_dir), tok, n_prompts)
    traces, t0 = [], time.time()
    for j, (_, _, ids) in enumerate(prompts):
        cont = [t for s in generate(model, ids, seed=seed + j, params=params, max_new_tokens=decode, drafts=0,
                                    stop_ids=tuple(gen.eos_token_id)) for t in s.tokens] if decode else []
        tokens = list(ids) + cont
        traces.append({"layers": trace(model, tokens), "prompt": len(ids), "tokens": tokens})
        say(f"prompt {j + 1}/{len(prompts)}: {len(ids)} + {len(cont)} positions ({time.time() - t0:.0f} s)")
    E, K = c.num_experts, c.num_experts_per_tok
    layer_types = {i: c.layer_type(i) for i in range(c.num_hidden_layers) if not c.is_dense(i)}
    figures = measure(traces, K, E, layer_types)
    for fig in figures.values():  # the share of the gap from chance to full coverage closed: comparable across E
        fig["coverage_above_chance"] = {name: {k: (v - int(k) / E) / (1 - int(k) / E) for k, v in cov["mean"].items()
                                               if int(k) < E} for name, cov in fig["coverage"].items()}
    report = {
        "commit": commit(), "model": str(model_dir), "caveat": CAVEAT, "engine": "reference (float64)",
        "prompts": len(prompts), "decode": {"tokens": decode, "seed": seed, "sampling": vars(params), "drafts": 0},
        "positions": {"prompt": sum(tr["prompt"] for tr in traces),
                      "decoded": sum(len(tr["tokens"]) - tr["prompt"] for tr in traces)},
        "experts": E, "top_k": K, "k_prime": k_primes(K, E), "k_prime_over_K": [k / K for k in k_primes(K, E)],
        "chance": {str(k): k / E for k in k_primes(K, E)}, "rows": list(ROWS), "layers": layer_types,
        "predictors": PREDICTORS, "figures": figures,
    }
    return report, traces


def table(report: dict) -> str:
    """The printed summary of a report as its JSON file holds it."""
    K, E, ks = report["top_k"], report["experts"], report["k_prime"]
    fig = report["figures"]
    lines = [f"coverage@k' (mean over MoE layers {list(report['layers'])}; chance k'/E), all positions:",
             "pred  " + "".join(f"  @{k:<3d}({k / K:g}K)" for k in ks)]
    lines.append("chance" + "".join(f"  {report['chance'][str(k)]:10.3f}" for k in ks))
    for name, cov in fig["all"]["coverage"].items():
        lines.append(f"{name:6s}" + "".join(f"  {cov['mean'][str(k)]:10.3f}" for k in ks))
    k2 = min(E, 2 * K)
    lines.append(f"coverage@{K} / @{k2} per layer, and by position kind (mean over layers):")
    lines.append("pred  " + "".join(f"  {'L' + i + ' ' + t[:4]:>11s}" for i, t in report["layers"].items())
                 + "".join(f"  {kind:>11s}" for kind in ("prompt", "decoded")))
    for name, cov in fig["all"]["coverage"].items():
        per = [cov.get(i) for i in report["layers"]]
        per += [fig[kind]["coverage"].get(name, {}).get("mean") for kind in ("prompt", "decoded")]
        lines.append(f"{name:6s}" + "".join(f"  {c[str(K)]:.3f}/{c[str(k2)]:.3f}" if c else f"  {'-':>11s}"
                                            for c in per))
    lines.append("live rows: warmed fraction / experts warmed (mean over layers), each row's top-k' predicted")
    for R in (4, 5):
        for k in ks[:3]:
            live = fig["all"]["live_rows"]
            cells = [f"{n} {e[str(R)]['mean'][str(k)]['warmed_fraction']:.2f}/{e[str(R)]['mean'][str(k)]['warmed']:.1f}"
                     for n, e in live.items() if str(R) in e]
            need = next(iter(live.values()))[str(R)]["mean"][str(k)]["needed"]
            lines.append(f"R={R} k'={k:<3d} needed {need:4.1f}: " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from ..cli.engines import default_model_dir

    ap = argparse.ArgumentParser(prog="python -m iquest.lab.expert_prediction", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the shipped mini model)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--decode", type=int, default=32, help="sampled continuation tokens per prompt (0: prefill only)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    model = args.model or default_model_dir()
    report, _ = run(model, args.prompts, args.decode, args.seed, progress=lambda m: print(m, file=sys.stderr))
    text = json.dumps(report, indent=1)
    args.out.write_text(text + "\n")
    print(table(json.loads(text)))  # the file's form: string keys
    print(f"caveat: {CAVEAT}\n{args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
