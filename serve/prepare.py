"""From a request body to what the engine needs: prompt ids, budget, sampling, stops; or a 400.

Every check names the field it is about (`param` of the OpenAI error), and runs before the request
takes a place in the queue.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from pydantic import ValidationError

from ..reference.sampling import SamplingParams
from .protocol import APIError, ChatRequest, CompletionRequest, bad_request

MAX_STOPS = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16      # the OpenAI default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024          # capped by what the context has left
END_OF_TURN = ("<|end|>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>")  # chat: stop at the turn's end


@dataclass(frozen=True)
class Limits:
    model_name: str
    context: int        # prompt + max_tokens may not exceed this
    vocab_size: int
    defaults: SamplingParams
    eos_ids: tuple[int, ...]


@dataclass(frozen=True)
class Prepared:
    prompt: list[int]
    max_tokens: int
    params: SamplingParams
    seed: int
    stops: list[str]
    stop_ids: tuple[int, ...]
    stream: bool
    include_usage: bool


def parse(model, raw: bytes):
    """The request model from the raw body; malformed JSON or a mistyped field is a 400."""
    try:
        return model.model_validate_json(raw or b"")
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if not (isinstance(p, str) and ("[" in p or p in ("str", "int")))]
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
        where = ".".join(loc) or "body"
        raise bad_request(f"{where}: {err['msg']}", param=loc[0] if loc else None, code="invalid_type") from None


def completion_prompt(req: CompletionRequest, tokenizer, limits: Limits) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        bad = [t for t in p if not 0 <= t < limits.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})", "prompt")
        return list(p)
    if isinstance(p, list):
        if len(p) != 1:
            raise bad_request(f"prompt must be one string (this server decodes one sequence per request), "
                              f"got a list of {len(p)}", "prompt")
        p = p[0]
    if not p:
        raise bad_request("prompt is empty", "prompt")
    return list(tokenizer.encode(p))


def chat_prompt(req: ChatRequest, tokenizer) -> list[int]:
    if not req.messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own raise_exception (role order, ...) or a missing template
        raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    return tuple(vocab[t] for t in END_OF_TURN if t in vocab)


def prepare(req, prompt: list[int], limits: Limits, *, default_max_tokens: int,
            extra_stop_ids: tuple[int, ...] = ()) -> Prepared:
    if req.model is not None and req.model != limits.model_name:
        raise bad_request(f"model {req.model!r} is not served here (this server serves {limits.model_name!r})",
                          "model", "model_not_found")
    if req.n != 1:
        raise bad_request(f"n={req.n}: this server returns one choice per request", "n")
    param = "messages" if isinstance(req, ChatRequest) else "prompt"
    if not prompt:
        raise bad_request("the prompt is empty after tokenization", param)
    if len(prompt) >= limits.context:
        raise bad_request(f"the prompt is {len(prompt)} tokens; the context holds {limits.context} "
                          f"(prompt + max_tokens)", param, "context_length_exceeded")
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    mt_param = "max_tokens" if req.max_tokens is not None or not isinstance(req, ChatRequest) else "max_completion_tokens"
    if max_tokens is None:
        max_tokens = min(default_max_tokens, limits.context - len(prompt))
    if max_tokens < 1:
        raise bad_request(f"max_tokens must be >= 1, got {max_tokens}", mt_param)
    if len(prompt) + max_tokens > limits.context:
        raise bad_request(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceed the context of "
                          f"{limits.context} tokens", mt_param, "context_length_exceeded")
    d = limits.defaults
    temperature = d.temperature if req.temperature is None else req.temperature
    top_p = d.top_p if req.top_p is None else req.top_p
    top_k = d.top_k if req.top_k is None else req.top_k
    if not temperature >= 0:
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if not 1 <= top_k <= limits.vocab_size:
        raise bad_request(f"top_k must be in [1, {limits.vocab_size}], got {top_k}", "top_k")
    seed = secrets.randbits(63) if req.seed is None else req.seed
    if not 0 <= seed < 2**64:
        raise bad_request(f"seed must be in [0, 2**64), got {seed}", "seed")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop has {len(stops)} strings; at most {MAX_STOPS}", "stop")
    stop_ids = tuple(dict.fromkeys(limits.eos_ids + extra_stop_ids))[:8]
    return Prepared(prompt, max_tokens, SamplingParams(float(temperature), top_k, float(top_p)), seed,
                    [s for s in stops if s], stop_ids, req.stream,
                    bool(req.stream_options and req.stream_options.include_usage))


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error", None, "invalid_api_key")
