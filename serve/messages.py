"""The Anthropic Messages API (`POST /v1/messages`) over the chat path, so that Claude Code can point
ANTHROPIC_BASE_URL at `iquest serve`.

A request is translated into the chat route's own request (system and user/assistant turns; `tool_use`
blocks as an assistant's `tool_calls`, `tool_result` blocks as role `tool` messages, `thinking` blocks as
`reasoning_content`; `tools` as function tools, `tool_choice` auto/any/tool/none as auto/required/named/none;
`stop_sequences` as stop; `thinking` enabled/disabled) and prepared by `prepare.prepare_chat`, so the prompt,
the forced calls and the split of the reply (`chat.ChatStream`) are the chat route's. The reply is
translated back into content blocks (`thinking`, `text`, `tool_use`), `stop_reason` and `usage`, or streamed
as Anthropic's events (`message_start`, `content_block_start` / `_delta` / `_stop`, `message_delta`,
`message_stop`).

`model` must be the served model's name (`GET /v1/models`; `iquest serve --served-model-name` sets it), else a
400 `model_not_found` (`invalid_request_error`), as on the chat and Responses routes. Claude Code sends names of
its own (its main model, a small fast one for background work, subagents' aliases): point each at the served name
(ANTHROPIC_MODEL, ANTHROPIC_SMALL_FAST_MODEL, ANTHROPIC_DEFAULT_{OPUS,SONNET,HAIKU}_MODEL), or serve under the name
it sends. A request for another model served by this one would hide a misrouted client, so none is.

Differences from Anthropic's API: thinking is on unless the request turns it off (the model's default, as on
the chat route; `adaptive` and `between_tools` count as `enabled`), and `budget_tokens` and `display` are
not honored (max_tokens bounds reasoning and answer together); `thinking` blocks carry an empty signature,
and `redacted_thinking` blocks sent back are dropped; a `tool_result` with `is_error` reaches the model as
"Error: " + its text. A final assistant message (a prefill) and content blocks of other types (`image`,
`document`, server tools) are refused with a 400.
Errors come in Anthropic's shape: `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
import uuid

from .prepare import Encoder, Limits, Prepared, prepare_chat
from .protocol import APIError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}
# Anthropic's thinking types: the model decides how much it thinks, so adaptive and between_tools are enabled
THINKING = {"enabled": "enabled", "adaptive": "enabled", "between_tools": "enabled", "disabled": "disabled"}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class AnthropicError(APIError):
    """An APIError answered in Anthropic's shape."""

    def body(self) -> dict:
        kind = ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    @classmethod
    def of(cls, exc: APIError) -> "AnthropicError":
        if isinstance(exc, AnthropicError):
            return exc
        message = exc.message if exc.param is None or exc.param in exc.message else f"{exc.param}: {exc.message}"
        return cls(exc.status, message, exc.type, exc.param, exc.code)


def invalid(message: str) -> AnthropicError:
    return AnthropicError(400, message)


