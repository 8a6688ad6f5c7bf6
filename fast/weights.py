"""One rank's weights: each rank reads only its own slices of the checkpoint (docs/model.md, "Tensor parallelism").

Linear weights are `Weight`s: block-FP8 E4M3 with fp32 scales (what the FP8 kernels consume), or plain bf16. The
format is a load option (`WEIGHT_FORMATS`): an FP8 checkpoint always runs as FP8; a BF16 checkpoint runs as BF16, or
is quantized once at load to E4M3 128x128 blocks
(over the whole blocks a rank's slice touches, so every TP degree runs the same values). The torch forms multiply by a dequantized copy in the compute
dtype, kept when it is small and rebuilt per call otherwise, so the full-size rank slice never holds a second, bf16
copy of its experts.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from ..reference.checkpoint import CheckpointReader, Shard, draft_prefix, expert_name, layer_prefix, shard_range
from ..reference.config import Config, ConfigError
from ..reference.fp8 import expand_scales, quantize
from .parallel import Parallel

HEAD_DTYPES = (torch.bfloat16, torch.float32)  # the LM heads' holdings: exact in fp32 products either way

KEEP_DENSE_BYTES = 64 << 20  # the torch forms keep a dequantized copy of a weight up to this size
WEIGHT_FORMATS = ("auto", "bf16", "fp8")
LOAD_BLOCK = (128, 128)  # a BF16 checkpoint quantized at load takes the published FP8 checkpoints' blocks


def weight_format(choice: str, config: Config, device: torch.device) -> str:
    """`--weights`: what a checkpoint's linears run as. auto = an FP8 checkpoint as FP8; a BF16 checkpoint as FP8 on
    CUDA (the kernels' format) and as BF16 elsewhere. bf16 on an FP8 checkpoint is refused (nothing to recover)."""
    if choice not in WEIGHT_FORMATS:
        raise ConfigError(f"--weights must be one of {', '.join(WEIGHT_FORMATS)}, got {choice!r}")
    if config.quantized:
        if choice == "bf16":
            raise ConfigError("--weights bf16: this checkpoint is block FP8; its weights run as stored (fp8)")
        return "fp8"
    if choice == "auto":
        return "fp8" if torch.device(device).type == "cuda" else "bf16"
    return choice


@dataclass
class Weight:
    """A linear's weight [..., out, in]: E4M3 `q` with fp32 block scales [..., ceil(out/B0), ceil(in/B1)], or a plain
    tensor (`scale` None). `offset`: where `q` starts inside its first scale block (a rank's 192-row shard of 128-row
    blocks starts mid-block)."""

    q: torch.Tensor
    scale: torch.Tensor | None
    block: tuple[int, int] | None
    dtype: torch.dtype
    offset: tuple[int, int] = (0, 0)
    _dense: torch.Tensor | None = field(default=None, repr=False)

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    def dense(self) -> torch.Tensor:
        if self._dense is not None:
            return self._dense
        if self.scale is None:
            w = self.q.to(self.dtype)
        else:
            s = expand_scales(self.scale, tuple(self.q.shape[-2:]), self.block, self.offset)
            w = (self.q.to(torch.float32) * s).to(self.dtype)
        if w.numel() * w.element_size() <= KEEP_DENSE_BYTES:
            self._dense = w
        return w

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.dense().T

    def select(self, index: torch.Tensor) -> torch.Tensor:
        """Stacked weights `index` picks ([..., out, in], compute dtype): from the kept dense copy when the stack is
        small, else by dequantizing only the gathered tiles, so a full-size expert stack is never dequantized whole."""
        if self._dense is not None or self.q.numel() * torch.finfo(self.dtype).bits // 8 <= KEEP_DENSE_BYTES:
            return self.dense()[index]
        if self.scale is None:
            return self.q[index].to(self.dtype)
        q = self.q.view(torch.uint8)[index].view(self.q.dtype).to(torch.float32)  # gather as bytes: any device
        return (q * expand_scales(self.scale[index], tuple(q.shape[-2:]), self.block, self.offset)).to(self.dtype)


def cat_rows(parts: list[Weight]) -> Weight | None:
    """One weight whose output rows are `parts`' in order, or None when a part's rows end inside a scale block (its
    last scale row would then cover the next part's first rows) or the parts differ in form."""
    first = parts[0]
    if any(p.q.dim() != 2 or p.quantized != first.quantized or p.q.shape[1] != first.q.shape[1] for p in parts):
        return None
    if first.quantized and any(p.block != first.block or p.offset != (0, 0) or p.q.shape[0] % first.block[0]
                               for p in parts):
        return None
    scale = torch.cat([p.scale for p in parts]) if first.quantized else None
    return Weight(torch.cat([p.q for p in parts]), scale, first.block, first.dtype)


def row_view(w: Weight, start: int, stop: int) -> Weight:
    """Output rows [start, stop) of a weight made by cat_rows, as a view (both ends on block boundaries there)."""
    if not w.quantized:
        return Weight(w.q[start:stop], None, None, w.dtype)
    b0 = w.block[0]
    return Weight(w.q[start:stop], w.scale[start // b0:stop // b0], w.block, w.dtype)


@dataclass
class Attention:
    wq: Weight
    wk: Weight
    wv: Weight
    wo: Weight                      # row-parallel: this rank's input columns
    q_norm: torch.Tensor            # [D], shared by the heads
    k_norm: torch.Tensor
    sink_k: torch.Tensor | None     # [kv heads of this rank, D] fp32
    wqkv: Weight | None = field(default=None, repr=False)  # q, k, v rows in one weight (__post_init__)

    def __post_init__(self) -> None:
        """Hold q/k/v as one weight so one launch projects all three (a decode block's projections are launch-bound);
        wq, wk, wv become views of it, so the torch forms' matmuls are unchanged."""
        self.wqkv = cat_rows([self.wq, self.wk, self.wv])
        if self.wqkv is not None:
            nq, nk = self.wq.q.shape[0], self.wk.q.shape[0]
            self.wq, self.wk, self.wv = (row_view(self.wqkv, a, b) for a, b in
                                         ((0, nq), (nq, nq + nk), (nq + nk, self.wqkv.q.shape[0])))


@dataclass
class DenseMLP:
    gate: Weight                    # [F/tp, H]
    up: Weight
    down: Weight                    # [H, F/tp]


@dataclass
class MoE:
    router: torch.Tensor            # [E, H] fp32, replicated: routing is an fp32 product
    gate: Weight                    # [E, I/tp, H]
    up: Weight
    down: Weight                    # [E, H, I/tp]


@dataclass
class LayerWeights:
    attention_norm: torch.Tensor
    attn_out_norm: torch.Tensor
    feed_forward_norm: torch.Tensor
    ffn_out_norm: torch.Tensor | None  # layer 0 and the draft block
    attn: Attention
    mlp: DenseMLP | MoE


@dataclass
class DraftWeights:
    embed: torch.Tensor             # [V/tp, H] the draft's own vocabulary rows
    lm_head: torch.Tensor           # [V/tp, H] its own head, held as stored (WeightLoader.head)
    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: Weight                 # [H, 2H/tp] columns of the row-parallel input
    block: LayerWeights
    final_layernorm: torch.Tensor


@dataclass
class ModelWeights:
    embed: torch.Tensor             # [V/tp, H] this rank's vocabulary rows
    lm_head: torch.Tensor           # [V/tp, H] held as stored (WeightLoader.head): the logits are fp32 products
    norm: torch.Tensor
    layers: list[LayerWeights]
    draft: DraftWeights
    vocab_offset: int
    format: str = "bf16"            # what the linears run as: bf16 or fp8


class WeightLoader:
    """Reads one rank's slices of a checkpoint into the engine's weight types."""

    def __init__(self, reader: CheckpointReader, par: Parallel, dtype: torch.dtype, bar, fmt: str = "bf16"):
        self.reader, self.par, self.dtype, self.bar, self.fmt = reader, par, dtype, bar, fmt

    def _read(self, name: str) -> Shard:
        self.bar.update(1)
        return self.reader.read_weight(name, self.par.world, self.par.rank)

    def plain(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._read(name).weight.to(device=self.par.device, dtype=dtype or self.dtype)

    def head(self, name: str) -> torch.Tensor:
        """An LM head as stored: bf16 (the published checkpoint's) or fp32, every value exact in the fp32 products
        (docs/model.md, "Numerics"), at half the bytes a call for bf16; any other float widened to fp32."""
        w = self._read(name).weight
        return w.to(device=self.par.device, dtype=w.dtype if w.dtype in HEAD_DTYPES else torch.float32)

    def linear(self, name: str) -> Weight:
        return self._weight(*self._read_linear(name))

    def _read_linear(self, name: str) -> tuple[Shard, tuple[int, int] | None]:
        """The rank's slice of a linear weight as it will run, with its block: stored FP8 as is; a BF16 weight to run
        as FP8 read over the whole LOAD_BLOCK blocks its slice touches and quantized there, so every TP degree runs
        the same values."""
        if self.reader.is_quantized(name) or self.fmt != "fp8":
            return self._read(name), self.reader.block
        spec = self.reader.specs[name]
        part = shard_range(spec, self.reader.config_of(name), self.par.world, self.par.rank)
        self.bar.update(1)
        if part is None:
            return Shard(*quantize(self.reader.read(name), LOAD_BLOCK)), LOAD_BLOCK
        dim, start, stop = part
        b = LOAD_BLOCK[dim]
        lo, hi = start // b * b, min(-(-stop // b) * b, spec.shape[dim])
        q, scale = quantize(self.reader.read(name, dim, lo, hi), LOAD_BLOCK)
        q = q.narrow(dim, start - lo, stop - start)
        return Shard(q, scale, (start - lo, 0) if dim == 0 else (0, start - lo)), LOAD_BLOCK

    def _weight(self, s: Shard, block: tuple[int, int] | None) -> Weight:
        dev = self.par.device
        if s.scale is not None:
            return Weight(s.weight.to(dev), s.scale.to(dev), block, self.dtype, s.offset)
        return Weight(s.weight.to(device=dev, dtype=torch.bfloat16), None, None, self.dtype)

    def experts(self, prefix: str, which: str, n: int) -> Weight:
        parts = [self._read_linear(expert_name(prefix, e, which)) for e in range(n)]
        shards = [p[0] for p in parts]
        scale = torch.stack([s.scale for s in shards]) if shards[0].scale is not None else None
        return self._weight(Shard(torch.stack([s.weight for s in shards]), scale, shards[0].offset), parts[0][1])

    def layer(self, c: Config, index: int, p: str) -> LayerWeights:
        a = p + "self_attn."
        attn = Attention(
            wq=self.linear(a + "q_proj.weight"), wk=self.linear(a + "k_proj.weight"),
            wv=self.linear(a + "v_proj.weight"), wo=self.linear(a + "o_proj.weight"),
            q_norm=self.plain(a + "q_norm.weight"), k_norm=self.plain(a + "k_norm.weight"),
            sink_k=self.plain(a + "sink_k", torch.float32).reshape(-1, c.head_dim) if c.enable_sink_attention else None)
        if c.is_dense(index):
            mlp = DenseMLP(self.linear(p + "mlp.gate_proj.weight"), self.linear(p + "mlp.up_proj.weight"),
                           self.linear(p + "mlp.down_proj.weight"))
        else:
            mlp = MoE(self.plain(p + "mlp.router.weight", torch.float32), self.experts(p, "gate_proj", c.num_experts),
                      self.experts(p, "up_proj", c.num_experts), self.experts(p, "down_proj", c.num_experts))
        return LayerWeights(
            attention_norm=self.plain(p + "attention_norm.weight"), attn_out_norm=self.plain(p + "attn_out_norm.weight"),
            feed_forward_norm=self.plain(p + "feed_forward_norm.weight"),
            ffn_out_norm=self.plain(p + "ffn_out_norm.weight") if index == 0 else None, attn=attn, mlp=mlp)


def load_weights(model_dir, config: Config, par: Parallel, dtype: torch.dtype, progress: bool | None = None,
                 loader: type[WeightLoader] = WeightLoader, fmt: str = "auto") -> ModelWeights:
    """Read this rank's slices of every tensor (target and draft), with a progress bar on rank 0. `fmt`: `--weights`
    (weight_format)."""
    reader = CheckpointReader(model_dir, config)
    fmt = weight_format(fmt, config, par.device)
    total = sum(1 for _ in reader.names())
    show = (par.rank == 0 and sys.stderr.isatty()) if progress is None else progress
    with tqdm(total=total, desc=f"loading weights (tp={par.world}, {fmt})", disable=not show, unit="tensor") as bar:
        ld = loader(reader, par, dtype, bar, fmt)
        layers = [ld.layer(config, i, layer_prefix(i)) for i in range(config.num_hidden_layers)]
        d = "mtp/"
        draft = DraftWeights(
            embed=ld.plain(d + "embed_tokens.weight"), lm_head=ld.head(d + "lm_head.weight"),
            enorm=ld.plain(d + "mtp.enorm.weight"), hnorm=ld.plain(d + "mtp.hnorm.weight"),
            eh_proj=ld.linear(d + "mtp.eh_proj.weight"), block=ld.layer(config.mtp, 0, draft_prefix()),
            final_layernorm=ld.plain(d + "mtp.final_layernorm.weight"))
        return ModelWeights(embed=ld.plain("model.embed_tokens.weight"),
                            lm_head=ld.head("lm_head.weight"), norm=ld.plain("model.norm.weight"),
                            layers=layers, draft=draft, vocab_offset=par.rank * (config.vocab_size // par.world),
                            format=fmt)
