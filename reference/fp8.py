"""FP8 E4M3 block quantization (docs/model.md: W[r, c] = W_e4m3[r, c] * scale_inv[r // B0, c // B1]).

Also DeepSeek-V3's per-token activation quantization (`act_quant`), which the checkpoint's `activation_scheme:
dynamic` names (docs/model.md, "Numerics"); the reference itself computes in float64 from dequantized weights.
"""

from __future__ import annotations

import math

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def expand_scales(scale_inv: torch.Tensor, shape: tuple[int, int], block: tuple[int, int],
                  offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Per-element scale of a [..., rows, cols] weight: scale_inv[..., (r + o0) // B0, (c + o1) // B1], where `offset`
    is where the weight starts inside its first scale block (a rank's slice may start mid-block)."""
    full = scale_inv.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)
    return full[..., offset[0]: offset[0] + shape[0], offset[1]: offset[1] + shape[1]]


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float64, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Real weight of an E4M3 tensor with block scales, computed in `dtype` (exact in float64)."""
    if weight.dim() < 2 or scale_inv.dim() < 2:
        raise ValueError(f"weight {tuple(weight.shape)} and scale {tuple(scale_inv.shape)} must be at least 2-D")
    rows, cols = weight.shape[-2:]
    want = scale_shape((rows + offset[0], cols + offset[1]), block)
    if tuple(scale_inv.shape[-2:]) != want or not all(0 <= o < b for o, b in zip(offset, block)):
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
                         f"with blocks {block} starting at {offset}")
    return weight.to(dtype) * expand_scales(scale_inv.to(dtype), (rows, cols), block, offset)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize a real [rows, cols] weight: (E4M3 weight, fp32 scale_inv)."""
    rows, cols = weight.shape
    nb0, nb1 = scale_shape((rows, cols), block)
    padded = torch.zeros(nb0 * block[0], nb1 * block[1], dtype=torch.float32)
    padded[:rows, :cols] = weight.float()
    tiles = padded.view(nb0, block[0], nb1, block[1])
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).float()
    q = (tiles / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.view(nb0 * block[0], nb1 * block[1])[:rows, :cols].contiguous(), scale_inv.contiguous()


def act_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 act_quant: per row and `group` contiguous channels, s = max(amax, 1e-4) / 448."""
    if x.shape[-1] % group:
        raise ValueError(f"last dimension {x.shape[-1]} is not a multiple of the group {group}")
    g = x.float().unflatten(-1, (x.shape[-1] // group, group))
    s = g.abs().amax(dim=-1).clamp(min=1e-4) / E4M3_MAX
    q = (g / s.unsqueeze(-1)).to(E4M3)
    return q.flatten(-2), s
