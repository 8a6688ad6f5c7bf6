"""The OpenAI Responses API (`POST /v1/responses`), the subset Codex uses, over the chat path.

A request is translated into the chat route's own request (`instructions` as the system message; `input` as
a string or a list of items: `message` items with role user/assistant/system/developer (developer is system)
and content as a string or `input_text`/`output_text` parts; `function_call` items as an assistant's
`tool_calls`; `function_call_output` items as role `tool` messages; `reasoning` items as the next assistant
turn's `reasoning_content`; `tools` of type function; `tool_choice`; `max_output_tokens`; `temperature`,
`top_p`; `model`, checked as the chat route checks it) and prepared by `prepare.prepare_chat`, as `messages.py`
does for Anthropic's API.

`model` must be the served model's name (`GET /v1/models`; `iquest serve --served-model-name` sets it), else a 400
`model_not_found`, as on the chat and Messages routes: a client that sends its own names (Codex's `model`
setting) is configured to send this one, or the server is started under the name it sends.

`reasoning.effort` is the chat route's thinking switch: "none" and "minimal" turn thinking off (the chat
template's enable_thinking false; no reasoning item); "low", "medium", "high", or no effort (no `reasoning`, or one
without `effort`) leave it on, the model's default: it decides how much it thinks, so the three levels are
alike. Any other effort is a 400 naming `reasoning.effort`. `reasoning.summary` is not honored (the summary
is the whole reasoning).

The reply comes back as output items (a `reasoning` item whose summary is the model's <think> part, a `message`
item with `output_text`, `function_call` items), the request's `tools` as sent and its `tool_choice` ("auto"
when absent), `status` (`incomplete` with reason `max_output_tokens` when the budget ran out) and
`usage`, or streamed as the Responses API's events (`response.created`, `response.output_item.added`,
`response.output_text.delta`, ..., `response.completed`), each with its `sequence_number`.

Not supported: responses are not stored (`previous_response_id` is a 400: send the whole input), tools
other than functions, content other than text (`input_image`, `input_file`: a 400). Errors are OpenAI's
shape (`{"error": {...}}`).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import replace

from .prepare import Encoder, Limits, Prepared, prepare_chat
from .protocol import APIError, bad_request

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# reasoning.effort as the chat route's thinking switch (True: on). The model has no effort levels of its own, so
# "none" and "minimal" (as little as can be) are off and every level above is on.
EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


def new_id(prefix: str) -> str:
    return prefix + "_" + uuid.uuid4().hex[:24]


# ---- request ------------------------------------------------------------------------------------------------
def text_of(content, where: str) -> str:
    """A message's content (a string, or a list of input_text/output_text parts) as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts", "input")
    out = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "summary_text", "reasoning_text"):
            raise bad_request(f"{where}[{i}]: content of type {kind!r} is not supported here (text only: "
                              f"input_text, output_text)", "input")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{i}].text must be a string", "input")
        out.append(part["text"])
    return "".join(out)


def chat_messages(instructions, items) -> list[dict]:
    """The Responses API's instructions and input as the chat route's messages."""
    out: list[dict] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("instructions must be a string", "instructions")
        if instructions:
            out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_request("input must be a string or a non-empty list of items", "input")
    seen_calls: set[str] = set()
    reasoning: list[str] = []          # reasoning items waiting for the assistant turn they belong to
    last_assistant: dict | None = None  # the assistant turn function calls join (None: a new one)

    def assistant() -> dict:
        nonlocal last_assistant
        if last_assistant is None:
            last_assistant = {"role": "assistant", "content": ""}
            out.append(last_assistant)
        if reasoning:
            last_assistant["reasoning_content"] = last_assistant.get("reasoning_content", "") + "".join(reasoning)
            reasoning.clear()
        return last_assistant

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))
            if role is None:
                raise bad_request(f"{where}.role must be user, assistant, system or developer, got "
                                  f"{item.get('role')!r}", "input")
            text = text_of(item.get("content"), f"{where}.content")
            if role == "assistant":
                last_assistant = None
                assistant()["content"] = text
            else:
                last_assistant = None
                out.append({"role": role, "content": text})
        elif kind == "function_call":
            cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not (isinstance(cid, str) and cid and isinstance(name, str) and name):
                raise bad_request(f"{where}: a function_call item needs a call_id and a name", "input")
            if not isinstance(args, str):
                raise bad_request(f"{where}.arguments must be a JSON string", "input")
            seen_calls.add(cid)
            a = assistant()
            a.setdefault("tool_calls", []).append({"id": cid, "type": "function",
                                                   "function": {"name": name, "arguments": args}})
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if cid not in seen_calls:
                raise bad_request(f"{where}: function_call_output's call_id {cid!r} matches no earlier "
                                  f"function_call item", "input")
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": cid,
                        "content": output if isinstance(output, str) else text_of(output, f"{where}.output")})
            last_assistant = None
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append(text_of(parts, f"{where}.content" if item.get("content") else f"{where}.summary"))
            last_assistant = None
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported here (message, function_call, "
                              f"function_call_output, reasoning)", "input")
    if out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
        raise bad_request("the last input item is an assistant message: a prefill is not supported here", "input")
    return out


