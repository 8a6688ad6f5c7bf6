"""Coding-agent sessions (issue 51) from the official openai and anthropic clients against a real `iquest serve`
process on the shipped mini model (CPU, loopback, started once for the module): three-turn tool sessions on the
chat completions, Messages and Responses APIs, streaming and not, whose tool results are files of this
repository; thinking on and off (Responses: reasoning.effort); bad input, a model other than the served one
included, as a clear 4xx each, the server healthy after.

The mini model was trained on Python source only and never writes the tool-call markup, so a forced call
(tool_choice required / named) opens in the prompt but its arguments do not parse: the reply is the call's text,
cut by the budget. Each turn therefore accepts either form and checks the one it got: a parsed call must carry
arguments typed by the tool's schema; an unparsed one is text that starts with the forced opening. The next
turn then carries the call the session's script holds (what an agent that called would send back), and its
result: a real file read from this repository. Within a session the second turn and a closing one stream and
the others do not (one session per API covers both forms at half the decode time of two sessions).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import openai
import pytest

from iquest.tests.helpers import MINI, ROOT, stop_server, streamed_tool_calls

MAX_TOKENS = 16
FILE_BYTES = 400    # each tool result: the head of a file, so that three turns stay a short prefill on CPU
FILES = ("fast/round.py", "reference/model.py", "serve/chat.py")
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "max_bytes": {"type": "integer"}},
          "required": ["path"]}
TASK = "Read the decode round, the reference model and the chat parser of this repository, then summarize them."
GREEDY = dict(temperature=0, seed=7)
OPENING = "<iquest_tool_call>"   # what a forced call's reply starts with; a named one then names its tool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    cmd = [sys.executable, "-m", "iquest.cli.main", "serve", "--model", str(MINI), "--device", "cpu",
           "--port", str(port), "--max-context", "4096", "--log-level", "warning"]
    # the log goes to a file: a pipe nobody reads while the tests run could fill and stall the server
    log_file = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_file, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 90
    try:
        while True:
            assert proc.poll() is None, log_file.read_text()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "the server did not come up"
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models", timeout=5).json()["data"][0]["id"]
        yield url, model
    finally:
        stop_server(proc)
        log.close()
    text = log_file.read_text()
    assert "Traceback" not in text, text  # every refusal was an answer, not a crash


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="unused", max_retries=0, timeout=120)


def read(path: str) -> str:
    return (ROOT / path).read_bytes()[:FILE_BYTES].decode("utf-8", "ignore")


def typed(args: dict) -> None:
    """Arguments as the schema types them: a string path, an integer byte count."""
    assert isinstance(args.get("path"), str), args
    assert "max_bytes" not in args or type(args["max_bytes"]) is int, args
    assert set(args) <= set(SCHEMA["properties"]), args


# ---- OpenAI chat completions -----------------------------------------------------------------------------------
CHAT_TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "read a file of the repository",
                                                 "parameters": SCHEMA}}]


def chat_stream(client, **kw):
    """The streamed reply put together as the non-streamed one is: reasoning, content, calls, finish, usage;
    every chunk's shape checked on the way."""
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert last.choices == [] and last.usage is not None  # include_usage: a last chunk of usage alone
    assert all(len(c.choices) == 1 and c.usage is None for c in body)
    finishes = [c.choices[0].finish_reason for c in body]
    assert all(f is None for f in finishes[:-1]) and finishes[-1] is not None
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in body)
    content = "".join(c.choices[0].delta.content or "" for c in body)
    return reasoning or None, content, streamed_tool_calls(body), finishes[-1], last.usage


def chat_turn(client, model: str, stream: bool, **kw):
    kw = dict(model=model, max_tokens=MAX_TOKENS, **GREEDY, **kw)
    if stream:
        return chat_stream(client, **kw)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == model
    assert len(r.choices) == 1
    m = r.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
    return m.reasoning_content, m.content or "", calls, r.choices[0].finish_reason, r.usage


def check_forced(content: str, calls: list, finish: str, budget_left: bool, named: bool) -> None:
    """A forced call's reply: a parsed call of the tool with typed arguments, or the call's unparsed text."""
    if calls:
        assert finish == "tool_calls" and [c["name"] for c in calls] == ["read_file"]
        for c in calls:
            assert c["id"]
            typed(json.loads(c["arguments"]))
    else:
        assert content.startswith(OPENING + ("read_file" if named else "")), content
        assert finish == ("stop" if budget_left else "length")


