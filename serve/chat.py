"""A chat reply's tokens split, on token ids, into reasoning, content and tool calls (docs/model.md,
"Tokenizer and chat template").

The server decodes text with the control tokens skipped, so the split runs on the ids of `<think>`,
`</think>`, `<iquest_tool_call>`, ...: with thinking on the output starts inside the reasoning and the
first `</think>` ends it; after it, `<iquest_tool_call>` ... `</iquest_tool_call>` is one call, parsed as
SGLang's iquest_q1 detector parses it (the name is the text before the first `<arg_key>`, stripped; each
value JSON-decoded unless the tool's schema declares that argument a string, and kept as its text where
it is not JSON). A call that does not parse (unknown tool, markup out of order, cut off by the budget)
is returned as content text, markup included.

tool_choice: "auto" parses calls, "none" offers the tools in the prompt but parses none (call markup is
text). "required" and a named function make the reply a call the only way this server can without a
grammar: the prompt itself closes the reasoning (empty, so these turns do not think) and opens the call,
`</think><iquest_tool_call>`, followed by the function's name when one is named; the model writes the
arguments. A reply that still does not parse (the model's arguments out of the format) comes back as
text with finish_reason "stop", not as an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from .protocol import bad_request
from .text import TextStream

MARKUP = ("<think>", "</think>", "<iquest_tool_call>", "</iquest_tool_call>", "<arg_key>", "</arg_key>",
          "<arg_value>", "</arg_value>")


@dataclass(frozen=True)
class Markup:
    """The control-token ids of the chat format (None where the tokenizer lacks one)."""

    think: int | None
    end_think: int | None
    call: int | None
    end_call: int | None
    key: int | None
    end_key: int | None
    value: int | None
    end_value: int | None

    @classmethod
    def of(cls, tokenizer) -> "Markup":
        vocab = tokenizer.get_vocab()
        return cls(*(vocab.get(t) for t in MARKUP))

    @property
    def call_ids(self) -> set[int]:
        """The ids a call's text shows (a call that does not parse is content with its markup)."""
        return {i for i in (self.call, self.end_call, self.key, self.end_key, self.value, self.end_value)
                if i is not None}


def string_params(tools: list[dict]) -> dict[str, set[str]]:
    """Per tool name, the arguments its JSON schema declares strings."""
    out = {}
    for tool in tools:
        f = tool["function"]
        params = f.get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        props = props if isinstance(props, dict) else {}
        out[f["name"]] = {k for k, s in props.items() if isinstance(s, dict) and
                          (s.get("type") == "string" or (isinstance(s.get("type"), list) and
                                                         "string" in s["type"] and len(s["type"]) == 1))}
    return out


def parse_call(ids: list[int], tokenizer, markup: Markup, strings: dict[str, set[str]]) -> dict | None:
    """The OpenAI tool call of the ids between <iquest_tool_call> and </iquest_tool_call> (exclusive), or
    None when they do not make a call of an offered tool."""
    def text(part: list[int]) -> str:
        return tokenizer.decode(part, skip_special_tokens=False)

    controls = {markup.key, markup.end_key, markup.value, markup.end_value}
    i = next((n for n, t in enumerate(ids) if t in controls), len(ids))
    name = text(ids[:i]).strip()
    if name not in strings or any(t in markup_all(markup) and t not in controls for t in ids[:i]):
        return None
    args: dict = {}
    rest = ids[i:]
    while rest:
        try:
            k0, k1 = rest.index(markup.key), rest.index(markup.end_key)
            v0, v1 = rest.index(markup.value), rest.index(markup.end_value)
        except ValueError:
            return None
        if not (k0 == 0 and k0 < k1 == v0 - 1 and v0 < v1):
            return None
        key, value = rest[k0 + 1:k1], rest[v0 + 1:v1]
        if any(t in controls for t in key + value):
            return None
        key_s, value_s = text(key).strip(), text(value)
        if not key_s or key_s in args:
            return None
        if key_s in strings[name]:
            args[key_s] = value_s
        else:
            try:
                args[key_s] = json.loads(value_s)
            except ValueError:
                args[key_s] = value_s
        rest = rest[v1 + 1:]
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def markup_all(markup: Markup) -> set[int]:
    return {i for i in (markup.think, markup.end_think, markup.call, markup.end_call, markup.key, markup.end_key,
                        markup.value, markup.end_value) if i is not None}


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def add(self, other: "Delta") -> "Delta":
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ContentStream(TextStream):
    """Content text: control tokens skipped, except a tool call's markup (shown when a call does not parse)."""

    def __init__(self, tokenizer, stops: list[str], shown: set[int]):
        super().__init__(tokenizer, stops)
        self.shown = shown
        self.hidden = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special} - shown

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.hidden], skip_special_tokens=False)


