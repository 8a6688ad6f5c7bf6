"""From a request body to what the engine needs: prompt ids, budget, sampling, stops; or a 400.

Every check names the field it is about (`param` of the OpenAI error), and runs before the request
takes a place in the queue. The routes run all of this on a worker thread (tokenizing a long prompt
takes a while), and a prompt too long for the context is refused before it is tokenized where its
length in characters already proves it (`Encoder.check_fits`).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace

from pydantic import ValidationError
from tokenizers import Tokenizer

from ..reference.sampling import SamplingParams
from .chat import Markup, check_tools
from .protocol import (UNSUPPORTED, APIError, ChatRequest, CompletionRequest, DetokenizeRequest, Message,
                       TokenizeRequest, bad_request)

MAX_STOPS = 16
MAX_TEMPERATURE = 1e6                   # far past where sampling is uniform; float32 ends at 3.4e38
MAX_TOP_LOGPROBS = 20                   # OpenAI's cap too
COMPLETION_DEFAULT_MAX_TOKENS = 16      # the OpenAI default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024          # capped by what the context has left
# chat: stop at the turn's end. IQuest-Q1's is <|iquest_end|> (its EOS too); the others are other checkpoints'
# (the fixtures made before the IQuest-Q1 tokenizer end turns with <|end|>)
END_OF_TURN = ("<|iquest_end|>", "<|end|>", "<|im_end|>", "<|eot_id|>", "<|endoftext|>")


@dataclass(frozen=True)
class Limits:
    model_name: str
    context: int        # prompt + max_tokens may not exceed this
    vocab_size: int
    defaults: SamplingParams
    eos_ids: tuple[int, ...]
    top_logprobs: bool = False  # the engine gives each token's top alternatives


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
    logprobs: int | None = None     # None: no logprobs; N: each token's logprob and its N top alternatives
    echo: str = ""                  # completions: the prompt's text, sent before the output
    # chat: the reply starts inside the reasoning; the tools whose calls are parsed (None: calls are text);
    # the output ids the prompt already holds (a forced call's opening: tool_choice required or named)
    thinking: bool = False
    tools: list | None = None
    forced: tuple[int, ...] = ()
    # Responses: the request's fields its reply repeats (responses.echoed); the chat route's reply has none
    reply: dict | None = None


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


class Encoder:
    """The tokenizer as the server uses it. Chat message content is encoded as plain text: text in it that
    spells a control token (`<|iquest_end|>`, `<think>`) is not that token; only the chat template makes
    control tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.specials = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        # one group, so that split() keeps the control tokens: text, token, text, ...
        self.special_re = re.compile("(" + "|".join(map(re.escape, sorted(self.specials, key=len, reverse=True)))
                                     + ")") if self.specials else None
        # A second backend, so that no request flips the shared one's flag under another thread's encode
        self.plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        self.plain.encode_special_tokens = True
        # No token covers more characters than its vocabulary entry has (byte-level: one per byte), so a
        # text of c characters is at least c / max_chars tokens. A normalizer could shrink the text first.
        self.max_chars = None if tokenizer.backend_tokenizer.normalizer is not None else \
            max(map(len, tokenizer.get_vocab()))

    def check_fits(self, text: str, limits: Limits, param: str) -> None:
        """Refuse, without tokenizing it, a text that has too many characters to fit the context."""
        if self.max_chars is not None and len(text) > (limits.context - 1) * self.max_chars:
            raise bad_request(f"the prompt is {len(text)} characters: at least "
                              f"{-(-len(text) // self.max_chars)} tokens (a token here spans at most "
                              f"{self.max_chars} characters); the context holds {limits.context}", param,
                              "context_length_exceeded")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **template_vars) -> str:
        """The chat template's text; `template_vars` are its own variables (IQuest-Q1's: enable_thinking, tools)."""
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **template_vars)
        except Exception as exc:  # the template's own raise_exception (role order, ...) or a missing template
            raise bad_request(f"the chat template rejected these messages: {exc}", "messages") from None

    def chat(self, messages: list[Message], limits: Limits | None = None, add_generation_prompt: bool = True) \
            -> list[int]:
        """The prompt ids of chat messages; with `limits`, a render too long to fit is refused unencoded."""
        return self.chat_ids([{"role": m.role, "content": m.text()} for m in messages], limits,
                             add_generation_prompt)

    def chat_ids(self, msgs: list[dict], limits: Limits | None = None, add_generation_prompt: bool = True,
                 **template_vars) -> list[int]:
        """`chat` for messages as dicts of role and content (string), and the template's own variables."""
        text = self.render(msgs, add_generation_prompt, **template_vars)
        if limits is not None:
            self.check_fits(text, limits, "messages")
        if self.special_re is None or not any(self.special_re.search(m["content"]) for m in msgs):
            return self.encode(text, add_special_tokens=False)
        # Some content spells control tokens. Render again with a marker in place of each content, so the
        # template's own text is known, then encode: its control tokens as such, everything else (content
        # included) as plain text, cut at the template's control tokens as a normal encode cuts there.
        marks = [f"\ue000{i}\ue001" for i in range(len(msgs))]
        skeleton = self.render([{**m, "content": k} for m, k in zip(msgs, marks)], add_generation_prompt,
                               **template_vars)
        parts = re.split("(\ue000\\d+\ue001)", skeleton)
        contents = {k: m["content"] for k, m in zip(marks, msgs)}
        if any(skeleton.count(k) != 1 for k in marks) or "".join(contents.get(q, q) for q in parts) != text:
            raise bad_request("a message spells a control token, and this chat template changes message text, "
                              "so it cannot be encoded as plain text", "messages")
        ids: list[int] = []
        pending = ""
        for i, part in enumerate(parts):
            if i % 2:
                pending += contents[part]
                continue
            for j, piece in enumerate(self.special_re.split(part)):
                if j % 2 == 0:
                    pending += piece
                    continue
                ids += self.plain.encode(pending, add_special_tokens=False).ids if pending else []
                ids.append(self.specials[piece])
                pending = ""
        return ids + (self.plain.encode(pending, add_special_tokens=False).ids if pending else [])


