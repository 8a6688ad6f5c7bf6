"""The LM heads for a decode block, docs/model.md ("Numerics", "Tensor parallelism"): `lm_head(hidden, head)` is
TorchOps.lm_head, hidden.float() @ head.float().T, the fp32 logits [R, V_local] of the post-norm rows (bf16, widened
exactly; fp32 taken too) against this rank's vocabulary slice of the head [V_local, H] (20000 x 3072 a rank at TP8),
held as the checkpoint stores it: bf16 (the published model's) or fp32. A bf16 head is widened to fp32 in registers,
exactly, so its logits are those of the same head held in fp32, bit for bit, at half the bytes of the stream (245 MB
a call in fp32 at TP8). The target's head and the draft's own take the same call.

IEEE fp32 throughout: each program's tl.dot runs with input_precision="ieee" (fp32 FMAs, never TF32, whose 10-bit
operands would move a logit by ~2^-11 of a product), so the kernel sums the products torch's fp32 matmul sums, in
another order. Agreement is therefore to rounding, not bit for bit (`device.logit_tolerance`); where every partial sum
is exact in fp32 (small-integer data in the tests), the logits equal torch's bit for bit.

Two forms (`LMHeadSettings.form`), the same products summed in different orders:
- "rows" (the default): grid (cdiv(V, BLOCK_V),); each program streams its [BLOCK_V, H] head rows K tile by K tile
  into registers, and each of the block's rows (padded to a power of two, R a compile-time constant: a draft's single
  row is one product an element) adds its products into its own lanes of an fp32 accumulator [rows, BLOCK_V,
  BLOCK_K] with FMAs; the lanes are summed once at the end. No shared-memory staging and no padding of the rows to 16:
  the loop is the head's stream (123 MB bf16 at TP8): 70 registers, no spill at 6 rows (`iquest bench sass`).
- "dot": the same grid; the tile's products by tl.dot with input_precision="ieee", the rows padded to BLOCK_R = 16
  (tl.dot's smallest M). On sm_90a an fp32 IEEE dot is FMAs on operands staged through shared memory, far slower than
  the head's byte stream (docs/PERF.md, "What the two eager profiles say about the folds").
The last V tile is partial: its loads re-read row V-1 (no masks in the weight stream) and its stores are masked. The
K tail (H not a multiple of BLOCK_K) is masked. No atomics (deterministic), no host reads (graph-capturable).

Decode blocks have 1..8 rows (at most 16 taken); a larger block (prefill) is refused (`fits`), and the engine runs
the torch form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS, is_pow2, sm_count as _sm_count
from .launch import launch_options, wait_for_inputs

BLOCK_R = 16  # tl.dot's smallest M
MAX_ROWS = BLOCK_R  # one row tile: the head is read once per call


FORMS = ("rows", "dot")
ROWS_BLOCK_V = 8  # "rows" with block_v None: 2,500 programs over a rank's 20,000 rows (tuned with rows_warps, below)


@dataclass(frozen=True)
class LMHeadSettings:
    """Launch choices. form, block_k and rows_block_k change the summation order, so the last bits (always within
    `device.logit_tolerance`); the others share the same sums out over programs and threads."""

    # "rows": fp32 products in registers, no shared-memory staging, R products an element; chosen over "dot", whose
    # FMA lowering runs far slower than the head's byte stream (docs/PERF.md, "What the two eager profiles say about
    # the folds")
    form: str = "rows"
    # None: "rows" takes ROWS_BLOCK_V; "dot" `choose_block_v`, the largest V tile that still gives programs_per_sm
    # programs an SM, so the last partial wave of the head's stream is short (docs/PERF.md, "The LM head, Philox and
    # the router as kernels").
    block_v: int | None = None
    programs_per_sm: int = 4
    block_k: int = 128     # "dot"
    num_warps: int = 4     # "dot"
    num_stages: int = 4    # "dot"
    # "rows": [8 x 128] tiles over 4 warps, with ROWS_BLOCK_V: 8 rows over 4 warps were faster than 16 over 8 with
    # the same bits (docs/PERF.md, "Current state", the same-bits tunes); 128 columns a step, not 64, a numerical
    # change qualified and paired with the round's other candidates (the same table, the candidate of 17fb4ea)
    rows_block_k: int = 128
    rows_warps: int = 4


@triton.jit
def _dot(acc, x, w):
    """acc [BLOCK_R, BLOCK_V] += x [BLOCK_R, BLOCK_K] @ w [BLOCK_V, BLOCK_K]^T: fp32 operands, IEEE fp32 FMAs."""
    return tl.dot(x, tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _row_products(acc, w, x):
    """acc [ROWS_PAD, BLOCK_V, BLOCK_K] + each row's products with the tile: w [BLOCK_V, BLOCK_K] and x
    [ROWS_PAD, BLOCK_K] fp32, one FMA an element a row."""
    return acc + w[None, :, :] * x[:, None, :]


@triton.jit
def _lm_head_rows_kernel(x_ptr, w_ptr, y_ptr, V, H, stride_x, stride_w, stride_y, ROWS: tl.constexpr,
                         ROWS_PAD: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr = False):
    pid_v = tl.program_id(0)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    rows = tl.arange(0, ROWS_PAD)
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + tl.minimum(cols, V - 1)[:, None].to(tl.int64) * stride_w + k[None, :]
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :]
    r_ok = (rows < ROWS)[:, None]
    # the first weight tile is a constant: read before the wait, overlapping the previous kernel (kernels/launch.py)
    w = tl.load(w_ptrs, mask=(k < H)[None, :], other=0.0)  # the head's own dtype: two tiles in flight at its size
    wait_for_inputs(PDL)
    # Every product goes into its own lane of acc; the lanes are summed once, after the last tile: the loop is loads
    # and FMAs only, no reduction across threads (which, a row and a tile at a time, would cost more than the stream)
    acc = tl.zeros([ROWS_PAD, BLOCK_V, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + k
        # the next tile's load goes out before this one's products: two tiles in flight a program
        nxt = tl.load(w_ptrs + (k0 + BLOCK_K), mask=((kk + BLOCK_K) < H)[None, :], other=0.0)
        x = tl.load(x_ptrs + k0, mask=r_ok & (kk < H)[None, :], other=0.0).to(tl.float32)  # bf16 -> fp32: exact
        acc = _row_products(acc, w.to(tl.float32), x)  # bf16 -> fp32: exact
        w = nxt
    y = tl.sum(acc, axis=2)  # [ROWS_PAD, BLOCK_V]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :], y, mask=r_ok & (cols < V)[None, :])


@triton.jit
def _lm_head_kernel(x_ptr, w_ptr, y_ptr, R, V, H, stride_x, stride_w, stride_y,
                    BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    pid_v = tl.program_id(0)
    rows = tl.arange(0, BLOCK_R)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    r_ok = rows < R
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :]
    w_ptrs = w_ptr + tl.minimum(cols, V - 1)[:, None].to(tl.int64) * stride_w + k[None, :]

    acc = tl.zeros([BLOCK_R, BLOCK_V], tl.float32)
    k_full = (H // BLOCK_K) * BLOCK_K
    for k0 in range(0, k_full, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=r_ok[:, None], other=0.0).to(tl.float32)  # bf16 -> fp32 is exact
        w = tl.load(w_ptrs + k0).to(tl.float32)
        acc = _dot(acc, x, w)
    if k_full < H:
        k_ok = (k_full + k) < H
        x = tl.load(x_ptrs + k_full, mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k_full, mask=k_ok[None, :], other=0.0).to(tl.float32)
        acc = _dot(acc, x, w)

    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
    tl.store(y_ptrs, acc, mask=r_ok[:, None] & (cols < V)[None, :])


# ---- host wrapper ----------------------------------------------------------------------------------
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"lm_head: {message}")


def fits(R: int, V: int, H: int) -> bool:
    """Whether `lm_head` takes a block of R rows with a head slice [V, H]; otherwise the engine runs the torch form."""
    return 1 <= R <= MAX_ROWS and V >= 1 and H >= 1


def choose_block_v(v: int, settings: LMHeadSettings, device: torch.device) -> int:
    """The V tile of a call: settings.block_v, else ROWS_BLOCK_V for "rows"; for "dot", the largest V tile in (64, 32)
    giving >= programs_per_sm programs an SM, else 16. Not 128: pipelined at the default block_k and num_stages, its
    fp32 tiles all but fill an SM's shared memory and spill registers (sm_90a)."""
    if settings.block_v is not None:
        return settings.block_v
    if settings.form == "rows":
        return ROWS_BLOCK_V
    programs = settings.programs_per_sm * _sm_count(device)
    for bv in (64, 32):
        if triton.cdiv(v, bv) >= programs:
            return bv
    return 16


