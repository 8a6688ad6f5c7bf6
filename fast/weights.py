"""One rank's weights: each rank reads only its own slices of the checkpoint (MODEL.md, "Tensor parallelism").

Quantized projections stay E4M3 with their block scales (what the FP8 kernels consume); the torch
fallback multiplies by a dequantized copy in the compute dtype, kept when it is small and rebuilt
per call otherwise, so the full-size rank slice never holds a second, bf16 copy of its experts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..reference.checkpoint import CheckpointReader, layer_prefix
from ..reference.config import Config
from ..reference.fp8 import expand_scales
from .parallel import Parallel

KEEP_DENSE_BYTES = 64 << 20  # fallback keeps a dequantized copy of a weight up to this size


@dataclass
class FP8Weight:
    """E4M3 weight [..., out, in] with fp32 block scales [..., ceil(out/B0), ceil(in/B1)]."""

    q: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    dtype: torch.dtype
    _dense: torch.Tensor | None = None
    # q in the MMA fragments' order (kernels/fp8_linear_direct.direct_weight), for stage linear_direct; made once,
    # before any capture (ModelWeights.hold_linear_direct)
    direct: torch.Tensor | None = field(default=None, repr=False)

    def dense(self) -> torch.Tensor:
        if self._dense is not None:
            return self._dense
        s = expand_scales(self.scale, tuple(self.q.shape[-2:]), self.block)
        w = (self.q.to(torch.float32) * s).to(self.dtype)
        if w.numel() * w.element_size() <= KEEP_DENSE_BYTES:
            self._dense = w
        return w

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dense().T

    def select(self, index: torch.Tensor) -> torch.Tensor:
        """Stacked weights `index` picks ([..., out, in], compute dtype): from the kept dense copy when the
        stack is small, else by dequantizing only the gathered E4M3 tiles (the same fp32 products as dense()),
        so a full-size expert stack is never dequantized whole."""
        if self._dense is not None or self.q.numel() * torch.finfo(self.dtype).bits // 8 <= KEEP_DENSE_BYTES:
            return self.dense()[index]
        q = self.q.view(torch.uint8)[index].view(self.q.dtype).to(torch.float32)  # gather as bytes: any device
        s = self.scale[index]
        (rows, cols), (b0, b1) = q.shape[-2:], self.block
        if rows % b0 or cols % b1:
            return (q * expand_scales(s, (rows, cols), self.block)).to(self.dtype)
        tiles = q.view(*q.shape[:-2], rows // b0, b0, cols // b1, b1)
        return tiles.mul_(s[..., :, None, :, None]).view(q.shape).to(self.dtype)

    def rows(self, start: int, stop: int) -> "FP8Weight":
        """Output rows [start, stop) as a view (both ends on block boundaries, so the scales slice with them)."""
        b0 = self.block[0]
        return FP8Weight(self.q[start:stop], self.scale[start // b0:stop // b0], self.block, self.dtype)


def cat_rows(parts: list[FP8Weight]) -> FP8Weight | None:
    """One weight whose output rows are `parts`' in order, or None when a part's rows end inside a scale block
    (its last scale row would then cover the next part's first rows)."""
    first = parts[0]
    if any(p.q.dim() != 2 or p.block != first.block or p.q.shape[1] != first.q.shape[1]
           or p.q.shape[0] % first.block[0] for p in parts):
        return None
    return FP8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), first.block, first.dtype)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    wq: FP8Weight
    wk: FP8Weight
    wv: FP8Weight
    wo: FP8Weight
    sinks: torch.Tensor | None      # this rank's query heads, fp32
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    router: torch.Tensor            # [E, H] bf16 as stored, replicated; routed in fp32 from the unrounded fp32 input
    gate: FP8Weight                 # [E, I/tp, H]
    up: FP8Weight                   # [E, I/tp, H]
    down: FP8Weight                 # [E, H, I/tp]
    wqkv: FP8Weight | None = field(default=None, repr=False)  # q, k, v rows in one tensor (__post_init__)
    router32: torch.Tensor | None = field(default=None, repr=False)  # the fallback's fp32 copy (hold_router_fp32)

    def __post_init__(self) -> None:
        """Hold q/k/v as one weight so one launch projects all three (a decode block's projections are
        launch-bound); wq, wk, wv become views of it, so the fallback's matmuls are unchanged."""
        self.wqkv = cat_rows([self.wq, self.wk, self.wv])
        if self.wqkv is not None:
            nq, nk = self.wq.q.shape[0], self.wk.q.shape[0]
            self.wq, self.wk, self.wv = (self.wqkv.rows(a, b) for a, b in
                                         ((0, nq), (nq, nq + nk), (nq + nk, self.wqkv.q.shape[0])))


