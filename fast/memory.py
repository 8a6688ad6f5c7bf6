"""Will a rank's weights and caches fit? Answered from the config before any device work.

Prefix reuse (`iquest serve --prefix-reuse on`, the default) holds one more copy of every ring layer's K, V and
slot_pos a rank (cache.RingSnapshot, made at the first request that keeps its prefix): at the published size, once
the context outgrows the 4,096-token window, 137 MB a rank at TP 8 and 1.08 GB at TP 1. `check_memory` counts it
where the engine's options say the server will keep it (`EngineOptions.prefix_reuse`, from `--prefix-reuse`).
"""

from __future__ import annotations

import torch

from ..reference.checkpoint import shard_range, tensor_specs
from ..reference.config import Config, ConfigError
from ..reference.fp8 import scale_shape
from .cache import StaticKV, layer_slots, windows
from .state import VERIFY_ROWS
from .weights import weight_format

HEADROOM = 1.15  # activations, graph pools, allocator slack
FP32_HELD = ("router.weight", "sink_k")  # held in fp32 whatever is stored; the heads as stored, bf16 (fast/weights.py)


def rank_tensor_bytes(config: Config, tp: int, rank: int = 0, fmt: str | None = None) -> dict[str, int]:
    """Bytes of one rank's slice of each logical tensor as the engine holds it (E4M3 + fp32 scales where the linears
    run as `fmt` = fp8, default the checkpoint's own format; bf16 elsewhere, the heads too; routers fp32), by name."""
    fp8 = config.quantized if fmt is None else fmt == "fp8"
    block = config.weight_block_size or (128, 128)
    out: dict[str, int] = {}
    for name, spec in tensor_specs(config).items():
        shape = list(spec.shape)
        part = shard_range(spec, config.mtp if name.startswith("mtp/") else config, tp, rank)
        scale = list(scale_shape(tuple(spec.shape), block)) if spec.quantized and fp8 else None
        if part is not None:
            dim, start, stop = part
            shape[dim] = stop - start
            if scale is not None:
                scale[dim] = -(-stop // block[dim]) - start // block[dim]
        numel = 1
        for d in shape:
            numel *= d
        size = 1 if scale is not None else 4 if name.endswith(FP32_HELD) else 2
        out[name] = numel * size + (4 * scale[0] * scale[1] if scale is not None else 0)
    return out


def rank_weight_bytes(config: Config, tp: int, rank: int = 0, fmt: str | None = None) -> int:
    """Bytes of one rank's slices (weights and their scales) as the engine holds them (`fmt`: rank_tensor_bytes)."""
    return sum(rank_tensor_bytes(config, tp, rank, fmt).values())


def prefix_snapshot_bytes(config: Config, tp: int, max_context: int, dtype_bytes: int = 2) -> int:
    """Bytes of one rank's copy of its ring caches for prefix reuse: K, V and slot_pos of every layer, the draft's
    included, whose ring has fewer slots than the caches hold positions (0 when no layer's does)."""
    kv_heads = max(config.num_key_value_heads // tp, 1)
    # the caches hold the context and a verification block's overrun past it (rank.cache_capacity): a window that
    # with its slack covers that many positions gets one slot a position, which decode writes only past the prompt
    capacity = max_context + 2 * VERIFY_ROWS
    total = 0
    for window in windows(config):
        slots = layer_slots(window, capacity)
        if window is not None and slots < capacity:
            total += 2 * (slots + 1) * kv_heads * config.head_dim * dtype_bytes + 8 * (slots + 1)
    return total


def router_fold_bytes(config: Config, tp: int) -> int:
    """What the router fold adds to a rank (EngineOptions.router_fold, fast/router_fold.py): its scaled router, fp32
    [E, H], beside every MoE layer's router, the draft's included; nothing where it does not fold (across ranks)."""
    if tp > 1:
        return 0
    layers = [(config, i) for i in range(config.num_hidden_layers)] + [(config.mtp, 0)]  # the draft's one block
    return sum(c.num_experts * c.hidden_size * 4 for c, i in layers if not c.is_dense(i))


def expert_prefetch_bytes(config: Config, tp: int, router_fold: bool) -> int:
    """What the expert prefetch adds to a rank (EngineOptions.expert_prefetch, fast/expert_prefetch.py): its
    predictor W', fp32 [E, H], beside every sliding target MoE layer's router, except where the router fold holds
    it."""
    if router_fold and tp == 1:
        return 0
    return sum(config.num_experts * config.hidden_size * 4 for i in range(config.num_hidden_layers)
               if not config.is_dense(i) and config.window(i) is not None)


def rank_bytes(config: Config, tp: int, max_context: int, dtype_bytes: int = 2, fmt: str | None = None,
               prefix_reuse: bool = False, router_fold: bool = False, expert_prefetch: bool = False) -> int:
    """A rank's weights and KV caches; with `prefix_reuse`, and the copy of its rings that prefix reuse keeps; with
    `router_fold`, and the fold's scaled routers; with `expert_prefetch`, and the prefetch's predictors."""
    kv_heads = max(config.num_key_value_heads // tp, 1)
    return rank_weight_bytes(config, tp, fmt=fmt) + StaticKV.bytes_needed(config, kv_heads, max_context, dtype_bytes) \
        + (prefix_snapshot_bytes(config, tp, max_context, dtype_bytes) if prefix_reuse else 0) \
        + (router_fold_bytes(config, tp) if router_fold else 0) \
        + (expert_prefetch_bytes(config, tp, router_fold) if expert_prefetch else 0)


def check_memory(config: Config, tp: int, options, device_kind: str, ranks=None, prefix_reuse: bool | None = None) \
        -> None:
    """Raise a clear error when weights plus caches at the requested context exceed device memory on the GPUs of
    `ranks` (default all): each process checks only its own GPU, since querying one creates a context on it. With
    `options.shared_gpu` every rank lives on GPU 0, so rank 0 checks that GPU for all of them and the others skip.
    `prefix_reuse` (None: `options.prefix_reuse`, which iquest serve sets from --prefix-reuse) counts the rings' copy
    too."""
    if device_kind != "cuda":
        return
    if prefix_reuse is None:
        # counted at the start: the copy is made mid-serving, where running out of memory would fail a request
        prefix_reuse = options.prefix_reuse
    dtype_bytes = options.torch_dtype(torch.device("cuda")).itemsize
    fmt = weight_format(options.weights, config, torch.device("cuda"))
    need = rank_bytes(config, tp, options.max_context, dtype_bytes, fmt, prefix_reuse, options.router_fold,
                      options.expert_prefetch) * HEADROOM
    for rank in range(tp) if ranks is None else ranks:
        if options.shared_gpu and rank > 0:
            continue
        gpu, ranks_there = (0, tp) if options.shared_gpu else (rank, 1)
        free, _ = torch.cuda.mem_get_info(gpu)
        if need * ranks_there > free:
            who = f"{tp} ranks sharing GPU 0 need" if options.shared_gpu else f"rank {rank} needs"
            what = "weights, KV caches and the prefix-reuse copy of the rings" if prefix_reuse else \
                "weights and KV caches"
            what += " (and the router fold's scaled routers)" if options.router_fold and tp == 1 else ""
            what += " (and the expert prefetch's predictors)" if options.expert_prefetch else ""
            raise ConfigError(f"{who} about {need * ranks_there / 2**30:.1f} GiB for {what} at "
                              f"--max-context {options.max_context} (tp={tp}), but GPU {gpu} has "
                              f"{free / 2**30:.1f} GiB free: raise --tp or lower --max-context")
