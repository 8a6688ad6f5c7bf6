"""The decode state that lives on the device for a whole request, and the result log the host reads.

Every tensor here is allocated once per engine, so captured graphs keep valid addresses; a request
fills it by copying, never by re-allocating. Scalars are 0-dim tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

import torch

MAX_DRAFTS = 7
VERIFY_ROWS = MAX_DRAFTS + 1  # one committed token + up to 7 drafts: the verification kernel width
MAX_STOP_IDS = 8
MAX_TOP_LOGPROBS = 20  # alternatives a token's log entry keeps at most (a top-k distribution has <= 20 by default)
TOKENS_PER_READ = 32  # the host reads the result log once per this many emitted tokens (streaming, cancel)


class DraftInputs(NamedTuple):
    """What the settle step leaves for the drafting that follows it (kernels/settle.py)."""

    tokens: torch.Tensor     # int64 [VERIFY_ROWS]: tokens[n + 1 + j] after the commit (the redraft block)
    positions: torch.Tensor  # int64 [VERIFY_ROWS]: n + j, the rows' positions (row p reads h_p and token p+1)
    live: torch.Tensor       # bool [VERIFY_ROWS]: j < count
    last: torch.Tensor       # int64 (): count - 1, the block's last live row
    row_pos: torch.Tensor    # int64 [MAX_DRAFTS]: n' + d - 2 for draft depth d = 1.. (n' = n + count): its row
    u_pos: torch.Tensor      # int64 [MAX_DRAFTS]: n' + d, its uniform's position

    @classmethod
    def allocate(cls, device: torch.device) -> "DraftInputs":
        def z(n, dt=torch.int64):
            return torch.zeros(n, dtype=dt, device=device)

        return cls(z(VERIFY_ROWS), z(VERIFY_ROWS), z(VERIFY_ROWS, torch.bool), z(()), z(MAX_DRAFTS), z(MAX_DRAFTS))


@dataclass
class DecodeState:
    # request parameters
    seed: torch.Tensor          # int64: the request seed's 64 bits
    temperature: torch.Tensor   # float32
    top_p: torch.Tensor         # float32
    budget: torch.Tensor        # int64: output tokens allowed
    stop_ids: torch.Tensor      # int64 [MAX_STOP_IDS], -1 = unused
    # sequence
    n: torch.Tensor             # int64: position of the pending token x_n (= main KV length)
    tokens: torch.Tensor        # int64 [capacity]: committed tokens by position; last entry is a trash slot
    hid: torch.Tensor           # [VERIFY_ROWS, H]: main hiddens of the last verification (or prefill tail)
    # drafts of the next round
    k: torch.Tensor             # int64: drafts generated
    drafts: torch.Tensor        # int64 [MAX_DRAFTS]
    q_ids: torch.Tensor         # int64 [MAX_DRAFTS, K]: each draft's proposal distribution
    q_probs: torch.Tensor       # float32 [MAX_DRAFTS, K]
    draft_h: torch.Tensor       # [1, H]: the last draft row's hidden (input of the next depth)
    product: torch.Tensor       # float32: running product of served probabilities
    more: torch.Tensor          # int32 [MAX_DRAFTS + 2]: more[d] = run draft depth d
    u_draft: torch.Tensor       # float32 [MAX_DRAFTS]: this round's draft uniforms, depth d at index d - 1
    # result log
    log_tokens: torch.Tensor    # int64 [log capacity]
    log_logprobs: torch.Tensor  # float32 [log capacity]
    log_rounds: torch.Tensor    # int64 [round capacity, 4]: drafts, accepted, emitted, bonus
    emitted: torch.Tensor       # int64
    rounds: torch.Tensor        # int64
    done: torch.Tensor          # int32: a stop token or the budget was reached
    running: torch.Tensor       # int32: condition of the decode loop
    target: torch.Tensor        # int64: the loop returns to the host once emitted reaches this
    # Held only where they are used, so a round without them launches nothing for them:
    halt: torch.Tensor | None = None         # int32: nonzero ends the loop (a peer collective gave up: TP on GPUs)
    log_top_ids: torch.Tensor | None = None  # int64 [log capacity, MAX_TOP_LOGPROBS]: each token's alternatives
    log_top_lp: torch.Tensor | None = None   # float32, the same shape: their log p under the model

    @classmethod
    def allocate(cls, capacity: int, log_capacity: int, hidden: int, top_k: int, dtype: torch.dtype,
                 device: torch.device) -> "DecodeState":
        def z(*shape, dt=torch.int64):
            return torch.zeros(shape, dtype=dt, device=device)

        return cls(
            seed=z(), temperature=z(dt=torch.float32), top_p=z(dt=torch.float32), budget=z(),
            stop_ids=torch.full((MAX_STOP_IDS,), -1, dtype=torch.int64, device=device),
            n=z(), tokens=z(capacity + 1), hid=z(VERIFY_ROWS, hidden, dt=dtype),
            k=z(), drafts=z(MAX_DRAFTS), q_ids=z(MAX_DRAFTS, top_k), q_probs=z(MAX_DRAFTS, top_k, dt=torch.float32),
            draft_h=z(1, hidden, dt=dtype), product=z(dt=torch.float32), more=z(MAX_DRAFTS + 2, dt=torch.int32),
            u_draft=z(MAX_DRAFTS, dt=torch.float32),
            log_tokens=z(log_capacity + 1), log_logprobs=z(log_capacity + 1, dt=torch.float32),
            log_rounds=z(log_capacity + 1, 4), emitted=z(), rounds=z(), done=z(dt=torch.int32),
            running=z(dt=torch.int32), target=z())

    def clear(self) -> None:
        for t in self.tensors():
            t.zero_()
        self.stop_ids.fill_(-1)

    def tensors(self) -> list[torch.Tensor]:
        return [t for f in fields(self) if (t := getattr(self, f.name)) is not None]

    def hold_alternatives(self) -> None:
        """The log of each token's top alternatives under the model (RoundRunner.logprobs), made once, before a capture."""
        if self.log_top_ids is None:
            rows, dev = self.log_tokens.shape[0], self.log_tokens.device
            self.log_top_ids = torch.zeros(rows, MAX_TOP_LOGPROBS, dtype=torch.int64, device=dev)
            self.log_top_lp = torch.zeros(rows, MAX_TOP_LOGPROBS, dtype=torch.float32, device=dev)

    def update_running(self) -> None:
        """The decode loop's condition, on the device: no stop yet, fewer than `target` tokens emitted, no halt."""
        go = (self.done == 0) & (self.emitted < self.target)
        if self.halt is not None:
            go = go & (self.halt == 0)
        self.running.copy_(go.to(torch.int32))

    @property
    def trash(self) -> int:
        """Index of the tokens buffer's trash entry (masked scatters of padding rows land there)."""
        return self.tokens.shape[0] - 1

    @property
    def log_trash(self) -> int:
        return self.log_tokens.shape[0] - 1
