"""Who runs a server's requests (the OpenAI server's and each Triton model instance's). A front end only submits
`Request`s and reads what their `RequestSink` gets.

`BatchScheduler` steps one runtime.batch.Batch on one worker thread: requests join between rounds (up to
`max_running` at once, as KV memory allows) and share every target forward; each one's output is exactly its
output alone. Every call out of the worker (the batch's step, the sinks) is guarded: what one raises is logged in one
line and ends at most that request, never the worker; `alive` says whether the worker runs (the servers' health).
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Protocol

from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.runtime.device import set_threads
from whiflash_trt.runtime.batch import Batch
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.plan import Plan
from whiflash_trt.runtime.request import GenerationResult
from whiflash_trt.runtime.request import Request as EngineRequest

log = logging.getLogger("whiflash.scheduler")


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
    plan: Plan | SpecConfig | None   # the front end's Engine.plan; a spec or None (the engine's default) is
                                     # planned when the request starts
    sink: RequestSink
    cancel_event: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop at the next round (or before it starts, if still queued); the sink then gets `cancelled`."""
        self.cancel_event.set()


class Scheduler(Protocol):
    """Runs submitted requests; `alive`, `num_waiting` and `num_running` feed /health and /metrics."""

    def start(self) -> None: ...
    def submit(self, request: Request) -> None: ...
    def close(self) -> None: ...
    @property
    def alive(self) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...


class BatchScheduler:
    """One worker thread runs every request through a Batch, admitting new ones between rounds."""

    def __init__(self, engine: Engine, threads: int, max_running: int) -> None:
        self.engine, self.threads = engine, threads
        self._batch = Batch(engine, max_running)
        self._inbox: queue.Queue[Request | None] = queue.Queue()
        self._live: dict[int, tuple[EngineRequest, Request]] = {}   # id(engine request) -> (it, the server's)
        self._closing = threading.Event()
        self._worker = threading.Thread(target=self._work, name="whiflash-engine", daemon=True)

    @property
    def alive(self) -> bool:
        """Whether the worker runs (started, not closing, not dead)."""
        return self._worker.is_alive() and not self._closing.is_set()

    @property
    def num_waiting(self) -> int:
        return self._inbox.qsize() + len(self._batch.waiting)

    @property
    def num_running(self) -> int:
        return len(self._batch.running)

    def start(self) -> None:
        self._worker.start()

    def submit(self, request: Request) -> None:
        self._inbox.put(request)

    def close(self) -> None:
        """Stop: every running and queued request is cancelled."""
        self._closing.set()
        self._inbox.put(None)
        if self._worker.is_alive():
            self._worker.join()
        while not self._inbox.empty():
            if (request := self._inbox.get_nowait()) is not None:
                _notify(request, "cancelled")

    def _work(self) -> None:
        set_threads(self.threads)   # torch's intra-op thread count, set on the thread that runs the engine
        while not self._closing.is_set():
            try:
                self._turn()
            except Exception as e:   # a bug between the guarded calls: logged, and the worker goes on
                log.error("whiflash scheduler: %s: %s (the worker goes on)", type(e).__name__, e)
        for req, _ in list(self._live.values()):
            self._batch.cancel(req, RequestCancelled())
        self._report_ended()

    def _turn(self) -> None:
        """Take what was submitted, cancel what was cancelled, run one step, report what ended."""
        self._take(block=not self._batch.busy)
        for req, request in list(self._live.values()):
            if request.cancel_event.is_set():
                self._batch.cancel(req, RequestCancelled())
        if self._batch.busy:
            try:
                self._batch.step()
            except Exception as e:   # Batch.step ended that step's requests with the error
                log.error("whiflash scheduler: a step failed: %s: %s", type(e).__name__, e)
        self._report_ended()

    def _report_ended(self) -> None:
        """Tell the sink of every request the batch no longer holds how it ended."""
        held = {id(r) for r in [*self._batch.waiting, *self._batch.running]}
        for key in [k for k in self._live if k not in held]:
            req, request = self._live.pop(key)
            if isinstance(req.error, RequestCancelled):
                _notify(request, "cancelled")
            elif req.error is not None:
                _notify(request, "failed", req.error)
            else:
                self._finish(req, request)

    @staticmethod
    def _finish(req: EngineRequest, request: Request) -> None:
        try:
            result = req.result()
        except Exception as e:
            _notify(request, "failed", e)
            return
        if not _notify(request, "finished", result):   # the client still gets its one final event
            _notify(request, "failed", RuntimeError("the server could not deliver the result"))

    def _take(self, block: bool) -> None:
        """Move submitted requests into the batch (waiting while idle); one that cannot run fails at once."""
        try:
            request = self._inbox.get(block=block)
        except queue.Empty:
            return
        while request is not None:
            self._admit(request)
            try:
                request = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _admit(self, request: Request) -> None:
        if request.cancel_event.is_set():
            _notify(request, "cancelled")
            return

        def on_tokens(new_ids: list[int]) -> None:
            if request.cancel_event.is_set():
                raise RequestCancelled
            request.sink.tokens(new_ids)

        try:
            req = self.engine.request(request.prompt_ids, request.gen, request.plan, on_tokens)
            self._batch.submit(req)
        except Exception as e:   # the request's failure, reported to its client
            _notify(request, "failed", e)
            return
        self._live[id(req)] = (req, request)


def _notify(request: Request, event: str, *args) -> bool:
    """request.sink.<event>(*args) -> whether it returned; what it raises is logged in one line."""
    try:
        getattr(request.sink, event)(*args)
        return True
    except Exception as e:
        log.error("whiflash scheduler: a request's %s report raised %s: %s", event, type(e).__name__, e)
        return False
