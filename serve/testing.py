"""Test helpers: an engine wrapper that lets a test hold a decode at a known point, an engine of scripted
replies, and SSE parsing."""

from __future__ import annotations

import json
import threading


class HeldEngine:
    """The wrapped engine, but a decode can be held: before its first Step (`hold_start`) or after it
    (`hold_after_first`), until the test calls `release()`. Records per request how many Steps were
    pulled from the engine after the release, and whether the engine's generator was closed."""

    def __init__(self, engine):
        self.engine, self.config, self.generation = engine, engine.config, engine.generation
        self.supports_top_logprobs = getattr(engine, "supports_top_logprobs", False)
        self.hold_start = self.hold_after_first = False
        self.entered = threading.Event()    # a decode is at its hold point
        self._release = threading.Event()
        self.requests: list[dict] = []

    def release(self) -> None:
        self._release.set()

    def reset(self) -> None:
        self.hold_start = self.hold_after_first = False
        self.entered.clear()
        self._release.clear()

    def generate(self, prompt, **kw):
        record = {"prompt": list(prompt), "steps": 0, "tokens": 0, "after_release": 0, "closed": False}
        self.requests.append(record)
        inner = self.engine.generate(prompt, **kw)

        def run():
            released = False
            try:
                if self.hold_start:
                    self.entered.set()
                    self._release.wait(30)
                    released = True
                for step in inner:
                    record["steps"] += 1
                    record["tokens"] += len(step.tokens)
                    if released:
                        record["after_release"] += 1
                    yield step
                    if self.hold_after_first and not released:
                        self.entered.set()
                        self._release.wait(30)
                        released = True
            finally:
                inner.close()
                record["closed"] = True

        return run()


def sse_events(lines) -> list:
    """The JSON payloads of a server-sent event stream (`data: [DONE]` as the string "[DONE]")."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


class ScriptedEngine:
    """An engine whose replies are scripted (token ids, one Step per 3 tokens; an Exception in the script is
    raised), honoring stop ids and the budget as the engines do; it records the prompts it was given."""

    def __init__(self, engine):
        self.config, self.generation = engine.config, engine.generation
        self.scripts: list = []
        self.prompts: list[list[int]] = []

    def generate(self, prompt, *, max_new_tokens, stop_ids=(), **kw):
        from ..reference.speculative import Step

        self.prompts.append(list(prompt))
        script = self.scripts.pop(0)
        if isinstance(script, Exception):
            raise script
        script = script[:max_new_tokens]
        for i in range(0, len(script), 3):
            tokens = script[i:i + 3]
            stop = next((n for n, t in enumerate(tokens) if t in stop_ids), None)
            if stop is not None:
                tokens = tokens[:stop + 1]
            yield Step(tokens, [0.0] * len(tokens), stopped=stop is not None)
            if stop is not None:
                return


# A read_file call in IQuest-Q1's tool-call format, with a string and an integer argument.
READ_FILE_CALL = ("<iquest_tool_call>read_file<arg_key>path</arg_key><arg_value>007.py</arg_value><arg_key>lines"
                  "</arg_key><arg_value>3</arg_value></iquest_tool_call>")


def spelled_ids(tokenizer, text: str) -> list[int]:
    """The ids of `text` where spelled control tokens become those tokens (a scripted reply)."""
    return tokenizer.encode(text, add_special_tokens=False)
