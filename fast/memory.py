"""Will a rank's weights and caches fit? Answered from the config before any device work."""

from __future__ import annotations

import torch

from ..reference.checkpoint import expected_dtypes_and_shapes, shard_range, tensor_specs
from ..reference.config import Config, ConfigError
from .cache import StaticKV

HEADROOM = 1.15  # activations, graph pools, allocator slack


def rank_tensor_bytes(config: Config, tp: int, rank: int = 0) -> dict[str, int]:
    """Bytes of one rank's checkpoint slice of each tensor (its scale_inv included), by tensor name."""
    specs = tensor_specs(config)
    out: dict[str, int] = {}
    for name, (shape, dtype) in expected_dtypes_and_shapes(config).items():
        is_scale = name.endswith("_scale_inv")
        base = name[: -len("_scale_inv")] if is_scale else name
        numel = 1
        for d in shape:
            numel *= d
        part = shard_range(specs[base], config, tp, rank)
        if part is not None:
            dim, start, stop = part
            if is_scale:
                b = config.weight_block_size[dim]
                start, stop = start // b, -(-stop // b)
            numel = numel // shape[dim] * (stop - start)
        out[base] = out.get(base, 0) + numel * dtype.itemsize
    return out


def rank_weight_bytes(config: Config, tp: int, rank: int = 0) -> int:
    """Bytes of one rank's checkpoint slices (weights and their scales), as loaded."""
    return sum(rank_tensor_bytes(config, tp, rank).values())


def rank_bytes(config: Config, tp: int, max_context: int, dtype_bytes: int = 2) -> int:
    kv_heads = max(config.num_key_value_heads // tp, 1)
    lm_head32 = config.vocab_size // tp * config.hidden_size * (4 - 2)  # the fallback's fp32 copy (hold_lm_head_fp32)
    return rank_weight_bytes(config, tp) + lm_head32 + StaticKV.bytes_needed(config, kv_heads, max_context, dtype_bytes)


def check_memory(config: Config, tp: int, options, device_kind: str, ranks=None) -> None:
    """Raise a clear error when weights plus caches at the requested context exceed device memory on the GPUs of
    `ranks` (default all): each process checks only its own GPU, since querying one creates a context on it. With
    `options.shared_gpu` every rank lives on GPU 0, so rank 0 checks that GPU for all of them and the others skip."""
    if device_kind != "cuda":
        return
    dtype_bytes = options.torch_dtype(torch.device("cuda")).itemsize
    need = rank_bytes(config, tp, options.max_context, dtype_bytes) * HEADROOM
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