def completion_prompt(req: CompletionRequest, enc: Encoder, limits: Limits) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
        check_ids(p, limits, "prompt")
        return list(p)
    if isinstance(p, list):
        if len(p) != 1:
            raise bad_request(f"prompt must be one string (this server decodes one sequence per request), "
                              f"got a list of {len(p)}", "prompt")
        p = p[0]
    if not p:
        raise bad_request("prompt is empty", "prompt")
    enc.check_fits(p, limits, "prompt")
    return enc.encode(p)


def chat_prompt(req: ChatRequest, enc: Encoder, limits: Limits) -> list[int]:
    if not req.messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    return enc.chat(req.messages, limits)


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    return tuple(vocab[t] for t in END_OF_TURN if t in vocab)


def prepare_completion(raw: bytes, enc: Encoder, limits: Limits) -> Prepared:
    req = parse(CompletionRequest, raw)
    logprobs = check_options(req, limits)
    if req.echo and logprobs is not None:
        raise bad_request("echo with logprobs would need the prompt's logprobs, which this server does not "
                          "compute; ask for one of them", "echo")
    prompt = completion_prompt(req, enc, limits)
    p = prepare(req, prompt, limits, default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS, logprobs=logprobs)
    if not req.echo:
        return p
    if isinstance(req.prompt, str):
        return replace(p, echo=req.prompt)
    if isinstance(req.prompt[0], str):
        return replace(p, echo=req.prompt[0])
    return replace(p, echo=enc.tokenizer.decode(prompt, skip_special_tokens=True))


