"""CUDA graph of the decode loop: one replay runs rounds on the device until 32 more tokens are logged
or the request ends (a WHILE conditional node around the round; draft depths 4-7 are IF nodes inside).

Captured once per (controller, top_k) at load or first use; capture and upload are off the decode clock.
"""

from __future__ import annotations

import torch

from .flow import EagerFlow, GraphFlow
from .round import RoundRunner
from .state import TOKENS_PER_READ, DecodeState


class DecodeLoopGraph:
    def __init__(self, graph: torch.cuda.CUDAGraph, flow: GraphFlow):
        self.graph, self.flow = graph, flow  # the flow must outlive the graph (its pool and kernel)

    def replay(self) -> None:
        self.graph.replay()


def capture_decode_loop(st: DecodeState, runner: RoundRunner, device: torch.device) -> DecodeLoopGraph:
    def body() -> None:
        runner.round()
        st.update_running()

    # Warm up every kernel and library call eagerly (on state that start() will clear), then capture.
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for more in (0, 1):
            st.clear()
            st.more.fill_(more)
            runner.round()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    st.clear()
    flow = GraphFlow(device)
    runner.flow = flow
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            st.target.copy_(st.emitted + TOKENS_PER_READ)
            st.update_running()
            flow.loop(st.running, body)
    finally:
        runner.flow = EagerFlow()  # prefill's drafting runs eagerly
    return DecodeLoopGraph(graph, flow)
