"""Live-row helpers of the MoE kernels: `load_live` (in a kernel), `check_live` (in a wrapper), the pair
capacity MAX_PAIRS of one moe call, and the routing plan (`moe_plan`): which distinct experts the live rows chose
and which of their rows, computed once per call so that the weight-streaming programs read their expert and rows
with one load instead of each deduplicating the routing for itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_options, wait_for_inputs

MAX_PAIRS = 128  # R * k a moe call takes (its programs' pair vectors); TritonOps splits longer blocks


@triton.jit
def load_live(live_ptr, rows, R, LIVE_COUNT: tl.constexpr):
    """Liveness of `rows`: a bool/uint8 mask [R], or (LIVE_COUNT) rows < a device int count."""
    if LIVE_COUNT:
        n = tl.load(live_ptr).to(tl.int32)
        return rows < n
    return tl.load(live_ptr + rows, mask=rows < R, other=0) != 0


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"moe: {message}")


def check_live(live: torch.Tensor, R: int, device: torch.device) -> bool:
    """Validates `live` (bool [R] mask, or an integer count of leading live rows: 0-d or [1]);
    returns True when it is a count."""
    _check(live.device == device, f"live is on {live.device}, experts on {device}")
    if live.dtype == torch.bool:
        _check(tuple(live.shape) == (R,) and live.is_contiguous(), f"live mask must be [{R}], got {tuple(live.shape)}")
        return False
    _check(live.dtype in (torch.int32, torch.int64) and live.numel() == 1,
           f"live must be a bool mask [{R}] or one int32/int64 count, got {live.dtype} {tuple(live.shape)}")
    return True


# ---- the routing plan: which programs stream which expert, computed once per moe call ----------------------------
@triton.jit
def _moe_plan_kernel(experts_ptr, live_ptr, plan_ptr, R, P,
                     K_TOP: tl.constexpr, K_PAD: tl.constexpr, P_PAD: tl.constexpr, R_PAD: tl.constexpr,
                     LIVE_COUNT: tl.constexpr, DEDUP: tl.constexpr, PDL: tl.constexpr = False):
    """One program: plan = [count, expert[P], owner pair[P], pairs[P, R]]. The d-th distinct expert chosen by a live
    row (in row-major order of its first live pair, its owner) is expert[d]; pairs[d, r] is row r's pair r * k + j
    with experts[r, j] == expert[d] when row r is live, else -1 (a row's experts are distinct: one slot at most).
    DEDUP = False (tests' negative control): every live pair is an entry of its own, repeats included."""
    wait_for_inputs(PDL)
    p = tl.arange(0, P_PAD)
    p_ok = p < P
    e = tl.load(experts_ptr + p, mask=p_ok, other=-1).to(tl.int32)
    live_p = load_live(live_ptr, p // K_TOP, R, LIVE_COUNT) & p_ok
    owner = live_p
    if DEDUP:  # an earlier live pair with the same expert owns it
        same = (e[None, :] == e[:, None]) & (p[None, :] < p[:, None]) & live_p[None, :]
        owner = live_p & (tl.sum(same.to(tl.int32), axis=1) == 0)
    own = owner.to(tl.int32)
    d = tl.cumsum(own, axis=0) - own  # the owner's entry: owners before it
    tl.store(plan_ptr + 1 + d, e, mask=owner)
    tl.store(plan_ptr + 1 + P + d, p, mask=owner)
    r = tl.arange(0, R_PAD)
    j = tl.arange(0, K_PAD)
    ex = tl.load(experts_ptr + r[:, None] * K_TOP + j[None, :], mask=(r < R)[:, None] & (j < K_TOP)[None, :],
                 other=-1).to(tl.int32)
    hit = ex[None, :, :] == e[:, None, None]  # [pair, row, slot]
    chose = (tl.sum(hit.to(tl.int32), axis=2) > 0) & load_live(live_ptr, r, R, LIVE_COUNT)[None, :]
    pairs = tl.where(chose, r[None, :] * K_TOP + tl.sum(tl.where(hit, j[None, None, :], 0), axis=2), -1)
    tl.store(plan_ptr + 1 + 2 * P + d[:, None] * R + r[None, :], pairs, mask=owner[:, None] & (r < R)[None, :])
    tl.store(plan_ptr, tl.sum(own, axis=0))


def plan_size(R: int, P: int) -> int:
    """int32 elements of a plan for R rows and P = R * k pairs."""
    return 1 + 2 * P + P * R


def moe_plan(experts: torch.Tensor, live: torch.Tensor, *, dedup: bool = True,
             plan: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The routing plan (see `_moe_plan_kernel`) of experts [R, k] int (contiguous) and `live` (as `check_live`
    takes it), as int32 [plan_size(R, R * k)]; one launch, no host sync."""
    R, k = experts.shape
    P = R * k
    count = check_live(live, R, experts.device)
    if plan is None:
        plan = torch.empty(plan_size(R, P), dtype=torch.int32, device=experts.device)
    _check(plan.dtype == torch.int32 and plan.numel() >= plan_size(R, P) and plan.is_contiguous(),
           f"plan must be contiguous int32 with >= {plan_size(R, P)} elements")
    live_arg = live.view(torch.uint8) if live.dtype == torch.bool else live
    _moe_plan_kernel[(1,)](experts, live_arg, plan, R, P, K_TOP=k, K_PAD=max(2, triton.next_power_of_2(k)),
                           P_PAD=max(16, triton.next_power_of_2(P)), R_PAD=max(2, triton.next_power_of_2(R)),
                           LIVE_COUNT=count, DEDUP=dedup, num_warps=4, **launch_options(pdl, experts.device))
    return plan


def moe_plan_ref(experts: torch.Tensor, live: torch.Tensor, dedup: bool = True) -> torch.Tensor:
    """Plain torch: the plan's entries that the kernel writes (count, then expert, owner and pairs of each entry)."""
    R, k = experts.shape
    P = R * k
    if live.dtype != torch.bool:
        live = torch.arange(R, device=live.device) < live.reshape(())
    e, lp = experts.cpu().flatten().tolist(), live.cpu().repeat_interleave(k).tolist()
    owners = [p for p in range(P) if lp[p] and (not dedup or not any(lp[q] and e[q] == e[p] for q in range(p)))]
    out = [len(owners), *[e[p] for p in owners], *[p for p in owners]]
    rows = experts.cpu().tolist()
    for p in owners:
        out += [r * k + rows[r].index(e[p]) if live[r] and e[p] in rows[r] else -1 for r in range(R)]
    return torch.tensor(out, dtype=torch.int32)


def plan_entries(plan: torch.Tensor, R: int, P: int) -> torch.Tensor:
    """The written part of a plan (as moe_plan_ref lists it), for comparisons."""
    plan = plan.cpu()
    n = int(plan[0])
    return torch.cat([plan[:1], plan[1:1 + n], plan[1 + P:1 + P + n], plan[1 + 2 * P:1 + 2 * P + n * R]])
