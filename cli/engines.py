"""One interface over both engines, for the CLI and the server: `Engine.generate(...) -> Iterator[Step]`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Protocol, Sequence

from ..reference.config import Config, GenerationConfig
from ..reference.sampling import SamplingParams
from ..reference.speculative import Step

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODELS = ("fixtures/iquest-q1-mini", "fixtures/tiny")


def default_model_dir() -> Path:
    """The shipped default model: the trained mini model, or the tiny random fixture before it exists in the published
    layout (a folder without the draft's mtp/config.json predates it)."""
    for rel in DEFAULT_MODELS:
        if (PACKAGE_ROOT / rel / "config.json").exists() and (PACKAGE_ROOT / rel / "mtp" / "config.json").exists():
            return PACKAGE_ROOT / rel
    raise FileNotFoundError(f"no shipped model found under {PACKAGE_ROOT / 'fixtures'}; pass --model DIR")


class Engine(Protocol):
    """An engine whose `supports_top_logprobs` is true also takes `generate(..., top_logprobs=N)` and fills
    `Step.top_logprobs`; the server refuses top_logprobs for one that does not."""

    config: Config
    generation: GenerationConfig

    def generate(self, prompt: Sequence[int], *, seed: int, params: SamplingParams, max_new_tokens: int,
                 drafts: int | str, stop_ids: Sequence[int]) -> Iterator[Step]: ...


@dataclass
class ReferenceEngine:
    """The float64 reference: slow, exact, the ground truth for numerics."""

    model_dir: Path
    supports_top_logprobs = True

    def __post_init__(self) -> None:
        from ..reference.model import ReferenceModel

        self.model = ReferenceModel.load(self.model_dir)
        self.config = self.model.config
        self.generation = GenerationConfig.from_dir(self.model_dir, self.config)

    def policy(self, drafts):
        """The reference runs what it is asked: `auto` is the fitted controller whatever a device's costs."""
        from ..fast.depth_policy import depth_policy

        return depth_policy(drafts, None, "cpu")

    def generate(self, prompt, *, seed, params, max_new_tokens, drafts, stop_ids, top_logprobs=0):
        from ..reference.speculative import generate

        return generate(self.model, prompt, seed=seed, params=params, max_new_tokens=max_new_tokens,
                        drafts=drafts, stop_ids=stop_ids, top_logprobs=top_logprobs)


def load_engine(name: str, model_dir: str | Path, tp: int = 1, max_context: int = 4096, dtype: str = "auto",
                device: str = "auto", kernels: str = "auto", weights: str = "auto", prefix_reuse: bool = False,
                router_fold: bool = False) -> Engine:
    """The named engine over a model folder. `weights` (fast engine): what its linears run as, auto, bf16 or fp8
    (fast/weights.weight_format); the reference always computes the checkpoint's exact values. `prefix_reuse`: the
    fast engine will keep its rings' copy between requests (the server's), so its memory check counts it.
    `router_fold`: EngineOptions.router_fold (fast engine only)."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"model folder {model_dir} has no config.json")
    if name == "reference":
        if tp != 1:
            raise ValueError("the reference engine runs on one CPU process: --tp must be 1")
        return ReferenceEngine(model_dir)
    if name == "fast":
        from ..fast.engine import FastEngine
        from ..fast.rank import EngineOptions

        return FastEngine.load(model_dir, tp=tp, device=device,
                               options=EngineOptions(max_context=max_context, dtype=dtype, kernels=kernels,
                                                     weights=weights, prefix_reuse=prefix_reuse,
                                                     router_fold=router_fold))
    raise ValueError(f"unknown engine {name!r}")
