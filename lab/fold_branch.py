"""The router fold's two terms off the layer's chain, measured before any engine plumbing (docs/PERF.md, "Open
directions": "The fold's two terms off the chain, on a side branch"). Lab only.

The fold's logits are rstd_h * (A + s * rstd_o * B), A = W' r and B = W' (w_out * y) (fast/router_fold.py). A needs
only the layer's residual r; with F = W' diag(w_out) W_o (fp32 [E, the rank's Hq * D], made once), B = F a needs only
the attention's output a. So both can run on a side stream while the attention and the o-projection run, and the
tail (kernels/route_tail.py) reads them whole, at T = 1. The chain piece at one TP8 rank's shapes and a 1K history,
from the q/k/v projection (its prologue and KV write in the launch) to the experts' choice, captured in seven arms and
replayed alternately:

  default  q/k/v -> attention (split, combine) -> o-projection (direct) -> add_norm -> router logits -> select
  fold     q/k/v -> attention -> the fold's o-projection (kernels/o_proj_router.py) -> add_norm_route (T column tiles)
  branch   [side: A into parts[0, 0]] q/k/v -> attention -> [side: B into parts[0, 1]] o-projection (direct) ->
           join -> add_norm_route (T = 1)
  chain_b  [side: A] q/k/v -> attention -> o-projection -> B = (W' w_out) y on the chain -> join -> add_norm_route
           (T = 1): B of the rounded y, as the fold's (its numerics), one launch more on the chain than branch
  branch1  branch with one expert a program (256 programs a term, not 64): more of W' and F in flight at once
  ideal    branch without its side launches (the tail reads the parts as they are): what the branch would give if its
           terms cost the chain nothing
  default' the default captured again: the A/A' arm, the noise of a pairing

The side's two launches are the router's logits kernel (kernels/router.py `split_logits`) at one H split, storing
straight into the tail's parts. Each "layer" has its own weights and cache (rotated past L2). The router's select
here asks L2 for nothing (`route` without `warm`), as the fold's tail; the engine's default does.

B from a is not the fold's B: it is an fp32 product of the unrounded o-projection, where the fold's is of the bf16 y.
The check prints both against torch and the gap between them (a numerical change the engine form would qualify).

    TRITON_INTERPRET=1 python -m iquest.lab.fold_branch --check   # small shapes: the terms and the tail's logits
    python -m iquest.lab.fold_branch --out FILE                   # on a GPU: the seven captured arms, paired
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton

from ..kernels import rmsnorm, route_tail, router
from ..reference.fp8 import dequantize

BLOCK_E, BLOCK_H, WARPS = 4, 512, 1  # RouterSettings' defaults: one warp on a [4, 512] fp32 tile


def terms_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, *, block_e: int = BLOCK_E) -> None:
    """out [R, E] fp32 (a view of parts[0, j]) = x [R, K] @ w [E, K]^T in fp32, one H split: the router's logits
    kernel, its one split's partials being the whole product. No PDL: the side stream follows an event."""
    R, K = x.shape
    E = w.shape[0]
    assert out.shape == (R, E) and out.is_contiguous() and w.is_contiguous() and x.stride(1) == 1
    splits, per_split = router.split_plan(K, 1, BLOCK_H)
    assert splits == 1
    router._router_logits_kernel[(triton.cdiv(E, block_e), 1)](
        x, w, out, E, K, x.stride(0), per_split, ROWS=R, ROWS_PAD=triton.next_power_of_2(R), BLOCK_E=block_e,
        BLOCK_H=BLOCK_H, num_warps=WARPS, PRELOAD=per_split == BLOCK_H)


