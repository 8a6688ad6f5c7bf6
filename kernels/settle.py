"""The round's settle step (docs/round.md: commit, log, stop) and the next drafts' inputs, in one launch.

After the accept step the round commits `count` tokens at positions n+1.., logs the emitted ones (cut at the first
stop token or the output budget), records the round, and decides whether the request is done; drafting then reads
the committed tokens back with their positions. In torch that is ~45 small kernels a round (comparisons, `any`,
`argmax`, `where`, three scatters, in-place adds), each a full kernel boundary in the captured round. Here one
program holds the 8 verification rows as a vector and does all of it; integer bookkeeping only, so the state it
leaves is the torch sequence's (`fast/torch_ops.settle`, which the torch fallback runs) exactly.

State read and written (fields of fast/state.DecodeState): tokens, n, stop_ids, budget, emitted, log_tokens,
log_logprobs, log_rounds, rounds, done; and the drafting's product (reset to 1) and more (to 0), since a drafting
follows every settle step. Several rows may land on a trash entry (tokens' or the log's last
entry), in no defined order, as with torch's index_copy_; trash entries are never read.

The drafting inputs (fast/state.DraftInputs): the redraft block's tokens (the ones just committed, at n+1+j), its
rows' positions (n+j: a draft row at p reads the hidden at p and the token at p+1) and live mask, its last live row,
and for each draft depth d = 1..7 the position of its row (n'+d-2, with n' the new n) and of its uniform (n'+d). Sizes come from the tensors: the rows from `committed`, the depths from
`out.row_pos`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import launch_options, wait_for_inputs

@triton.jit
def _settle_kernel(committed_ptr, count_ptr, emitted_ptr, n_emit_ptr, logprobs_ptr, k_ptr, a_ptr,
                   tokens_ptr, n_ptr, stop_ptr, budget_ptr, em_ptr, log_tok_ptr, log_lp_ptr, log_rounds_ptr,
                   rounds_ptr, done_ptr, d_tok_ptr, d_pos_ptr, d_live_ptr, d_last_ptr, d_row_ptr, d_u_ptr,
                   product_ptr, more_ptr, n_more, trash, log_trash, n_stops, depths, ROWS: tl.constexpr,
                   STOPS: tl.constexpr, DEPTHS: tl.constexpr, MORE: tl.constexpr,
                   PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    j = tl.arange(0, ROWS)
    n = tl.load(n_ptr)
    count = tl.load(count_ptr)
    n_emit = tl.load(n_emit_ptr)
    k = tl.load(k_ptr)
    a = tl.load(a_ptr)
    committed = tl.load(committed_ptr + j)
    emitted = tl.load(emitted_ptr + j)
    # commit: count tokens at n+1.. (the others to the trash entry)
    tl.store(tokens_ptr + tl.where(j < count, n + 1 + j, trash), committed)
    n_new = n + count
    tl.store(n_ptr, n_new)
    # the first stop token among the emitted ones, the budget, and what is logged
    s = tl.arange(0, STOPS)
    stops = tl.load(stop_ptr + s, mask=s < n_stops, other=-1)  # -1 marks an unused entry, as in stop_ids
    is_stop = (tl.sum((emitted[:, None] == stops[None, :]).to(tl.int32), axis=1) > 0) & (j < n_emit)
    any_stop = tl.max(is_stop.to(tl.int32), axis=0) > 0
    first_stop = tl.where(any_stop, tl.min(tl.where(is_stop, j, ROWS), axis=0) + 1, n_emit)
    done_before = tl.load(em_ptr)
    budget = tl.load(budget_ptr)
    keep = tl.maximum(tl.minimum(first_stop, budget - done_before), 0)
    slots = tl.where(j < keep, done_before + j, log_trash)
    tl.store(log_tok_ptr + slots, emitted)
    tl.store(log_lp_ptr + slots, tl.load(logprobs_ptr + j))
    r = tl.load(rounds_ptr)
    c = tl.arange(0, 4)
    bonus = ((a == k) & (k > 0)).to(tl.int64)
    record = tl.where(c == 0, k, tl.where(c == 1, a, tl.where(c == 2, keep, bonus)))
    tl.store(log_rounds_ptr + tl.minimum(r, log_trash) * 4 + c, record)
    tl.store(em_ptr, done_before + keep)
    tl.store(rounds_ptr, r + 1)
    full = n_new + 2 * ROWS >= trash
    done = ((first_stop <= keep) & any_stop) | (done_before + keep >= budget) | full
    tl.store(done_ptr, done.to(tl.int32))
    # the next drafts' inputs: the committed rows read back (the others' entries are not written here)
    later = tl.load(tokens_ptr + n + 1 + j, mask=j >= count, other=0)
    tl.store(d_tok_ptr + j, tl.where(j < count, committed, later))
    tl.store(d_pos_ptr + j, n + j)
    tl.store(d_live_ptr + j, (j < count).to(tl.int8))
    tl.store(d_last_ptr, count - 1)
    d = tl.arange(0, DEPTHS)
    tl.store(d_row_ptr + d, n_new + d - 1, mask=d < depths)
    tl.store(d_u_ptr + d, n_new + d + 1, mask=d < depths)
    tl.store(product_ptr, 1.0)
    mo = tl.arange(0, MORE)
    tl.store(more_ptr + mo, tl.zeros([MORE], tl.int32), mask=mo < n_more)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"settle: {message}")


def _check_state(st, committed, emitted, logprobs, scalars: dict, out) -> None:
    dev, rows = st.n.device, committed.shape[0]
    _check(rows >= 1 and rows & (rows - 1) == 0, f"committed must have a power-of-two row count, got {rows}")
    for name, t in (("committed", committed), ("emitted", emitted), ("out.tokens", out.tokens),
                    ("out.positions", out.positions)):
        _check(t.dtype == torch.int64 and tuple(t.shape) == (rows,) and t.is_contiguous() and t.device == dev,
               f"{name} must be contiguous int64 [{rows}] on {dev}")
    _check(logprobs.dtype == torch.float32 and tuple(logprobs.shape) == (rows,) and logprobs.device == dev,
           f"logprobs must be float32 [{rows}] on {dev}")
    for name, t in (*scalars.items(), ("out.last", out.last)):
        _check(t.dtype == torch.int64 and t.numel() == 1 and t.device == dev, f"{name} must be one int64 on {dev}")
    _check(out.live.dtype == torch.bool and tuple(out.live.shape) == (rows,) and out.row_pos.shape == out.u_pos.shape
           and all(t.device == dev and t.is_contiguous() for t in out), f"draft inputs must be contiguous on {dev}")
    _check(st.log_rounds.shape[1:] == (4,) and st.done.dtype == torch.int32 and st.product.dtype == torch.float32
           and st.more.dtype == torch.int32, "state: log_rounds [*, 4], done int32, product float32, more int32")


def settle(st, committed: torch.Tensor, count: torch.Tensor, emitted: torch.Tensor, n_emit: torch.Tensor,
           logprobs: torch.Tensor, k: torch.Tensor, a: torch.Tensor, out, *, pdl: bool = False):
    """Commit `count` of `committed` [R] at n+1.., log the first `n_emit` of `emitted` [R] with `logprobs` [R] up to a
    stop token or the budget, record the round (k, a, kept, bonus), set done; fill `out` (fast.state.DraftInputs)
    for the drafting that follows. `st`: fast.state.DecodeState (fields in the module docstring). Scalars are int64
    device tensors."""
    _check_state(st, committed, emitted, logprobs, dict(count=count, n_emit=n_emit, k=k, a=a), out)
    stops, depths = st.stop_ids, out.row_pos.numel()
    _settle_kernel[(1,)](committed, count, emitted, n_emit, logprobs.contiguous(), k, a, st.tokens, st.n, stops,
                         st.budget, st.emitted, st.log_tokens, st.log_logprobs, st.log_rounds, st.rounds, st.done,
                         out.tokens, out.positions, out.live.view(torch.int8), out.last, out.row_pos, out.u_pos,
                         st.product, st.more, st.more.numel(), st.trash, st.log_trash, stops.numel(), depths,
                         ROWS=committed.shape[0], STOPS=triton.next_power_of_2(stops.numel()),
                         DEPTHS=triton.next_power_of_2(depths), MORE=triton.next_power_of_2(st.more.numel()),
                         num_warps=1, **launch_options(pdl, st.n.device))
    return out
