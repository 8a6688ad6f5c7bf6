"""Will a rank's weights and caches fit? Answered from the config before any device work."""

from __future__ import annotations

import torch

from ..reference.checkpoint import shard_range, tensor_specs
from ..reference.config import Config, ConfigError
from ..reference.fp8 import scale_shape
from .cache import StaticKV
from .weights import weight_format

HEADROOM = 1.15  # activations, graph pools, allocator slack
FP32_HELD = ("lm_head.weight", "router.weight", "sink_k")  # held in fp32 whatever is stored (fast/weights.py)


def rank_tensor_bytes(config: Config, tp: int, rank: int = 0, fmt: str | None = None) -> dict[str, int]:
    """Bytes of one rank's slice of each logical tensor as the engine holds it (E4M3 + fp32 scales where the linears
    run as `fmt` = fp8, default the checkpoint's own format; bf16 elsewhere; heads and routers fp32), by name."""
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


def rank_bytes(config: Config, tp: int, max_context: int, dtype_bytes: int = 2, fmt: str | None = None) -> int:
    kv_heads = max(config.num_key_value_heads // tp, 1)
    return rank_weight_bytes(config, tp, fmt=fmt) + StaticKV.bytes_needed(config, kv_heads, max_context, dtype_bytes)


def check_memory(config: Config, tp: int, options, device_kind: str, ranks=None) -> None:
    """Raise a clear error when weights plus caches at the requested context exceed device memory on the GPUs of
    `ranks` (default all): each process checks only its own GPU, since querying one creates a context on it. With
    `options.shared_gpu` every rank lives on GPU 0, so rank 0 checks that GPU for all of them and the others skip."""
    if device_kind != "cuda":
        return
    dtype_bytes = options.torch_dtype(torch.device("cuda")).itemsize
    fmt = weight_format(options.weights, config, torch.device("cuda"))
    need = rank_bytes(config, tp, options.max_context, dtype_bytes, fmt) * HEADROOM
    for rank in range(tp) if ranks is None else ranks:
        if options.shared_gpu and rank > 0:
            continue
        gpu, ranks_there = (0, tp) if options.shared_gpu else (rank, 1)
        free, _ = torch.cuda.mem_get_info(gpu)
        if need * ranks_there > free:
            who = f"{tp} ranks sharing GPU 0 need" if options.shared_gpu else f"rank {rank} needs"
            raise ConfigError(f"{who} about {need * ranks_there / 2**30:.1f} GiB for weights and KV caches at "
                              f"--max-context {options.max_context} (tp={tp}), but GPU {gpu} has "
                              f"{free / 2**30:.1f} GiB free: raise --tp or lower --max-context")
