"""Options do what they say or are refused (issue 36): logprobs and top_logprobs (the reference engine
gives the alternatives; the fast engine does not yet, and says so), echo, a 400 naming each option this
server does not implement, OpenAI-style 404/405; and what vLLM's users reach for: /tokenize,
/detokenize, /v1/models/{id}, top_k -1, prompt tokens and end-to-end latency in /metrics, /docs behind
the key."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iquest.cli.engines import load_engine
from iquest.serve.app import ServeOptions, create_app
from iquest.serve.server import ServerThread, load_tokenizer
from iquest.tests.helpers import TINY

CONTEXT = 256
MESSAGES = [{"role": "user", "content": "fizzbuzz"}]
TIMEOUT = 60


def start(engine: str, **options) -> ServerThread:
    app = create_app(load_engine(engine, TINY, 1, max_context=CONTEXT), load_tokenizer(TINY),
                     ServeOptions("tiny", max_context=CONTEXT, **options))
    return ServerThread(app)


@pytest.fixture(scope="module")
def reference():
    with start("reference") as s:
        yield s


@pytest.fixture(scope="module")
def fast():
    with start("fast") as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)


def metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def test_chat_top_logprobs_are_the_models(reference):
    """logprobs report the model's own distribution (docs/round.md), not the sampling one: with top_k=3 a token is
    drawn from three candidates, yet its top_logprobs are the model's five most likely, with probabilities of the
    whole vocabulary."""
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, seed=3, top_p=1.0, extra_body={"top_k": 3},
              logprobs=True, top_logprobs=5)
    r = client(reference).chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    message = r.choices[0].message  # thinking on: reasoning first, then content
    assert bytes(b for e in content for b in e.bytes).decode(errors="replace") == \
        (message.reasoning_content or "") + (message.content or "")
    for e in content:
        top = e.top_logprobs
        assert len(top) == 5
        assert [a.logprob for a in top] == sorted((a.logprob for a in top), reverse=True)
        assert sum(math.exp(a.logprob) for a in top) < 1.0
        assert (e.token, e.logprob) in [(a.token, a.logprob) for a in top[:3]]  # drawn from the top 3
    chunks = list(client(reference).chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob, e.top_logprobs) for e in streamed] == \
        [(e.token, e.logprob, e.top_logprobs) for e in content]


def test_completion_logprobs_and_echo(reference):
    kw = dict(model="tiny", prompt="def f(x):", max_tokens=10, seed=4)
    plain = client(reference).completions.create(**kw).choices[0].text
    r = client(reference).completions.create(logprobs=2, **kw)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == plain and len(lp.tokens) == len(lp.token_logprobs) == 10
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(t in top and top[t] == v and len(top) <= 3 for t, v, top in zip(lp.tokens, lp.token_logprobs,
                                                                               lp.top_logprobs))
    echoed = client(reference).completions.create(echo=True, **kw)
    assert echoed.choices[0].text == "def f(x):" + plain
    chunks = list(client(reference).completions.create(echo=True, stream=True, **kw))
    assert chunks[0].choices[0].text == "def f(x):" and "".join(c.choices[0].text for c in chunks) == \
        echoed.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client(reference).completions.create(echo=True, logprobs=1, **kw)


def test_fast_engine_gives_logprobs_and_top_alternatives(fast):
    r = client(fast).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, seed=1, logprobs=True)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 and all(e.logprob <= 0 and e.top_logprobs == [] for e in content)
    r = client(fast).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, seed=1, logprobs=True,
                                             top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for e in content:  # the engine's distribution: at most 2 alternatives, most likely first
        assert 1 <= len(e.top_logprobs) <= 2 and e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob
        assert e.logprob <= e.top_logprobs[0].logprob + 1e-6
    with pytest.raises(openai.BadRequestError) as info:
        client(fast).chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, logprobs=True,
                                             top_logprobs=21)
    assert info.value.body["param"] == "top_logprobs" and "20" in info.value.body["message"]
    tops = client(fast).completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=2).choices[0].logprobs
    # the legacy form: the 2 most likely, and the sampled token beside them where it is not among them
    assert len(tops.top_logprobs) == 2 and all(1 <= len(t) <= 3 for t in tops.top_logprobs)
    assert client(fast).completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=0) \
        .choices[0].logprobs.top_logprobs is None


UNSUPPORTED = [
    ("/v1/completions", {"best_of": 3}), ("/v1/completions", {"suffix": "}"}),
    ("/v1/completions", {"presence_penalty": 0.5}), ("/v1/completions", {"frequency_penalty": -1}),
    ("/v1/completions", {"logit_bias": {"5": 100}}), ("/v1/completions", {"repetition_penalty": 1.2}),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}),
    # tools and tool_choice are served (tests/test_serve_tools.py); the legacy functions are not
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}),
]


def test_options_that_would_do_nothing_are_refused_by_name(fast):
    with httpx.Client(base_url=fast.url, timeout=TIMEOUT) as http:
        for route, extra in UNSUPPORTED:
            base = {"prompt": "x"} if route == "/v1/completions" else {"messages": MESSAGES}
            r = http.post(route, json={**base, "max_tokens": 2, **extra})
            (param,) = extra
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert r.json()["error"]["code"] == "unsupported_parameter" and param in r.json()["error"]["message"]
        # a value that changes nothing is taken as it is
        neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "best_of": 1}
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **neutral}).status_code == 200
        for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                     ("DELETE", "/health", 405)):
            r = http.request(method, path)
            assert r.status_code == status and set(r.json()) == {"error"}, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and path in err["message"]


def test_tokenize_detokenize_models_and_top_k_off(fast):
    tokenizer = load_tokenizer(TINY)
    with httpx.Client(base_url=fast.url, timeout=TIMEOUT) as http:
        r = http.post("/tokenize", json={"prompt": "def f(x):", "return_token_strs": True}).json()
        assert r["tokens"] == tokenizer.encode("def f(x):") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == CONTEXT and r["token_strs"] == tokenizer.convert_ids_to_tokens(r["tokens"])
        assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "def f(x):"}
        bad = http.post("/detokenize", json={"tokens": [1, 10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "seed": 0}).json()
        assert chat["count"] == reply["usage"]["prompt_tokens"]

        assert http.get("/v1/models/tiny").json()["id"] == "tiny"
        missing = http.get("/v1/models/gpt-4")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

        body = {"prompt": "x = ", "max_tokens": 8, "seed": 9}
        off = http.post("/v1/completions", json={**body, "top_k": -1}).json()["choices"][0]["text"]
        whole = http.post("/v1/completions", json={**body, "top_k": tokenizer.vocab_size}).json()
        assert off == whole["choices"][0]["text"]

        before = metrics(fast.url)
        done = http.post("/v1/completions", json=body).json()
        after = metrics(fast.url)
        assert after["iquest_prompt_tokens_total"] == before["iquest_prompt_tokens_total"] + \
            done["usage"]["prompt_tokens"]
        assert after["iquest_e2e_request_latency_seconds_count"] == \
            before["iquest_e2e_request_latency_seconds_count"] + 1
    assert httpx.get(fast.url + "/docs", timeout=TIMEOUT).status_code == 200  # no key: open, as before


def test_docs_are_behind_the_key():
    with start("fast", api_key="k3y") as s:
        for path in ("/docs", "/openapi.json", "/tokenize", "/v1/models/tiny"):
            method = "POST" if path == "/tokenize" else "GET"
            assert httpx.request(method, s.url + path, timeout=TIMEOUT).status_code == 401
        auth = {"Authorization": "Bearer k3y"}
        assert httpx.get(s.url + "/docs", headers=auth, timeout=TIMEOUT).status_code == 200
        spec = httpx.get(s.url + "/openapi.json", headers=auth, timeout=TIMEOUT).json()
        assert "/v1/completions" in spec["paths"]
        assert httpx.get(s.url + "/redoc", headers=auth, timeout=TIMEOUT).status_code == 404