def test_chat_completions_tool_session_of_three_turns(oai, server):
    model = server[1]
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": TASK}]
    prompts = []
    for turn, path in enumerate(FILES):
        choice = "required" if turn == 1 else {"type": "function", "function": {"name": "read_file"}}
        stream = turn == 1
        reasoning, content, calls, finish, usage = chat_turn(oai, model, stream, messages=messages,
                                                             tools=CHAT_TOOLS, tool_choice=choice)
        assert reasoning is None  # a forced call does not think: the prompt closes the reasoning
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        details = usage.prompt_tokens_details   # cached_tokens: where the server reports prefix reuse
        assert details is None or 0 <= (details.cached_tokens or 0) < usage.prompt_tokens
        assert 1 <= usage.completion_tokens <= MAX_TOKENS
        check_forced(content, calls, finish, usage.completion_tokens < MAX_TOKENS, named=turn != 1)
        prompts.append(usage.prompt_tokens)
        call = calls[0] if calls else {"id": f"call_{turn}", "name": "read_file",
                                       "arguments": json.dumps({"path": path, "max_bytes": FILE_BYTES})}
        # the reply goes back as the client got it: an unparsed call's text (markup spelled in content) too
        messages += [{"role": "assistant", "content": content or None, "tool_calls": [
                         {"id": call["id"], "type": "function",
                          "function": {"name": call["name"], "arguments": call["arguments"]}}]},
                     {"role": "tool", "tool_call_id": call["id"], "content": read(path)}]
    # each turn's prompt holds the one before, its call and a file's head
    assert all(b > a + 100 for a, b in zip(prompts, prompts[1:])), prompts
    # the closing turn, free to answer: thinking on gives reasoning apart, off gives content alone
    on = chat_turn(oai, model, True, messages=messages, tools=CHAT_TOOLS)
    off = chat_turn(oai, model, False, messages=messages, tools=CHAT_TOOLS,
                    extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert on[0] and on[4].prompt_tokens > prompts[-1]
    assert off[0] is None and off[1] and not off[2]
    assert off[4].prompt_tokens == on[4].prompt_tokens + 1  # the closed <think></think>
    for r in (on, off):
        assert r[3] in ("stop", "length", "tool_calls")


def test_chat_streamed_and_whole_replies_agree(oai, server):
    kw = dict(messages=[{"role": "user", "content": TASK}], tools=CHAT_TOOLS, tool_choice="auto")
    whole = chat_turn(oai, server[1], False, **kw)
    streamed = chat_turn(oai, server[1], True, **kw)
    assert whole[:4] == streamed[:4]
    # the same tokens either way; what came from a cache may differ (the second follows the first)
    assert (whole[4].prompt_tokens, whole[4].completion_tokens) == (streamed[4].prompt_tokens,
                                                                    streamed[4].completion_tokens)


# ---- Anthropic Messages ------------------------------------------------------------------------------------------
CLAUDE_TOOLS = [{"name": "read_file", "description": "read a file of the repository", "input_schema": SCHEMA}]


def claude_turn(client, model: str, stream: bool, **kw):
    # greedy, so that a run is repeatable (this anthropic client takes temperature only as an extra); the served
    # model's name, as Claude Code sends it when ANTHROPIC_MODEL names it (another name is a 400, as on every route)
    kw = dict(model=model, max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, **kw)
    if not stream:
        return client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    raw = [k for k in kinds if k in ("message_start", "content_block_start", "content_block_stop", "message_delta",
                                     "message_stop")]
    assert raw[0] == "message_start" and raw[-2:] == ["message_delta", "message_stop"]
    assert raw.count("content_block_start") == raw.count("content_block_stop") == len(final.content)
    return final


def prompt_of(m) -> int:
    """A message's prompt tokens: Anthropic's input_tokens leave out those read from (or written to) a cache."""
    u = m.usage
    return u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0)


def check_message(m, model: str) -> None:
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == model
    assert 1 <= m.usage.output_tokens <= MAX_TOKENS and m.usage.input_tokens > 0
    assert 0 <= (m.usage.cache_read_input_tokens or 0) < prompt_of(m)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert (m.stop_reason == "max_tokens") == (m.usage.output_tokens == MAX_TOKENS)


