"""The HTTP routes: /v1/completions, /v1/chat/completions (streaming or not), Anthropic's /v1/messages and
/v1/messages/count_tokens (over the chat path: `messages.py`), OpenAI's /v1/responses (`responses.py`),
/v1/models[/{id}], /tokenize, /detokenize,
/health, /metrics.

A request's body is capped (413 past `max_body_size`), then checked and tokenized on a worker thread
(`prepare.py`; the event loop keeps serving meanwhile), admitted to the worker's bounded queue (429
past it), waits for the engine (503/504 when the server stops or the deadline passes first; a client
that leaves gives its place back), then turns the worker's Steps into text: all at once, or as
server-sent events in OpenAI's chunk format ending `data: [DONE]`. A stream whose client goes away is
cancelled (Starlette cancels the generator; the worker closes the engine's generator at its next read).
A chat reply is split on the control tokens' ids into reasoning_content, content and tool_calls
(`chat.py`); tool_choice "required" or a named function opens the call in the prompt itself.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from . import messages as anthropic
from . import responses as openai_responses
from .chat import ChatStream, Delta, Markup
from .metrics import Metrics
from .prepare import (Encoder, Limits, Prepared, detokenize, end_of_turn_ids, prepare_chat, prepare_completion,
                      tokenize, unauthorized)
from .protocol import APIError
from .text import TextStream, TokenText
from .worker import Job, Worker

log = logging.getLogger("iquest.serve")
DISCONNECT_POLL_S = 0.25  # while a request waits for the engine, how often to ask whether its client left
LOGPROB_FLOOR = -9999.0   # OpenAI's logprob for a token of probability 0 (JSON has no -inf)


def default_max_body_size(context: int) -> int:
    """16 bytes a context token (a prompt as token ids, or as text with JSON escapes), at least 1 MiB."""
    return max(2**20, 16 * context)


@dataclass(frozen=True)
class ServeOptions:
    model_name: str
    api_key: str | None = None
    queue_size: int = 16
    deadline: float | None = 600.0   # seconds from arrival; None = no deadline
    max_context: int = 4096
    drafts: int | str = "auto"
    max_body_size: int | None = None  # bytes; None = default_max_body_size(max_context)
    prefix_reuse: bool = True         # prefill only past the prefix a prompt shares with the last (engines that can)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or "-"


def log_5xx(rid: str, status: int, message: str) -> None:
    log.error("request %s: %d %s", rid, status, message)


class Front:
    """The outermost ASGI layer: each request's id (the client's X-Request-Id, or a fresh one; echoed in the
    response and in the log line of every 5xx), and a body whose Content-Length is past the cap refused with
    the JSON 413 a chunked one gets (Starlette's own answer to it is plain text)."""

    def __init__(self, app, body_limit: int, on_413):
        self.app, self.body_limit, self.on_413 = app, body_limit, on_413

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:128].strip() or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.body_limit:
            response = self.on_413(scope)
            return await response(scope, receive, send_with_id)
        await self.app(scope, receive, send_with_id)


class App(FastAPI):
    """FastAPI with `Front` outside everything (FastAPI's own body limit included)."""

    front: tuple | None = None

    def build_middleware_stack(self):
        stack = super().build_middleware_stack()
        return stack if self.front is None else Front(stack, *self.front)


