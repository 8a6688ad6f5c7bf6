"""The OpenAI Responses API (issue 51: `POST /v1/responses`, serve/responses.py) end to end with the official
openai client against a live server on loopback: text with a reasoning item streaming and not, a two-turn
function-call round trip (function_call, then function_call_output), max_output_tokens as an incomplete
response, and bad input as a 400 in OpenAI's shape with the server healthy after. The engine replies from a
script (token ids): the fixtures do not write reasoning or tool calls by themselves."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from iquest.cli.engines import load_engine
from iquest.reference.sampling import SamplingParams
from iquest.serve.app import ServeOptions, create_app
from iquest.serve.chat import Markup
from iquest.serve.prepare import Encoder, Limits
from iquest.serve.responses import of_chat, prepare_responses
from iquest.serve.server import ServerThread, load_tokenizer
from iquest.serve.testing import READ_FILE_CALL, ScriptedEngine, spelled_ids
from iquest.tests.helpers import TINY

TOOLS = [{"type": "function", "name": "read_file", "description": "read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}}]
USER = [{"role": "user", "content": [{"type": "input_text", "text": "How long is a.py?"}]}]
CALL = READ_FILE_CALL
KEY = "sk-test-key"
MODEL = "tiny"   # the served name (ServeOptions below): the only one the routes take
LIMITS = Limits(MODEL, 1024, 512, SamplingParams(1.0, 20, 1.0), (0,))


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


ids = spelled_ids


@pytest.fixture(scope="module")
def server():
    fake = ScriptedEngine(load_engine("fast", TINY, 1, max_context=256))
    app = create_app(fake, load_tokenizer(TINY), ServeOptions(MODEL, api_key=KEY, max_context=1024))
    with ServerThread(app) as s:
        yield fake, openai.OpenAI(base_url=s.url + "/v1", api_key=KEY, max_retries=0, timeout=60), s.url


def prompt_text(tok, fake) -> str:
    return tok.decode(fake.prompts[-1], skip_special_tokens=False)


def stream(client, **kw):
    """The stream's event types (sequence numbers checked), and the final response."""
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return [e.type for e in events], events[-1].response


def summary(r) -> list:
    out = []
    for item in r.output:
        if item.type == "reasoning":
            out.append(("reasoning", "".join(s.text for s in item.summary)))
        elif item.type == "message":
            out.append(("message", "".join(c.text for c in item.content)))
        else:
            out.append((item.type, item.name, item.arguments))
    return out


def test_text_with_reasoning_streaming_and_not(server, tok):
    fake, client, _ = server
    reply = ids(tok, "Plan: answer briefly.</think>Three lines.<|iquest_end|>")
    fake.scripts += [reply, reply]
    kw = dict(model=MODEL, input=USER, instructions="You are terse.", max_output_tokens=50,
              reasoning={"effort": "low"})
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert summary(r) == [("reasoning", "Plan: answer briefly."), ("message", "Three lines.")]
    assert r.output_text == "Three lines."
    assert r.usage.input_tokens == len(fake.prompts[-1]) and r.usage.output_tokens == len(reply)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert "You are terse." in prompt_text(tok, fake) and prompt_text(tok, fake).endswith("<think>")
    kinds, final = stream(client, **kw)
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    for k in ("response.reasoning_summary_text.delta", "response.output_text.delta", "response.output_text.done",
              "response.content_part.added", "response.content_part.done"):
        assert k in kinds
    assert kinds.index("response.reasoning_summary_text.delta") < kinds.index("response.output_text.delta")
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 2
    assert summary(final) == summary(r) and final.usage.output_tokens == len(reply)
    fake.scripts += [reply]  # the SDK's accumulating stream helper takes the events too
    with client.responses.stream(**kw) as s:
        assert summary(s.get_final_response()) == summary(r)
    # a plain string input, thinking at the server's default
    fake.scripts += [ids(tok, "hm</think>Hi.<|iquest_end|>")]
    r = client.responses.create(model=MODEL, input="hello")
    assert summary(r) == [("reasoning", "hm"), ("message", "Hi.")]


