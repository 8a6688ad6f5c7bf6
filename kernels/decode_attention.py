"""Split-KV decode attention over the static KV cache (seed: "Read only the KV tiles needed").

Not on the product path until re-based to docs/model.md: its sink is the retired, guessed architecture's one constant
logit per query head, not the published sink key (a logit q_h . sink_k[g] that depends on the query, applied as
sigmoid(LSE - s_sink)), so fast/triton_ops.py no longer dispatches it and the published attention runs its torch form.
Its tests hold it to its own reference (`decode_attention_ref`, below). Without sinks it is plain split-KV attention
over the cache.

One rank's query heads for one KV head and all live rows form one matrix: row m = r * G + h for
row r and local head h (G = Hq / Hkv; 6 heads x 8 rows = 48 rows at full size), so every K/V tile
is read once per block. The slot axis is split over a grid (kv_head, split); each split streams its
tiles with an online softmax and stores a partial (max, sum of exponentials, weighted V) in fp32.
A combine kernel merges the splits by log-sum-exp and adds the learned sink exactly once: a logit
with a zero value, so it only enlarges the denominator (`attention_ref`).

Visibility is evaluated in the kernel from `slot_pos` (the position each slot holds, -1 = empty)
and each row's query position, exactly as `fast.cache.LayerKV.visible`:
    slot_pos >= first_position and slot_pos <= q_pos [and slot_pos > q_pos - window].
`kv_len` (a device int tensor, no host sync) bounds the slots read: slots at index >= kv_len are
never loaded, and splits that start past it exit at once, so a full layer's preallocated capacity
costs nothing. The split length follows kv_len on the device: every live split gets an equal
share (a whole number of tiles, at least `min_split` slots). `q_pos.max() + 1` is a valid bound
for both cache kinds (a ring slot index never exceeds the position it holds).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS, sm_count as _sm_count
from .launch import launch_options, prefetch_lines, prefetch_rows, wait_for_inputs

# Under TRITON_INTERPRET=1 (read when triton is imported) tl.dot on bf16 is wrong (GPU_FACTS.md): upcast.
INTERPRETED = bool(triton.knobs.runtime.interpret)
LOG2E = 1.4426950408889634
MAX_MATRIX_ROWS = 128
EARLY_SLOTS = 128  # slots a split prefetches before its wait (`early`): its first two tiles, all of one at 1K context


@triton.jit
def _split_len(kv_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    per = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return tl.maximum(per, MIN_SPLIT)


@triton.jit
def _load_kv_len(kv_len_ptr, S, R, HAS_KV_LEN: tl.constexpr, R_PAD: tl.constexpr):
    """The slots to read: S (HAS_KV_LEN 0), the kv_len tensor's value (1), or the rows' last position + 1 with
    kv_len_ptr at the rows' positions (2): a value the caller would otherwise compute with two launches."""
    if HAS_KV_LEN == 0:
        n = S
    else:
        if HAS_KV_LEN == 1:
            n = tl.load(kv_len_ptr).to(tl.int32)
        else:
            i = tl.arange(0, R_PAD)
            n = tl.max(tl.load(kv_len_ptr + i, mask=i < R, other=-1), axis=0).to(tl.int32) + 1
        n = tl.minimum(tl.maximum(n, 0), S)
    return n


