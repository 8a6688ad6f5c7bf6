"""The decode worker: one thread owns the engine and runs one request at a time.

Requests are admitted into a bounded queue (`submit` says False past the bound: the route answers
429). The worker drives the engine's generator and hands each Step to the request's asyncio queue;
between Steps (the fast engine reads its device log about every 32 tokens) it checks the request's
cancel flag and deadline, and closing the generator cancels the decode on every TP rank.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

from ..reference.sampling import SamplingParams
from .metrics import Metrics


@dataclass
class Job:
    prompt: list[int]
    seed: int
    params: SamplingParams
    max_new_tokens: int
    stop_ids: Sequence[int]
    deadline: float                       # time.monotonic() past which the request ends
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def emit(self, *event) -> None:
        """Called from the worker thread: hand an event to the request's coroutine."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (server shutdown)
            self.cancelled.set()


class Worker:
    """Events a Job receives, in order: ("start",), then ("step", Step)*, then one of
    ("end", reason) with reason in {"done", "cancelled", "deadline"} or ("error", message)."""

    def __init__(self, engine, *, drafts: int | str, queue_size: int, metrics: Metrics):
        if queue_size < 0:
            raise ValueError(f"queue_size must be >= 0, got {queue_size}")
        self.engine, self.drafts, self.queue_size, self.metrics = engine, drafts, queue_size, metrics
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._admitted = 0                  # running + waiting
        self._current: Job | None = None
        self._thread = threading.Thread(target=self._run, name="iquest-decode", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel the running request, drop the waiting ones, and end the thread."""
        current = self._current
        if current is not None:
            current.cancelled.set()
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> bool:
        with self._lock:
            if self._admitted >= 1 + self.queue_size:
                return False
            self._admitted += 1
            self._publish()
        self._jobs.put(job)
        return True

    def _publish(self) -> None:
        running = 1 if self._current is not None else 0
        self.metrics.running.set(running)
        self.metrics.queue_depth.set(self._admitted - running)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            with self._lock:
                self._current = job
                self._publish()
            try:
                self._decode(job)
            finally:
                with self._lock:
                    self._current = None
                    self._admitted -= 1
                    self._publish()
        while True:  # shutting down: whatever still waits ends as cancelled
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.emit("end", "cancelled")

    def _decode(self, job: Job) -> None:
        if job.cancelled.is_set():  # the client left (or its deadline passed) while it waited
            job.emit("end", "cancelled")
            return
        if time.monotonic() >= job.deadline:
            job.emit("end", "deadline")
            return
        job.emit("start")
        gen = None
        reason = "done"
        try:
            gen = self.engine.generate(job.prompt, seed=job.seed, params=job.params,
                                       max_new_tokens=job.max_new_tokens, drafts=self.drafts,
                                       stop_ids=job.stop_ids)
            for step in gen:
                self.metrics.observe_step(step)
                job.emit("step", step)
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
