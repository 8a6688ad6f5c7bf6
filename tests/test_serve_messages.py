"""The Anthropic Messages API (issue 51: `POST /v1/messages`, serve/messages.py) end to end with the official
anthropic client against a live server on loopback: thinking and text blocks streaming and not, thinking
off, a two-turn tool round trip (tool_use, then tool_result), tool_choice, stop reasons, x-api-key auth, and
bad input as 4xx errors in Anthropic's shape with the server healthy after. The engine replies from a script
(token ids): the fixtures do not write reasoning or tool calls by themselves."""

from __future__ import annotations


import anthropic
import httpx
import pytest

from iquest.cli.engines import load_engine
from iquest.serve.app import ServeOptions, create_app
from iquest.serve.server import ServerThread, load_tokenizer
from iquest.serve.testing import READ_FILE_CALL, ScriptedEngine, spelled_ids
from iquest.tests.helpers import TINY

TOOLS = [{"name": "read_file", "description": "read a file",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}}]
USER = [{"role": "user", "content": "How long is a.py?"}]
CALL = READ_FILE_CALL
KEY = "sk-test-key"
MODEL = "tiny"   # the served name (ServeOptions below): the only one the routes take


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


ids = spelled_ids


@pytest.fixture(scope="module")
def server():
    fake = ScriptedEngine(load_engine("fast", TINY, 1, max_context=256))
    app = create_app(fake, load_tokenizer(TINY), ServeOptions(MODEL, api_key=KEY, max_context=1024))
    with ServerThread(app) as s:
        yield fake, anthropic.Anthropic(base_url=s.url, api_key=KEY, max_retries=0, timeout=60), s.url


def prompt_text(tok, fake) -> str:
    return tok.decode(fake.prompts[-1], skip_special_tokens=False)


def stream(client, **kw):
    """The stream's event types, and its final message as the SDK accumulates it."""
    with client.messages.stream(**kw) as s:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in s
                 if e.type in ("message_start", "content_block_start", "content_block_delta", "content_block_stop",
                               "message_delta", "message_stop")]
        return kinds, s.get_final_message()


def test_text_with_a_thinking_block_streaming_and_not(server, tok):
    fake, client, _ = server
    reply = ids(tok, "Plan: answer briefly.</think>Three lines.<|iquest_end|>")
    fake.scripts += [reply, reply]
    kw = dict(model=MODEL, max_tokens=50, messages=USER,
              system=[{"type": "text", "text": "You are terse."}])
    m = client.messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == \
        [("thinking", "Plan: answer briefly."), ("text", "Three lines.")]
    assert m.stop_reason == "end_turn" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.usage.input_tokens == len(fake.prompts[-1]) and m.usage.output_tokens == len(reply)
    assert "You are terse." in prompt_text(tok, fake) and prompt_text(tok, fake).endswith("<think>")
    counted = client.messages.count_tokens(model=MODEL, messages=USER, system=kw["system"])
    assert counted.input_tokens == m.usage.input_tokens
    kinds, final = stream(client, **kw)
    assert kinds[0] == ("message_start", None) and kinds[-2:] == [("message_delta", None), ("message_stop", None)]
    deltas = [k for k in kinds if k[0] == "content_block_delta"]
    assert [d for _, d in deltas[:1] + deltas[-1:]] == ["thinking_delta", "text_delta"]
    assert kinds.count(("content_block_start", None)) == kinds.count(("content_block_stop", None)) == 2
    assert [b.model_dump(exclude={"signature", "citations"}) for b in final.content] == \
        [b.model_dump(exclude={"signature", "citations"}) for b in m.content]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(reply)


def test_thinking_disabled_is_all_text(server, tok):
    fake, client, _ = server
    fake.scripts += [ids(tok, "Hello there.<|iquest_end|>")]
    m = client.messages.create(model=MODEL, max_tokens=30, messages=USER, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in m.content] == [("text", "Hello there.")]
    assert prompt_text(tok, fake).endswith("</think>")
    # enabled (with Anthropic's budget) keeps the prompt inside the reasoning
    fake.scripts += [ids(tok, "hm</think>Hi.<|iquest_end|>")]
    m = client.messages.create(model=MODEL, max_tokens=30, messages=USER,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in m.content] == ["thinking", "text"] and prompt_text(tok, fake).endswith("<think>")
    fake.scripts += [ids(tok, "hm</think>Hi.<|iquest_end|>")]
    m = client.messages.create(model=MODEL, max_tokens=30, messages=USER, thinking={"type": "adaptive"})
    assert [b.type for b in m.content] == ["thinking", "text"]


@pytest.mark.parametrize("streamed", [False, True])
def test_tool_round_trip_of_two_turns(server, tok, streamed):
    fake, client, _ = server
    fake.scripts += [ids(tok, "Need the file.</think>" + CALL + "<|iquest_end|>"),
                     ids(tok, "It has 3.</think>a.py has 3 lines.<|iquest_end|>")]
    kw = dict(model=MODEL, max_tokens=80, tools=TOOLS)
    if streamed:
        kinds, first = stream(client, messages=USER, **kw)
        assert ("content_block_delta", "input_json_delta") in kinds
    else:
        first = client.messages.create(messages=USER, **kw)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    call = first.content[1]
    assert call.name == "read_file" and call.id and call.input == {"path": "007.py", "lines": 3}
    history = USER + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                    "content": [{"type": "text", "text": "1\n2\n3\n"}]}]}]
    second = client.messages.create(messages=history, **kw)
    assert [(b.type, getattr(b, "text", None)) for b in second.content] == \
        [("thinking", None), ("text", "a.py has 3 lines.")]
    assert second.stop_reason == "end_turn"
    prompt = prompt_text(tok, fake)
    # the call, its reasoning and its result rendered back through the template
    assert ("<iquest_tool_call>read_file<arg_key>path</arg_key><arg_value>007.py</arg_value><arg_key>lines"
            "</arg_key><arg_value>3</arg_value></iquest_tool_call><|iquest_end|><|iquest_tool|><tool_response>"
            "1\n2\n3\n</tool_response><|iquest_end|><|iquest_assistant|><think>") in prompt
    assert "Need the file." in prompt and '"name": "read_file"' in prompt