def prepare_chat(raw: bytes, enc: Encoder, limits: Limits, end_of_turn: tuple[int, ...],
                 markup: Markup | None = None) -> Prepared:
    req = parse(ChatRequest, raw)
    logprobs = check_options(req, limits)
    if not req.messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    tools, choice = check_tools(req.tools, req.tool_choice)
    thinking = thinking_of(req)
    template_vars = {**(req.chat_template_kwargs or {}), "enable_thinking": thinking}
    template_vars.pop("thinking", None)
    if tools:
        template_vars["tools"] = tools
    prompt = enc.chat_ids(chat_messages(req.messages, enc), limits, **template_vars)
    forced: list[int] = []
    if choice not in ("auto", "none") and markup is not None and markup.call is not None:
        # tool_choice required or named: the reply must be a call, so the prompt ends the (empty) reasoning and
        # opens the call, with the function's name when one is named. The model writes the rest.
        forced = [markup.call] + (enc.plain.encode(choice, add_special_tokens=False).ids
                                  if choice != "required" else [])
        prompt = prompt + ([markup.end_think] if thinking and markup.end_think is not None else []) + forced
    p = prepare(req, prompt, limits, default_max_tokens=CHAT_DEFAULT_MAX_TOKENS,
                extra_stop_ids=end_of_turn, logprobs=logprobs)
    return replace(p, thinking=thinking and not forced, tools=tools if choice != "none" else None,
                   forced=tuple(forced))


def thinking_of(req: ChatRequest) -> bool:
    """Thinking on unless the request turns it off: chat_template_kwargs.enable_thinking (vLLM, SGLang),
    chat_template_kwargs.thinking, or a top-level thinking of true/false or {"type": "enabled"|"disabled"}."""
    kw = req.chat_template_kwargs or {}
    for key in ("enable_thinking", "thinking"):
        if key in kw:
            if not isinstance(kw[key], bool):
                raise bad_request(f"chat_template_kwargs.{key} must be true or false", "chat_template_kwargs")
            return kw[key]
    t = req.thinking
    if t is None:
        return True
    if isinstance(t, bool):
        return t
    if isinstance(t, dict) and t.get("type") in ("enabled", "disabled"):
        return t["type"] == "enabled"
    raise bad_request("thinking must be true, false or {'type': 'enabled' | 'disabled'}", "thinking")


def chat_messages(messages: list[Message], enc: Encoder) -> list[dict]:
    """Messages as the chat template takes them: content as text, an assistant's reasoning and tool calls
    (arguments as an object), a tool result's content. Only content may spell control tokens."""
    out, call_ids = [], set()  # the ids of the assistant's calls so far: a tool result answers one of them
    for i, m in enumerate(messages):
        d: dict = {"role": m.role, "content": m.text()}
        if m.role == "tool":
            if not call_ids:
                raise bad_request(f"messages[{i}]: a tool result with no assistant tool call before it", "messages")
            if m.tool_call_id is not None and m.tool_call_id not in call_ids:
                raise bad_request(f"messages[{i}]: tool_call_id {m.tool_call_id!r} answers no earlier tool call",
                                  "messages")
        extra = []
        if m.reasoning_content:
            d["reasoning_content"] = m.reasoning_content
            extra.append(m.reasoning_content)
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}]: only an assistant message has tool_calls", "messages")
            calls = []
            for call in m.tool_calls:
                f = call.get("function") if isinstance(call, dict) else None
                if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
                    raise bad_request(f"messages[{i}].tool_calls: each call needs function.name", "messages")
                args = f.get("arguments")
                if isinstance(args, str):
                    try:
                        args = json.loads(args) if args.strip() else {}
                    except ValueError:
                        raise bad_request(f"messages[{i}].tool_calls: the arguments of {f['name']} are not "
                                          f"JSON", "messages") from None
                if args is None:
                    args = {}
                if not isinstance(args, dict):
                    raise bad_request(f"messages[{i}].tool_calls: the arguments of {f['name']} must be a JSON "
                                      f"object", "messages")
                call_ids.add(call.get("id"))
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": f["name"], "arguments": args}})
                extra += [f["name"], json.dumps(args)]
            d["tool_calls"] = calls
        if enc.special_re is not None and any(enc.special_re.search(x) for x in extra):
            raise bad_request(f"messages[{i}]: its reasoning or tool calls spell a control token", "messages")
        out.append(d)
    return out