def create_app(engine, tokenizer, options: ServeOptions) -> FastAPI:
    cfg, gen = engine.config, engine.generation
    from ..reference.sampling import SamplingParams

    limits = Limits(options.model_name, min(options.max_context, cfg.max_position_embeddings - 8), cfg.vocab_size,
                    SamplingParams(gen.temperature, gen.top_k, gen.top_p), tuple(gen.eos_token_id),
                    top_logprobs=bool(getattr(engine, "supports_top_logprobs", False)))
    chat_stop_ids = end_of_turn_ids(tokenizer)
    markup = Markup.of(tokenizer)
    encoder, token_text = Encoder(tokenizer), TokenText(tokenizer)
    body_limit = options.max_body_size or default_max_body_size(options.max_context)
    metrics = Metrics()
    worker = Worker(engine, drafts=options.drafts, queue_size=options.queue_size, metrics=metrics,
                    prefix_reuse=options.prefix_reuse)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    # with a key, the API's description is behind it too (the routes below)
    hidden = {} if options.api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = App(title="IQuestRT", lifespan=lifespan, max_body_size=body_limit, **hidden)
    app.state.metrics, app.state.worker, app.state.limits = metrics, worker, limits

    def count(request: Request, status: int) -> None:
        route = request.scope.get("route")  # the route's template: a client's made-up paths add no series
        metrics.requests.labels(route.path if route is not None else "unmatched", str(status)).inc()

    def authorize(request: Request) -> None:
        if options.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise unauthorized()

    def authorize_anthropic(request: Request) -> None:
        """Anthropic's x-api-key header, or a bearer token (Claude Code's ANTHROPIC_AUTH_TOKEN)."""
        if options.api_key is None:
            return
        key = request.headers.get("x-api-key")
        if key is None:
            try:
                return authorize(request)
            except APIError:
                pass
        elif hmac.compare_digest(key.strip().encode(), options.api_key.encode()):
            return
        raise anthropic.AnthropicError(401, "missing or wrong API key: send 'x-api-key: <key>'",
                                       "authentication_error")

    too_large = f"the request body is larger than {body_limit} bytes (--max-body-size)"
    paths = None

    def refuse_413(scope) -> JSONResponse:
        nonlocal paths
        paths = paths or {getattr(r, "path", None) for r in app.routes}
        metrics.requests.labels(scope["path"] if scope["path"] in paths else "unmatched", "413").inc()
        return JSONResponse(APIError(413, too_large).body(), status_code=413, headers={"Connection": "close"})

    app.front = (body_limit, refuse_413)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        # a bug, not the client's doing: logged with its traceback, answered in OpenAI's shape
        log.exception("request %s: 500 %s: %s", request_id(request), type(exc).__name__, exc)
        count(request, 500)
        err = APIError(500, f"internal error ({type(exc).__name__}); request id {request_id(request)}",
                       "server_error")
        if request.url.path.startswith("/v1/messages"):
            err = anthropic.AnthropicError.of(err)
        return JSONResponse(err.body(), status_code=500, headers={"x-request-id": request_id(request)})

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        if exc.status >= 500:
            log_5xx(request_id(request), exc.status, exc.message)
        count(request, exc.status)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        # Starlette's own refusals (no such route, wrong method, a body past the limit) in OpenAI's shape. A
        # body whose Content-Length is past the limit gets Starlette's plain-text 413 in place of this one.
        messages = {404: f"no route {request.method} {request.url.path}",
                    405: f"{request.method} is not allowed on {request.url.path}",
                    413: too_large}
        count(request, exc.status_code)
        err = APIError(exc.status_code, messages.get(exc.status_code, str(exc.detail)))
        if request.url.path.startswith("/v1/messages"):
            err = anthropic.AnthropicError.of(err)
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone):
        count(request, 499)
        return Response(status_code=499)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": options.model_name}

    @app.get("/metrics")
    async def metrics_route(request: Request):
        authorize(request)
        return PlainTextResponse(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    card = {"id": options.model_name, "object": "model", "created": 0, "owned_by": "iquest",
            "max_model_len": limits.context}

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str):
        authorize(request)
        if model_id != options.model_name:
            raise APIError(404, f"model {model_id!r} is not served here (this server serves "
                           f"{options.model_name!r})", "invalid_request_error", "model", "model_not_found")
        return card

    if options.api_key is not None:
        @app.get("/openapi.json", include_in_schema=False)
        async def openapi(request: Request):
            authorize(request)
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False)
        async def docs(request: Request):
            authorize(request)
            return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    # Parsing and tokenizing run on a thread: a long prompt must not hold the event loop (and every other
    # client) while it is encoded.
    @app.post("/v1/completions")
    async def completions(request: Request):
        arrival = time.monotonic()
        authorize(request)
        p = await asyncio.to_thread(prepare_completion, await request.body(), encoder, limits)
        return await serve(request, p, False, arrival)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrival = time.monotonic()
        authorize(request)
        p = await asyncio.to_thread(prepare_chat, await request.body(), encoder, limits, chat_stop_ids,
                                    markup)
        return await serve(request, p, True, arrival)

    @app.post("/v1/messages")
    async def messages(request: Request):
        arrival = time.monotonic()
        authorize_anthropic(request)
        p = await asyncio.to_thread(anthropic.prepare_messages, await request.body(), encoder, limits,
                                    chat_stop_ids, markup)
        try:
            return await serve(request, p, True, arrival, style="anthropic")
        except APIError as exc:  # busy, deadline, shutdown, the engine's failure: in Anthropic's shape
            raise anthropic.AnthropicError.of(exc) from None

    @app.post("/v1/responses")
    async def responses(request: Request):
        arrival = time.monotonic()
        authorize(request)
        p = await asyncio.to_thread(openai_responses.prepare_responses, await request.body(), encoder, limits,
                                    chat_stop_ids, markup)
        return await serve(request, p, True, arrival, style="responses")

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        authorize_anthropic(request)
        body = await asyncio.to_thread(anthropic.count_tokens, await request.body(), encoder, limits, chat_stop_ids,
                                       markup)
        count(request, 200)
        return body

    async def answer_with(request: Request, handler) -> dict:
        authorize(request)
        body = await asyncio.to_thread(handler, await request.body(), encoder, limits)
        count(request, 200)
        return body

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await answer_with(request, tokenize)

    @app.post("/detokenize")
    async def detokenize_route(request: Request):
        return await answer_with(request, detokenize)

    # ---- one request ------------------------------------------------------------------------------
    async def serve(request: Request, p: Prepared, chat: bool, arrival: float, style: str = "openai"):
        deadline = arrival + options.deadline if options.deadline else float("inf")
        job = Job(p.prompt, p.seed, p.params, p.max_tokens, p.stop_ids, deadline, asyncio.get_running_loop(),
                  p.logprobs or 0)
        if not worker.submit(job):
            raise APIError(429, f"the server is busy: {options.queue_size} requests already wait for the engine; "
                           "retry later", "rate_limit_error", None, "queue_full")
        try:
            await wait_for_start(request, job)
        except BaseException:
            worker.withdraw(job)
            raise
        answer = Answer(job, p, chat, options.model_name, tokenizer, token_text, metrics, arrival,
                        options.deadline, markup)
        answer.request_id = request_id(request)
        if p.stream:
            events = answer.events if style == "openai" else \
                (lambda c: openai_responses.events(answer, options.model_name, c)) if style == "responses" else \
                (lambda c: anthropic.events(answer, options.model_name, c))
            return StreamingResponse(events(lambda status: count(request, status)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            body = await answer.collect(request)
        finally:
            job.cancelled.set()  # a no-op once the decode has ended
        count(request, 200)
        if style == "responses":
            return JSONResponse(openai_responses.of_chat(body, options.model_name, p))
        return JSONResponse(body if style == "openai" else anthropic.message(body, answer, options.model_name))

    async def wait_for_start(request: Request, job: Job) -> None:
        while True:
            remaining = job.deadline - time.monotonic()
            if remaining <= 0:
                raise deadline_error("waiting for the engine")
            try:
                event = await asyncio.wait_for(job.events.get(), min(remaining, DISCONNECT_POLL_S))
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    raise ClientGone() from None
                continue
            if event[0] == "start":
                return
            raise end_error(event, options.deadline, "waiting for the engine")

    def deadline_error(where: str) -> APIError:
        return end_error(("end", "deadline"), options.deadline, where)

    return app


def end_error(event: tuple, deadline: float | None, where: str) -> APIError:
    """The error for a decode that did not end normally: ("error", message) or
    ("end", deadline|shutdown|cancelled)."""
    if event[0] == "error":
        return APIError(500, f"the engine failed: {event[1]}", "server_error")
    if event[1] == "deadline":
        return APIError(504, f"the request passed its deadline of {deadline or 0:g} s while {where}",
                        "timeout_error", None, "deadline_exceeded")
    if event[1] == "shutdown":
        return APIError(503, f"the server is shutting down; the request ended while {where}", "server_error", None,
                        "shutting_down")
    return APIError(503, "the request was cancelled", "server_error", None, "cancelled")


class Answer:
    """Turns one running Job's events into an OpenAI response body or a stream of chunks."""

    def __init__(self, job: Job, p: Prepared, chat: bool, model: str, tokenizer, token_text: TokenText,
                 metrics: Metrics, arrival: float, deadline_s: float | None, markup: Markup | None = None):
        self.job, self.p, self.chat, self.model, self.metrics, self.arrival = job, p, chat, model, metrics, arrival
        self.deadline_s, self.token_text = deadline_s, token_text
        # chat: reasoning, content and tool calls, split on the control tokens' ids; completions: the text
        self.text = ChatStream(tokenizer, p.stops, markup or Markup.of(tokenizer), thinking=p.thinking,
                               tools=p.tools, stop_ids=p.stop_ids, forced=list(p.forced)) if chat else \
            TextStream(tokenizer, p.stops)
        self.calls = 0  # tool calls sent so far (a stream's tool_calls delta index)
        self.request_id = "-"
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.eos = False
        self.first_token_at: float | None = None
        self.unsent: list[tuple] = []   # (token, logprob, top alternatives) not yet in a response's logprobs
        self.offset = len(p.echo)       # completions' text_offset: characters of text before the next token
        # the text's characters from its bytes, as the tokenizer's decode makes them (U+FFFD for bad bytes);
        # a token that starts inside a character gets that character's offset
        self.chars = codecs.getincrementaldecoder("utf-8")(errors="replace")

    @property
    def tokens(self) -> int:
        """Completion tokens: those the text holds (a stop string drops the rest of its round)."""
        return len(self.text.ids)

    async def next_event(self) -> tuple:
        remaining = self.job.deadline - time.monotonic()
        if remaining <= 0:
            return ("end", "deadline")
        try:
            return await asyncio.wait_for(self.job.events.get(), remaining)
        except asyncio.TimeoutError:
            return ("end", "deadline")

    def take_step(self, step):
        """A Step's tokens in; what may be sent now out: text (completions) or a Delta (chat)."""
        now = time.monotonic()
        if self.first_token_at is None and step.tokens:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrival)
        self.eos = self.eos or step.stopped
        before = self.tokens
        new = self.text.push(step.tokens)
        if self.p.logprobs is not None:
            tops = step.top_logprobs or [()] * len(step.tokens)
            self.unsent += list(zip(step.tokens, step.logprobs, tops))[: self.tokens - before]
        if self.text.stopped:
            self.job.cancelled.set()  # a stop string ended the text: the engine can stop at its next read
        return new

    def finish(self, reason: str) -> str:
        """Record the decode's end; return the OpenAI finish_reason."""
        self.job.cancelled.set()
        now = time.monotonic()
        if self.first_token_at is not None and self.tokens > 1:
            self.metrics.tpot.observe((now - self.first_token_at) / (self.tokens - 1))
        self.metrics.e2e.observe(now - self.arrival)
        finish = "stop" if self.text.stopped or self.eos else "length"
        if self.chat and self.text.calls and finish == "stop":
            finish = "tool_calls"
        ended = reason if reason in ("cancelled", "deadline", "shutdown", "error") else finish
        self.metrics.finished.labels(ended).inc()
        return finish

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.p.prompt), "completion_tokens": self.tokens,
                "total_tokens": len(self.p.prompt) + self.tokens,
                "prompt_tokens_details": {"cached_tokens": self.job.cached}}

    def logprobs(self) -> dict | None:
        """The logprobs of the tokens not yet sent, in OpenAI's shape for this route (None: not asked for)."""
        if self.p.logprobs is None:
            return None
        taken, self.unsent = self.unsent, []
        shown = self.token_text
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                text, raw = shown(token)
                return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(raw)}

            return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, alp) for a, alp in top]}
                                for t, lp, top in taken], "refusal": None}
        offsets = []
        for t, _, _ in taken:
            offsets.append(self.offset)
            self.offset += len(self.chars.decode(shown.text_bytes(t)))
        tops = None
        if self.p.logprobs:  # OpenAI's shape: the alternatives and the chosen token, by their text
            tops = [{**{shown(a)[0]: max(alp, LOGPROB_FLOOR) for a, alp in top},
                     shown(t)[0]: max(lp, LOGPROB_FLOOR)} for t, lp, top in taken]
        return {"tokens": [shown(t)[0] for t, _, _ in taken],
                "token_logprobs": [max(lp, LOGPROB_FLOOR) for _, lp, _ in taken],
                "top_logprobs": tops, "text_offset": offsets}

    # ---- whole answer -------------------------------------------------------------------------------
    async def collect(self, request: Request) -> dict:
        parts: list = [self.p.echo] if not self.chat else [Delta()]
        while True:
            event = await self.next_event()
            if event[0] == "step":
                parts.append(self.take_step(event[1]))
                if self.text.stopped:
                    break
                if await request.is_disconnected():
                    self.finish("cancelled")
                    raise ClientGone()
                continue
            if event[0] == "error" or event[1] != "done":
                self.finish("error" if event[0] == "error" else event[1])
                raise end_error(event, self.deadline_s, "decoding")
            break
        parts.append(self.text.finish())
        finish = self.finish("done")
        if self.chat:
            out = Delta()
            for d in parts:
                out.add(d)
            message = {"role": "assistant", "content": out.content if out.content or not out.calls else None,
                       "reasoning_content": out.reasoning or None}
            if out.calls:
                message["tool_calls"] = out.calls
            choice = {"index": 0, "message": message, "logprobs": self.logprobs(), "finish_reason": finish}
        else:
            choice = {"index": 0, "text": "".join(parts), "logprobs": self.logprobs(), "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    # ---- stream -------------------------------------------------------------------------------------
    def chunk(self, text, finish: str | None = None, first: bool = False) -> str:
        """One chunk (`text`: a string for completions, a Delta for chat); it carries the logprobs of the
        tokens decoded since the last one (their text may come later: text that could start a stop string,
        or part of a character, is held back)."""
        logprobs = None if first else self.logprobs()
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if first else {}
            if text:
                if text.reasoning:
                    delta["reasoning_content"] = text.reasoning
                if text.content:
                    delta["content"] = text.content
                if text.calls:
                    delta["tool_calls"] = [{"index": self.calls + i, **c} for i, c in enumerate(text.calls)]
                    self.calls += len(text.calls)
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}
        if self.p.include_usage:
            body["usage"] = None
        return sse(body)

    async def events(self, count):
        status, ended = 499, False
        try:
            if self.chat:
                yield self.chunk(None, first=True)
            elif self.p.echo:
                yield self.chunk(self.p.echo, first=True)
            while True:
                event = await self.next_event()
                if event[0] == "step":
                    new = self.take_step(event[1])
                    if new or self.unsent:
                        yield self.chunk(new)
                    if self.text.stopped:
                        break
                    continue
                if event[0] == "error" or event[1] != "done":
                    reason = "error" if event[0] == "error" else event[1]
                    self.finish(reason)
                    ended = True
                    err = end_error(event, self.deadline_s, "decoding (the stream ends here)")
                    status = err.status
                    log_5xx(self.request_id, err.status, err.message + " (in a stream)")
                    yield sse(err.body())
                    return
                break
            rest = self.text.finish()
            if rest:
                yield self.chunk(rest)
            finish = self.finish("done")
            ended = True
            yield self.chunk(None, finish)
            if self.p.include_usage:
                yield sse({"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                           "created": self.created, "model": self.model, "choices": [], "usage": self.usage()})
            yield "data: [DONE]\n\n"
            status = 200
        finally:
            if not ended:  # the client went away (Starlette cancelled us) or a send failed
                self.finish("cancelled")
            count(status)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
