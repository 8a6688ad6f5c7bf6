"""`iquest serve` end to end: the official openai client against a live uvicorn server on 127.0.0.1
(tiny fixture, fast engine, tp=1): completions and chat, streaming and not, stop strings, bad input
(400 with an OpenAI error, then the server still serves), the API key (401), /v1/models, /metrics."""

from __future__ import annotations

import shutil
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from iquest.cli.engines import load_engine
from iquest.serve.app import ServeOptions, create_app
from iquest.serve.server import ServerThread, load_tokenizer
from iquest.tests.helpers import TINY
CONTEXT = 256
MESSAGES = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "fizzbuzz"}]


@pytest.fixture(scope="module")
def server():
    engine = load_engine("fast", TINY, 1, max_context=CONTEXT)
    app = create_app(engine, load_tokenizer(TINY), ServeOptions("tiny", max_context=CONTEXT))
    with ServerThread(app) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str, **headers) -> dict:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_completions_stream_and_not_agree_and_repeat(client):
    kw = dict(model="tiny", prompt="def fibonacci(n):", max_tokens=24, seed=11, temperature=1.0)
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True, **kw))
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text
    assert "".join(c.choices[0].text for c in chunks) == a.choices[0].text
    assert chunks[-1].choices[0].finish_reason == a.choices[0].finish_reason
    # "length" at the budget, "stop" when the model drew its end-of-sequence token first
    assert (a.choices[0].finish_reason == "length") == (a.usage.completion_tokens == 24)
    assert a.usage.prompt_tokens > 0
    other = client.completions.create(**{**kw, "seed": 12})
    assert other.choices[0].text != a.choices[0].text


def test_chat_stream_and_not_agree(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=24, seed=5, top_p=0.9, extra_body={"top_k": 8})
    a = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert a.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    # thinking is on by default: the reply starts inside the reasoning
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (a.choices[0].message.content or "")
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert reasoning == (a.choices[0].message.reasoning_content or "") and reasoning + text
    assert chunks[-1].usage.completion_tokens == a.usage.completion_tokens
    assert a.usage.prompt_tokens == chunks[-1].usage.prompt_tokens


def test_greedy_is_seed_independent(client):
    texts = {client.completions.create(model="tiny", prompt="x = ", max_tokens=12, temperature=0, seed=s)
             .choices[0].text for s in (1, 2)}
    assert len(texts) == 1


def test_stop_string_cuts_the_text(client):
    kw = dict(model="tiny", prompt="import os\n", max_tokens=40, seed=3)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2: len(full) // 2 + 2]
    want = full[: full.find(stop)]
    cut = client.completions.create(stop=[stop, "\x00never"], **kw)
    assert cut.choices[0].text == want and cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **kw))
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    # an earlier request cut by a stop string may still be finishing its engine read: wait for idle
    end = time.monotonic() + 20
    while (before := metrics(server.url))[("iquest_running", ())] or before[("iquest_queue_depth", ())]:
        assert time.monotonic() < end, "the server did not go idle"
        time.sleep(0.01)
    client.completions.create(model="tiny", prompt="a", max_tokens=5, seed=1)
    after = metrics(server.url)
    key = ("iquest_requests_total", (("route", "/v1/completions"), ("status", "200")))
    assert after[key] == before.get(key, 0) + 1
    assert after[("iquest_emitted_tokens_total", ())] == before[("iquest_emitted_tokens_total", ())] + 5
    assert after[("iquest_queue_depth", ())] == 0 and after[("iquest_running", ())] == 0
    assert after[("iquest_rounds_total", ())] > 0
    assert 0 <= after[("iquest_mean_accepted_length", ())] <= 7
    assert after[("iquest_time_per_output_token_seconds_count", ())] >= 1


BAD = [
    ("/v1/completions", b'{"model": "tiny", "prompt": "x",', None),
    ("/v1/completions", b'[1, 2]', None),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": 7}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": CONTEXT}, "max_tokens"),
    ("/v1/completions", {"prompt": "def " * 400, "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": [1] * CONTEXT, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 1e39}, "temperature"),  # past float32: was a 500
    ("/v1/chat/completions", {"messages": MESSAGES, "temperature": 1e39, "stream": True}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_k": 0}, "top_k"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "tiny"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "model": "nope", "stream": True}, "model"),
]


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_400_and_the_server_keeps_serving(server, route, body, param):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        if isinstance(body, bytes):
            r = http.post(route, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(route, json=body)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == "invalid_request_error" and err["message"]
        assert err["param"] == param
        ok = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "seed": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="x", max_tokens=0)
    assert info.value.code is None and "max_tokens" in str(info.value)