@dataclass
class MTPWeights:
    block: LayerWeights
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: FP8Weight              # [H, 2H/tp] columns of the row-parallel input
    head_norm: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor             # [V/tp, H] this rank's vocabulary rows
    lm_head: torch.Tensor           # [V/tp, H] in the compute dtype; the logits are fp32 products of these values
    norm: torch.Tensor
    layers: list[LayerWeights]
    mtp: MTPWeights
    vocab_offset: int
    lm_head32: torch.Tensor | None = field(default=None, repr=False)  # the fallback's fp32 copy (hold_lm_head_fp32)

    def hold_lm_head_fp32(self) -> torch.Tensor:
        """An fp32 copy of the LM head for the fallback's fp32 matmul, made once when an engine is built (never
        lazily: inside a graph capture the copy would only be recorded). Converting per call moved ~0.7 GB per
        call at full size (3.1 ms of a 33 ms round, d572fe8); the LM-head kernel reads the rows as they are."""
        if self.lm_head32 is None:
            self.lm_head32 = self.lm_head if self.lm_head.dtype == torch.float32 else self.lm_head.float()
        return self.lm_head32

    def hold_linear_direct(self, make) -> int:
        """Every decode linear's weight (q/k/v, o_proj, the MTP block's and its eh_proj) also held as `make(q)` (the
        MMA fragments' order, stage linear_direct), made once when an engine is built, never inside a capture. Weights
        whose K is not whole 128-wide tiles are skipped (the kernel reads those tiles). Returns the weights made."""
        made = 0
        for fw in (*(w for lw in (*self.layers, self.mtp.block) for w in (lw.wqkv, lw.wo)), self.mtp.eh_proj):
            if fw is not None and fw.direct is None and fw.q.dim() == 2 and fw.q.shape[1] % 128 == 0:
                fw.direct = make(fw.q)
                made += 1
        return made

    def hold_router_fp32(self) -> None:
        """fp32 copies of every router (the MTP block's too) for the fallback's fp32 routing matmul, made once when an
        engine is built, as the LM head's: widening per call moved 6.3 MB a layer at full size. The router kernel
        reads the bf16 rows as they are."""
        for lw in (*self.layers, self.mtp.block):
            if lw.router32 is None:
                lw.router32 = lw.router.float()


def _to(t: torch.Tensor, par: Parallel, dtype: torch.dtype | None = None) -> torch.Tensor:
    return t.to(device=par.device, dtype=dtype or t.dtype)


class WeightLoader:
    """Reads one rank's slices of a checkpoint into the engine's weight types."""

    def __init__(self, reader: CheckpointReader, par: Parallel, dtype: torch.dtype, bar):
        self.reader, self.par, self.dtype, self.bar = reader, par, dtype, bar
        self.block = reader.config.weight_block_size

    def plain(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        w, _ = self.reader.read_weight(name, self.par.world, self.par.rank)
        self.bar.update(1)
        return _to(w, self.par, dtype or self.dtype)

    def fp8(self, name: str) -> FP8Weight:
        w, s = self.reader.read_weight(name, self.par.world, self.par.rank)
        self.bar.update(1)
        return FP8Weight(_to(w, self.par), _to(s, self.par), self.block, self.dtype)

    def experts(self, prefix: str, which: str, n: int) -> FP8Weight:
        parts = [self.fp8(f"{prefix}mlp.experts.{e}.{which}.weight") for e in range(n)]
        return FP8Weight(torch.stack([p.q for p in parts]), torch.stack([p.scale for p in parts]),
                         self.block, self.dtype)

    def layer(self, index: int) -> LayerWeights:
        c, p = self.reader.config, layer_prefix(index)
        return LayerWeights(
            input_norm=self.plain(p + "input_layernorm.weight"),
            post_norm=self.plain(p + "post_attention_layernorm.weight"),
            wq=self.fp8(p + "self_attn.q_proj.weight"), wk=self.fp8(p + "self_attn.k_proj.weight"),
            wv=self.fp8(p + "self_attn.v_proj.weight"), wo=self.fp8(p + "self_attn.o_proj.weight"),
            sinks=self.plain(p + "self_attn.sinks", torch.float32) if c.attention_sinks else None,
            q_norm=self.plain(p + "self_attn.q_norm.weight") if c.qk_norm else None,
            k_norm=self.plain(p + "self_attn.k_norm.weight") if c.qk_norm else None,
            router=self.plain(p + "mlp.gate.weight", torch.bfloat16),  # the kernel widens it in registers
            gate=self.experts(p, "gate_proj", c.n_routed_experts),
            up=self.experts(p, "up_proj", c.n_routed_experts),
            down=self.experts(p, "down_proj", c.n_routed_experts),
        )


def load_weights(model_dir, config: Config, par: Parallel, dtype: torch.dtype, progress: bool | None = None,
                 loader: type[WeightLoader] = WeightLoader) -> ModelWeights:
    """Read this rank's slices of every tensor, with a progress bar on rank 0."""
    reader = CheckpointReader(model_dir, config)
    total = sum(1 for _ in reader.names())
    show = (par.rank == 0 and sys.stderr.isatty()) if progress is None else progress
    with tqdm(total=total, desc=f"loading weights (tp={par.world})", disable=not show, unit="tensor") as bar:
        ld = loader(reader, par, dtype, bar)
        layers = [ld.layer(i) for i in range(config.num_hidden_layers)]
        m = layer_prefix(config.mtp_layer_index)
        mtp = MTPWeights(ld.layer(config.mtp_layer_index), ld.plain(m + "enorm.weight"),
                         ld.plain(m + "hnorm.weight"), ld.fp8(m + "eh_proj.weight"),
                         ld.plain(m + "shared_head.norm.weight"))
        embed = ld.plain("model.embed_tokens.weight")
        return ModelWeights(embed=embed, lm_head=ld.plain("lm_head.weight"), norm=ld.plain("model.norm.weight"),
                            layers=layers, mtp=mtp, vocab_offset=par.rank * (config.vocab_size // par.world))