@pytest.mark.parametrize("streamed", [False, True])
def test_function_call_round_trip_of_two_turns(server, tok, streamed):
    fake, client, _ = server
    fake.scripts += [ids(tok, "Need the file.</think>" + CALL + "<|iquest_end|>"),
                     ids(tok, "It has 3.</think>a.py has 3 lines.<|iquest_end|>")]
    kw = dict(model=MODEL, max_output_tokens=80, tools=TOOLS)
    if streamed:
        kinds, first = stream(client, input=USER, **kw)
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    else:
        first = client.responses.create(input=USER, **kw)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    call = first.output[1]
    assert call.name == "read_file" and call.call_id and call.id
    assert __import__("json").loads(call.arguments) == {"path": "007.py", "lines": 3}
    history = USER + [i.model_dump(exclude_none=True) for i in first.output] + \
        [{"type": "function_call_output", "call_id": call.call_id, "output": "1\n2\n3\n"}]
    second = client.responses.create(input=history, **kw)
    assert summary(second) == [("reasoning", "It has 3."), ("message", "a.py has 3 lines.")]
    prompt = prompt_text(tok, fake)
    # the call, its reasoning and its result rendered back through the template
    assert ("<iquest_tool_call>read_file<arg_key>path</arg_key><arg_value>007.py</arg_value><arg_key>lines"
            "</arg_key><arg_value>3</arg_value></iquest_tool_call><|iquest_end|><|iquest_tool|><tool_response>"
            "1\n2\n3\n</tool_response><|iquest_end|><|iquest_assistant|><think>") in prompt
    assert "Need the file." in prompt and '"name": "read_file"' in prompt


def test_tool_choice_and_max_output_tokens(server, tok):
    fake, client, _ = server
    rest = ids(tok, "<arg_key>path</arg_key><arg_value>b.py</arg_value></iquest_tool_call><|iquest_end|>")
    fake.scripts += [rest]
    r = client.responses.create(model=MODEL, input=USER, tools=TOOLS,
                                tool_choice={"type": "function", "name": "read_file"})
    assert summary(r) == [("function_call", "read_file", '{"path": "b.py"}')]
    assert prompt_text(tok, fake).endswith("</think><iquest_tool_call>read_file")
    fake.scripts += [ids(tok, "r</think>a b c d e f g h"), ids(tok, "r</think>a b c d e f g h")]
    r = client.responses.create(model=MODEL, input=USER, max_output_tokens=4)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4
    kinds, final = stream(client, model=MODEL, input=USER, max_output_tokens=4)
    assert kinds[-1] == "response.incomplete" and final.status == "incomplete"


