"""Request bodies (pydantic, strict: a field of the wrong type is a 400) and OpenAI-style errors."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error the client gets as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class _Strict(BaseModel):
    # Unknown fields (user, metadata, ...) are ignored as OpenAI clients send many; known ones are typed.
    # Fields typed Any are options this server does not implement: `prepare` refuses them unless neutral.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None     # not in the OpenAI API: pass it with `extra_body={"top_k": ...}`
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None   # vLLM's
    logit_bias: Any = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    logprobs: int | None = None      # the chosen token's logprob and this many alternatives per token
    echo: bool = False
    best_of: Any = None
    suffix: Any = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None     # an assistant turn's reasoning (vLLM's and SGLang's name)
    tool_calls: list[dict] | None = None     # an assistant turn's calls: OpenAI's {id, type, function}
    tool_call_id: str | None = None          # a tool result's call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: list[Message] = Field(...)
    max_completion_tokens: int | None = None  # the newer OpenAI name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: Any = None
    tools: Any = None            # checked by chat.check_tools
    tool_choice: Any = None
    chat_template_kwargs: dict | None = None  # vLLM's and SGLang's: the template's variables (enable_thinking)
    thinking: Any = None         # true/false, or {"type": "enabled"|"disabled"}
    functions: Any = None
    function_call: Any = None


# The options of `Any` type above, and the values of each that change nothing (accepted as if absent).
UNSUPPORTED = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
               "logit_bias": ({},), "best_of": (1,), "suffix": ("",), "response_format": ({"type": "text"},),
               "functions": ([],), "function_call": ("none",)}


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a prompt (`add_special_tokens` as for completions) or chat messages (encoded as
    /v1/chat/completions encodes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