def test_api_key():
    engine = load_engine("fast", TINY, 1, max_context=CONTEXT)
    app = create_app(engine, load_tokenizer(TINY), ServeOptions("tiny", api_key="s3cret", max_context=CONTEXT))
    with ServerThread(app) as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, headers=headers, timeout=10)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(s.url + "/v1/models", headers=headers, timeout=10).status_code == 401
            assert httpx.get(s.url + "/metrics", headers=headers, timeout=10).status_code == 401
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=s.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        # a fixed seed: without one the server draws a fresh seed, and a stop token may end the reply early
        assert good.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3,
                                            seed=1).usage.completion_tokens == 3
        m = metrics(s.url, Authorization="Bearer s3cret")
        assert m[("iquest_requests_total", (("route", "/v1/completions"), ("status", "401")))] == 3


# ---- <|iquest_end|> ends the reply ------------------------------------------------------------------------------
END = 0  # <|iquest_end|>: IQuest-Q1's end of turn and EOS (docs/model.md, "Tokenizer and chat template")


def _ending_model(tmp_path, prompt: list[int], after: int):
    """A copy of tiny whose greedy continuation of `prompt` draws <|iquest_end|> within `after` + 1 tokens: the LM
    head's row 0 is pointed at the final hidden state after the greedy prefix of `after` tokens. Returns the folder
    and the reference's greedy tokens (through the end token)."""
    from safetensors.torch import load_file, save_file

    from iquest.reference.model import ReferenceModel
    from iquest.reference.sampling import SamplingParams
    from iquest.reference.speculative import generate

    model = tmp_path / "ending"
    shutil.copytree(TINY, model)
    ref = ReferenceModel.load(model)
    greedy = SamplingParams(temperature=0.0)
    prefix = [t for s in generate(ref, prompt, seed=0, params=greedy, max_new_tokens=after, drafts=0) for t in s.tokens]
    seq = prompt + prefix
    _, hidden = ref.forward(torch.tensor(seq), torch.arange(len(seq)), ref.new_cache())
    shard = next(p for p in model.glob("*.safetensors"))
    tensors = load_file(str(shard))
    head = tensors["lm_head.weight"].float()
    head[END] = 50 * hidden[-1].float() / hidden[-1].norm()
    tensors["lm_head.weight"] = head.bfloat16()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    ref = ReferenceModel.load(model)
    out = [t for s in generate(ref, prompt, seed=0, params=greedy, max_new_tokens=after + 8, drafts=0,
                               stop_ids=(END,)) for t in s.tokens]
    assert out[-1] == END and END not in out[:-1], out
    return model, out


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_the_reply_ends_at_iquest_end(tmp_path, route):
    """A completion and a chat turn stop where the model draws <|iquest_end|> (the generation config's EOS; for chat
    also the template's end of turn): finish_reason "stop", the text is what came before it, and the engine drew
    nothing past it."""
    tokenizer = load_tokenizer(TINY)
    vocab = tokenizer.get_vocab()
    assert vocab["<|iquest_end|>"] == END
    if route == "chat":
        text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=False)  # as the server encodes messages without markup
        body = {"messages": MESSAGES}
    else:
        prompt = tokenizer.encode("def fibonacci(n):", add_special_tokens=False)
        body = {"prompt": "def fibonacci(n):"}
    model, want = _ending_model(tmp_path, list(prompt), after=3)
    engine = load_engine("fast", model, 1, max_context=CONTEXT)
    app = create_app(engine, load_tokenizer(model), ServeOptions("tiny", max_context=CONTEXT, drafts=3))
    with ServerThread(app) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        before = metrics(s.url)[("iquest_emitted_tokens_total", ())]
        r = http.post(f"/v1/{'chat/' if route == 'chat' else ''}completions",
                      json={**body, "max_tokens": 40, "temperature": 0, "seed": 1}).json()
        choice = r["choices"][0]
        text = ((choice["message"]["reasoning_content"] or "") + (choice["message"]["content"] or "")
                if route == "chat" else choice["text"])
        assert choice["finish_reason"] == "stop"
        assert text == tokenizer.decode(want[:-1], skip_special_tokens=True)
        assert r["usage"]["prompt_tokens"] == len(prompt)
        assert metrics(s.url)[("iquest_emitted_tokens_total", ())] - before == len(want)
