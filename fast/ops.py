"""The two implementations of the model's heavy stages, chosen once per engine (`EngineOptions.kernels`).

`TorchOps` is the fallback every device runs (CPU CI included): dequantized matmuls and masked
attention over the whole static cache. `TritonOps` calls the kernels of `kernels/`: the FP8
block-scaled linear and split-KV decode attention, which evaluates visibility from `slot_pos` in
the kernel and reads a full layer only up to the block's last position (`kv_len` stays a device
tensor: no host read, graph-capturable). Both compute the same math; the kernels' rounding differs
(fp32 accumulation in other orders), which the qualification suite measures.
"""

from __future__ import annotations

import torch

from ..reference.layers import attention
from .cache import LayerKV
from .weights import FP8Weight


class TorchOps:
    name = "torch"

    def linear(self, w: FP8Weight, x: torch.Tensor) -> torch.Tensor:
        return w.linear(x)

    def attention(self, q: torch.Tensor, kv: LayerKV, positions: torch.Tensor,
                  sinks: torch.Tensor | None) -> torch.Tensor:
        return attention(q.float(), kv.k.float(), kv.v.float(), kv.visible(positions), sinks).to(q.dtype)


class TritonOps(TorchOps):
    name = "triton"
    MAX_MATRIX_ROWS = 128  # decode_attention packs rows x query heads per KV head into one matrix

    def __init__(self) -> None:
        from ..kernels.decode_attention import decode_attention
        from ..kernels.fp8_linear import fp8_linear

        self._attention, self._linear = decode_attention, fp8_linear

    def linear(self, w: FP8Weight, x: torch.Tensor) -> torch.Tensor:
        if w.q.dim() != 2:
            return super().linear(w, x)
        return self._linear(x, w.q, w.scale, w.block, out_dtype=x.dtype)

    def attention(self, q: torch.Tensor, kv: LayerKV, positions: torch.Tensor,
                  sinks: torch.Tensor | None) -> torch.Tensor:
        rows, q_heads = q.shape[0], q.shape[1]
        if rows * (q_heads // kv.k.shape[1]) > self.MAX_MATRIX_ROWS:  # long prefill blocks: not the decode path
            return super().attention(q, kv, positions, sinks)
        kv_len = (positions.max() + 1).view(1)
        return self._attention(q.contiguous(), kv.k, kv.v, kv.slot_pos, positions, sinks, kv.window,
                               kv.first_position, kv_len, causal=kv.causal)


def make_ops(name: str) -> TorchOps:
    if name == "torch":
        return TorchOps()
    if name == "triton":
        return TritonOps()
    raise ValueError(f"unknown kernels {name!r}: choose torch or triton")
