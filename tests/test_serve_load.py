"""Bounded load tests on 127.0.0.1. 30 concurrent streaming clients per round (some cancel after the
first chunk, some send bad input) against a queue of 6: every valid request completes or gets 429,
every bad one 400, nothing hangs (every wait is bounded), the server ends each round idle, and its
memory (RSS of this process, where the server runs) stays within a bound across rounds. And a mix of
what must not freeze or starve it (issue 36): bodies at and past the size cap, queued clients that
give up, a stream cancelled mid-way; /health stays fast throughout, the abandoned leave the queue
while the engine is still busy, and the next request returns what it returns alone."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iquest.cli.engines import load_engine
from iquest.serve.app import ServeOptions, create_app, default_max_body_size
from iquest.serve.server import ServerThread, load_tokenizer
from iquest.serve.testing import sse_events

from iquest.tests.helpers import TINY
CLIENTS = 30
ROUNDS = 4
TIMEOUT = 30.0                 # per client request
RSS_GROWTH_BOUND = 24 * 2**20  # bytes, from the end of the first round to the end of the last


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def client(url: str, i: int, out: dict) -> None:
    kind = ("valid", "cancel", "bad")[i % 5 % 3]  # 0,3 valid; 1,4 cancel; 2 bad
    body = {"prompt": f"def f{i}(x):", "max_tokens": 8, "seed": i, "stream": True}
    if kind == "bad":
        body = {**body, "top_p": 2.0} if i % 2 else {**body, "max_tokens": 0}
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                out[i] = (kind, r.status_code, r.json()["error"]["code"])
                return
            lines = r.iter_lines()
            if kind == "cancel":
                next(lines)
                out[i] = (kind, 200, "cancelled")
                return  # leaving the with-block closes the connection mid-stream
            events = sse_events(lines)
            out[i] = (kind, 200, events[-1])


def metric(url: str, name: str, **labels) -> float:
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


@pytest.fixture(scope="module")
def server():
    engine = load_engine("fast", TINY, 1, max_context=256)
    app = create_app(engine, load_tokenizer(TINY),
                     ServeOptions("tiny", queue_size=6, max_context=256, drafts=0, deadline=60))
    with ServerThread(app) as s:
        yield s


class HeldEngine:
    """The real engine, whose decodes pause after each Step while `hold` is set: a test that needs the
    engine busy holds it so, instead of racing a 200-token CPU decode (on a slow CI machine that decode
    finished before the queued clients had given up)."""

    def __init__(self, engine):
        self.engine, self.hold = engine, threading.Event()
        self.config, self.generation = engine.config, engine.generation

    def generate(self, prompt, **kwargs):
        with contextlib.closing(self.engine.generate(prompt, **kwargs)) as steps:
            for step in steps:
                yield step
                end = time.monotonic() + TIMEOUT
                while self.hold.is_set() and time.monotonic() < end:
                    time.sleep(0.005)


@pytest.fixture(scope="module")
def held_server():
    engine = HeldEngine(load_engine("fast", TINY, 1, max_context=256))
    app = create_app(engine, load_tokenizer(TINY),
                     ServeOptions("tiny", queue_size=6, max_context=256, drafts=0, deadline=60))
    with ServerThread(app) as s:
        yield s, engine


def test_concurrent_clients_complete_or_get_429_and_memory_stays_bounded(server):
    sizes = []
    totals = {"ok": 0, "429": 0, "400": 0}
    for _ in range(ROUNDS):
        out: dict = {}
        threads = [threading.Thread(target=client, args=(server.url, i, out), daemon=True) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT + 10)
        assert not any(t.is_alive() for t in threads), "a client hung"
        assert len(out) == CLIENTS
        for i, (kind, status, last) in out.items():
            if kind == "bad":
                assert status == 400 and last is None, out[i]
                totals["400"] += 1
            elif status == 429:
                assert last == "queue_full"
                totals["429"] += 1
            else:
                assert status == 200, out[i]
                assert kind == "cancel" or last == "[DONE]", out[i]
                totals["ok"] += 1
        # the round's work drains: nothing left running or queued
        for _ in range(500):
            if metric(server.url, "iquest_running") == 0 and metric(server.url, "iquest_queue_depth") == 0:
                break
            threading.Event().wait(0.02)
        else:
            pytest.fail("the server did not drain")
        sizes.append(rss())
    assert totals["ok"] >= ROUNDS and totals["400"] == ROUNDS * 6
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "seed": 1}, timeout=TIMEOUT)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    assert sizes[-1] - sizes[0] < RSS_GROWTH_BOUND, f"RSS by round: {[s >> 20 for s in sizes]} MiB"


# seconds for one /health answer under the mix below, its clients' threads in this process too (a 1 MiB
# prompt tokenized on the event loop held it about 1 s; test_serve_limits holds the server alone to 0.1 s)
HEALTH_BOUND = 0.25


def test_large_bodies_abandoned_clients_and_cancels_neither_freeze_nor_starve_the_server(held_server):
    server, engine = held_server
    normal = {"prompt": "def g(x):", "max_tokens": 16, "seed": 21}
    limit = default_max_body_size(256)
    filler = limit - len(json.dumps({"prompt": "", "max_tokens": 4}))
    large = [(json.dumps({"prompt": "x" * filler, "max_tokens": 4}).encode(), 400),
             (json.dumps({"prompt": "x" * (filler + 1), "max_tokens": 4}).encode(), 413)]
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        alone = http.post("/v1/completions", json=normal).json()["choices"][0]["text"]
        latencies: list[float] = []
        stop_polling = threading.Event()

        def poll_health() -> None:
            with httpx.Client(base_url=server.url, timeout=TIMEOUT) as h:
                h.get("/health")
                while not stop_polling.is_set():
                    start = time.perf_counter()
                    assert h.get("/health").status_code == 200
                    latencies.append(time.perf_counter() - start)
                    time.sleep(0.01)

        def abandon(i: int, out: dict) -> None:  # waits in the queue behind the long stream, then gives up
            try:
                r = httpx.post(server.url + "/v1/completions", json={**normal, "seed": i}, timeout=0.3)
                out[i] = r.status_code
            except httpx.TimeoutException:
                out[i] = "gave up"

        def send_large(i: int, out: dict) -> None:
            raw, _ = large[i % 2]
            r = httpx.post(server.url + "/v1/completions", content=raw, timeout=TIMEOUT,
                           headers={"content-type": "application/json"})
            out[i] = r.status_code

        poller = threading.Thread(target=poll_health, daemon=True)
        poller.start()
        for _ in range(2):
            emitted = metric(server.url, "iquest_emitted_tokens_total")
            engine.hold.set()
            with http.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 200, "stream": True,
                                                              "seed": 3}) as long:
                # the engine is busy with this stream: it drew a token and is held (the token's text may be part of a
                # character the stream holds back, so the metrics, not the first line, say so)
                end = time.monotonic() + TIMEOUT
                while metric(server.url, "iquest_running") != 1 or \
                        metric(server.url, "iquest_emitted_tokens_total") == emitted:
                    assert time.monotonic() < end, "the long stream never started decoding"
                    time.sleep(0.02)
                waited: dict = {}
                sized: dict = {}
                threads = [threading.Thread(target=abandon, args=(i, waited)) for i in range(8)] + \
                          [threading.Thread(target=send_large, args=(i, sized)) for i in range(4)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(TIMEOUT)
                assert not any(t.is_alive() for t in threads), "a client hung"
                assert set(waited.values()) <= {"gave up", 429} and "gave up" in waited.values(), waited
                assert sized == {i: large[i % 2][1] for i in range(4)}, sized
                end = time.monotonic() + 5
                while metric(server.url, "iquest_queue_depth") != 0:  # the abandoned leave while it decodes
                    assert time.monotonic() < end, "abandoned clients kept their places"
                    time.sleep(0.02)
                assert metric(server.url, "iquest_running") == 1
            # leaving the block closes the long stream mid-way: once released, its decode is cancelled
            engine.hold.clear()
            end = time.monotonic() + 10
            while metric(server.url, "iquest_running") != 0:
                assert time.monotonic() < end, "the cancelled stream kept decoding"
                time.sleep(0.02)
            assert metric(server.url, "iquest_emitted_tokens_total") - emitted < 200, "the stream was not cancelled"
        stop_polling.set()
        poller.join(TIMEOUT)
        assert http.post("/v1/completions", json=normal).json()["choices"][0]["text"] == alone
    assert len(latencies) >= 10 and max(latencies) < HEALTH_BOUND, \
        f"/health took up to {max(latencies) * 1e3:.0f} ms"
