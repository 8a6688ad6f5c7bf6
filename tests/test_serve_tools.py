"""Chat reasoning and tool calls (issue 51): the split of a reply's token ids into reasoning, content and
tool calls (serve/chat.py) as units on constructed id sequences, and end to end with the official openai
client against a live server: the tiny fixture's own output (thinking on and off), and an engine that
emits a scripted reply (the fixtures do not write tool calls by themselves) for a two-turn tool round
trip, tool_choice, and malformed calls (text, not an error)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from iquest.cli.engines import load_engine
from iquest.serve.app import ServeOptions, create_app
from iquest.serve.chat import ChatStream, Delta, Markup
from iquest.serve.server import ServerThread, load_tokenizer
from iquest.serve.testing import ScriptedEngine, spelled_ids
from iquest.tests.helpers import TINY, streamed_tool_calls

CONTEXT = 256
TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"},
                                                    "opts": {"type": "object"}}}}}]
USER = [{"role": "user", "content": "How long is a.py?"}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


ids = spelled_ids


CALL = ("<iquest_tool_call>read_file<arg_key>path</arg_key><arg_value>007.py</arg_value><arg_key>lines"
        "</arg_key><arg_value>3</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": [1]}</arg_value>"
        "</iquest_tool_call>")


def run(tok, text: str, *, one_by_one: bool, thinking=True, tools=TOOLS, stops=(), forced=None):
    s = ChatStream(tok, list(stops), Markup.of(tok), thinking=thinking, tools=tools, stop_ids=(0,),
                   forced=forced)
    out = Delta()
    seq = ids(tok, text)
    for chunk in ([[t] for t in seq] if one_by_one else [seq]):
        out.add(s.push(chunk))
    return out.add(s.finish()), s


@pytest.mark.parametrize("one_by_one", [False, True])
def test_reasoning_content_and_a_call_split_on_token_ids(tok, one_by_one):
    out, s = run(tok, "I should read it</think>Reading. " + CALL + "<|iquest_end|>", one_by_one=one_by_one)
    assert out.reasoning == "I should read it" and out.content == "Reading. "
    assert [c["function"]["name"] for c in out.calls] == ["read_file"]
    # typed by the schema: a string stays raw ("007.py", not 7), the others are JSON
    assert json.loads(out.calls[0]["function"]["arguments"]) == {"path": "007.py", "lines": 3, "opts": {"a": [1]}}
    assert len(s.ids) == len(ids(tok, "I should read it</think>Reading. " + CALL + "<|iquest_end|>"))


def test_two_calls_in_one_turn_stream_with_their_indices(scripted, tok):
    fake, client, _ = scripted
    two = "</think>" + CALL + CALL.replace("007.py", "b.py") + "<|iquest_end|>"
    fake.scripts += [ids(tok, two)]
    _, content, calls, finish = stream_reply(client, model="tiny", messages=USER, tools=TOOLS, max_tokens=120)
    assert finish == "tool_calls" and not content and len({c["id"] for c in calls}) == 2
    assert [json.loads(c["arguments"])["path"] for c in calls] == ["007.py", "b.py"]


def test_thinking_off_is_all_content_and_calls_need_tools(tok):
    out, _ = run(tok, "no think here", one_by_one=False, thinking=False)
    assert out.reasoning == "" and out.content == "no think here"
    out, _ = run(tok, "a</think>" + CALL, one_by_one=False, tools=None)  # no tools offered: a call is text
    assert out.calls == [] and out.content == CALL and out.reasoning == "a"


@pytest.mark.parametrize("bad", [
    "<iquest_tool_call>unknown_tool<arg_key>path</arg_key><arg_value>x</arg_value></iquest_tool_call>",
    "<iquest_tool_call>read_file<arg_key>path</arg_key>x</arg_value></iquest_tool_call>",
    "<iquest_tool_call>read_file<arg_value>x</arg_value><arg_key>path</arg_key></iquest_tool_call>",
    "<iquest_tool_call>read_file<arg_key>path</arg_key><arg_value>x</arg_value>",  # cut off: no end
])
@pytest.mark.parametrize("one_by_one", [False, True])
def test_a_malformed_call_is_content_text(tok, bad, one_by_one):
    out, _ = run(tok, "r</think>see " + bad, one_by_one=one_by_one)
    assert out.calls == [] and out.content == "see " + bad and out.reasoning == "r"


def test_odd_schemas_parse_every_value_as_json_where_it_is_json(tok):
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"properties": ["path"]}}}]
    out, _ = run(tok, "</think>" + CALL, one_by_one=False, tools=tools)
    assert json.loads(out.calls[0]["function"]["arguments"]) == {"path": "007.py", "lines": 3, "opts": {"a": [1]}}
    tools = [{"type": "function", "function": {"name": "read_file"}}]  # no schema at all
    out, _ = run(tok, "</think>" + CALL.replace("007.py", "a.py"), one_by_one=False, tools=tools)
    assert json.loads(out.calls[0]["function"]["arguments"])["path"] == "a.py"  # not JSON: kept as text


def test_a_stop_string_in_content_ends_the_reply(tok):
    out, s = run(tok, "r</think>alpha STOP beta", one_by_one=False, stops=["STOP"])
    assert out.content == "alpha " and s.stopped
    assert tok.decode(s.ids, skip_special_tokens=True) == "ralpha STOP"


def test_a_forced_call_parses_from_its_prefix(tok):
    out, _ = run(tok, "<arg_key>path</arg_key><arg_value>a.py</arg_value></iquest_tool_call><|iquest_end|>",
                 one_by_one=True, forced=ids(tok, "<iquest_tool_call>read_file"))
    assert out.calls[0]["function"]["name"] == "read_file" and out.content == "" and out.reasoning == ""


# ---- end to end ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine():
    return load_engine("fast", TINY, 1, max_context=CONTEXT)


@pytest.fixture(scope="module")
def live(engine):
    app = create_app(engine, load_tokenizer(TINY), ServeOptions("tiny", max_context=CONTEXT))
    with ServerThread(app) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def scripted(engine):
    fake = ScriptedEngine(engine)
    app = create_app(fake, load_tokenizer(TINY), ServeOptions("tiny", max_context=1024))
    with ServerThread(app) as s:
        yield fake, openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60), s.url


def stream_reply(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, **kw))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    return reasoning, content, streamed_tool_calls(chunks), chunks[-1].choices[0].finish_reason


def test_live_reasoning_is_separate_and_thinking_switches_off(live, tok):
    kw = dict(model="tiny", messages=USER, max_tokens=10, seed=4, temperature=0)
    on = live.chat.completions.create(**kw)
    off = live.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)
    off2 = live.chat.completions.create(extra_body={"thinking": {"type": "disabled"}}, **kw)
    # thinking on: the prompt ends inside the reasoning, and the reply is reasoning; off: one more prompt
    # token (</think>), and the reply is content
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + 1
    assert on.choices[0].message.reasoning_content and not on.choices[0].message.content
    assert off.choices[0].message.content and off.choices[0].message.reasoning_content is None
    assert off2.choices[0].message.content == off.choices[0].message.content
    reasoning, content, _, _ = stream_reply(live, **kw)
    assert (reasoning, content) == (on.choices[0].message.reasoning_content, "")


def test_scripted_reasoning_stream_and_not(scripted, tok):
    fake, client, _ = scripted
    reply = ids(tok, "Plan: answer briefly.</think>Three lines.<|iquest_end|>")
    fake.scripts += [reply, reply]
    a = client.chat.completions.create(model="tiny", messages=USER, max_tokens=50)
    assert a.choices[0].message.reasoning_content == "Plan: answer briefly."
    assert a.choices[0].message.content == "Three lines." and a.choices[0].finish_reason == "stop"
    assert stream_reply(client, model="tiny", messages=USER, max_tokens=50) == \
        ("Plan: answer briefly.", "Three lines.", [], "stop")
    assert tok.decode(fake.prompts[-1][-2:]) == "<|iquest_assistant|><think>"


@pytest.mark.parametrize("stream", [False, True])
def test_tool_round_trip_of_two_turns(scripted, tok, stream):
    fake, client, _ = scripted
    fake.scripts += [ids(tok, "Need the file.</think>" + CALL + "<|iquest_end|>"),
                     ids(tok, "It has 3.</think>a.py has 3 lines.<|iquest_end|>")]
    kw = dict(model="tiny", tools=TOOLS, max_tokens=80)
    if stream:
        reasoning, content, calls, finish = stream_reply(client, messages=USER, **kw)
    else:
        r = client.chat.completions.create(messages=USER, **kw)
        m, finish = r.choices[0].message, r.choices[0].finish_reason
        reasoning, content = m.reasoning_content, m.content
        calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls]
    assert finish == "tool_calls" and reasoning == "Need the file." and not content
    assert [c["name"] for c in calls] == ["read_file"] and calls[0]["id"]
    assert json.loads(calls[0]["arguments"]) == {"path": "007.py", "lines": 3, "opts": {"a": [1]}}
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": reasoning,
         "tool_calls": [{"id": calls[0]["id"], "type": "function",
                         "function": {"name": "read_file", "arguments": calls[0]["arguments"]}}]},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "1\n2\n3\n"}]
    r2 = client.chat.completions.create(messages=history, **kw)
    assert r2.choices[0].message.content == "a.py has 3 lines." and r2.choices[0].finish_reason == "stop"
    prompt = tok.decode(fake.prompts[-1], skip_special_tokens=False)
    # the call and its result rendered back through the template (a string raw, the others as JSON)
    assert ("<iquest_tool_call>read_file<arg_key>path</arg_key><arg_value>007.py</arg_value><arg_key>lines"
            "</arg_key><arg_value>3</arg_value><arg_key>opts</arg_key><arg_value>{\"a\": [1]}</arg_value>"
            "</iquest_tool_call><|iquest_end|><|iquest_tool|><tool_response>1\n2\n3\n</tool_response>"
            "<|iquest_end|><|iquest_assistant|><think>") in prompt
    assert prompt.startswith("<|iquest_system|>") and '"name": "read_file"' in prompt


def test_tool_choice_named_and_required_force_the_call(scripted, tok):
    fake, client, _ = scripted
    rest = ids(tok, "<arg_key>path</arg_key><arg_value>b.py</arg_value></iquest_tool_call><|iquest_end|>")
    fake.scripts += [rest, ids(tok, "read_file") + rest, ids(tok, "I will not call.<|iquest_end|>")]
    named = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=40, tool_choice={
        "type": "function", "function": {"name": "read_file"}})
    assert named.choices[0].message.tool_calls[0].function.name == "read_file"
    assert json.loads(named.choices[0].message.tool_calls[0].function.arguments) == {"path": "b.py"}
    assert tok.decode(fake.prompts[-1], skip_special_tokens=False).endswith(
        "<think></think><iquest_tool_call>read_file")
    req = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=40,
                                         tool_choice="required")
    assert req.choices[0].finish_reason == "tool_calls"
    assert tok.decode(fake.prompts[-1][-2:], skip_special_tokens=False) == "</think><iquest_tool_call>"
    # tool_choice none: the call markup is not parsed (here: plain text)
    none = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=40,
                                          tool_choice="none")
    assert none.choices[0].message.tool_calls is None


def test_bad_tool_input_is_a_400_and_a_malformed_call_is_text(scripted, tok):
    fake, client, url = scripted
    for choice in ({"type": "function", "function": {"name": "rm_rf"}}, "sometimes"):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=choice)
        assert info.value.body["param"] == "tool_choice"
    bad_history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": "{not json"}}]}]
    for body in ({"messages": USER, "tools": "read_file"}, {"messages": USER, "tools": [{"type": "function"}]},
                 {"messages": bad_history, "tools": TOOLS},
                 {"messages": USER, "chat_template_kwargs": {"enable_thinking": "no"}}):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
    bad = "<iquest_tool_call>read_file<arg_value>x</arg_value></iquest_tool_call>"
    fake.scripts += [ids(tok, "hm</think>" + bad + "<|iquest_end|>")] * 2
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=40)
    assert r.choices[0].message.content == bad and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    assert stream_reply(client, model="tiny", messages=USER, tools=TOOLS, max_tokens=40) == ("hm", bad, [], "stop")


def test_a_5xx_is_logged_with_its_request_id(scripted, caplog):
    fake, _, url = scripted
    fake.scripts += [RuntimeError("boom"), RuntimeError("bang")]
    with caplog.at_level("ERROR", logger="iquest.serve"):
        r = httpx.post(url + "/v1/chat/completions", json={"messages": USER}, headers={"x-request-id": "rq-1"},
                       timeout=30)
        assert r.status_code == 500 and "boom" in r.json()["error"]["message"]
        assert r.headers["x-request-id"] == "rq-1"
        with httpx.stream("POST", url + "/v1/chat/completions", json={"messages": USER, "stream": True},
                          headers={"x-request-id": "rq-2"}, timeout=30) as s:
            assert s.status_code == 200 and "bang" in s.read().decode()
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "iquest.serve"]
    assert any("rq-1" in m and "500" in m and "boom" in m for m in logged), logged
    assert any("rq-2" in m and "500" in m and "bang" in m for m in logged), logged


def test_a_model_that_draws_end_think_splits_on_the_real_engine(tmp_path, tok):
    """A copy of tiny whose LM head makes its greedy reply draw </think> after a few tokens (as
    tests/test_serve.py makes one draw <|iquest_end|>): the fast engine's ids, split by the server, give the
    reasoning before it and the content after it, streaming and not."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from iquest.reference.model import ReferenceModel
    from iquest.reference.sampling import SamplingParams
    from iquest.reference.speculative import generate
    from iquest.serve.prepare import Encoder

    end_think = Markup.of(tok).end_think
    prompt = Encoder(tok).chat_ids(USER)
    model = tmp_path / "thinks"
    shutil.copytree(TINY, model)
    ref = ReferenceModel.load(model)
    greedy = SamplingParams(temperature=0.0)
    prefix = [t for s in generate(ref, prompt, seed=0, params=greedy, max_new_tokens=3, drafts=0) for t in s.tokens]
    seq = prompt + prefix
    _, hidden = ref.forward(torch.tensor(seq), torch.arange(len(seq)), ref.new_cache())
    shard = next(p for p in model.glob("*.safetensors"))
    tensors = load_file(str(shard))
    head = tensors["lm_head.weight"].float()
    # a row orthogonal to the hidden states of the earlier reply positions (logit 0 there, below their greedy
    # token's) and well above the greedy token's logit at the last one
    h = hidden[len(prompt) - 1:].float()
    q, _ = torch.linalg.qr(h[:-1].T)
    row = h[-1] - q @ (q.T @ h[-1])
    top = (h[-1] @ head.T).max()
    head[end_think] = row * (top + 8) / (row @ h[-1])
    tensors["lm_head.weight"] = head.bfloat16()
    save_file(tensors, str(shard), metadata={"format": "pt"})
    out = [t for s in generate(ReferenceModel.load(model), prompt, seed=0, params=greedy, max_new_tokens=12,
                               drafts=0, stop_ids=(0,)) for t in s.tokens]
    assert end_think in out, out
    cut = out.index(end_think)
    assert cut > 0, out
    engine = load_engine("fast", model, 1, max_context=CONTEXT)
    with ServerThread(create_app(engine, load_tokenizer(model), ServeOptions("tiny", max_context=CONTEXT))) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw = dict(model="tiny", messages=USER, max_tokens=12, temperature=0, seed=1)
        m = client.chat.completions.create(**kw).choices[0].message
        assert m.reasoning_content == tok.decode(out[:cut], skip_special_tokens=True)
        assert m.content == tok.decode(out[cut + 1:], skip_special_tokens=True) and m.content
        assert stream_reply(client, **kw)[:2] == (m.reasoning_content, m.content)
