"""The HTTP routes: /v1/completions, /v1/chat/completions (streaming or not), /v1/models, /health, /metrics.

A request is checked (`prepare.py`), admitted to the worker's bounded queue (429 past it), waits for
the engine (503/504 when the server stops or the deadline passes first; a client that leaves gives
its place back), then turns the worker's Steps into text: all at once, or as server-sent events in
OpenAI's chunk format ending `data: [DONE]`. A stream whose client goes away is cancelled (Starlette
cancels the generator; the worker closes the engine's generator at its next read).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from .metrics import Metrics
from .prepare import (CHAT_DEFAULT_MAX_TOKENS, COMPLETION_DEFAULT_MAX_TOKENS, Limits, Prepared, chat_prompt,
                      completion_prompt, end_of_turn_ids, parse, prepare, unauthorized)
from .protocol import APIError, ChatRequest, CompletionRequest
from .text import TextStream
from .worker import Job, Worker

DISCONNECT_POLL_S = 0.25  # while a request waits for the engine, how often to ask whether its client left


@dataclass(frozen=True)
class ServeOptions:
    model_name: str
    api_key: str | None = None
    queue_size: int = 16
    deadline: float | None = 600.0   # seconds from arrival; None = no deadline
    max_context: int = 4096
    drafts: int | str = "auto"


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def create_app(engine, tokenizer, options: ServeOptions) -> FastAPI:
    cfg, gen = engine.config, engine.generation
    from ..reference.sampling import SamplingParams

    limits = Limits(options.model_name, min(options.max_context, cfg.max_position_embeddings - 8), cfg.vocab_size,
                    SamplingParams(gen.temperature, gen.top_k, gen.top_p), tuple(gen.eos_token_id))
    chat_stop_ids = end_of_turn_ids(tokenizer)
    metrics = Metrics()
    worker = Worker(engine, drafts=options.drafts, queue_size=options.queue_size, metrics=metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="IQuestRT", lifespan=lifespan)
    app.state.metrics, app.state.worker, app.state.limits = metrics, worker, limits

    def count(request: Request, status: int) -> None:
        metrics.requests.labels(request.url.path, str(status)).inc()

    def authorize(request: Request) -> None:
        if options.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), options.api_key.encode()):
            raise unauthorized()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        count(request, exc.status)
        headers = {"Retry-After": "1"} if exc.status == 429 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

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

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": options.model_name, "object": "model", "created": 0,
                                            "owned_by": "iquest", "max_model_len": limits.context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        authorize(request)
        req = parse(CompletionRequest, await request.body())
        p = prepare(req, completion_prompt(req, tokenizer, limits), limits,
                    default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS)
        return await serve(request, p, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        authorize(request)
        req = parse(ChatRequest, await request.body())
        p = prepare(req, chat_prompt(req, tokenizer), limits, default_max_tokens=CHAT_DEFAULT_MAX_TOKENS,
                    extra_stop_ids=chat_stop_ids)
        return await serve(request, p, chat=True)

    # ---- one request ------------------------------------------------------------------------------
    async def serve(request: Request, p: Prepared, chat: bool):
        arrival = time.monotonic()
        deadline = arrival + options.deadline if options.deadline else float("inf")
        job = Job(p.prompt, p.seed, p.params, p.max_tokens, p.stop_ids, deadline, asyncio.get_running_loop())
        if not worker.submit(job):
            raise APIError(429, f"the server is busy: {options.queue_size} requests already wait for the engine; "
                           "retry later", "rate_limit_error", None, "queue_full")
        try:
            await wait_for_start(request, job)
        except BaseException:
            worker.withdraw(job)
            raise
        answer = Answer(job, p, chat, options.model_name, tokenizer, metrics, arrival, options.deadline)
        if p.stream:
            return StreamingResponse(answer.events(lambda status: count(request, status)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            body = await answer.collect(request)
        finally:
            job.cancelled.set()  # a no-op once the decode has ended
        count(request, 200)
        return JSONResponse(body)

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

    def __init__(self, job: Job, p: Prepared, chat: bool, model: str, tokenizer, metrics: Metrics, arrival: float,
                 deadline_s: float | None):
        self.job, self.p, self.chat, self.model, self.metrics, self.arrival = job, p, chat, model, metrics, arrival
        self.deadline_s = deadline_s
        self.text = TextStream(tokenizer, p.stops)
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tokens = 0
        self.eos = False
        self.first_token_at: float | None = None

    async def next_event(self) -> tuple:
        remaining = self.job.deadline - time.monotonic()
        if remaining <= 0:
            return ("end", "deadline")
        try:
            return await asyncio.wait_for(self.job.events.get(), remaining)
        except asyncio.TimeoutError:
            return ("end", "deadline")

    def take_step(self, step) -> str:
        now = time.monotonic()
        if self.first_token_at is None and step.tokens:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrival)
        self.tokens += len(step.tokens)
        self.eos = self.eos or step.stopped
        new = self.text.push(step.tokens)
        if self.text.stopped:
            self.job.cancelled.set()  # a stop string ended the text: the engine can stop at its next read
        return new

    def finish(self, reason: str) -> str:
        """Record the decode's end; return the OpenAI finish_reason."""
        self.job.cancelled.set()
        if self.first_token_at is not None and self.tokens > 1:
            self.metrics.tpot.observe((time.monotonic() - self.first_token_at) / (self.tokens - 1))
        finish = "stop" if self.text.stopped or self.eos else "length"
        ended = reason if reason in ("cancelled", "deadline", "shutdown", "error") else finish
        self.metrics.finished.labels(ended).inc()
        return finish

    def usage(self) -> dict:
        return {"prompt_tokens": len(self.p.prompt), "completion_tokens": self.tokens,
                "total_tokens": len(self.p.prompt) + self.tokens}

    # ---- whole answer -------------------------------------------------------------------------------
    async def collect(self, request: Request) -> dict:
        parts: list[str] = []
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
        text = "".join(parts)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice], "usage": self.usage()}

    # ---- stream -------------------------------------------------------------------------------------
    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
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
            while True:
                event = await self.next_event()
                if event[0] == "step":
                    new = self.take_step(event[1])
                    if new:
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
