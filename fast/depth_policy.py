"""What `--drafts auto` runs for a user's request on this device: the model's fitted depth controller where
speculation pays, plain sampling where verifying drafts costs more than it saves. The engines' own `drafts="auto"`
always means the controller (docs/round.md: both engines apply the same rule), so the qualification suite and the
engine tests compare the controller wherever they run; the CLI and the server ask `depth_policy` first.

Speculation pays where a verification block of up to 8 rows costs little more than one row (a weight stream: the
GPU); on a CPU the rows are compute, so a round costs several plain steps and emits ~2.5 tokens. The decision reads
`round_costs.json` beside the model: decode time per output token, measured once per device kind with plain
sampling and with the controller (`iquest fit-depth --round-costs DEVICE`). A device kind with no measurement keeps
the controller, whose threshold was fitted to GPU round times (depth_controller.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ROUND_COSTS_FILE = "round_costs.json"


@dataclass(frozen=True)
class DepthPolicy:
    drafts: int | str  # what the engine's generate() takes: 0 (plain), 3..7 (fixed) or "auto" (the controller)
    label: str         # what ran, for summaries and reports


def round_costs(model_dir: Path | None, device_kind: str) -> dict | None:
    """The measured decode costs of `device_kind` ("cpu", "cuda") beside the model, or None."""
    path = None if model_dir is None else Path(model_dir) / ROUND_COSTS_FILE
    if path is None or not path.exists():
        return None
    try:
        entry = json.loads(path.read_text()).get(device_kind)
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not a round-cost file ({e})") from None
    if entry is not None and not all(isinstance(entry.get(k), (int, float)) and entry[k] > 0
                                     for k in ("plain_us_per_token", "auto_us_per_token")):
        raise ValueError(f"{path}: {device_kind} needs positive plain_us_per_token and auto_us_per_token")
    return entry


def depth_policy(drafts: int | str, model_dir: Path | None, device_kind: str) -> DepthPolicy:
    """The policy for `--drafts` (auto, 0 or 3..7) on this device kind."""
    if drafts == 0:
        return DepthPolicy(0, "plain sampling (--drafts 0)")
    if drafts != "auto":
        return DepthPolicy(int(drafts), f"fixed depth {int(drafts)}")
    costs = round_costs(model_dir, device_kind)
    if costs is not None and costs["plain_us_per_token"] < costs["auto_us_per_token"]:
        return DepthPolicy(0, f"auto = plain sampling on {device_kind} (measured "
                              f"{costs['plain_us_per_token'] / 1000:.1f} ms a token plain, "
                              f"{costs['auto_us_per_token'] / 1000:.1f} ms with drafts: {ROUND_COSTS_FILE})")
    return DepthPolicy("auto", "auto = the fitted depth controller")