class ChatStream:
    """A chat reply's tokens, as they come, split into reasoning, content and tool calls.

    `push` takes a Step's tokens and returns what may be sent now; `finish` the rest. `ids` holds the
    tokens the reply holds (a stop string drops the rest of its round), `stopped` says a stop string ended
    it. `forced` are output ids the prompt already holds (a forced call's opening) that the parse starts with.
    """

    def __init__(self, tokenizer, stops: list[str], markup: Markup, *, thinking: bool,
                 tools: list[dict] | None, stop_ids: tuple[int, ...] = (), forced: list[int] | None = None):
        self.tokenizer, self.markup = tokenizer, markup
        self.strings = string_params(tools) if tools else None   # None: calls are not parsed
        self.stop_ids = set(stop_ids)
        self.reasoning = TextStream(tokenizer, stops)
        self.content = ContentStream(tokenizer, stops, markup.call_ids)
        self.section = "reasoning" if thinking and markup.end_think is not None else "content"
        self.call: list[int] | None = None      # inside a call: its ids so far
        self.call_at = 0                        # where it starts in self.ids
        self.calls: list[dict] = []
        self.ids: list[int] = []
        self.stopped = False
        if forced:
            self.section = "content"
            self.call = list(forced)

    def push(self, tokens: list[int]) -> Delta:
        out = Delta()
        run: list[int] = []   # consecutive tokens of the current text section, pushed together
        start = [0]           # where the run's first token is in self.ids

        def add(ids: list[int], at: int) -> None:
            if not run:
                start[0] = at
            run.extend(ids)

        def flush() -> None:
            if run:
                stream = self.reasoning if self.section == "reasoning" else self.content
                before = len(stream.ids)
                text = stream.push(list(run))
                if self.section == "reasoning":
                    out.reasoning += text
                else:
                    out.content += text
                if stream.stopped:
                    # a stop string ended the reply inside this run: drop the tokens after it
                    del self.ids[max(start[0] + len(stream.ids) - before, 0):]
                    self.stopped = True
                run.clear()

        for t in tokens:
            if self.stopped:
                break
            self.ids.append(t)
            if self.call is not None:
                if t == self.markup.end_call:
                    call = parse_call(self.call[1:], self.tokenizer, self.markup, self.strings)
                    if call is None:  # the call's text, markup and all, is content
                        add(self.call + [t], self.call_at)
                    else:
                        out.calls.append(call)
                        self.calls.append(call)
                    self.call = None
                elif t not in self.stop_ids:
                    self.call.append(t)
                continue
            if self.section == "reasoning" and t == self.markup.end_think:
                flush()
                self.section = "content"
                continue
            if self.section == "content" and t == self.markup.call and self.strings is not None:
                flush()
                self.call, self.call_at = [t], len(self.ids) - 1
                continue
            add([t], len(self.ids) - 1)
        flush()
        return out

    def finish(self) -> Delta:
        out = Delta()
        if self.call is not None and not self.stopped:  # a call the decode cut off: text
            ids, self.call = self.call, None
            out.content += self.content.push([t for t in ids if t not in self.stop_ids])
        out.reasoning += self.reasoning.finish()
        out.content += self.content.finish()
        return out


def check_tools(tools, tool_choice) -> tuple[list[dict] | None, str | None]:
    """The request's tools (OpenAI function tools) and tool_choice: "auto", "none", "required" or the name of
    the function it names; a 400 for a malformed one or a name no tool has."""
    if tools is None or tools == []:
        tools = None
    elif not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools", "tools")
    else:
        for i, tool in enumerate(tools):
            f = tool.get("function") if isinstance(tool, dict) else None
            if not (isinstance(tool, dict) and tool.get("type", "function") == "function" and isinstance(f, dict)
                    and isinstance(f.get("name"), str) and f["name"]):
                raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                                  f"'parameters': ...}}}}", "tools")
            if not isinstance(f.get("parameters", {}) or {}, dict):
                raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        return tools, "auto" if tools else "none"
    if tool_choice in ("auto", "none", "required"):
        if tool_choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return tools, tool_choice
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which tools does not hold "
                              f"(tools: {names})", "tool_choice")
        return tools, name
    raise bad_request("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': "
                      "{'name': ...}}", "tool_choice")
