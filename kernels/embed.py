"""The vocabulary-parallel embedding lookup of a block's tokens, in one launch.

    x[r] = table[t_r - offset] * (offset <= t_r < offset + V)      (V = the rank's rows of the vocabulary)

A rank holds rows [offset, offset + V) of the embedding; a token outside them contributes a zero row, and the
all-reduce that follows sums the one rank's row into every rank (docs/model.md TP layout). The engine's torch form is
eight small kernels (a subtraction, two comparisons and their `and`, a clamp, the row gather, the mask's
conversion, the product); a round embeds six blocks (the verification block and five draft depths), so 48
launches a round become 6. Same roundings: the product is taken in fp32 and rounded to the table's dtype, as
torch's bf16 multiply does, so x * 1 is x and x * 0 is a zero carrying x's sign (NaN stays NaN), bit for bit.

One program per (row, column block); a row out of range still reads the clamped row, as the torch form does,
so its zeros carry the same signs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS
from .launch import launch_options, wait_for_inputs

BLOCK = 1024  # columns per program: 3 programs a row at H = 3072


@triton.jit
def _embed_kernel(tok_ptr, table_ptr, out_ptr, offset, V, H, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    local = tl.load(tok_ptr + row) - offset
    mine = (local >= 0) & (local < V)
    src = tl.minimum(tl.maximum(local, 0), V - 1).to(tl.int64)
    x = tl.load(table_ptr + src * H + c, mask=ok, other=0.0)
    keep = tl.where(mine, 1.0, 0.0)
    tl.store(out_ptr + row * H + c, (x.to(tl.float32) * keep).to(out_ptr.dtype.element_ty), mask=ok)


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"embed: {message}")


def embed(tokens: torch.Tensor, table: torch.Tensor, offset: int, *, out: torch.Tensor | None = None,
          pdl: bool = False) -> torch.Tensor:
    """[R, H] rows of `table` [V, H] (this rank's vocabulary rows [offset, offset + V)) for int64 `tokens` [R], zero
    rows (signed as the clamped row's values) for tokens outside them."""
    _check(isinstance(tokens, torch.Tensor) and isinstance(table, torch.Tensor), "tokens and table must be tensors")
    _check(tokens.dim() == 1 and tokens.dtype == torch.int64 and tokens.is_contiguous(),
           f"tokens must be contiguous int64 [R], got {tokens.dtype} {tuple(tokens.shape)}")
    _check(table.dim() == 2 and table.dtype in _FLOATS and table.is_contiguous(),
           f"table must be a contiguous float [V, H], got {table.dtype} {tuple(table.shape)}")
    _check(tokens.device == table.device, f"devices differ: tokens {tokens.device}, table {table.device}")
    _check(isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0,
           f"offset must be an int >= 0, got {offset!r}")
    R, (V, H) = tokens.shape[0], table.shape
    _check(V >= 1 and H >= 1, "empty table")
    _check(V * H < 2**62, "table too large")
    if out is None:
        out = torch.empty((R, H), dtype=table.dtype, device=table.device)
    _check(tuple(out.shape) == (R, H) and out.dtype == table.dtype and out.is_contiguous(),
           f"out must be contiguous {table.dtype} [{R}, {H}]")
    if R:
        _embed_kernel[(R, triton.cdiv(H, BLOCK))](tokens, table, out, offset, V, H, BLOCK=BLOCK,
                                                 **launch_options(pdl, table.device))
    return out