def _check_settings(s: LMHeadSettings) -> None:
    _check(isinstance(s, LMHeadSettings), f"settings must be an LMHeadSettings, got {type(s).__name__}")
    _check(s.form in FORMS, f"form {s.form!r} must be one of {', '.join(FORMS)}")
    least = 16 if s.form == "dot" else 1  # tl.dot's smallest N
    _check(s.block_v is None or is_pow2(s.block_v, least),
           f"block_v {s.block_v!r} must be None or a power of two >= {least}")
    _check(is_pow2(s.block_k, 16), f"block_k {s.block_k!r} must be a power of two >= 16")
    _check(is_pow2(s.rows_block_k, 16), f"rows_block_k {s.rows_block_k!r} must be a power of two >= 16")
    _check(isinstance(s.rows_warps, int) and s.rows_warps in (1, 2, 4, 8, 16), f"rows_warps {s.rows_warps!r}")
    _check(isinstance(s.num_warps, int) and s.num_warps in (1, 2, 4, 8, 16), f"num_warps {s.num_warps!r}")
    _check(isinstance(s.num_stages, int) and s.num_stages >= 1, f"num_stages {s.num_stages!r} must be >= 1")
    _check(isinstance(s.programs_per_sm, int) and s.programs_per_sm >= 1,
           f"programs_per_sm must be an int >= 1, got {s.programs_per_sm!r}")