@triton.jit
def _attention_split_kernel(
    q_ptr, k_ptr, v_ptr, slot_pos_ptr, q_pos_ptr, kv_len_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    S, R, window, first_position, qk_scale,
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_KV_LEN: tl.constexpr,
    SLIDING: tl.constexpr, CAUSAL: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr = False, R_PAD: tl.constexpr = 16, EARLY_SLOTS: tl.constexpr = 0,
    LINE_ELEMS: tl.constexpr = 64, LINES: tl.constexpr = 2,
):
    g = tl.program_id(0)
    split = tl.program_id(1)
    if EARLY_SLOTS == 0:
        wait_for_inputs(PDL)
    # With EARLY_SLOTS: the rows' positions (kv_len's source: HAS_KV_LEN 0 or 2) were written before the forward, two
    # launches back or earlier, so they are complete before this kernel starts (kernels/launch.py): the split's range is
    # known before the wait, and its first slots' K/V lines are requested into L2 (a hint: L2 is coherent, so a line the
    # previous kernel is still writing is read again correctly after the wait).
    kv_len = _load_kv_len(kv_len_ptr, S, R, HAS_KV_LEN, R_PAD)
    split_len = _split_len(kv_len, NUM_SPLITS, BLOCK_N, MIN_SPLIT)
    start = split * split_len
    if EARLY_SLOTS > 0:
        ahead = start + tl.arange(0, EARLY_SLOTS)
        ahead = tl.where(ahead < tl.minimum(start + split_len, kv_len), ahead, tl.minimum(start, S - 1))  # clamp
        prefetch_rows(k_ptr + ahead * stride_ks + g * stride_kh, 0, D, LINE_ELEMS, LINES)
        prefetch_rows(v_ptr + ahead * stride_vs + g * stride_vh, 0, D, LINE_ELEMS, LINES)
        wait_for_inputs(PDL)
    if start >= kv_len:
        return  # past the valid history: nothing read, nothing stored (combine skips it)
    end = tl.minimum(start + split_len, kv_len)

    RG = R * G
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < RG
    r = rows // G
    head = g * G + rows % G
    d = tl.arange(0, D)
    q_pos = tl.load(q_pos_ptr + r, mask=row_ok, other=-1)
    q = tl.load(q_ptr + r[:, None] * stride_qr + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if F32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        sp = tl.load(slot_pos_ptr + n, mask=n_ok, other=-1)
        k = tl.load(k_ptr + n[:, None] * stride_ks + g * stride_kh + d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + n[:, None] * stride_vs + g * stride_vh + d[None, :], mask=n_ok[:, None], other=0.0)
        if F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # log2 domain
        vis = (sp[None, :] >= first_position) & (q_pos[:, None] >= 0)
        if CAUSAL:
            vis = vis & (sp[None, :] <= q_pos[:, None])
        if SLIDING:
            vis = vis & (sp[None, :] > q_pos[:, None] - window)
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    part = (g * NUM_SPLITS + split) * RG + rows
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _attention_combine_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, kv_len_ptr, out_ptr,
    S, R, stride_or, stride_oh,
    G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    COLS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_KV_LEN: tl.constexpr,
    HAS_SINKS: tl.constexpr, PDL: tl.constexpr = False, R_PAD: tl.constexpr = 16, PRELOAD: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    # One program a (KV head, row, COLS columns), its warps across BLOCK_S splits a step: a step's partials are all
    # requested at once, so a program pays one dependent L2 round trip a step (one at up to 128 live splits, three at
    # the 264 of a full layer on an H200) and many programs share the work.
    RG = R * G
    pid = tl.program_id(0) // (D // COLS)
    d = (tl.program_id(0) % (D // COLS)) * COLS + tl.arange(0, COLS)
    g = pid // RG
    row = pid % RG
    r = row // G
    head = g * G + row % G
    if HAS_SINKS and PRELOAD:  # a constant weight: read before the wait, its HBM latency overlapping the split kernel
        sink = tl.load(sinks_ptr + head)
    if not EARLY:
        wait_for_inputs(PDL)
    kv_len = _load_kv_len(kv_len_ptr, S, R, HAS_KV_LEN, R_PAD)  # EARLY: from the positions, as in the split kernel
    split_len = _split_len(kv_len, NUM_SPLITS, BLOCK_N, MIN_SPLIT)
    n_live = tl.cdiv(kv_len, split_len)  # <= NUM_SPLITS; later splits exited without storing
    if EARLY:  # the partials' loads go out right after the wait, not after a load of the positions
        wait_for_inputs(PDL)

    first = g * NUM_SPLITS
    every = tl.arange(0, MAX_SPLITS)
    m = tl.max(tl.load(part_m_ptr + (first + every) * RG + row, mask=every < n_live, other=float("-inf")), axis=0)
    if HAS_SINKS:
        if not PRELOAD:
            sink = tl.load(sinks_ptr + head)
        sink = sink.to(tl.float32) * 1.4426950408889634  # log2 domain, like the partials
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no visible slot and no sink
    s = tl.arange(0, BLOCK_S)
    den = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
    acc = tl.zeros([COLS], tl.float32)
    for s0 in range(0, n_live, BLOCK_S):
        ok = s0 + s < n_live
        part = (first + s0 + s) * RG + row
        w = tl.exp2(tl.load(part_m_ptr + part, mask=ok, other=float("-inf")) - m_safe)
        den += tl.sum(tl.load(part_l_ptr + part, mask=ok, other=0.0) * w, axis=0)
        acc += tl.sum(tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                      * w[:, None], axis=0)
    if HAS_SINKS:
        den += tl.exp2(sink - m_safe)  # the sink, exactly once
    out = tl.where(den > 0, acc / den, 0.0)  # no visible slot and no sink: zeros, not NaN
    tl.store(out_ptr + r * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# ---- host wrapper ----------------------------------------------------------------------------------


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"decode_attention: {message}")


def default_num_splits(slots: int, kv_heads: int, device: torch.device, min_split: int) -> int:
    """Enough splits for about two programs per SM at full capacity; short contexts use fewer
    (the kernel shares kv_len out in whole tiles of at least `min_split` slots)."""
    sms = _sm_count(device)
    return max(1, min(triton.cdiv(slots, min_split), max(1, 2 * sms // kv_heads)))


def default_num_stages(window: int | None) -> int:
    """K/V tiles in flight a split program: 3 for a full layer, whose splits at long context stream many tiles (2
    left it near 2.4 TB/s at 192K); 2 for a sliding layer, whose splits are a tile or two at any context, where the
    third stage's shared memory only costs programs an SM (bench tune, docs/PERF.md)."""
    return 2 if window is not None else 3


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pos: torch.Tensor,
                     q_pos: torch.Tensor, sinks: torch.Tensor | None, window: int | None,
                     first_position: int = 0, kv_len: torch.Tensor | None = None, *, causal: bool = True,
                     num_splits: int | None = None, block_n: int = 64, min_split: int | None = None,
                     out: torch.Tensor | None = None, workspace: tuple[torch.Tensor, ...] | None = None,
                     num_warps: int = 4, num_stages: int | None = None, pdl: bool = False, combine_splits: int = 128,
                     combine_cols: int = 32, combine_warps: int = 4, kv_len_from_q: bool = False,
                     preload: bool = False, early: bool = False) -> torch.Tensor:
    """Attention of R query rows over a static KV cache: q [R, Hq, D], k/v [S, Hkv, D] -> [R, Hq, D].
    `preload`: the combine reads the sinks (constant) before its PDL wait (kernels/launch.py; the same values).
    `early` (with `pdl`, and kv_len from q_pos or none), for a caller whose q_pos was written two launches back or
    earlier (then final: kernels/launch.py): each split asks L2 for its first EARLY_SLOTS slots' K/V lines before its
    PDL wait, and the combine computes its live splits from the positions before its wait (a hint and an earlier read
    of final values: the same bits).

    slot_pos [S] int64 (position held by each slot, -1 = empty), q_pos [R] int64, sinks [Hq] fp32 or
    None, window (sliding layers) or None, kv_len: int tensor of one element on q's device, an upper
    bound on the slots holding visible history (None = all S). Output in q's dtype; fp32 softmax.
    `out` (like q) and `workspace` (from `decode_attention_workspace`) may be given as static
    buffers, e.g. for CUDA graphs; every element of `out` is written. The combine: a program for each (KV head, row,
    `combine_cols` columns) with `combine_warps` warps, summing `combine_splits` splits a step (the order of its sums
    follows these three).
    `num_stages`: the split kernel's K/V tiles in flight (None: `default_num_stages`; any value gives the same bits).
    `kv_len_from_q`: the kernels take kv_len = q_pos.max() + 1 themselves (instead of a kv_len tensor, which the
    caller would make with two launches); the same bound, so the same bits.
    """
    _check(q.dim() == 3 and k.dim() == 3 and v.dim() == 3, "q, k, v must be [R, Hq, D], [S, Hkv, D], [S, Hkv, D]")
    R, Hq, D = q.shape
    S, Hkv, Dk = k.shape
    _check(tuple(v.shape) == tuple(k.shape), f"v {tuple(v.shape)} differs from k {tuple(k.shape)}")
    _check(Dk == D, f"head_dim of q ({D}) and k ({Dk}) differ")
    _check(D >= 16 and D & (D - 1) == 0, f"head_dim {D} must be a power of two >= 16")
    _check(Hkv >= 1 and Hq % Hkv == 0, f"query heads {Hq} are not a multiple of kv heads {Hkv}")
    G = Hq // Hkv
    _check(1 <= R and R * G <= MAX_MATRIX_ROWS, f"rows x heads per kv head = {R * G} must be in 1..{MAX_MATRIX_ROWS}")
    _check(q.dtype in _FLOATS and k.dtype in _FLOATS, f"q/k dtypes {q.dtype}/{k.dtype} must be bf16, fp16 or fp32")
    _check(v.dtype == k.dtype, f"k and v dtypes differ ({k.dtype}, {v.dtype})")
    _check(slot_pos.dtype == torch.int64 and tuple(slot_pos.shape) == (S,), f"slot_pos must be int64 [{S}]")
    _check(q_pos.dtype == torch.int64 and tuple(q_pos.shape) == (R,), f"q_pos must be int64 [{R}]")
    tensors = {"q": q, "k": k, "v": v, "slot_pos": slot_pos, "q_pos": q_pos}
    if sinks is not None:
        _check(sinks.dtype == torch.float32 and tuple(sinks.shape) == (Hq,), f"sinks must be fp32 [{Hq}]")
        tensors["sinks"] = sinks
    if kv_len is not None:
        _check(isinstance(kv_len, torch.Tensor) and kv_len.numel() == 1
               and kv_len.dtype in (torch.int32, torch.int64), "kv_len must be an int32/int64 tensor of one element")
        tensors["kv_len"] = kv_len
    for name, t in tensors.items():
        _check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
        _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(window is None or (isinstance(window, int) and window > 0),
           f"window must be a positive int or None, got {window!r}")
    _check(isinstance(first_position, int) and first_position >= 0,
           f"first_position must be an int >= 0, got {first_position!r}")
    _check(block_n >= 16 and block_n & (block_n - 1) == 0, f"block_n {block_n} must be a power of two >= 16")
    _check(combine_splits >= 16 and combine_splits & (combine_splits - 1) == 0,
           f"combine_splits {combine_splits} must be a power of two >= 16")
    _check(combine_cols >= 16 and combine_cols & (combine_cols - 1) == 0,
           f"combine_cols {combine_cols} must be a power of two >= 16")
    _check(combine_warps in (1, 2, 4, 8), f"combine_warps {combine_warps} must be 1, 2, 4 or 8")
    num_stages = default_num_stages(window) if num_stages is None else num_stages
    _check(isinstance(num_stages, int) and num_stages >= 1, f"num_stages must be an int >= 1, got {num_stages!r}")
    # One tile per split at least: at 1K context 17 live splits instead of 5, 14.5 -> 9.7 us a call on an H200
    # (`iquest bench tune`, bench/results/tune-h200-932ec08.*); long contexts are capped by default_num_splits.
    min_split = block_n if min_split is None else min_split
    _check(min_split >= block_n and min_split % block_n == 0, f"min_split {min_split} must be a multiple of block_n")
    num_splits = default_num_splits(S, Hkv, q.device, min_split) if num_splits is None else num_splits
    _check(num_splits >= 1, f"num_splits must be >= 1, got {num_splits}")

    RG = R * G
    if workspace is None:
        workspace = decode_attention_workspace(R, Hq, Hkv, D, num_splits, q.device)
    part_m, part_l, part_acc = workspace
    _check(tuple(part_m.shape) == (Hkv, num_splits, RG) and tuple(part_l.shape) == (Hkv, num_splits, RG)
           and tuple(part_acc.shape) == (Hkv, num_splits, RG, D), "workspace does not match the shapes and num_splits")
    _check(all(t.dtype == torch.float32 and t.device == q.device and t.is_contiguous() for t in workspace),
           "workspace must be contiguous fp32 on q's device")
    if out is None:
        out = torch.empty_like(q)
    _check(tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype and out.device == q.device
           and out.is_contiguous(), "out must be a contiguous tensor like q")
    f32 = INTERPRETED or q.dtype == torch.float32 or k.dtype == torch.float32 or q.dtype != k.dtype
    _check(not (kv_len_from_q and kv_len is not None), "give kv_len or kv_len_from_q, not both")
    has_kv_len = 2 if kv_len_from_q else int(kv_len is not None)
    kv_len_arg = q_pos if kv_len_from_q else kv_len if kv_len is not None else slot_pos  # unused when mode 0
    # early: a kv_len tensor may be written by the previous kernel, the positions not (kernels/launch.py)
    early_slots = EARLY_SLOTS if early and pdl and has_kv_len != 1 and not INTERPRETED else 0
    line_elems, lines = prefetch_lines(D, k.element_size())
    _attention_split_kernel[(Hkv, num_splits)](
        q, k, v, slot_pos, q_pos, kv_len_arg, part_m, part_l, part_acc,
        S, R, window or 0, first_position, LOG2E / math.sqrt(D),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        G=G, D=D, NUM_SPLITS=num_splits, BLOCK_M=max(16, triton.next_power_of_2(RG)), BLOCK_N=block_n,
        MIN_SPLIT=min_split, HAS_KV_LEN=has_kv_len, SLIDING=window is not None, CAUSAL=causal,
        F32=f32, PREC="ieee" if f32 else "tf32", R_PAD=max(16, triton.next_power_of_2(R)), num_warps=num_warps,
        num_stages=num_stages, EARLY_SLOTS=early_slots, LINE_ELEMS=line_elems, LINES=lines,
        **launch_options(pdl, q.device))
    cols, max_splits = min(combine_cols, D), max(16, triton.next_power_of_2(num_splits))
    _attention_combine_kernel[(Hkv * RG * (D // cols),)](
        part_m, part_l, part_acc, sinks if sinks is not None else part_m, kv_len_arg, out,
        S, R, out.stride(0), out.stride(1),
        G=G, D=D, NUM_SPLITS=num_splits, MAX_SPLITS=max_splits, BLOCK_S=min(combine_splits, max_splits), COLS=cols,
        BLOCK_N=block_n,
        MIN_SPLIT=min_split, HAS_KV_LEN=has_kv_len, HAS_SINKS=sinks is not None,
        R_PAD=max(16, triton.next_power_of_2(R)), num_warps=combine_warps, PRELOAD=preload, EARLY=early_slots > 0,
        **launch_options(pdl, q.device))
    return out


def decode_attention_workspace(rows: int, q_heads: int, kv_heads: int, head_dim: int, num_splits: int,
                               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 split partials (max [Hkv, splits, R*G], sum-exp [same], weighted V [.., D]) in the log2 domain."""
    rg = rows * (q_heads // kv_heads)
    m = torch.empty((kv_heads, num_splits, rg), dtype=torch.float32, device=device)
    return m, torch.empty_like(m), torch.empty((kv_heads, num_splits, rg, head_dim), dtype=torch.float32, device=device)


# ---- reference -------------------------------------------------------------------------------------
def visible_ref(slot_pos: torch.Tensor, q_pos: torch.Tensor, window: int | None, first_position: int,
                kv_len: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """bool [R, S], the rule of fast.cache.LayerKV.visible (with first_position 0), plus a first visible position
    (the retired draft layer's cache began at position 1) and the kv_len bound on slot indices."""
    sp, q = slot_pos[None, :], q_pos[:, None]
    mask = (sp >= first_position) & (q >= 0)
    if causal:
        mask = mask & (sp <= q)
    if window is not None:
        mask = mask & (sp > q - window)
    if kv_len is not None:
        mask = mask & (torch.arange(slot_pos.shape[0], device=slot_pos.device) < kv_len.reshape(()))[None, :]
    return mask


def decode_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_pos: torch.Tensor,
                         q_pos: torch.Tensor, sinks: torch.Tensor | None, window: int | None,
                         first_position: int = 0, kv_len: torch.Tensor | None = None, *,
                         causal: bool = True) -> torch.Tensor:
    """`attention_ref` in fp32 with the same mask, cast to q's dtype."""
    mask = visible_ref(slot_pos, q_pos, window, first_position, kv_len, causal)
    return attention_ref(q.float(), k.float(), v.float(), mask, sinks).to(q.dtype)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention with GQA and one sink logit per query head (the kernel's form): q [R, Hq, D], k/v [S, Hkv, D],
    mask [R, S] -> [R, Hq, D]. out_h = sum_j exp(s_j) v_j / (exp(sink_h) + sum_j exp(s_j)), s_j = q_h . k_{g,j} /
    sqrt(D), g = h // (Hq / Hkv); the sink's value is zero and the max subtracted includes it."""
    R, Hq, D = q.shape
    group = Hq // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("rhd,thd->hrt", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(Hq, R, 1)], dim=-1)
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.einsum("hrt,thd->rhd", probs[..., : k.shape[0]], v)
