"""GPU: what a decode round of each variant holds (kernel nodes, conditional nodes, per graph level) and costs (decode
time per round, paired over held-out prompts with rotated order): fixed depth 3, the product's controller, the product
with the rule's torch form, and the ablations of lab/depth_probe/mend.py. Lab only."""
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from iquest.fast.engine import FastEngine
from iquest.fast.flow import EagerFlow
from iquest.fast.graphs import capture_decode_loop
from iquest.reference.depth import FixedDepth, load_controller
from iquest.reference.sampling import SamplingParams
from iquest.lab.depth_probe.mend import ProbeRunner

MODEL = Path(__file__).resolve().parents[2] / "fixtures" / "iquest-q1-mini"
VARIANTS = ["fixed3", "auto", "torch_rule", "nodes3", "ops3"]


def capture(st, runner, device):
    """fast/graphs.capture_decode_loop, its graph kept for inspection (census reads its nodes)."""
    real = torch.cuda.CUDAGraph

    def kept():
        try:
            return real(keep_graph=True)
        except TypeError:  # a torch without keep_graph
            return real()

    with mock.patch.object(torch.cuda, "CUDAGraph", kept):
        return capture_decode_loop(st, runner, device)


def census(graph):
    """Node types per graph level: {'top': {...}, 'while': {...}, 'if@1': ...} (recursive through conditionals)."""
    from cuda.bindings import driver as drv
    try:
        raw = graph.raw_cuda_graph()
    except Exception as e:  # noqa: BLE001
        return {"error": repr(e)}
    out = []

    def walk(g, label, depth):
        err, nodes, n = drv.cuGraphGetNodes(drv.CUgraph(int(g) if not isinstance(g, drv.CUgraph) else g), 0)
        err, nodes, n = drv.cuGraphGetNodes(g if isinstance(g, drv.CUgraph) else drv.CUgraph(int(g)), n)
        counts = {}
        kids = []
        for node in nodes[:n]:
            err, t = drv.cuGraphNodeGetType(node)
            name = str(t).split(".")[-1].replace("CU_GRAPH_NODE_TYPE_", "").lower()
            counts[name] = counts.get(name, 0) + 1
            if name == "conditional":
                err, p = drv.cuGraphNodeGetParams(node)
                kids.append((p.conditional.phGraph_out[0], str(p.conditional.type).split(".")[-1]))
        out.append({"level": label, "depth": depth, **counts})
        for i, (kg, kind) in enumerate(kids):
            walk(kg, f"{label}/{kind.replace('CU_GRAPH_COND_TYPE_', '').lower()}{i}", depth + 1)
    try:
        walk(drv.CUgraph(int(raw)), "top", 0)
    except Exception as e:  # noqa: BLE001
        out.append({"error": repr(e)})
    return out


def main(prompts=16, tokens=64, repeats=2):
    device = os.environ.get("PROBE_DEVICE", "cuda")
    eng = FastEngine.load(MODEL, device=device)
    rank, gen = eng.rank0, eng.generation
    dev = rank.par.device
    params, stop = SamplingParams(gen.temperature, gen.top_k, gen.top_p), tuple(gen.eos_token_id)
    from iquest.bench.depth import held_out
    from tokenizers import Tokenizer
    chosen, _ = held_out(MODEL, Tokenizer.from_file(str(MODEL / "tokenizer.json")), prompts)
    key = ("auto", gen.top_k, 0)
    built, report = {}, {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "census": {}}
    for v in VARIANTS:
        ctl = FixedDepth(3) if v in ("fixed3", "nodes3", "ops3") else load_controller(MODEL)
        r = ProbeRunner(rank.model, rank.state, gen.top_k, ctl, EagerFlow(),
                        variant="product" if v in ("fixed3", "auto") else v)
        g = capture(rank.state, r, dev) if dev.type == "cuda" else None
        built[v] = (r, g)
        report["census"][v] = census(g.graph) if g is not None else None
        print(v, json.dumps(report["census"][v]), flush=True)

    def decode(v, ids, seed):
        rank._runners[key] = built[v]
        steps = eng.generate(ids, seed=seed, params=params, max_new_tokens=tokens, drafts="auto", stop_ids=stop)
        first = next(steps)
        t0 = time.perf_counter()
        rest = list(steps)
        sec = time.perf_counter() - t0
        return sec, sum(len(s.tokens) for s in rest), len(rest), sum(s.drafts for s in rest), \
            [t for s in [first, *rest] for t in s.tokens]

    for v in VARIANTS:  # warm
        decode(v, chosen[0][2], 0)
    tot = {v: [0.0, 0, 0, 0] for v in VARIANTS}
    ids_of = {v: [] for v in VARIANTS}
    unit = 0
    for r in range(repeats):
        for i, (_, _, ids) in enumerate(chosen):
            order = VARIANTS[unit % len(VARIANTS):] + VARIANTS[:unit % len(VARIANTS)]
            for v in order:
                sec, n, rounds, drafts, toks = decode(v, ids, 1000 + unit)
                t = tot[v]
                t[0] += sec; t[1] += n; t[2] += rounds; t[3] += drafts
                ids_of[v].append(toks)
            unit += 1
    print(f"{'variant':8s} {'TPOT us':>8s} {'us/round':>9s} {'tok/rnd':>8s} {'drafts/rnd':>10s}  same tokens as")
    for v in VARIANTS:
        s, n, rounds, d = tot[v]
        same = [w for w in VARIANTS if w != v and ids_of[w] == ids_of[v]]
        print(f"{v:8s} {1e6 * s / n:8.1f} {1e6 * s / rounds:9.1f} {n / rounds:8.3f} {d / rounds:10.2f}  {same}")
        report[v] = {"tpot_us": 1e6 * s / n, "us_per_round": 1e6 * s / rounds, "tokens": n, "rounds": rounds,
                     "drafts": d, "same_tokens_as": same}
    fa = sum(a == b for a, b in zip(ids_of["torch_rule"], ids_of["auto"]))
    print(f"torch_rule == auto tokens in {fa}/{len(ids_of['auto'])} units")
    out = os.environ.get("OUT", "/tmp")
    Path(out, "gpu_bench.json").write_text(json.dumps(report, indent=1))
    eng.close()


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:]))
