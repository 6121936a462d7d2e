"""Who runs the server's requests. The HTTP layer only submits `Request`s and reads what their `RequestSink` gets;
a batched engine replaces `SerialScheduler` by another `Scheduler` without touching the HTTP layer.

Today `SerialScheduler` runs one request at a time on one worker thread, in arrival order: requests are queued,
not batched, until the engine steps batched rounds (issue 17, part 1).
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Protocol

from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.runtime.device import set_threads
from whiflash_trt.runtime.engine import Engine, GenerationResult


class RequestCancelled(Exception):
    """Raised inside the engine's on_tokens callback to stop a cancelled request (generate() frees its blocks)."""


class RequestSink(Protocol):
    """Receives one request's output, on the scheduler's thread: any number of `tokens` calls, then exactly one of
    `finished` (the engine's result), `failed` (an exception, the request's own fault or the engine's) or
    `cancelled`."""

    def tokens(self, new_ids: list[int]) -> None: ...
    def finished(self, result: GenerationResult) -> None: ...
    def failed(self, error: Exception) -> None: ...
    def cancelled(self) -> None: ...


@dataclass
class Request:
    """One generation request, validated: the prompt's token ids and the settings the engine runs it with."""
    prompt_ids: list[int]
    gen: GenerationConfig
    spec: SpecConfig
    sink: RequestSink
    cancel_event: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop at the next round (or before it starts, if still queued); the sink then gets `cancelled`."""
        self.cancel_event.set()


class Scheduler(Protocol):
    """Runs submitted requests; `num_waiting` and `num_running` feed /health and /metrics."""

    def start(self) -> None: ...
    def submit(self, request: Request) -> None: ...
    def close(self) -> None: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...


class SerialScheduler:
    """One worker thread runs the queued requests one at a time through Engine.generate."""

    def __init__(self, engine: Engine, threads: int) -> None:
        self.engine, self.threads = engine, threads
        self._queue: queue.Queue[Request | None] = queue.Queue()
        self._current: Request | None = None   # the request the worker is running
        self._worker = threading.Thread(target=self._work, name="whiflash-engine", daemon=True)

    @property
    def num_waiting(self) -> int:
        return self._queue.qsize()

    @property
    def num_running(self) -> int:
        return int(self._current is not None)

    def start(self) -> None:
        self._worker.start()

    def submit(self, request: Request) -> None:
        self._queue.put(request)

    def close(self) -> None:
        """Stop: the request in progress and every queued one are cancelled."""
        pending = []
        while not self._queue.empty():
            pending.append(self._queue.get_nowait())
        if self._current is not None:
            self._current.cancel()
        self._queue.put(None)
        if self._worker.is_alive():
            self._worker.join()
        for request in pending:
            if request is not None:
                request.sink.cancelled()

    def _work(self) -> None:
        set_threads(self.threads)   # torch's intra-op thread count, set on the thread that runs the engine
        while (request := self._queue.get()) is not None:
            self._current = request
            try:
                self._run(request)
            finally:
                self._current = None

    def _run(self, request: Request) -> None:
        if request.cancel_event.is_set():
            request.sink.cancelled()
            return

        def on_tokens(new_ids: list[int]) -> None:
            if request.cancel_event.is_set():
                raise RequestCancelled
            request.sink.tokens(new_ids)

        try:
            result = self.engine.generate(request.prompt_ids, request.gen, on_tokens=on_tokens, spec=request.spec)
        except RequestCancelled:
            request.sink.cancelled()
        except Exception as e:  # the request's failure, reported to its client; the worker goes on
            request.sink.failed(e)
        else:
            request.sink.finished(result)