def function_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {'type': 'function', 'name', 'parameters'}", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: tools of type {kind!r} are not supported here (function tools only)",
                              "tools")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}] needs a name", "tools")
        f = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if isinstance(tool.get("description"), str):
            f["description"] = tool["description"]
        out.append({"type": "function", "function": f})
    return out


def chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice   # auto, none, required: checked by chat.check_tools
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice")


def chat_request(body) -> dict:
    """A Responses API body (parsed JSON) as the chat route's body."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise bad_request("previous_response_id is not supported: this server does not store responses; send "
                          "the whole conversation in input", "previous_response_id")
    if not isinstance(body.get("stream", False), bool):
        raise bad_request("stream must be true or false", "stream")
    out: dict = {"messages": chat_messages(body.get("instructions"), body.get("input")),
                 "stream": body.get("stream", False)}
    if body.get("model") is not None:
        out["model"] = body["model"]   # checked by prepare_chat, as on the chat route
    tools = function_tools(body.get("tools"))
    if tools:
        out["tools"] = tools
    choice = chat_tool_choice(body.get("tool_choice"))
    if choice is not None:
        out["tool_choice"] = choice
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    reasoning = body.get("reasoning")
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad_request("reasoning must be an object: {'effort': ...}", "reasoning")
        effort = reasoning.get("effort")
        if effort is not None:
            if not isinstance(effort, str) or effort not in EFFORT:
                raise bad_request(f"reasoning.effort must be one of {', '.join(map(repr, EFFORT))}, got {effort!r}",
                                  "reasoning.effort")
            out["thinking"] = {"type": "enabled" if EFFORT[effort] else "disabled"}
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def echoed(body: dict) -> dict:
    """What a Response repeats of its request: the tools as sent, and tool_choice."""
    choice = body.get("tool_choice")
    return {"tool_choice": "auto" if choice is None else choice, "tools": body.get("tools") or []}


def prepare_responses(raw: bytes, enc: Encoder, limits: Limits, end_of_turn: tuple[int, ...], markup) -> Prepared:
    try:
        body = json.loads(raw or b"")
    except ValueError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    try:
        p = prepare_chat(json.dumps(chat_request(body)).encode(), enc, limits, end_of_turn, markup)
    except APIError as exc:
        if exc.param == "max_tokens":
            exc.param = "max_output_tokens"
        raise
    return replace(p, reply=echoed(body))


# ---- response -----------------------------------------------------------------------------------------------
def reasoning_item(text: str, rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or new_id("rs"), "summary": [{"type": "summary_text", "text": text}]}


def message_item(text: str, mid: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": mid or new_id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(call: dict, status: str = "completed") -> dict:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


def response(rid: str, model: str, created: int, output: list, finish: str | None,
             usage: tuple[int, int, int], echo: dict | None = None) -> dict:
    """`usage`: (input tokens, output tokens, input tokens whose KV was reused); `echo`: the request's fields the
    Response repeats (`echoed`; None: a request without tools)."""
    status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
    return {"id": rid, "object": "response", "created_at": created, "model": model, "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None, "output": output, "parallel_tool_calls": True,
            **(echo or {"tool_choice": "auto", "tools": []}),
            "usage": None if finish is None else {
                "input_tokens": usage[0], "output_tokens": usage[1], "total_tokens": usage[0] + usage[1],
                "input_tokens_details": {"cached_tokens": usage[2]}, "output_tokens_details": {"reasoning_tokens": 0}}}


def of_chat(body: dict, model: str, p: Prepared | None = None) -> dict:
    """The chat route's answer body as a Response; `p`: its request's Prepared (`prepare_responses`), whose tools and
    tool_choice the Response echoes."""
    choice = body["choices"][0]
    m = choice["message"]
    output = []
    if m.get("reasoning_content"):
        output.append(reasoning_item(m["reasoning_content"]))
    if m.get("content"):
        output.append(message_item(m["content"], status="incomplete" if choice["finish_reason"] == "length"
                                   else "completed"))
    output += [call_item(c) for c in m.get("tool_calls") or []]
    u = body["usage"]
    return response(new_id("resp"), model, body["created"], output, choice["finish_reason"],
                    (u["prompt_tokens"], u["completion_tokens"], u["prompt_tokens_details"]["cached_tokens"]),
                    p.reply if p is not None else None)


class Items:
    """A reply's Deltas as the Responses API's events: an item opens when its kind of output starts, and
    closes when another starts or the reply ends; `output` holds the finished items."""

    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None   # the open reasoning or message item, its text so far in "text"

    def event(self, kind: str, **data) -> str:
        data = {"type": kind, "sequence_number": self.seq, **data}
        out = f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
        self.seq += 1
        return out

    def close(self) -> list[str]:
        it, self.open = self.open, None
        if it is None:
            return []
        at, text = len(self.output), it["text"]
        if it["kind"] == "reasoning":
            item = reasoning_item(text, it["id"])
            part = item["summary"][0]
            out = [self.event("response.reasoning_summary_text.done", item_id=it["id"], output_index=at,
                              summary_index=0, text=text),
                   self.event("response.reasoning_summary_part.done", item_id=it["id"], output_index=at,
                              summary_index=0, part=part)]
        else:
            item = message_item(text, it["id"])
            part = item["content"][0]
            out = [self.event("response.output_text.done", item_id=it["id"], output_index=at, content_index=0,
                              text=text, logprobs=[]),
                   self.event("response.content_part.done", item_id=it["id"], output_index=at, content_index=0,
                              part=part)]
        self.output.append(item)
        return out + [self.event("response.output_item.done", output_index=at, item=item)]

    def start(self, kind: str) -> list[str]:
        out = self.close()
        at = len(self.output)
        if kind == "reasoning":
            rid = new_id("rs")
            out += [self.event("response.output_item.added", output_index=at,
                               item={"type": "reasoning", "id": rid, "summary": []}),
                    self.event("response.reasoning_summary_part.added", item_id=rid, output_index=at,
                               summary_index=0, part={"type": "summary_text", "text": ""})]
        else:
            rid = new_id("msg")
            out += [self.event("response.output_item.added", output_index=at,
                               item={"type": "message", "id": rid, "role": "assistant", "status": "in_progress",
                                     "content": []}),
                    self.event("response.content_part.added", item_id=rid, output_index=at, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []})]
        self.open = {"kind": kind, "id": rid, "text": ""}
        return out

    def delta(self, d) -> list[str]:
        out: list[str] = []
        for kind, text in (("reasoning", d.reasoning), ("message", d.content)):
            if not text:
                continue
            if self.open is None or self.open["kind"] != kind:
                out += self.start(kind)
            self.open["text"] += text
            at = len(self.output)
            if kind == "reasoning":
                out.append(self.event("response.reasoning_summary_text.delta", item_id=self.open["id"],
                                      output_index=at, summary_index=0, delta=text))
            else:
                out.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=at,
                                      content_index=0, delta=text, logprobs=[]))
        for call in d.calls:
            out += self.close()
            item, at = call_item(call), len(self.output)
            out += [self.event("response.output_item.added", output_index=at,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=at,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=at,
                               name=item["name"], arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=at, item=item)]
            self.output.append(item)
        return out


async def events(answer, model: str, count):
    """The Responses API's event stream of a running chat Answer (its Deltas from messages.deltas)."""
    from .messages import deltas

    status, ended = 499, False
    items = Items()
    rid, created = new_id("resp"), int(time.time())
    try:
        echo = answer.p.reply
        head = response(rid, model, created, [], None, (len(answer.p.prompt), 0, answer.job.cached), echo)
        yield items.event("response.created", response=head)
        yield items.event("response.in_progress", response=head)
        async for kind, value in deltas(answer):
            if kind == "delta":
                for out in items.delta(value):
                    yield out
            elif kind == "error":
                ended = True
                status = value.status
                body = value.body()["error"]
                yield items.event("error", code=body.get("code") or body.get("type"), message=body["message"],
                                  param=body.get("param"))
                return
            else:
                ended = True
                for out in items.close():
                    yield out
                final = response(rid, model, created, items.output, value,
                                 (len(answer.p.prompt), answer.tokens, answer.job.cached), echo)
                yield items.event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                                  response=final)
                status = 200
    finally:
        if not ended:
            answer.finish("cancelled")
        count(status)