def tokenize(raw: bytes, enc: Encoder, limits: Limits) -> dict:
    """vLLM's /tokenize: the ids a prompt or chat messages become (as the completion routes encode them)."""
    req = parse(TokenizeRequest, raw)
    check_model(req.model, limits)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("send either prompt or messages", "prompt")
    # capped as the completion routes are: a text too long to fit the context is refused untokenized
    if req.prompt is not None:
        enc.check_fits(req.prompt, limits, "prompt")
        ids = enc.encode(req.prompt, req.add_special_tokens)
    elif not req.messages:
        raise bad_request("messages is empty: send at least one message", "messages")
    else:
        ids = enc.chat(req.messages, limits, add_generation_prompt=req.add_generation_prompt)
    return {"count": len(ids), "max_model_len": limits.context, "tokens": ids,
            "token_strs": enc.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}


def detokenize(raw: bytes, enc: Encoder, limits: Limits) -> dict:
    req = parse(DetokenizeRequest, raw)
    check_model(req.model, limits)
    check_ids(req.tokens, limits, "tokens")
    return {"prompt": enc.tokenizer.decode(req.tokens)}


def check_ids(ids: list[int], limits: Limits, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary (0..{limits.vocab_size - 1})", param)


def check_model(model: str | None, limits: Limits) -> None:
    if model is not None and model != limits.model_name:
        raise bad_request(f"model {model!r} is not served here (this server serves {limits.model_name!r})",
                          "model", "model_not_found")


def check_options(req, limits: Limits) -> int | None:
    """Refuse what this server does not do (before any tokenizing); return Prepared.logprobs."""
    check_model(req.model, limits)
    for name in UNSUPPORTED.keys() & type(req).model_fields.keys():
        value = getattr(req, name)
        if value is not None and value not in UNSUPPORTED[name]:
            raise bad_request(f"{name} is not supported by this server", name, "unsupported_parameter")
    if isinstance(req, ChatRequest):
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        n, param = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
    else:
        n, param = req.logprobs, "logprobs"
    if n is None:
        return None
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {n}: the alternatives come from the "
                          f"sampling distribution, which holds at most top_k (by default 20) tokens; OpenAI "
                          f"caps it at 20 too", param)
    if n > 0 and not limits.top_logprobs:
        raise bad_request(f"{param}={n}: this server's engine gives each token's own logprob but not the top "
                          f"alternatives; ask for {param}=0, or serve with --engine reference", param,
                          "unsupported_parameter")
    return n


def prepare(req, prompt: list[int], limits: Limits, *, default_max_tokens: int,
            extra_stop_ids: tuple[int, ...] = (), logprobs: int | None = None) -> Prepared:
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
    if top_k == -1:  # vLLM's "off"
        top_k = limits.vocab_size
    if not 0 <= temperature <= MAX_TEMPERATURE:  # NaN too; past float32's range the engine cannot take it
        raise bad_request(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", "temperature")
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    if not 1 <= top_k <= limits.vocab_size:
        raise bad_request(f"top_k must be -1 (off) or in [1, {limits.vocab_size}], got {top_k}", "top_k")
    seed = secrets.randbits(63) if req.seed is None else req.seed
    if not 0 <= seed < 2**64:
        raise bad_request(f"seed must be in [0, 2**64), got {seed}", "seed")
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"stop has {len(stops)} strings; at most {MAX_STOPS}", "stop")
    stop_ids = tuple(dict.fromkeys(limits.eos_ids + extra_stop_ids))[:8]
    return Prepared(prompt, max_tokens, SamplingParams(float(temperature), top_k, float(top_p)), seed,
                    [s for s in stops if s], stop_ids, req.stream,
                    bool(req.stream_options and req.stream_options.include_usage), logprobs)


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    "invalid_request_error", None, "invalid_api_key")