def lm_head(hidden: torch.Tensor, head: torch.Tensor, *, settings: LMHeadSettings = LMHeadSettings(),
            out: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """Logits [R, V] fp32 = TorchOps.lm_head(hidden, head) = hidden.float() @ head.float().T to rounding
    (`device.logit_tolerance`), for hidden [R, H] bf16 (fp16 / fp32 taken too), R in 1..MAX_ROWS, and head [V, H]
    bf16 or fp32, both with unit stride along H. `out`: [R, V] fp32 with unit stride along V (rows may be strided).
    `pdl`: as kernels/launch.py's. ValueError for what it does not take."""
    _check(isinstance(hidden, torch.Tensor) and isinstance(head, torch.Tensor), "hidden and head must be tensors")
    _check(hidden.dim() == 2 and head.dim() == 2,
           f"hidden {tuple(hidden.shape)} and head {tuple(head.shape)} must be 2-D")
    R, H = hidden.shape
    V, Hw = head.shape
    _check(Hw == H, f"hidden has H={H}, head has H={Hw}")
    _check(fits(R, V, H), f"a block of {R} rows with a head [{V}, {H}] is not taken (rows 1..{MAX_ROWS}): run the "
           f"torch form")
    _check(hidden.dtype in _FLOATS, f"hidden {hidden.dtype} must be bfloat16, float16 or float32")
    _check(head.dtype in (torch.bfloat16, torch.float32),
           f"head {head.dtype} must be bfloat16 or float32 (docs/model.md: the head as stored, fp32 products)")
    _check(hidden.device == head.device, f"hidden is on {hidden.device}, head on {head.device}")
    _check(hidden.stride(1) == 1 or H == 1, "hidden must have unit stride along H")
    _check(head.stride(1) == 1 or H == 1, "head must have unit stride along H")
    _check_settings(settings)
    if out is None:
        out = torch.empty((R, V), dtype=torch.float32, device=hidden.device)
    _check(tuple(out.shape) == (R, V) and out.dtype == torch.float32,
           f"out must be [{R}, {V}] fp32, got {tuple(out.shape)} {out.dtype}")
    _check(out.device == hidden.device, f"out is on {out.device}, hidden on {hidden.device}")
    _check(out.stride(1) == 1 or V == 1, "out must have unit stride along V")
    block_v = choose_block_v(V, settings, hidden.device)
    launch = launch_options(pdl, hidden.device)
    if settings.form == "rows":
        _lm_head_rows_kernel[(triton.cdiv(V, block_v),)](
            hidden, head, out, V, H, hidden.stride(0), head.stride(0), out.stride(0), ROWS=R,
            ROWS_PAD=triton.next_power_of_2(R), BLOCK_V=block_v, BLOCK_K=settings.rows_block_k,
            num_warps=settings.rows_warps, num_stages=1, **launch)
    else:
        _lm_head_kernel[(triton.cdiv(V, block_v),)](
            hidden, head, out, R, V, H, hidden.stride(0), head.stride(0), out.stride(0), BLOCK_R=BLOCK_R,
            BLOCK_V=block_v, BLOCK_K=settings.block_k, num_warps=settings.num_warps, num_stages=settings.num_stages,
            **launch)
    return out
