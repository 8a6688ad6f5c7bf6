"""Router ties in the draft layer: when may the fast engine's MTP experts differ from the reference's?

The draft layer is one decoder layer, so its output h' is mostly that layer's MoE output: one expert swapped
at a router tie moves h' by a sizeable fraction of its scale (GPU, bf16: 0.394 at a log-score margin of 3e-4,
where the same row under the engine's experts is within 0.009). A swap is a rounding event, not a defect,
only if the engine's own input could have produced it. Both engines compute logits l = W b from their MoE
input b (the normalized residual): the engine from b_f, the reference from b_r. If the engine chose expert x
and not y while the reference ranks y above x by m = l_r[y] - l_r[x] >= 0, then

    (l_f[x] - l_f[y]) - (l_r[x] - l_r[y]) = (w_x - w_y) . (b_f - b_r) + (the engine's rounding of both)

and the engine ranking x first needs m <= band = |(w_x - w_y) . (b_f - b_r)| + rho, with rho the fp32
rounding bound of two length-H dot products, gamma_H * sum_j (|w_xj| + |w_yj|) |b_fj| (Higham, Thm 3.1;
gamma_H = H u / (1 - H u), u = 2^-24), plus 8u for the engine's fp32 softmax and selection (log-score).
Every pair (x chosen by the engine only, y chosen by the reference only) must satisfy it; the row's value is
max m / band (<= 1: explained). An explained row is then held to its usual tolerances against the reference
recomputed with the engine's experts, so the rest of the layer is still checked at rounding level.

The router fold (EngineOptions.router_fold, fast/router_fold.py) computes its logits without the rounded b: they are
an fp32 evaluation of w b_fold, b_fold the float64 normalized h of the engine's own r and o (its tap router_in). Both
checks then use b_fold as the engine's input, and its rounding band grows with what the fold evaluates: two length-H
dot products of W' = w * w_ffn (H + 2 roundings a term), two inverse norms (each a sum of H squares, a division, a
square root: within gamma_{H+4} relative) and the products joining them. The band is gamma_n sum_j |w_ej| mag_j with
n = 2H + 16 and mag the tap router_in_bound, w_ffn * rstd_h * (|r| + |s t|) >= |b_fold| (`fold_terms`): the two
products' terms bounded term by term, and the inverse norms' relative errors times |l_e| <= sum_j |w_ej| mag_j. It
assumes h's sum of squares is not cancelled away (|h| not far below |r| + |s t|), as in every row measured.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

U32 = 2.0 ** -24


class RouterInput(NamedTuple):
    """The engine's router input for one row at one MoE layer: b (its MoE input, or the fold's b_fold), mag >= |b| term
    by term, and the number of fp32 roundings n its logits' band counts (gamma_n)."""

    b: torch.Tensor
    mag: torch.Tensor
    terms: int


def fold_terms(hidden: int) -> int:
    return 2 * hidden + 16


def router_input(taps: dict, prefix: str, i: int) -> RouterInput:
    """Row i's router input at the MoE layer of tap prefix `prefix` ("layer3.", "mtp."): the fold's exact input where
    the engine folded routing (taps router_in, router_in_bound), else its MoE input mlp_in."""
    if prefix + "router_in" in taps:
        b = taps[prefix + "router_in"][i]
        return RouterInput(b, taps[prefix + "router_in_bound"][i], fold_terms(b.shape[-1]))
    return plain_input(taps[prefix + "mlp_in"][i])


def plain_input(b: torch.Tensor) -> RouterInput:
    """The router's own fp32 product of its input b: n = H roundings a term, mag = |b|."""
    return RouterInput(b, b.abs(), b.shape[-1])


def _gamma(n: int) -> float:
    return n * U32 / (1 - n * U32)


def swap_ratio(w: torch.Tensor, fast_in: RouterInput, b_ref: torch.Tensor, fast_experts: torch.Tensor,
               ref_experts: torch.Tensor) -> tuple[bool, float]:
    """(swapped, max m / band over the swapped pairs) for one row; (False, 0.0) when the expert sets agree.

    w [E, H] router weight, fast_in the engine's router input (`router_input`), b_ref [H] the reference's MoE input,
    *_experts [k] chosen experts."""
    fast, ref = set(fast_experts.tolist()), set(ref_experts.tolist())
    if fast == ref:
        return False, 0.0
    w, bf, br, mag = w.double(), fast_in.b.double(), b_ref.double(), fast_in.mag.double()
    gamma = _gamma(fast_in.terms)
    l_ref = w @ br
    worst = 0.0
    for x in fast - ref:
        for y in ref - fast:
            m = float(l_ref[y] - l_ref[x])
            d = w[x] - w[y]
            band = abs(float(d @ (bf - br))) + gamma * float((w[x].abs() + w[y].abs()) @ mag) + 8 * U32
            worst = max(worst, max(m, 0.0) / band)
    return True, worst


def scores_error(w: torch.Tensor, fast_in: RouterInput, scores: torch.Tensor, experts: torch.Tensor,
                 w_abs: torch.Tensor | None = None) -> tuple[float, str]:
    """numerics.router_scores of one row at one MoE layer: the engine's router on the engine's own input.

    w [E, H] the stored router (exact in fp32), fast_in the engine's router input b [H] (`router_input`: its tap mlp_in,
    a compute-dtype value exact in fp32, or the fold's b_fold), scores [E] the engine's softmax scores, experts [k] its
    chosen experts. The exact scores are s = softmax(w b) in float64. The engine's fp32 logits differ from w b by at
    most rho_e = gamma_n sum_j |w_ej| mag_j (Higham, Thm 3.1, with n = H and mag = |b| for the router's own product of
    fp32 values; the fold's n and mag above), which moves ln s_e by at most 2 max_e rho_e; its fp32 softmax adds
    at most u (|t_e| + max_e |t_e| + E + 9), t_e = l_e - max l (the shift's rounding, a sum of E terms, exp to within 2
    ulps, the division). The value is max_e |ln s_fast_e - ln s_e| / that bound (<= 1: the engine's router is an fp32
    product of its own input and the stored router, as docs/model.md says); the chosen experts must also be the top k
    of the engine's own scores (ties: the lower index), else the value is inf. Entries whose exact score is below 1e-30
    are compared only for having underflowed on both sides. `w_abs`: |w|, where the caller holds it (one per router,
    not one per row)."""
    w, b, s_fast = w.double(), fast_in.b.double(), scores.double()
    logits = w @ b
    exact = torch.softmax(logits, -1)
    rho = _gamma(fast_in.terms) * float((((w.abs() if w_abs is None else w_abs) @ fast_in.mag.double())).max())
    t = (logits - logits.max()).abs()
    bound = 2 * rho + U32 * (t + float(t.max()) + w.shape[0] + 9)
    k = experts.numel()
    own, chosen = torch.sort(s_fast, descending=True, stable=True).indices[:k].tolist(), experts.tolist()
    if own != chosen:
        return float("inf"), f"chosen experts {chosen} are not the top {k} of the engine's own scores ({own})"
    big = exact > 1e-30
    if bool(((~big) & (s_fast > 1e-28)).any()):
        return float("inf"), "an expert whose exact score underflows has a sizeable score in the engine"
    ratio = (torch.log(s_fast[big]) - torch.log(exact[big])).abs() / bound[big]
    worst = int(ratio.argmax())
    e = int(big.nonzero()[worst])
    return float(ratio[worst]), f"expert {e}: score {float(s_fast[e]):.9g} vs exact {float(exact[e]):.9g}"