def test_messages_tool_session_of_three_turns(claude, server):
    model = server[1]
    messages: list = [{"role": "user", "content": TASK}]
    inputs = []
    for turn, path in enumerate(FILES):
        choice = {"type": "any"} if turn == 1 else {"type": "tool", "name": "read_file"}
        m = claude_turn(claude, model, turn == 1, system="You are a coding agent.", messages=messages, tools=CLAUDE_TOOLS,
                        tool_choice=choice)
        check_message(m, model)
        kinds = [b.type for b in m.content]
        assert "thinking" not in kinds  # a forced call does not think
        uses = [b for b in m.content if b.type == "tool_use"]
        if uses:
            assert m.stop_reason == "tool_use" and all(b.name == "read_file" and b.id for b in uses)
            for b in uses:
                typed(b.input)
            use = {"id": uses[0].id, "input": uses[0].input}
        else:
            assert kinds == ["text"] and m.content[0].text.startswith(OPENING + ("read_file" if turn != 1 else "")), \
                m.content
            use = {"id": f"toolu_{turn}", "input": {"path": path, "max_bytes": FILE_BYTES}}
        said = [{"type": "text", "text": b.text} for b in m.content if b.type == "text"]
        inputs.append(prompt_of(m))
        messages += [{"role": "assistant", "content": said + [{"type": "tool_use", "id": use["id"],
                                                               "name": "read_file", "input": use["input"]}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                   "content": [{"type": "text", "text": read(path)}]}]}]
    assert all(b > a + 100 for a, b in zip(inputs, inputs[1:])), inputs
    counted = claude.messages.count_tokens(model=model, messages=messages, tools=CLAUDE_TOOLS,
                                           system="You are a coding agent.")
    on = claude_turn(claude, model, True, system="You are a coding agent.", messages=messages, tools=CLAUDE_TOOLS,
                     thinking={"type": "enabled", "budget_tokens": 1024})
    off = claude_turn(claude, model, False, system="You are a coding agent.", messages=messages, tools=CLAUDE_TOOLS,
                      thinking={"type": "disabled"})
    for m in (on, off):
        check_message(m, model)
    assert prompt_of(on) == counted.input_tokens
    assert on.content[0].type == "thinking" and on.content[0].thinking
    assert [b.type for b in off.content][:1] == ["text"] and "thinking" not in [b.type for b in off.content]


# ---- OpenAI Responses ----------------------------------------------------------------------------------------------
RESP_TOOLS = [{"type": "function", "name": "read_file", "description": "read a file of the repository",
               "parameters": SCHEMA, "strict": False}]


def responses_turn(client, model: str, stream: bool, **kw):
    kw = dict(model=model, max_output_tokens=MAX_TOKENS, temperature=0, **kw)
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(events[-1].response.output)))
    return events[-1].response


def check_response(r, model: str) -> None:
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert 0 <= r.usage.input_tokens_details.cached_tokens < r.usage.input_tokens
    assert 1 <= r.usage.output_tokens <= MAX_TOKENS
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.status == "incomplete") == (r.usage.output_tokens == MAX_TOKENS)
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"


def test_responses_tool_session_of_three_turns(oai, server):
    model = server[1]
    items: list = [{"role": "user", "content": [{"type": "input_text", "text": TASK}]}]
    inputs = []
    for turn, path in enumerate(FILES):
        choice = "required" if turn == 1 else {"type": "function", "name": "read_file"}
        r = responses_turn(oai, model, turn == 1, instructions="You are a coding agent.", input=items,
                           tools=RESP_TOOLS, tool_choice=choice)
        check_response(r, model)
        if turn == 1:  # the streamed reply echoes the request's tools and tool_choice
            assert r.tool_choice == "required" and [(t.name, t.strict) for t in r.tools] == [("read_file", False)]
        kinds = [o.type for o in r.output]
        assert "reasoning" not in kinds  # a forced call does not think
        calls = [o for o in r.output if o.type == "function_call"]
        if calls:
            assert all(c.name == "read_file" and c.call_id for c in calls)
            for c in calls:
                typed(json.loads(c.arguments))
            call = {"call_id": calls[0].call_id, "arguments": calls[0].arguments}
        else:
            assert kinds == ["message"], r.output
            assert r.output[0].content[0].text.startswith(OPENING + ("read_file" if turn != 1 else "")), r.output
            call = {"call_id": f"call_{turn}", "arguments": json.dumps({"path": path, "max_bytes": FILE_BYTES})}
        inputs.append(r.usage.input_tokens)
        said = [{"role": "assistant", "content": [{"type": "output_text", "text": o.content[0].text}]}
                for o in r.output if o.type == "message"]
        items += [*said, {"type": "function_call", "name": "read_file", **call},
                  {"type": "function_call_output", "call_id": call["call_id"], "output": read(path)}]
    assert all(b > a + 100 for a, b in zip(inputs, inputs[1:])), inputs
    # thinking: on with reasoning.effort low (as by default), off with effort none
    r = responses_turn(oai, model, True, instructions="You are a coding agent.", input=items, tools=RESP_TOOLS,
                       reasoning={"effort": "low"})
    check_response(r, model)
    assert r.output[0].type == "reasoning" and r.output[0].summary[0].text
    r = responses_turn(oai, model, False, instructions="You are a coding agent.", input=items, tools=RESP_TOOLS,
                       reasoning={"effort": "none"})
    check_response(r, model)
    assert r.output and "reasoning" not in [o.type for o in r.output], r.output


