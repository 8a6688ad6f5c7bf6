"""Prefix reuse in the server (issue 51): each API reports the prompt tokens whose KV was reused (OpenAI's
`prompt_tokens_details.cached_tokens`, the Responses API's `input_tokens_details.cached_tokens`, Anthropic's
`cache_read_input_tokens`), /metrics counts hits, misses, reused and prefilled tokens, the answers are those of a
server with `--prefix-reuse off`, and off reuses nothing (tiny fixture, fast engine, tp=1)."""

from __future__ import annotations

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from iquest.cli.engines import load_engine
from iquest.cli.main import build_parser
from iquest.serve.app import ServeOptions, create_app
from iquest.serve.server import ServerThread, load_tokenizer
from iquest.serve.testing import sse_events
from iquest.tests.helpers import TINY

CONTEXT = 512
TIMEOUT = 60
FIRST = [int(x) for x in torch.randint(3, 500, (127,), generator=torch.Generator().manual_seed(7))]
EXTRA = [int(x) for x in torch.randint(3, 500, (20,), generator=torch.Generator().manual_seed(8))]
SYSTEM = "You are a coding agent. " + " ".join(f"rule {i}: keep functions short and name them well." for i in range(12))
FIRST_TURN = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write fizzbuzz."}]


@pytest.fixture(scope="module")
def engine():
    return load_engine("fast", TINY, 1, max_context=CONTEXT)


@pytest.fixture(scope="module")
def servers(engine):
    """One engine behind two servers, used one request at a time: reuse on, and off."""
    tok = load_tokenizer(TINY)
    on = create_app(engine, tok, ServeOptions("tiny", max_context=CONTEXT, drafts=3))
    off = create_app(engine, tok, ServeOptions("tiny", max_context=CONTEXT, drafts=3, prefix_reuse=False))
    with ServerThread(on) as a, ServerThread(off) as b:
        yield a.url, b.url


def metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def counter(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def post(url: str, path: str, body: dict, **headers) -> dict:
    r = httpx.post(url + path, json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_report_reuse_and_match_a_full_prefill(servers):
    on, off = servers
    body = {"max_tokens": 8, "seed": 3, "logprobs": 1}
    before = metrics(on)
    first = post(on, "/v1/completions", {**body, "prompt": FIRST})
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    second = post(on, "/v1/completions", {**body, "prompt": FIRST + EXTRA})
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 64}
    after = metrics(on)
    cold = post(off, "/v1/completions", {**body, "prompt": FIRST + EXTRA})
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert cold["choices"][0]["text"] == second["choices"][0]["text"]
    assert cold["choices"][0]["logprobs"]["token_logprobs"] == second["choices"][0]["logprobs"]["token_logprobs"]
    assert counter(after, "iquest_prefix_lookups_total", result="hit") == \
        counter(before, "iquest_prefix_lookups_total", result="hit") + 1
    assert counter(after, "iquest_prefix_lookups_total", result="miss") == \
        counter(before, "iquest_prefix_lookups_total", result="miss") + 1
    grew = {name: counter(after, name) - counter(before, name)
            for name in ("iquest_prefix_cached_tokens_total", "iquest_prefill_tokens_total")}
    assert grew == {"iquest_prefix_cached_tokens_total": 64,
                    "iquest_prefill_tokens_total": len(FIRST) + len(FIRST + EXTRA) - 64}
    assert counter(after, "iquest_prefix_snapshot_bytes") > 0
    off_m = metrics(off)
    assert counter(off_m, "iquest_prefix_snapshot_bytes") == 0
    assert counter(off_m, "iquest_prefix_lookups_total", result="hit") == 0
    assert counter(off_m, "iquest_prefix_cached_tokens_total") == 0
    assert counter(off_m, "iquest_prefill_tokens_total") == len(FIRST + EXTRA)


def test_each_api_reports_the_cached_prompt_tokens(servers):
    """A second turn = the first's messages + its reply + a new user message, on each API: its usage names the tokens
    reused (a whole number of prefill blocks, less than the prompt); the Anthropic input counts add up to
    count_tokens'."""
    on, _ = servers
    chat = {"model": "tiny", "max_tokens": 6, "seed": 5}
    first = post(on, "/v1/chat/completions", {**chat, "messages": FIRST_TURN})
    turn = FIRST_TURN + [{"role": "assistant", "content": first["choices"][0]["message"]["content"] or "ok"},
                         {"role": "user", "content": "Now in one line."}]
    second = post(on, "/v1/chat/completions", {**chat, "messages": turn})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < second["usage"]["prompt_tokens"] and cached % 64 == 0

    events = sse_events(httpx.post(on + "/v1/chat/completions", json={
        **chat, "messages": turn, "stream": True, "stream_options": {"include_usage": True}},
        timeout=TIMEOUT).text.splitlines())
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached  # the same prompt: its whole blocks

    claude = {"model": "tiny", "max_tokens": 6, "system": SYSTEM,
              "messages": [{"role": "user", "content": "Write fizzbuzz."}]}
    post(on, "/v1/messages", claude)
    claude["messages"] += [{"role": "assistant", "content": "def f(): pass"},
                           {"role": "user", "content": "Now in one line."}]
    m = post(on, "/v1/messages", claude)
    counted = post(on, "/v1/messages/count_tokens", {k: v for k, v in claude.items() if k != "max_tokens"})
    u = m["usage"]
    assert u["cache_read_input_tokens"] > 0 and u["cache_read_input_tokens"] % 64 == 0
    assert u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] == \
        counted["input_tokens"]
    stream = httpx.post(on + "/v1/messages", json={**claude, "stream": True}, timeout=TIMEOUT).text
    start = next(e for e in sse_events(stream.splitlines()) if e.get("type") == "message_start")
    assert start["message"]["usage"]["cache_read_input_tokens"] >= u["cache_read_input_tokens"]

    resp = {"model": "tiny", "max_output_tokens": 6, "instructions": SYSTEM}
    post(on, "/v1/responses", {**resp, "input": "Write fizzbuzz."})
    r = post(on, "/v1/responses", {**resp, "input": [
        {"role": "user", "content": "Write fizzbuzz."}, {"role": "assistant", "content": "def f(): pass"},
        {"role": "user", "content": "Now in one line."}]})
    assert r["usage"]["input_tokens_details"]["cached_tokens"] > 0


def test_off_reuses_nothing(servers):
    _, off = servers
    for _ in range(2):
        r = post(off, "/v1/completions", {"prompt": FIRST, "max_tokens": 2, "seed": 1})
        assert r["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_the_flag_parses_and_is_documented():
    parser = build_parser()
    assert parser.parse_args(["serve"]).prefix_reuse == "on"
    assert parser.parse_args(["serve", "--prefix-reuse", "off"]).prefix_reuse == "off"
    serve = next(a for a in parser._subparsers._group_actions[0].choices["serve"]._actions
                 if "--prefix-reuse" in a.option_strings)
    assert "default" in serve.help and "cached_tokens" in serve.help
