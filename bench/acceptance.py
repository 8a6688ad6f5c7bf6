"""Time per output token on the mini model's acceptance profile (issue 8): a random-weight round emits one token,
so its latency is divided by the tokens per round the trained mini model's card measured at the same fixed depth
(float64 reference replay, `iquest card`). The round's work barely depends on acceptance: verify and the redraft
run the same row blocks whatever was accepted."""

from __future__ import annotations

import json

from ..cli.engines import default_model_dir


def mini_tokens_per_round(drafts: int) -> float | None:
    """Mean emitted tokens per round at fixed depth `drafts` from the shipped mini model's card.json, if recorded."""
    card = default_model_dir() / "card.json"
    if not card.exists():
        return None
    entry = json.loads(card.read_text()).get(f"fixed_depth_{drafts}")
    return None if entry is None else float(entry["mean_emitted_per_round"])


def tpot(round_us: float, drafts: int) -> dict | None:
    per = mini_tokens_per_round(drafts)
    if per is None:
        return None
    return {"tokens_per_round": per, "tpot_us": round_us / per,
            "source": f"fixtures/iquest-q1-mini/card.json fixed_depth_{drafts}"}