def test_tool_choice_forces_the_call_and_stop_reasons(server, tok):
    fake, client, _ = server
    rest = ids(tok, "<arg_key>path</arg_key><arg_value>b.py</arg_value></iquest_tool_call><|iquest_end|>")
    fake.scripts += [rest, ids(tok, "read_file") + rest]
    m = client.messages.create(model=MODEL, max_tokens=40, messages=USER, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "read_file"})
    assert m.stop_reason == "tool_use" and m.content[0].input == {"path": "b.py"}
    assert prompt_text(tok, fake).endswith("</think><iquest_tool_call>read_file")
    m = client.messages.create(model=MODEL, max_tokens=40, messages=USER, tools=TOOLS, tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use" and prompt_text(tok, fake).endswith("</think><iquest_tool_call>")
    fake.scripts += [ids(tok, "r</think>alpha STOP beta<|iquest_end|>"), ids(tok, "r</think>a b c d e f g h")]
    m = client.messages.create(model=MODEL, max_tokens=40, messages=USER, stop_sequences=["STOP"])
    assert (m.stop_reason, m.stop_sequence, m.content[-1].text) == ("stop_sequence", "STOP", "alpha ")
    m = client.messages.create(model=MODEL, max_tokens=4, messages=USER)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 4


def test_x_api_key_auth(server):
    fake, _, url = server
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=USER)
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"
    assert httpx.post(url + "/v1/messages", json={"max_tokens": 5, "messages": USER}).status_code == 401
    r = httpx.get(url + "/v1/messages", headers={"x-api-key": KEY})
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    fake.scripts += [[5, 6, 7]]  # Claude Code's ANTHROPIC_AUTH_TOKEN: a bearer token
    r = httpx.post(url + "/v1/messages", json={"max_tokens": 3, "messages": USER},
                   headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json()["type"] == "message"


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
BAD = {  # each case's body changes, and a word its message must hold
    "unknown tool in tool_choice": ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "rm_rf"}}, "rm_rf"),
    "tool_result for no tool_use": ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, "toolu_nope"),
    "image block": ({"messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}]}, "image"),
    "image in a tool_result": ({"messages": USER + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [IMAGE]}]}]},
        "image"),
    "no max_tokens": ({"max_tokens": None}, "max_tokens"),
    "bad thinking": ({"thinking": {"type": "sometimes"}}, "thinking"),
    "bad role": ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    "assistant prefill": ({"messages": USER + [{"role": "assistant", "content": "Sure,"}]}, "prefill"),
    "temperature past float32": ({"temperature": 1e39}, "temperature"),
    "another model": ({"model": "claude-sonnet-4-5"}, "claude-sonnet-4-5"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_4xx_in_anthropic_shape(server, tok, case):
    fake, client, url = server
    change, word = BAD[case]
    body = {"model": MODEL, "max_tokens": 20, "messages": USER, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert word in err["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as info:  # the client reads the error as Anthropic's
        client.post("/v1/messages", body=body, cast_to=httpx.Response)
    assert word in info.value.message
    # healthy after
    fake.scripts += [ids(tok, "ok</think>fine<|iquest_end|>")]
    assert client.messages.create(model=MODEL, max_tokens=20, messages=USER).content[-1].text == "fine"


def test_an_engine_failure_is_an_anthropic_error_streaming_and_not(server, tok):
    fake, client, url = server
    fake.scripts += [RuntimeError("boom"), RuntimeError("bang")]
    body, headers = {"max_tokens": 10, "messages": USER}, {"x-api-key": KEY}
    r = httpx.post(url + "/v1/messages", json=body, headers=headers, timeout=30)
    assert r.status_code == 500 and r.json()["type"] == "error" and "boom" in r.json()["error"]["message"]
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, headers=headers, timeout=30) as s:
        text = s.read().decode()
    assert text.startswith("event: message_start") and "event: error" in text and "bang" in text
    assert "message_stop" not in text
    fake.scripts += [ids(tok, "ok</think>fine<|iquest_end|>")]
    assert client.messages.create(model=MODEL, max_tokens=20, messages=USER).content[-1].text == "fine"


def test_another_model_is_refused_as_the_other_routes_refuse_it(server):
    """A name other than the served one: 400 on Messages and count_tokens, as on chat completions and Responses."""
    _, client, url = server
    body = {"model": "claude-3-5-haiku-latest", "max_tokens": 20, "messages": USER}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        r = httpx.post(url + path, json=body, headers={"x-api-key": KEY}, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert "claude-3-5-haiku-latest" in r.json()["error"]["message"] and MODEL in r.json()["error"]["message"]
    for path, req in (("/v1/chat/completions", {"messages": USER}), ("/v1/responses", {"input": "hi"})):
        r = httpx.post(url + path, json={"model": body["model"], **req}, headers={"authorization": f"Bearer {KEY}"},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found", r.text