# ---- bad input ---------------------------------------------------------------------------------------------------
def chat_bad(model: str) -> list:
    user = [{"role": "user", "content": TASK}]

    def called(args: str) -> list:
        return user + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x"}]

    return [
        ("unknown forced tool", dict(messages=user, tools=CHAT_TOOLS,
                                     tool_choice={"type": "function", "function": {"name": "rm_rf"}}), "rm_rf"),
        ("image content", dict(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]), "messages"),
        ("arguments not JSON", dict(messages=called("{path: fast/round.py"), tools=CHAT_TOOLS), "not JSON"),
        ("arguments not an object", dict(messages=called('["fast/round.py"]'), tools=CHAT_TOOLS), "object"),
    ]


def test_bad_input_is_a_clear_4xx_on_every_api_and_the_server_stays_healthy(oai, claude, server):
    url, model = server
    for name, kw, needle in chat_bad(model):
        with pytest.raises(openai.BadRequestError) as info:
            oai.chat.completions.create(model=model, max_tokens=MAX_TOKENS, **kw)
        assert needle in info.value.body["message"], (name, info.value.body)
    user = [{"role": "user", "content": TASK}]
    used = [{"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file",
                                               "input": {"path": "fast/round.py"}}]}]
    for name, kw, needle in [
        ("unknown forced tool", dict(messages=user, tools=CLAUDE_TOOLS, tool_choice={"type": "tool", "name": "rm_rf"}),
         "rm_rf"),
        ("tool_result for an unknown id", dict(messages=user + used + [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}], tools=CLAUDE_TOOLS), "toolu_9"),
        ("image block", dict(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), "'image'"),
        ("tool_use input not an object", dict(messages=user + [{"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": "fast/round.py"}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}]}],
            tools=CLAUDE_TOOLS), "input must be an object"),
    ]:
        with pytest.raises(anthropic.BadRequestError) as info:
            claude.messages.create(model=model, max_tokens=MAX_TOKENS, **kw)
        body = info.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", (name, body)
        assert needle in body["error"]["message"], (name, body)
    call = {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "a.py"}'}
    for name, kw, needle in [
        ("unknown forced tool", dict(input=TASK, tools=RESP_TOOLS, tool_choice={"type": "function", "name": "rm_rf"}),
         "rm_rf"),
        ("output for an unknown call_id", dict(input=[*user, call, {"type": "function_call_output",
                                                                   "call_id": "call_9", "output": "x"}],
                                               tools=RESP_TOOLS), "call_9"),
        ("image part", dict(input=[{"role": "user", "content": [{"type": "input_image",
                                                                 "image_url": "data:image/png;base64,AA=="}]}]),
         "input_image"),
        ("arguments not JSON", dict(input=[*user, {**call, "arguments": "{path"}, {"type": "function_call_output",
                                                                                  "call_id": "call_1", "output": "x"}],
                                    tools=RESP_TOOLS), "not JSON"),
    ]:
        with pytest.raises(openai.BadRequestError) as info:
            oai.responses.create(model=model, max_output_tokens=MAX_TOKENS, **kw)
        assert needle in info.value.body["message"], (name, info.value.body)
    # a model other than the served one: refused alike by the three routes
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model="gpt-5-codex", messages=user, max_tokens=MAX_TOKENS)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="gpt-5-codex", input=TASK, max_output_tokens=MAX_TOKENS)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model="claude-sonnet-4-5", messages=user, max_tokens=MAX_TOKENS)
    assert "claude-sonnet-4-5" in info.value.body["error"]["message"] and model in info.value.body["error"]["message"]
    assert httpx.get(url + "/health", timeout=5).json()["status"] == "ok"
    r = oai.chat.completions.create(model=model, messages=user, max_tokens=4, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    metrics = httpx.get(url + "/metrics", timeout=5).text
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        assert f'iquest_requests_total{{route="{route}",status="400"}}' in metrics, metrics


def test_chat_tool_result_for_an_unknown_id_is_a_400(oai, server):
    messages = [{"role": "user", "content": TASK},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "read_file", "arguments": '{"path": "fast/round.py"}'}}]},
                {"role": "tool", "tool_call_id": "call_9", "content": "x"}]
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=server[1], messages=messages, tools=CHAT_TOOLS, max_tokens=1)
    assert "call_9" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:  # a tool result before any call
        oai.chat.completions.create(model=server[1], messages=[messages[0], {"role": "tool", "tool_call_id": "call_1",
                                                                             "content": "x"}], max_tokens=1)
    assert "no assistant tool call" in info.value.body["message"]
