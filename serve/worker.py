"""The decode worker: one thread owns the engine and runs one request at a time.

Requests are admitted into a bounded queue (`submit` says False past the bound: the route answers
429); one whose client leaves before it starts is taken out at once (`withdraw`). The worker drives
the engine's generator and hands each Step to the request's asyncio queue; between Steps (the fast
engine reads its device log about every 32 tokens) it checks the request's cancel flag, its deadline
and shutdown, and closing the generator cancels the decode on every TP rank. `drain` (the server is
stopping) ends the waiting requests at once and the running one at its next Step.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

from ..reference.sampling import SamplingParams
from .metrics import Metrics


@dataclass(eq=False)  # identity: withdraw() finds this job, not an equal one
class Job:
    prompt: list[int]
    seed: int
    params: SamplingParams
    max_new_tokens: int
    stop_ids: Sequence[int]
    deadline: float                       # time.monotonic() past which the request ends
    loop: asyncio.AbstractEventLoop
    top_logprobs: int = 0
    cached: int = 0                       # prompt tokens whose KV the engine reused, set before ("start",)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, *event) -> None:
        """Called from the worker thread: hand an event to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutdown)
            self.cancelled.set()


class Worker:
    """Events a Job receives, in order: ("start",), then ("step", Step)*, then one of ("end", reason)
    with reason in {"done", "cancelled", "deadline", "shutdown"} or ("error", message). A job that never
    starts gets only the end."""

    def __init__(self, engine, *, drafts: int | str, queue_size: int, metrics: Metrics, prefix_reuse: bool = False):
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.engine, self.drafts, self.queue_size, self.metrics = engine, drafts, queue_size, metrics
        # only an engine that supports it reuses the last prompt's prefix (the reference engine does not)
        self.prefix_reuse = prefix_reuse and getattr(engine, "supports_prefix_reuse", False)
        metrics.snapshot_bytes.set(engine.prefix_snapshot_bytes if self.prefix_reuse else 0)
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._current: Job | None = None
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="iquest-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def drain(self) -> None:
        """The server is stopping: refuse new jobs, end the waiting ones now and the running one at its
        next Step, each with reason "shutdown"."""
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), deque()
            self._publish()
            self._cond.notify()
        for job in waiting:
            job.emit("end", "shutdown")

    def stop(self, timeout: float = 30.0) -> None:
        """Drain, and end the thread."""
        self.drain()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> bool:
        with self._cond:
            if self._closing:
                job.emit("end", "shutdown")
                return True
            if len(self._waiting) + (self._current is not None) >= 1 + self.queue_size:
                return False
            self._waiting.append(job)
            self._publish()
            self._cond.notify()
        return True

    def withdraw(self, job: Job) -> None:
        """The job's client left (or its deadline passed) before it started: its place is free now.
        A job that has started stops at its next Step instead."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self._publish()

    def _publish(self) -> None:
        self.metrics.running.set(1 if self._current is not None else 0)
        self.metrics.queue_depth.set(len(self._waiting))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                job = self._current = self._waiting.popleft()
                self._publish()
            try:
                self._decode(job)
            finally:
                with self._cond:
                    self._current = None
                    self._publish()

    def _decode(self, job: Job) -> None:
        if self._closing:  # drained as the worker took it
            job.emit("end", "shutdown")
            return
        if job.cancelled.is_set():  # withdrawn as the worker took it
            job.emit("end", "cancelled")
            return
        if time.monotonic() >= job.deadline:
            job.emit("end", "deadline")
            return
        # only an engine that supports it gets the keyword (the fast engine does not yet)
        extra = {"top_logprobs": job.top_logprobs} if job.top_logprobs else {}
        if self.prefix_reuse:
            # asked before the start event, so that a response's first event can report it; this thread alone
            # runs the engine, so the decode that follows reuses exactly this much
            job.cached = self.engine.cached_prefix(job.prompt, self.drafts)
            self.metrics.prefix_lookups.labels("hit" if job.cached else "miss").inc()
            extra["prefix_reuse"] = True
        job.emit("start")
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self.metrics.cached_tokens.inc(job.cached)
        self.metrics.prefill_tokens.inc(len(job.prompt) - job.cached)
        gen = None
        reason = "done"
        try:
            gen = self.engine.generate(job.prompt, seed=job.seed, params=job.params,
                                       max_new_tokens=job.max_new_tokens, drafts=self.drafts,
                                       stop_ids=job.stop_ids, **extra)
            for step in gen:
                self.metrics.observe_step(step)
                job.emit("step", step)
                if self._closing:
                    reason = "shutdown"
                    break
                if job.cancelled.is_set():
                    reason = "cancelled"
                    break
                if time.monotonic() >= job.deadline:
                    reason = "deadline"
                    break
        except Exception as exc:  # an engine failure ends this request; the server keeps serving
            job.emit("error", f"{type(exc).__name__}: {exc}")
            return
        finally:
            if gen is not None:
                gen.close()  # the fast engine stops every rank at this read
        job.emit("end", reason)
