"""Split-KV decode attention over the static KV cache, with the zero-value sink key (docs/model.md, "Attention").

For each row r of a decode block (query position positions[r], -1 = padding) and query head h, reading KV head
g = h // G (G = Hq / Hkv):

    out[r, h] = sum_j e^{s_j} v[j, g] / (e^{s_sink} + sum_j e^{s_j})
    s_j = scale * q[r, h] . k[j, g]   over the cache slots j visible to the row
    s_sink = scale * q[r, h] . sink_k[g]

in fp32 from q's and the cache's values, rounded once to q's dtype: `reference.layers.attention` over the cache's mask,
the torch form the engine otherwise runs (`fast.torch_ops.TorchOps.attention`). The sink key's value is zero and it is
never windowed out, so it only enlarges the denominator; without `sink_k` the denominator is the keys' alone. A row
that sees no slot (a padding row) gets zeros, with or without the sink.

Visibility is the cache's rule (`fast.cache.LayerKV.visible`), evaluated from `slot_pos` (the position each slot
holds, -1 = empty; the last slot is the trash slot, always -1):
    slot_pos >= 0 and q_pos >= 0 and slot_pos <= q_pos [and slot_pos > q_pos - window on sliding layers].

Why split-KV: one rank's decode block is at most 8 rows x G heads per KV head, so the rows and heads of a KV head form
one small matrix (row m = r * G + h, 48 rows at 8 x 6) and each K/V tile is read once for all of them; but one program
per KV head could not stream a long cache at HBM speed. The slot axis is split over a grid (kv_head, split): each split
streams its tiles with an online softmax and stores an fp32 partial (max, sum of exponentials, weighted V) in the log2
domain; a combine merges the live splits by log-sum-exp. The sink joins that merge exactly once, as one more logit:
in the max taken for stability and as e^{s_sink - max} in the denominator, nothing in the numerator (added in every
split it would count once a live split).

The slots read are bounded on the device, with no host sync (so the call can be captured in a CUDA graph): both
kernels take kv_len = max(positions) + 1 themselves, clamped to the cache. No visible slot lies at or past it, since a
full layer's slot index is its position and a ring slot's index never exceeds the position it holds; splits that
start past it exit at once, so a full layer's preallocated capacity costs nothing. The split length follows kv_len:
every live split gets an equal share, in whole tiles of at least `min_split` slots.

Launch choices (tile, splits, warps, stages, the combine's shape, reads before the PDL wait) are `AttentionSettings`;
why each value, with its measurements, is in docs/PERF.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .device import FLOATS as _FLOATS, is_pow2 as _pow2, sm_count as _sm_count
from .launch import launch_options, prefetch_lines, prefetch_rows, wait_for_inputs

# Under TRITON_INTERPRET=1 (read when triton is imported) tl.dot on bf16 is wrong (GPU_FACTS.md): upcast.
INTERPRETED = bool(triton.knobs.runtime.interpret)
LOG2E = 1.4426950408889634
MAX_MATRIX_ROWS = 128  # rows x query heads of one KV head: the split kernel's matrix
EARLY_SLOTS = 128  # slots a split prefetches before its wait (`early`): its first two tiles, all of one at 1K context


@dataclass(frozen=True)
class AttentionSettings:
    """How the two kernels launch. num_stages, long_stages, long_tiles, preload and early change no value (each checked
    bit-identical); the tile, the splits, the warps and the combine's shape set the order of the fp32 sums (re-qualify
    when changing)."""

    # slots a K/V tile: 32 on sliding layers (`SLIDING`), qualified and paired with the o-projection's and the q/k/v
    # fold's splits (docs/PERF.md, "Current state", the numerical candidate of 17fb4ea), 64 on full ones (`FULL`); on
    # the retired architecture 64 was the fastest (docs/PERF.md, "32-slot tiles and splits in a sliding layer's
    # attention")
    block_n: int = 64
    # slots a split at least (None: one tile): one-tile splits give the most live splits at short context, so more of
    # the grid streams (docs/PERF.md, "Launch configurations"); longer splits starve the grid (256-slot splits,
    # rejected: docs/PERF.md, "The context sweep")
    min_split: int | None = None
    # the grid's splits (None: about two programs an SM at full capacity, `default_num_splits`: the 264 of a full
    # layer on an H200 in docs/PERF.md's "context sweep")
    num_splits: int | None = None
    # warps of a split program: the fastest `bench tune` found (docs/PERF.md, "Launch configurations")
    num_warps: int = 4
    # K/V tiles in flight a split: 1 on both layer types (`FULL`, `SLIDING`; docs/PERF.md, "Current state", one tile
    # in flight on full layers, paired from 1K to 512K)
    num_stages: int = 2
    # splits the combine merges a step, columns a combine program, its warps: every live split's maximum in one load,
    # so a long context's many splits are not walked in a serial chain (docs/PERF.md, "The attention combine as one
    # program a (KV head, row, 32 columns), 4 warps over 128 splits a step")
    combine_splits: int = 128
    combine_cols: int = 32
    combine_warps: int = 4
    # K/V tiles in flight on a split longer than `long_tiles` tiles (None: `num_stages` on every split): a split's
    # length follows the context (one 64-slot tile at 16K, 31 at 512K on a full layer), and one tile in flight, the
    # fastest from 1K to 256K, may not keep enough bytes in flight at 512K; the same bits (docs/PERF.md, "Open
    # directions", the 512K row)
    long_stages: int | None = None
    long_tiles: int = 8
    # with PDL, the combine reads sink_k (a constant) and q (written before the split kernel) and forms the sink
    # logit before its wait (docs/PERF.md, "Constant weights loaded into registers before the PDL wait")
    preload: bool = True
    # with PDL, each split asks L2 for its first K/V lines and the combine counts its live splits before their waits,
    # from positions written two launches back or earlier (docs/PERF.md, "Reads of data written two launches back")
    early: bool = True

    def splits(self, slots: int, kv_heads: int, device: torch.device) -> int:
        """The grid's splits for a cache of `slots` slots (its workspace's size)."""
        return self.num_splits or default_num_splits(slots, kv_heads, _sm_count(device), self.split_min)

    @property
    def split_min(self) -> int:
        return self.block_n if self.min_split is None else self.min_split


# A full layer's splits grow long with the context (264 splits of ~2K slots at 512K): 64-slot tiles (32-slot ones cost
# 1.85x the added KV bytes: docs/PERF.md, "Current state", the context sweeps of 1946ffa), one in flight: the same bits
# as three, paired 0.98-0.99x from 1K to 256K, 1.004x at 512K (the rows of c29c1b3)
FULL = AttentionSettings(block_n=64, num_stages=1)
# a sliding split is a tile or two at any context (the draft's too): one tile in flight. Its window at 32-slot tiles
# makes up to 131 live splits, which the combine merges in one step of 256 (128 registers, no spill on sm_90a: bench
# sass) rather than two of 128; a numerical change, qualified with the q/k/v fold's split at TP 1 and TP 2
# (docs/PERF.md, "Current state", the candidate of 9c6eda1)
SLIDING = AttentionSettings(block_n=32, num_stages=1, combine_splits=256)


def settings_for(window: int | None) -> AttentionSettings:
    return FULL if window is None else SLIDING


def default_num_splits(slots: int, kv_heads: int, sms: int, min_split: int) -> int:
    """Enough splits for about two programs per SM at full capacity (one does not stream a 512K cache: docs/PERF.md,
    "Decisions rejected", one attention program an SM); short caches use fewer."""
    return max(1, min(triton.cdiv(slots, min_split), max(1, 2 * sms // kv_heads)))


# ---- kernels ---------------------------------------------------------------------------------------


@triton.jit
def _split_len(kv_len, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr):
    per = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    return tl.maximum(per, MIN_SPLIT)


@triton.jit
def _kv_len(q_pos_ptr, S, R, R_PAD: tl.constexpr):
    """Slots that can hold visible history: the rows' last position + 1, within the cache (0 for a block of padding
    rows only)."""
    i = tl.arange(0, R_PAD)
    n = tl.max(tl.load(q_pos_ptr + i, mask=i < R, other=-1), axis=0).to(tl.int32) + 1
    return tl.minimum(tl.maximum(n, 0), S)


@triton.jit
def _tile(q, q_pos, m_i, l_i, acc, n0, end, k_ptr, v_ptr, slot_pos_ptr, g, d, window, qk_scale,
          stride_ks, stride_kh, stride_vs, stride_vh,
          BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr):
    """One K/V tile of slots n0.. (those before `end`) into a split's online softmax: (max, sum, weighted V)."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < end
    sp = tl.load(slot_pos_ptr + n, mask=n_ok, other=-1)
    k = tl.load(k_ptr + n[:, None] * stride_ks + g * stride_kh + d[None, :], mask=n_ok[:, None], other=0.0)
    v = tl.load(v_ptr + n[:, None] * stride_vs + g * stride_vh + d[None, :], mask=n_ok[:, None], other=0.0)
    if F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale  # log2 domain
    vis = (sp[None, :] >= 0) & (q_pos[:, None] >= 0) & (sp[None, :] <= q_pos[:, None])
    if SLIDING:
        vis = vis & (sp[None, :] > q_pos[:, None] - window)
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _attention_split_kernel(
    q_ptr, k_ptr, v_ptr, slot_pos_ptr, q_pos_ptr,
    part_m_ptr, part_l_ptr, part_acc_ptr,
    S, R, window, qk_scale,
    stride_qr, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
    G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, SLIDING: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr,
    PDL: tl.constexpr = False, R_PAD: tl.constexpr = 16, EARLY_SLOTS: tl.constexpr = 0,
    LINE_ELEMS: tl.constexpr = 64, LINES: tl.constexpr = 2, LONG_STAGES: tl.constexpr = 0,
    LONG_TILES: tl.constexpr = 8,
):
    g = tl.program_id(0)
    split = tl.program_id(1)
    if EARLY_SLOTS == 0:
        wait_for_inputs(PDL)
    # With EARLY_SLOTS: the positions were written two launches back or earlier, so they are complete before this
    # kernel starts (kernels/launch.py): the split's range is known before the wait, and its first slots' K/V lines are
    # requested into L2 (a hint: L2 is coherent, so a line the previous kernel is still writing is read again
    # correctly after the wait).
    kv_len = _kv_len(q_pos_ptr, S, R, R_PAD)
    split_len = _split_len(kv_len, NUM_SPLITS, BLOCK_N, MIN_SPLIT)
    start = split * split_len
    if EARLY_SLOTS > 0:
        ahead = start + tl.arange(0, EARLY_SLOTS)
        ahead = tl.where(ahead < tl.minimum(start + split_len, kv_len), ahead, tl.minimum(start, S - 1))  # clamp
        prefetch_rows(k_ptr + ahead * stride_ks + g * stride_kh, 0, D, LINE_ELEMS, LINES)
        prefetch_rows(v_ptr + ahead * stride_vs + g * stride_vh, 0, D, LINE_ELEMS, LINES)
        wait_for_inputs(PDL)
    if start >= kv_len:
        return  # past the valid history: nothing read, nothing stored (the combine counts only live splits)
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
    if LONG_STAGES > 0 and split_len > LONG_TILES * BLOCK_N:
        # the same tiles in the same order, more of them in flight: split_len is one value for the whole grid, so
        # every program takes the same loop
        for n0 in tl.range(start, end, BLOCK_N, num_stages=LONG_STAGES):
            m_i, l_i, acc = _tile(q, q_pos, m_i, l_i, acc, n0, end, k_ptr, v_ptr, slot_pos_ptr, g, d, window,
                                  qk_scale, stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_N, SLIDING, F32, PREC)
    else:
        for n0 in range(start, end, BLOCK_N):
            m_i, l_i, acc = _tile(q, q_pos, m_i, l_i, acc, n0, end, k_ptr, v_ptr, slot_pos_ptr, g, d, window,
                                  qk_scale, stride_ks, stride_kh, stride_vs, stride_vh, BLOCK_N, SLIDING, F32, PREC)

    part = (g * NUM_SPLITS + split) * RG + rows
    tl.store(part_m_ptr + part, m_i, mask=row_ok)
    tl.store(part_l_ptr + part, l_i, mask=row_ok)
    tl.store(part_acc_ptr + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _sink_logit(q_ptr, sink_k_ptr, r, head, g, stride_qr, stride_qh, qk_scale, D: tl.constexpr,
                HAS_SINK: tl.constexpr):
    """s_sink of one row and head in the log2 domain (the partials'): fp32(q) . sink_k[g]; -inf without a sink,
    which then adds nothing to the merge."""
    if HAS_SINK:
        e = tl.arange(0, D)
        q = tl.load(q_ptr + r * stride_qr + head * stride_qh + e).to(tl.float32)
        s = tl.sum(q * tl.load(sink_k_ptr + g * D + e), axis=0) * qk_scale
    else:
        s = tl.full([], float("-inf"), tl.float32)
    return s


@triton.jit
def _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, first, RG, row, d, n_live, s_sink,
                  D: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, COLS: tl.constexpr):
    """(numerator [COLS], denominator) of one row's output from its live splits' partials and the sink, relative to
    their common max, which includes the sink so its exponential cannot overflow."""
    every = tl.arange(0, MAX_SPLITS)
    m = tl.max(tl.load(part_m_ptr + (first + every) * RG + row, mask=every < n_live, other=float("-inf")), axis=0)
    m = tl.maximum(m, s_sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # no visible slot and no sink
    s = tl.arange(0, BLOCK_S)
    den = tl.exp2(s_sink - m_safe)  # the sink, exactly once: a logit with a zero value
    acc = tl.zeros([COLS], tl.float32)
    for s0 in range(0, n_live, BLOCK_S):
        ok = s0 + s < n_live
        part = (first + s0 + s) * RG + row
        w = tl.exp2(tl.load(part_m_ptr + part, mask=ok, other=float("-inf")) - m_safe)
        den += tl.sum(tl.load(part_l_ptr + part, mask=ok, other=0.0) * w, axis=0)
        acc += tl.sum(tl.load(part_acc_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
                      * w[:, None], axis=0)
    return acc, den


@triton.jit
def _attention_combine_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, q_ptr, sink_k_ptr, q_pos_ptr, out_ptr,
    S, R, qk_scale, stride_qr, stride_qh, stride_or, stride_oh,
    G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, MAX_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    COLS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_SPLIT: tl.constexpr, HAS_SINK: tl.constexpr,
    PDL: tl.constexpr = False, R_PAD: tl.constexpr = 16, PRELOAD: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    # One program a (KV head, row, COLS columns), its warps across BLOCK_S splits a step: a step's partials are all
    # requested at once, so a program pays one dependent L2 round trip a step and many programs share the work.
    RG = R * G
    pid = tl.program_id(0) // (D // COLS)
    d = (tl.program_id(0) % (D // COLS)) * COLS + tl.arange(0, COLS)
    g = pid // RG
    row = pid % RG
    r = row // G
    head = g * G + row % G
    # PRELOAD: sink_k is a constant and q an input of the split kernel, written before it, so complete before this
    # kernel starts (kernels/launch.py); the logit's loads overlap the split kernel's tail.
    if PRELOAD:
        s_sink = _sink_logit(q_ptr, sink_k_ptr, r, head, g, stride_qr, stride_qh, qk_scale, D, HAS_SINK)
    if not EARLY:
        wait_for_inputs(PDL)
    kv_len = _kv_len(q_pos_ptr, S, R, R_PAD)  # EARLY: the positions are two launches back, as in the split kernel
    split_len = _split_len(kv_len, NUM_SPLITS, BLOCK_N, MIN_SPLIT)
    n_live = tl.cdiv(kv_len, split_len)  # <= NUM_SPLITS; later splits exited without storing
    if EARLY:  # the partials' loads go out right after the wait, not after a load of the positions
        wait_for_inputs(PDL)
    if not PRELOAD:
        s_sink = _sink_logit(q_ptr, sink_k_ptr, r, head, g, stride_qr, stride_qh, qk_scale, D, HAS_SINK)

    acc, den = _merge_splits(part_m_ptr, part_l_ptr, part_acc_ptr, g * NUM_SPLITS, RG, row, d, n_live, s_sink,
                             D, MAX_SPLITS, BLOCK_S, COLS)
    out = tl.where(den > 0, acc / den, 0.0)  # no visible slot and no sink: zeros, not NaN
    tl.store(out_ptr + r * stride_or + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# ---- host wrapper ----------------------------------------------------------------------------------


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(f"decode_attention: {message}")


def _check_settings(st: AttentionSettings) -> None:
    _check(_pow2(st.block_n, 16), f"block_n {st.block_n} must be a power of two >= 16")
    _check(st.split_min >= st.block_n and st.split_min % st.block_n == 0,
           f"min_split {st.min_split} must be a multiple of block_n")
    _check(st.num_splits is None or (isinstance(st.num_splits, int) and st.num_splits >= 1),
           f"num_splits must be None or an int >= 1, got {st.num_splits!r}")
    _check(isinstance(st.num_stages, int) and st.num_stages >= 1,
           f"num_stages must be an int >= 1, got {st.num_stages!r}")
    _check(st.long_stages is None or (isinstance(st.long_stages, int) and st.long_stages >= 1),
           f"long_stages must be None or an int >= 1, got {st.long_stages!r}")
    _check(isinstance(st.long_tiles, int) and st.long_tiles >= 1,
           f"long_tiles must be an int >= 1, got {st.long_tiles!r}")
    _check(st.num_warps in (1, 2, 4, 8, 16), f"num_warps {st.num_warps} must be a power of two <= 16")
    _check(_pow2(st.combine_splits, 16), f"combine_splits {st.combine_splits} must be a power of two >= 16")
    _check(_pow2(st.combine_cols, 16), f"combine_cols {st.combine_cols} must be a power of two >= 16")
    _check(st.combine_warps in (1, 2, 4, 8), f"combine_warps {st.combine_warps} must be 1, 2, 4 or 8")


def decode_attention_workspace(q: torch.Tensor, cache_k: torch.Tensor,
                               settings: AttentionSettings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split partials for q [R, Hq, D] over cache_k [S, Hkv, D] under `settings`: fp32 max [Hkv, splits, R*G],
    sum of exponentials [same] and weighted V [.., D], in the log2 domain. Any values: every live entry is written
    before it is read."""
    (R, Hq, D), (S, Hkv) = q.shape, cache_k.shape[:2]
    splits = settings.splits(S, Hkv, q.device)
    m = torch.empty((Hkv, splits, R * (Hq // Hkv)), dtype=torch.float32, device=q.device)
    return m, torch.empty_like(m), torch.empty((*m.shape, D), dtype=torch.float32, device=q.device)


def decode_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, slot_pos: torch.Tensor,
                     positions: torch.Tensor, scale: float, sink_k: torch.Tensor | None, window: int | None, *,
                     settings: AttentionSettings | None = None, out: torch.Tensor | None = None,
                     workspace: tuple[torch.Tensor, ...] | None = None, pdl: bool = False) -> torch.Tensor:
    """Attention of a decode block's rows over one layer's cache, with the sink key: q [R, Hq, D] (rotated queries,
    unit stride along D), cache_k/cache_v [S, Hkv, D] and slot_pos [S] int64 (a `fast.cache.LayerKV`'s), positions [R]
    int64 (-1 = padding row), scale (the softmax scale, config.scale), sink_k [Hkv, D] fp32 or None, window (sliding
    layers) or None -> [R, Hq, D] in q's dtype, fp32 inside.

    `settings`: None = `settings_for(window)`. `out` (like q) and `workspace` (`decode_attention_workspace` with the
    same settings) may be static buffers, e.g. for CUDA graphs; every element of `out` is written. `pdl`: launch both
    kernels with programmatic dependent launch (CUDA; kernels/launch.py), where `settings.early` asks that the
    positions were written two launches back or earlier.
    """
    st = settings_for(window) if settings is None else settings
    _check(isinstance(st, AttentionSettings), f"settings must be AttentionSettings, got {type(st).__name__}")
    _check_settings(st)
    _check(q.dim() == 3 and cache_k.dim() == 3 and cache_v.dim() == 3,
           "q, cache_k, cache_v must be [R, Hq, D], [S, Hkv, D], [S, Hkv, D]")
    R, Hq, D = q.shape
    S, Hkv, Dk = cache_k.shape
    _check(tuple(cache_v.shape) == tuple(cache_k.shape), f"cache_v {tuple(cache_v.shape)} differs from cache_k")
    _check(Dk == D, f"head_dim of q ({D}) and cache_k ({Dk}) differ")
    _check(_pow2(D, 16), f"head_dim {D} must be a power of two >= 16")
    _check(Hkv >= 1 and Hq % Hkv == 0, f"query heads {Hq} are not a multiple of kv heads {Hkv}")
    G = Hq // Hkv
    _check(1 <= R and R * G <= MAX_MATRIX_ROWS, f"rows x heads per kv head = {R * G} must be in 1..{MAX_MATRIX_ROWS}")
    _check(q.dtype in _FLOATS and cache_k.dtype in _FLOATS,
           f"q/cache dtypes {q.dtype}/{cache_k.dtype} must be bf16, fp16 or fp32")
    _check(cache_v.dtype == cache_k.dtype, f"cache_k and cache_v dtypes differ ({cache_k.dtype}, {cache_v.dtype})")
    _check(slot_pos.dtype == torch.int64 and tuple(slot_pos.shape) == (S,), f"slot_pos must be int64 [{S}]")
    _check(positions.dtype == torch.int64 and tuple(positions.shape) == (R,), f"positions must be int64 [{R}]")
    _check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
           f"scale must be a positive number, got {scale!r}")
    tensors = {"q": q, "cache_k": cache_k, "cache_v": cache_v, "slot_pos": slot_pos, "positions": positions}
    if sink_k is not None:
        _check(sink_k.dtype == torch.float32 and tuple(sink_k.shape) == (Hkv, D), f"sink_k must be fp32 [{Hkv}, {D}]")
        tensors["sink_k"] = sink_k
    for name, t in tensors.items():
        _check(t.device == q.device, f"{name} is on {t.device}, q on {q.device}")
        _check(t.is_contiguous() or (name == "q" and q.stride(2) == 1), f"{name} must be contiguous")
    _check(window is None or (isinstance(window, int) and window > 0),
           f"window must be a positive int or None, got {window!r}")

    num_splits = st.splits(S, Hkv, q.device)
    if workspace is None:
        workspace = decode_attention_workspace(q, cache_k, st)
    part_m, part_l, part_acc = workspace
    RG = R * G
    _check(tuple(part_m.shape) == (Hkv, num_splits, RG) and tuple(part_l.shape) == (Hkv, num_splits, RG)
           and tuple(part_acc.shape) == (Hkv, num_splits, RG, D), "workspace does not match the shapes and settings")
    _check(all(t.dtype == torch.float32 and t.device == q.device and t.is_contiguous() for t in workspace),
           "workspace must be contiguous fp32 on q's device")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _check(tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype and out.device == q.device
           and out.is_contiguous(), "out must be a contiguous tensor like q")

    f32 = INTERPRETED or q.dtype == torch.float32 or cache_k.dtype == torch.float32 or q.dtype != cache_k.dtype
    early = st.early and pdl and not INTERPRETED
    qk_scale = float(scale) * LOG2E  # the partials and the sink logit live in the log2 domain
    r_pad = max(16, triton.next_power_of_2(R))
    line_elems, lines = prefetch_lines(D, cache_k.element_size())
    _attention_split_kernel[(Hkv, num_splits)](
        q, cache_k, cache_v, slot_pos, positions, part_m, part_l, part_acc,
        S, R, window or 0, qk_scale,
        q.stride(0), q.stride(1), cache_k.stride(0), cache_k.stride(1), cache_v.stride(0), cache_v.stride(1),
        G=G, D=D, NUM_SPLITS=num_splits, BLOCK_M=max(16, triton.next_power_of_2(RG)), BLOCK_N=st.block_n,
        MIN_SPLIT=st.split_min, SLIDING=window is not None, F32=f32, PREC="ieee" if f32 else "tf32", R_PAD=r_pad,
        num_warps=st.num_warps, num_stages=st.num_stages, EARLY_SLOTS=EARLY_SLOTS if early else 0,
        LINE_ELEMS=line_elems, LINES=lines, LONG_STAGES=st.long_stages or 0, LONG_TILES=st.long_tiles,
        **launch_options(pdl, q.device))
    cols, max_splits = min(st.combine_cols, D), max(16, triton.next_power_of_2(num_splits))
    _attention_combine_kernel[(Hkv * RG * (D // cols),)](
        part_m, part_l, part_acc, q, sink_k if sink_k is not None else part_m, positions, out,
        S, R, qk_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        G=G, D=D, NUM_SPLITS=num_splits, MAX_SPLITS=max_splits, BLOCK_S=min(st.combine_splits, max_splits),
        COLS=cols, BLOCK_N=st.block_n, MIN_SPLIT=st.split_min, HAS_SINK=sink_k is not None, R_PAD=r_pad,
        num_warps=st.combine_warps, PRELOAD=st.preload, EARLY=early, **launch_options(pdl, q.device))
    return out