def composed(router_w: torch.Tensor, w_out: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """F = W' diag(w_out) W_o, fp32 [E, K], from the dequantized o-projection W_o [H, K]."""
    return ((router_w.double() * w_out.double()) @ wo.double()).float().contiguous()



# ---- the CPU check (interpreter) ---------------------------------------------------------------------------------
def check(seed: int = 0, control: bool = False) -> int:
    """Small shapes: the two terms through the router's kernel against torch (A over three H tiles, the loop the
    probe's A runs; B in one, the preloading path), and the tail at T = 1 on them against route_tail's torch form.
    Prints each gap; exit 1 where a gap passes its bound. `control`: A's launch drops its last H tile, which the check
    must catch."""
    from ..kernels.testing import patch_interpreter

    patch_interpreter()  # NumPy >= 2.3 under Triton 3.6's interpreter
    g = torch.Generator().manual_seed(seed)
    R, H, K, E, top_k, eps, s = 3, 1280, 192, 16, 4, 1e-6, 0.5
    r = torch.randn((R, H), generator=g).to(torch.bfloat16)
    a = torch.randn((R, K), generator=g).to(torch.bfloat16)
    wo = torch.randn((H, K), generator=g) / K ** 0.5
    w_out, w_ffn = torch.rand(H, generator=g) + 0.5, torch.rand(H, generator=g) + 0.5
    rw = (torch.randn((E, H), generator=g) * 0.1 * w_ffn).contiguous()  # W' = router * w_ffn
    f = composed(rw, w_out, wo)
    y = (a.float() @ wo.T).to(torch.bfloat16)
    parts = torch.zeros((1, 2, R, E))
    if control:
        kept = H - H % BLOCK_H
        print(f"control: A from the first {kept} of {H} columns (its last H tile dropped)")
        terms_into(r[:, :kept].contiguous(), rw[:, :kept].contiguous(), parts[0, 0])
    else:
        terms_into(r, rw, parts[0, 0])
    terms_into(a, f, parts[0, 1])
    one = torch.zeros((R, E))
    terms_into(r, rw, one, block_e=1)  # branch1's launch: one expert a program
    gap_one = float((one.double() - r.double() @ rw.double().T).abs().max() / one.abs().max())
    chain = torch.zeros((R, E))
    terms_into(y, (rw * w_out).contiguous(), chain)  # chain_b's B: of the rounded y, through W' diag(w_out)
    want_a = r.double() @ rw.double().T
    want_b = a.double() @ f.double().T
    fold_b = (y.double() * w_out.double()) @ rw.double().T
    gap_a = float((parts[0, 0].double() - want_a).abs().max() / want_a.abs().max())
    gap_b = float((parts[0, 1].double() - want_b).abs().max() / want_b.abs().max())
    gap_fold = float((want_b - fold_b).abs().max() / want_b.abs().max())
    gap_chain = float((chain.double() - fold_b).abs().max() / fold_b.abs().max())
    h, b, weights, experts, scores = route_tail.add_norm_route(r, y, s, w_out.to(torch.bfloat16),
                                                                w_ffn.to(torch.bfloat16), eps, torch.bfloat16,
                                                                parts, top_k)
    want = route_tail.fold_logits_torch(r, y, s, w_out.to(torch.bfloat16), eps, parts)
    want_scores = torch.softmax(want, -1)
    gap_scores = float((scores - want_scores).abs().max())
    h0, b0 = rmsnorm.add_norm_torch(r, y, s, w_out.to(torch.bfloat16), w_ffn.to(torch.bfloat16), eps, torch.bfloat16)
    print(f"A = W' r: {gap_a:.3g} of max |A|; B = F a: {gap_b:.3g} of max |B|; chain_b's B against the fold's: "
          f"{gap_chain:.3g}; A at one expert a program: {gap_one:.3g}; the fold's B (bf16 y) against F a: "
          f"{gap_fold:.3g}; the tail's scores against torch: {gap_scores:.3g}; h, b as add_norm_torch's: "
          f"{float((h.float() - h0.float()).abs().max()):.3g}, {float((b.float() - b0.float()).abs().max()):.3g}")
    # fp32 rounding for every term and the tail; and the fold's B (of the rounded y) must differ from F a
    ok = max(gap_a, gap_b, gap_one, gap_chain, gap_scores) < 1e-5 and gap_fold > 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


# ---- the GPU probe -----------------------------------------------------------------------------------------------
class Layer:
    """One layer's inputs and weights, and its arms' chains as launches on the current stream."""

    def __init__(self, s, rows: int, qkv, attention, attn_scale: float, device, g):
        from ..bench.tune import _fp8_weight, _randn
        from ..kernels import fp8_linear_direct as fd

        H, K, E = s.hidden, s.q_heads * s.head_dim, s.experts
        self.s, self.rows, self.qkv, self.attention, self.attn_scale = s, rows, qkv, attention, attn_scale
        self.wq, self.wsc = _fp8_weight(H, K, s.block, g, device)
        self.direct = fd.direct_weight(self.wq)
        self.r = _randn((rows, H), g, device)
        self.w_out = (torch.rand(H, generator=g, device=device) + 0.5).to(torch.bfloat16)
        self.w_ffn = (torch.rand(H, generator=g, device=device) + 0.5).to(torch.bfloat16)
        router_w = torch.randn((E, H), generator=g, device=device) * 0.02
        self.router_w = router_w
        self.folded = (router_w * self.w_ffn.float()).contiguous()  # W'
        self.f = composed(self.folded, self.w_out.float(), dequantize(self.wq, self.wsc, s.block))
        self.g = (self.folded * self.w_out.float()).contiguous()  # W' diag(w_out), for B of y
        self.parts1 = torch.zeros((1, 2, rows, E), device=device)

    def _attend(self) -> torch.Tensor:
        self.qkv()  # its outputs are not the attention's inputs here: the chain's order is the stream's
        (out,) = self.attention()
        return out.view(self.rows, -1)

    def _o_proj(self, a):
        from ..fast.kernel_settings import KernelSettings
        from ..kernels import fp8_linear_direct as fd

        return fd.fp8_linear_direct(a, self.direct, self.wsc, self.s.block, out_dtype=torch.bfloat16, pdl=True,
                                    settings=KernelSettings().o_proj)

    def default(self):
        s = self.s
        y = self._o_proj(self._attend())
        h, b = rmsnorm.add_norm(self.r, y, self.attn_scale, self.w_out, self.w_ffn, s.eps, torch.bfloat16,
                                pdl=True)
        return router.route(b, self.router_w, s.top_k, pdl=True)

    def fold(self):
        from ..fast.kernel_settings import KernelSettings
        from ..kernels import o_proj_router

        s = self.s
        y, parts = o_proj_router.o_proj_router(self._attend(), self.wq, self.wsc, s.block, self.r, self.folded,
                                               self.w_out, pdl=True, settings=KernelSettings().o_proj,
                                               parts_settings=KernelSettings().o_proj_router)
        return route_tail.add_norm_route(self.r, y, self.attn_scale, self.w_out, self.w_ffn, s.eps, torch.bfloat16,
                                         parts, s.top_k, pdl=True)[2:]

    def chain_b(self, side):
        s, main = self.s, torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            terms_into(self.r, self.folded, self.parts1[0, 0])
        y = self._o_proj(self._attend())
        terms_into(y, self.g, self.parts1[0, 1])
        main.wait_stream(side)
        return route_tail.add_norm_route(self.r, y, self.attn_scale, self.w_out, self.w_ffn, s.eps, torch.bfloat16,
                                         self.parts1, s.top_k, pdl=True)[2:]

    def branch(self, side, block_e: int = BLOCK_E):
        """`side` None: the ideal arm, no side launches."""
        s, main = self.s, torch.cuda.current_stream()
        if side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                terms_into(self.r, self.folded, self.parts1[0, 0], block_e=block_e)
        a = self._attend()
        if side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                terms_into(a, self.f, self.parts1[0, 1], block_e=block_e)
        y = self._o_proj(a)
        if side is not None:
            main.wait_stream(side)
        return route_tail.add_norm_route(self.r, y, self.attn_scale, self.w_out, self.w_ffn, s.eps, torch.bfloat16,
                                         self.parts1, s.top_k, pdl=True)[2:]


def longest_kernel_path(kernel: dict[int, bool], edges: list[tuple[int, int]]) -> int:
    """The most kernel nodes (`kernel[node]` True) on one dependency path of a DAG given as edges (from, to)."""
    preds: dict[int, list[int]] = {v: [] for v in kernel}
    for a, b in edges:
        preds[b].append(a)
    depth: dict[int, int] = {}
    for v in kernel:  # iterative depth-first: a chain of thousands of nodes would pass Python's recursion limit
        stack = [v]
        while stack:
            u = stack[-1]
            todo = [p for p in preds[u] if p not in depth]
            if todo:
                stack += todo
                continue
            stack.pop()
            depth[u] = max((depth[p] for p in preds[u]), default=0) + kernel[u]
    return max(depth.values(), default=0)


def chain_kernels(graph: torch.cuda.CUDAGraph) -> int | str:
    """Kernels on the longest dependency path through a captured graph (kept: `keep_graph`), PDL edges included:
    the chain's dependent steps, the side's launches counting only where they lengthen it. An error's text where the
    driver's graph queries fail (cuda-python's signatures differ across versions)."""
    from cuda.bindings import driver as drv

    def ok(res):
        if res[0] != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(str(res[0]))
        return res[1:]

    try:
        g = drv.CUgraph(int(graph.raw_cuda_graph()))
        n = ok(drv.cuGraphGetNodes(g, 0))[-1]
        nodes = ok(drv.cuGraphGetNodes(g, n))[0][:n]
        get = getattr(drv, "cuGraphGetEdges_v2", drv.cuGraphGetEdges)  # with edge data: PDL edges carry some
        m = ok(get(g, 0))[-1]
        got = ok(get(g, m))
        frm, to = got[0][:m], got[1][:m]
        kernel = {int(v): ok(drv.cuGraphNodeGetType(v))[0] == drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
                  for v in nodes}
        return longest_kernel_path(kernel, [(int(a), int(b)) for a, b in zip(frm, to)])
    except Exception as e:  # noqa: BLE001
        return f"error: {e!r}"


def probe(layers: int, rows: int, context: int, repeats: int, device) -> dict:
    from ..bench.timing import replay_times
    from ..bench.tune import FULL_CONFIG, build, rank_shapes
    from ..reference.config import Config
    from ..fast.flow import destroy_stream, private_stream
    from ..fast.kernel_settings import KernelSettings

    s = rank_shapes(0)
    config = Config.from_file(FULL_CONFIG, FULL_CONFIG.with_name(FULL_CONFIG.stem + "-mtp.json"))
    attn_scale = config.out_scales(1)[0]  # the attention tail's scale at a MoE layer (s in h = r + s t)
    g = torch.Generator(device=device).manual_seed(0)
    qkv = build("qkv_rope_kv", s, rows, context, 0, device).calls(KernelSettings().qkv_rope_kv)
    att = build("attention_sliding", s, rows, context, 0, device).calls(KernelSettings().attention_sliding)
    stack = [Layer(s, rows, qkv[i % len(qkv)], att[i % len(att)], attn_scale, device, g) for i in range(layers)]
    side = private_stream(device)
    arms = {"default": lambda L: L.default(), "fold": lambda L: L.fold(), "branch": lambda L: L.branch(side),
            "chain_b": lambda L: L.chain_b(side), "branch1": lambda L: L.branch(side, block_e=1),
            "ideal": lambda L: L.branch(None),
            "default'": lambda L: L.default()}
    graphs, routing, steps = {}, {}, {}
    for name, arm in arms.items():
        for L in stack:  # eager first: compiles, and the routing to compare
            out = arm(L)
        torch.cuda.synchronize(device)
        routing[name] = [t.clone() for t in out]
        graph = torch.cuda.CUDAGraph(keep_graph=True)  # kept for chain_kernels; replay instantiates it
        with torch.cuda.graph(graph):
            for L in stack:
                arm(L)
        graphs[name] = graph
        steps[name] = chain_kernels(graph)
        graph.instantiate()
    times = {name: [] for name in arms}
    names = list(arms)
    for i in range(repeats):  # alternated: each repeat replays every arm once, in a rotating order
        for name in names[i % len(names):] + names[:i % len(names)]:
            times[name] += replay_times(graphs[name], layers, 1, warmup=1)
    del graphs  # no graph captured with the side stream may outlive it
    torch.cuda.synchronize(device)
    destroy_stream(side)
    med = {name: statistics.median(t) for name, t in times.items()}
    same = {name: bool(torch.equal(routing[name][1], routing["default"][1])) for name in arms}
    return {"layers": layers, "rows": rows, "context": context, "repeats": repeats,
            "device": torch.cuda.get_device_name(device), "us_a_layer": times, "median_us_a_layer": med,
            "against_default": {n: med[n] / med["default"] for n in arms},
            "experts_as_default": same,
            "chain_kernels_a_layer": {n: v / layers if isinstance(v, int) else v for n, v in steps.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="small shapes on the interpreter (TRITON_INTERPRET=1)")
    p.add_argument("--control", action="store_true", help="the check with A's last H tile dropped: must FAIL")
    p.add_argument("--layers", type=int, default=32, help="chain pieces a graph (default 32)")
    p.add_argument("--rows", type=int, default=6, help="rows a block (default 6: a verification at depth 5)")
    p.add_argument("--context", type=int, default=1024, help="history length (default 1024)")
    p.add_argument("--repeats", type=int, default=50, help="replays of each graph (default 50)")
    p.add_argument("--out", help="raw JSON here")
    a = p.parse_args(argv)
    if a.check or a.control:
        return check(control=a.control)
    if not torch.cuda.is_available():
        print("fold_branch: the probe needs a GPU (--check runs the interpreter's)", file=sys.stderr)
        return 2
    result = probe(a.layers, a.rows, a.context, a.repeats, torch.device("cuda"))
    for n, us in result["median_us_a_layer"].items():
        print(f"{n:8s} {us:8.2f} us a layer  {result['against_default'][n]:.4f}x default  "
              f"experts as default's: {result['experts_as_default'][n]}  "
              f"chain kernels a layer: {result['chain_kernels_a_layer'][n]}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