# ---- request ------------------------------------------------------------------------------------------------
def text_of(content, where: str) -> str:
    """A string, or a list of text blocks, as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text blocks")
    out = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise invalid(f"{where}[{i}]: content blocks of type {kind!r} are not supported here (only 'text')")
        if not isinstance(block.get("text"), str):
            raise invalid(f"{where}[{i}].text must be a string")
        out.append(block["text"])
    return "".join(out)


def chat_messages(system, messages) -> list[dict]:
    """Anthropic's system and messages as the chat route's messages (OpenAI's roles, tool_calls, tool)."""
    out: list[dict] = []
    if system is not None:
        text = text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list of {'role': 'user' | 'assistant', 'content': ...}")
    seen_calls: set[str] = set()
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role must be 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid(f"{where}.content must be a string or a list of content blocks")
        if role == "assistant":
            text, reasoning, calls = [], [], []
            for j, block in enumerate(content):
                kind = block.get("type") if isinstance(block, dict) else None
                at = f"{where}.content[{j}]"
                if kind == "text":
                    text.append(text_of([block], at))
                elif kind == "thinking":
                    if not isinstance(block.get("thinking"), str):
                        raise invalid(f"{at}.thinking must be a string")
                    reasoning.append(block["thinking"])
                elif kind == "redacted_thinking":
                    continue
                elif kind == "tool_use":
                    cid, name, args = block.get("id"), block.get("name"), block.get("input", {})
                    if not (isinstance(cid, str) and cid and isinstance(name, str) and name):
                        raise invalid(f"{at}: a tool_use block needs an id and a name")
                    if not isinstance(args, dict):
                        raise invalid(f"{at}.input must be an object")
                    seen_calls.add(cid)
                    calls.append({"id": cid, "type": "function", "function": {"name": name, "arguments": args}})
                else:
                    raise invalid(f"{at}: content blocks of type {kind!r} are not supported in an assistant "
                                  f"message (text, thinking, tool_use)")
            msg: dict = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            continue
        pending: list[str] = []   # user text, sent as one message before the next tool result or at the end
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            at = f"{where}.content[{j}]"
            if kind == "text":
                pending.append(text_of([block], at))
            elif kind == "tool_result":
                cid = block.get("tool_use_id")
                if cid not in seen_calls:
                    raise invalid(f"{at}: tool_result's tool_use_id {cid!r} matches no earlier tool_use block")
                if pending:
                    out.append({"role": "user", "content": "".join(pending)})
                    pending = []
                result = text_of(block.get("content") or "", f"{at}.content")
                if block.get("is_error") is True:
                    result = "Error: " + result
                out.append({"role": "tool", "tool_call_id": cid, "content": result})
            else:
                raise invalid(f"{at}: content blocks of type {kind!r} are not supported in a user message "
                              f"(text, tool_result)")
        if pending or not content:
            out.append({"role": "user", "content": "".join(pending)})
    if messages[-1].get("role") != "user":
        raise invalid("the last message must be the user's: a final assistant message (a prefill) is not "
                      "supported here")
    return out


def function_tools(tools) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools must be a list of {'name', 'description', 'input_schema'}")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str) or not tool["name"]:
            raise invalid(f"tools[{i}] needs a name")
        if tool.get("type", "custom") not in ("custom", None):
            raise invalid(f"tools[{i}]: tools of type {tool['type']!r} are not supported here (custom tools only)")
        schema = tool.get("input_schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise invalid(f"tools[{i}].input_schema must be a JSON schema object")
        f = {"name": tool["name"], "parameters": schema}
        if isinstance(tool.get("description"), str):
            f["description"] = tool["description"]
        out.append({"type": "function", "function": f})
    return out


def openai_tool_choice(choice, tools: list[dict] | None):
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        if not tools:
            raise invalid("tool_choice 'any' needs tools")
        return "required"
    if kind == "tool":
        name = choice.get("name")
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise invalid(f"tool_choice names the tool {name!r}, which tools does not hold (tools: {names})")
        return {"type": "function", "function": {"name": name}}
    raise invalid("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}")


def chat_request(body) -> dict:
    """An Anthropic Messages request body (parsed JSON) as the chat route's body."""
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if type(max_tokens) is not int:
        raise invalid("max_tokens is required: an integer >= 1")
    tools = function_tools(body.get("tools"))
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") in THINKING):
        raise invalid("thinking must be {'type': 'enabled', 'budget_tokens': ...}, {'type': 'adaptive'} or "
                      "{'type': 'disabled'}")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise invalid("stop_sequences must be a list of strings")
    if not isinstance(body.get("stream", False), bool):
        raise invalid("stream must be true or false")
    out = {"messages": chat_messages(body.get("system"), body.get("messages")), "max_tokens": max_tokens,
           "stream": body.get("stream", False)}
    if body.get("model") is not None:
        out["model"] = body["model"]   # checked by prepare_chat, as on the chat route
    if tools:
        out["tools"] = tools
        choice = openai_tool_choice(body.get("tool_choice"), tools)
        if choice is not None:
            out["tool_choice"] = choice
    elif body.get("tool_choice") is not None:
        openai_tool_choice(body["tool_choice"], None)   # a named tool or 'any' without tools: a 400
    if thinking is not None:
        out["thinking"] = {"type": THINKING[thinking["type"]]}
    if stops:
        out["stop"] = stops
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    return out


def prepare_messages(raw: bytes, enc: Encoder, limits: Limits, end_of_turn: tuple[int, ...], markup,
                     override: dict | None = None) -> Prepared:
    """The chat route's Prepared for an Anthropic Messages body (its keys replaced by `override`); every 400 in
    Anthropic's shape."""
    try:
        try:
            body = json.loads(raw or b"")
        except ValueError as exc:
            raise invalid(f"the body is not valid JSON: {exc}") from None
        if override and isinstance(body, dict):
            body = {**body, **override}
        return prepare_chat(json.dumps(chat_request(body)).encode(), enc, limits, end_of_turn, markup)
    except APIError as exc:
        raise AnthropicError.of(exc) from None


def count_tokens(raw: bytes, enc: Encoder, limits: Limits, end_of_turn: tuple[int, ...], markup) -> dict:
    """`/v1/messages/count_tokens`: the prompt tokens a Messages body (max_tokens optional) would take."""
    p = prepare_messages(raw, enc, limits, end_of_turn, markup, override={"stream": False, "max_tokens": 1})
    return {"input_tokens": len(p.prompt)}


# ---- response -----------------------------------------------------------------------------------------------
def message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def tool_use(call: dict) -> dict:
    try:
        args = json.loads(call["function"]["arguments"])
    except ValueError:
        args = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": args}


def stop_of(answer, finish: str) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence for a finished chat Answer."""
    text = answer.text
    for stream in (text.reasoning, text.content):
        if stream.stopped:
            full = stream._decode(stream.ids)
            at = len(stream.text)
            seq = next((s for s in stream.stops if full.startswith(s, at)), None) or \
                min(stream.stops, key=lambda s: (full.find(s) if s in full else len(full)))
            return "stop_sequence", seq
    return STOP_REASONS.get(finish, "end_turn"), None


def message(body: dict, answer, model: str) -> dict:
    """The chat route's answer body as an Anthropic message."""
    choice = body["choices"][0]
    m = choice["message"]
    content = []
    if m.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": m["reasoning_content"], "signature": ""})
    if m.get("content"):
        content.append({"type": "text", "text": m["content"]})
    content += [tool_use(c) for c in m.get("tool_calls") or []]
    reason, seq = stop_of(answer, choice["finish_reason"])
    return {"id": message_id(), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq,
            "usage": usage(answer, body["usage"]["completion_tokens"])}


def usage(answer, output_tokens: int) -> dict:
    """Anthropic's usage: input_tokens are the prompt tokens not read from the cache, so that the three input counts
    add up to the prompt (count_tokens' input_tokens)."""
    cached = answer.job.cached
    return {"input_tokens": len(answer.p.prompt) - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


class Blocks:
    """A reply's Deltas as content block events: a block opens when its kind of output starts, and closes
    when another starts or the reply ends."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None   # "thinking" or "text"

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]

    def start(self, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, d) -> list[str]:
        out: list[str] = []
        for kind, text, delta in (("thinking", d.reasoning, "thinking_delta"), ("text", d.content, "text_delta")):
            if not text:
                continue
            if self.open != kind:
                out += self.start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                  else {"type": "text", "text": ""})
                self.open = kind
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": delta, kind: text}}))
        for call in d.calls:
            block = tool_use(call)
            out += self.start({**block, "input": {}})
            out.append(event("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}}))
            out.append(event("content_block_stop", {"index": self.index}))
        return out


async def deltas(answer):
    """A running chat Answer's Deltas as they come (app.Answer.events' loop), then ("done", finish_reason)
    or, when the decode failed, ("error", APIError) (logged; the answer finished). Shared by the Anthropic
    and Responses streams."""
    from .app import end_error, log_5xx

    while True:
        ev = await answer.next_event()
        if ev[0] == "step":
            yield "delta", answer.take_step(ev[1])
            if answer.text.stopped:
                break
            continue
        if ev[0] == "error" or ev[1] != "done":
            answer.finish("error" if ev[0] == "error" else ev[1])
            err = end_error(ev, answer.deadline_s, "decoding (the stream ends here)")
            log_5xx(answer.request_id, err.status, err.message + " (in a stream)")
            yield "error", err
            return
        break
    yield "delta", answer.text.finish()
    yield "done", answer.finish("done")


async def events(answer, model: str, count):
    """The Anthropic event stream of a running chat Answer."""
    status, ended = 499, False
    blocks = Blocks()
    try:
        yield event("message_start", {"message": {
            "id": message_id(), "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": usage(answer, 0)}})
        async for kind, value in deltas(answer):
            if kind == "delta":
                for out in blocks.delta(value):
                    yield out
            elif kind == "error":
                ended = True
                err = AnthropicError.of(value)
                status = err.status
                yield event("error", {"error": err.body()["error"]})
                return
            else:
                ended = True
                for out in blocks.close():
                    yield out
                reason, seq = stop_of(answer, value)
                yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": seq},
                                              "usage": usage(answer, answer.tokens)})
                yield event("message_stop", {})
                status = 200
    finally:
        if not ended:
            answer.finish("cancelled")
        count(status)
