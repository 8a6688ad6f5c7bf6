"""kernels/allreduce.py on one GPU as a world of one rank (its own buffer its only peer): the re-arm restores the
sentinel over everything the previous call wrote, its rows and its width, when calls of one buffer differ in width (the
sampling gather's K and the logprobs gather's differ within a round). A re-arm only as wide as the current call leaves a
wider call's tail stale, where a later wide call would read it as arrived (the negative control, `rearm_width`). The
peer protocol itself, between ranks, is tests/test_tp_collectives.py's."""

from __future__ import annotations

import pytest
import torch

from iquest.kernels import allreduce as ar
from iquest.tests.kernel_controls import BROKEN

pytestmark = pytest.mark.gpu

ROWS, WIDTH = 8, 64


def _buffer(dtype: torch.dtype):
    own = ar.arm(torch.empty((ar.SLOTS, 1, ROWS, WIDTH), dtype=dtype, device="cuda"))
    peers = torch.tensor([own.data_ptr()], dtype=torch.int64, device="cuda")
    state = torch.zeros(8, dtype=torch.int32, device="cuda")
    error = torch.zeros((), dtype=torch.int32, device="cuda")
    return own, peers, state, error


def _armed(own: torch.Tensor) -> torch.Tensor:
    """Where the buffer holds its sentinel."""
    if own.dtype == torch.int64:
        return own == ar.INT64_MIN
    return own.view(torch.int16) == -32768


def _widths_then_slot0(rearm=None) -> torch.Tensor:
    """All-reduces of widths 64, 8, 8 (slots 0, 1, 2): the second call re-arms slot 0, which the first filled 64 wide;
    the sentinel mask of slot 0 after the third."""
    own, peers, state, error = _buffer(torch.bfloat16)
    pieces = {} if rearm is None else {"rearm": rearm}
    for width in (WIDTH, 8, 8):
        x = torch.randn(ROWS, width, device="cuda").to(torch.bfloat16) + 3  # no -0.0 among them
        got = ar._all_reduce(x, peers, own, state, error, 0, 0, 2_000_000_000, None, None, False, **pieces)
        assert torch.equal(got, x)  # a world of one: the sum is the rank's own rows
    torch.cuda.synchronize()
    assert int(error) == 0 and int(state[0]) == 3 and state[5:].tolist() == [WIDTH, 8, 8]
    return _armed(own[0, 0])


def test_rearm_covers_the_previous_calls_width():
    assert bool(_widths_then_slot0().all())


def test_a_rearm_as_wide_as_the_current_call_leaves_a_stale_tail():
    armed = _widths_then_slot0(BROKEN["rearm_width"])
    assert bool(armed[:, :8].all()), "the control re-arms the current call's width"
    assert not bool(armed[:, 8:].any()), "the control's stale tail: the wider call's data still there"


def test_gathers_of_unlike_widths_leave_every_used_slot_armed():
    own, peers, state, error = _buffer(torch.int64)
    for k in (WIDTH, 4, 4, 20):
        keys = torch.randint(0, 2 ** 40, (ROWS, k), device="cuda")
        assert torch.equal(ar.all_gather(keys, peers, own, state, error, 0), keys)
    torch.cuda.synchronize()
    # the 4th call (slot 0, 20 wide) re-armed slot 2 (4 wide); slot 1 was re-armed by the 3rd call, 4 wide of 4
    assert bool(_armed(own[1:]).all()) and int(error) == 0
    assert not bool(_armed(own[0, 0, :, :20]).any()) and bool(_armed(own[0, 0, :, 20:]).all())