BAD = {  # each case's body changes, and a word its message must hold
    "output for no call": ({"input": USER + [{"type": "function_call_output", "call_id": "call_nope",
                                               "output": "x"}]}, "call_nope"),
    "unknown tool in tool_choice": ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "rm_rf"}},
                                    "rm_rf"),
    "input_image": ({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "see"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
        "input_image"),
    "unsupported item": ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "web_search_call"),
    "previous_response_id": ({"previous_response_id": "resp_123"}, "previous_response_id"),
    "unknown effort": ({"reasoning": {"effort": "maximal"}}, "reasoning.effort"),
    "effort not a string": ({"reasoning": {"effort": 3}}, "reasoning.effort"),
    "another model": ({"model": "gpt-5-codex"}, "gpt-5-codex"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_400_in_openai_shape(server, tok, case):
    fake, client, url = server
    change, word = BAD[case]
    body = {"model": MODEL, "input": USER, **change}
    r = httpx.post(url + "/v1/responses", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and word in err["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**body)
    assert word in info.value.message
    assert httpx.post(url + "/v1/responses", json=body).status_code == 401  # auth as the other OpenAI routes
    # healthy after
    fake.scripts += [ids(tok, "ok</think>fine<|iquest_end|>")]
    assert client.responses.create(model=MODEL, input=USER).output_text == "fine"


def test_an_engine_failure_is_an_openai_error_streaming_and_not(server, tok):
    fake, client, url = server
    fake.scripts += [RuntimeError("boom"), RuntimeError("bang")]
    body, headers = {"model": MODEL, "input": "hi"}, {"authorization": f"Bearer {KEY}"}
    r = httpx.post(url + "/v1/responses", json=body, headers=headers, timeout=30)
    assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, headers=headers, timeout=30) as s:
        text = s.read().decode()
    assert text.startswith("event: response.created") and "event: error" in text and "bang" in text
    assert "response.completed" not in text
    fake.scripts += [ids(tok, "ok</think>fine<|iquest_end|>")]
    assert client.responses.create(model=MODEL, input=USER).output_text == "fine"


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high", None])
def test_reasoning_effort_is_the_thinking_switch(server, tok, effort):
    """none and minimal turn thinking off (no reasoning item, a prompt that does not open one); the levels above
    leave it on, as does a reasoning object without an effort."""
    fake, client, _ = server
    off = effort in ("none", "minimal")
    reply = "Three lines.<|iquest_end|>" if off else "Plan.</think>Three lines.<|iquest_end|>"
    fake.scripts += [ids(tok, reply), ids(tok, reply)]
    kw = dict(model=MODEL, input=USER, max_output_tokens=50, reasoning={} if effort is None else {"effort": effort})
    r = client.responses.create(**kw)
    want = [("message", "Three lines.")] if off else [("reasoning", "Plan."), ("message", "Three lines.")]
    assert summary(r) == want
    assert prompt_text(tok, fake).endswith("<think>") is not off
    kinds, final = stream(client, **kw)
    assert summary(final) == want and ("response.reasoning_summary_text.delta" in kinds) is not off


def test_a_bad_effort_and_another_model_are_400s_naming_their_field(server):
    _, client, url = server
    headers = {"authorization": f"Bearer {KEY}"}
    for change, param, code in (({"reasoning": {"effort": "xl"}}, "reasoning.effort", None),
                                ({"model": "gpt-5-codex"}, "model", "model_not_found")):
        for stream_ in (False, True):
            body = {"model": MODEL, "input": USER, "stream": stream_, **change}
            r = httpx.post(url + "/v1/responses", json=body, headers=headers, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and (code is None or err["code"] == code), err
    # the chat route refuses that model alike
    r = httpx.post(url + "/v1/chat/completions", json={"model": "gpt-5-codex", "messages": [
        {"role": "user", "content": "hi"}]}, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"


def test_the_reply_echoes_the_requests_tools_and_tool_choice(server, tok):
    fake, client, url = server
    headers = {"authorization": f"Bearer {KEY}"}
    # as sent: a field this server does not use (strict) comes back too
    tools = [{**TOOLS[0], "strict": False}]
    for body, want in (({"tools": tools, "tool_choice": "required"}, ("required", tools)),
                       ({"tools": tools}, ("auto", tools)),
                       ({"tools": tools, "tool_choice": {"type": "function", "name": "read_file"}},
                        ({"type": "function", "name": "read_file"}, tools)),
                       ({}, ("auto", []))):
        rest = "<arg_key>path</arg_key><arg_value>b.py</arg_value></iquest_tool_call><|iquest_end|>"
        script = ids(tok, rest if "tool_choice" in body else "r</think>fine<|iquest_end|>")
        fake.scripts += [script]
        req = {"model": MODEL, "input": USER, "stream": True, "max_output_tokens": 40, **body}
        with httpx.stream("POST", url + "/v1/responses", json=req, headers=headers, timeout=30) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        for e in (events[0], events[-1]):
            assert e["type"] in ("response.created", "response.completed", "response.incomplete")
            assert (e["response"]["tool_choice"], e["response"]["tools"]) == want
        # the non-streamed reply, from the request's Prepared
        p = prepare_responses(json.dumps({**req, "stream": False}).encode(), Encoder(tok), LIMITS, (),
                              Markup.of(tok))
        chat_body = {"created": 0, "choices": [{"message": {"content": "fine"}, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details":
                               {"cached_tokens": 0}}}
        r = of_chat(chat_body, MODEL, p)
        assert (r["tool_choice"], r["tools"]) == want
        fake.scripts += [script]  # and through the route
        r = httpx.post(url + "/v1/responses", json={**req, "stream": False}, headers=headers, timeout=30).json()
        assert (r["tool_choice"], r["tools"]) == want
