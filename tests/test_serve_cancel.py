"""Cancellation, the bounded queue and the deadline, with the decode held at known points
(`HeldEngine`) instead of sleeps: a stream abandoned mid-way stops its decode at the engine's next
read and the next request is unaffected; past the queue bound the answer is 429 at once; a queued
client that leaves gives its place back at once; the deadline ends a queued request with 504 and a
running stream with an error event."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iquest.cli.engines import load_engine
from iquest.serve.app import ServeOptions, create_app
from iquest.serve.server import ServerThread, load_tokenizer
from iquest.serve.testing import HeldEngine, sse_events
from iquest.tests.helpers import TINY

CONTEXT = 1024
WAIT = 20.0  # bound on every wait in this file (seconds)


@pytest.fixture(scope="module")
def engine():
    return HeldEngine(load_engine("fast", TINY, 1, max_context=CONTEXT))


@pytest.fixture
def held(engine):
    engine.reset()
    engine.requests.clear()
    yield engine
    engine.release()


def start(held, **options):
    app = create_app(held, load_tokenizer(TINY), ServeOptions("tiny", max_context=CONTEXT, **options))
    return ServerThread(app)


def metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


def until(predicate, what: str) -> None:
    end = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def stream_text(http: httpx.Client, body: dict) -> tuple[str, list]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]), events


def test_abandoned_stream_stops_at_the_next_read_and_the_next_request_is_unaffected(held):
    b_body = {"prompt": "def add(a, b):", "max_tokens": 40, "seed": 7}
    with start(held) as s, httpx.Client(base_url=s.url, timeout=WAIT) as http:
        alone, _ = stream_text(http, b_body)

        held.hold_after_first = True  # A: the worker holds after A's first Step, until released
        with http.stream("POST", "/v1/chat/completions",
                         json={"messages": [{"role": "user", "content": "go on"}], "max_tokens": 900,
                               "seed": 1, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: dropping the iterator would close the response
            assert next(lines).startswith("data: ")
            assert held.entered.wait(WAIT)  # A has produced its first Step and is held
        # the client has gone: the server notices (Starlette cancels the stream) and flags the job
        until(lambda: metric(s.url, "iquest_decodes_total", reason="cancelled") == 1, "the cancel")
        held.hold_after_first = False
        held.release()  # the worker pulls A's next Step, sees the flag and closes the engine generator
        again, _ = stream_text(http, b_body)
        assert again == alone

        a = held.requests[1]
        assert a["closed"] and a["after_release"] <= 1 and a["tokens"] < 900
        assert metric(s.url, "iquest_requests_total", route="/v1/chat/completions", status="499") == 1
        assert metric(s.url, "iquest_running") == 0


def test_queue_bound_429_and_a_queued_client_that_leaves_gives_its_place_back(held):
    body = {"prompt": "x", "max_tokens": 4, "seed": 2}
    with start(held, queue_size=1) as s, httpx.Client(base_url=s.url, timeout=WAIT) as http:
        held.hold_start = True
        results: dict[str, httpx.Response] = {}

        def post(name: str, **extra) -> threading.Thread:
            t = threading.Thread(target=lambda: results.setdefault(name, http.post("/v1/completions",
                                                                                   json={**body, **extra})))
            t.start()
            return t

        a = post("a")
        assert held.entered.wait(WAIT)  # A decodes (held)

        # B waits in the queue, then its client gives up: its place is free again at once
        with pytest.raises(httpx.TimeoutException):
            http.post("/v1/completions", json={**body, "seed": 3}, timeout=0.5)
        until(lambda: metric(s.url, "iquest_requests_total", route="/v1/completions", status="499") == 1,
              "the server to notice B left")
        assert metric(s.url, "iquest_queue_depth") == 0

        c = post("c", seed=4)  # C takes that place: A running + C queued = the bound
        until(lambda: metric(s.url, "iquest_queue_depth") == 1, "C to be queued")
        d = http.post("/v1/completions", json=body)
        assert d.status_code == 429 and d.json()["error"]["code"] == "queue_full"
        assert d.headers["retry-after"] == "1"

        held.release()
        a.join(WAIT)
        c.join(WAIT)
        assert results["a"].status_code == 200 and results["c"].status_code == 200
        until(lambda: metric(s.url, "iquest_queue_depth") == 0, "the queue to drain")
        assert len(held.requests) == 2  # B never reached the engine
        held.hold_start = False
        assert http.post("/v1/completions", json=body).status_code == 200


def test_deadline_ends_queued_with_504_and_running_stream_with_an_error_event(held):
    with start(held, deadline=1.0) as s, httpx.Client(base_url=s.url, timeout=WAIT) as http:
        held.hold_start = True
        out: dict = {}

        def running():
            with http.stream("POST", "/v1/completions",
                             json={"prompt": "x", "max_tokens": 50, "stream": True}) as r:
                out["status"] = r.status_code
                out["events"] = sse_events(r.iter_lines())

        t = threading.Thread(target=running)
        t.start()
        assert held.entered.wait(WAIT)
        queued = http.post("/v1/completions", json={"prompt": "y", "max_tokens": 5})
        assert queued.status_code == 504 and queued.json()["error"]["code"] == "deadline_exceeded"
        t.join(WAIT)
        assert out["status"] == 200
        assert "[DONE]" not in out["events"]
        assert out["events"][-1]["error"]["code"] == "deadline_exceeded"
        assert metric(s.url, "iquest_decodes_total", reason="deadline") >= 1
        held.hold_start = False
        held.release()
        until(lambda: metric(s.url, "iquest_running") == 0, "the held decode to end")
        ok = http.post("/v1/completions", json={"prompt": "z", "max_tokens": 3})
        assert ok.status_code == 200
