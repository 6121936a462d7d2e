"""The OpenAI-compatible HTTP API (FastAPI): /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics.

Handlers run on the event loop; the engine runs on the scheduler's thread. A request's body is read within the
server's limits (serving.openai_api.limits), then parsed, validated and tokenized on a parsing thread, off the loop
(a bad one is answered 4xx at once), submitted (429 while the queue is full), and its output comes back through
`_Events`, a RequestSink that moves each event onto the loop. A streaming client that goes away cancels its request:
the scheduler stops it at the next round and the engine frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException

from whiflash_trt.errors import WhiflashError
from whiflash_trt.serving.openai_api.body import read_json
from whiflash_trt.serving.openai_api.limits import ServerLimits
from whiflash_trt.serving.openai_api.metrics import ServerMetrics
from whiflash_trt.serving.openai_api.protocol import APIError, ParsedRequest, parse_chat, parse_completion
from whiflash_trt.serving.openai_api.responses import ChatFormat, CompletionFormat, ResponseFormat
from whiflash_trt.serving.scheduler import Request, Scheduler
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.kv_cache import KVCacheExhausted
from whiflash_trt.runtime.text_stream import TextStream

DISCONNECT_POLL_S = 0.5   # how often a non-streaming request checks that its client is still there


class _Events:
    """RequestSink: each event goes onto the event loop's queue (`outcome` first sees the final one); token events
    only when the response streams."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outcome: Callable[[str, object], None],
                 stream: bool) -> None:
        self.loop, self.outcome, self.stream, self.queue = loop, outcome, stream, asyncio.Queue()

    def _put(self, kind: str, value, final: bool = False) -> None:
        def deliver():
            if final:
                self.outcome(kind, value)
            self.queue.put_nowait((kind, value))

        try:
            self.loop.call_soon_threadsafe(deliver)
        except RuntimeError:   # the loop is closed: the server is shutting down and nobody is listening
            pass

    def tokens(self, new_ids):
        if self.stream:
            self._put("tokens", new_ids)

    def finished(self, result):
        self._put("finished", result, final=True)

    def failed(self, error):
        self._put("failed", error, final=True)

    def cancelled(self):
        self._put("cancelled", None, final=True)


def error_of(exc: Exception) -> APIError:
    """A request that failed inside the engine: its own fault (400) or the server's (500)."""
    if isinstance(exc, KVCacheExhausted):
        return APIError(f"{exc} (start the server with a larger --kv-budget-mb)", code="kv_cache_exhausted")
    if isinstance(exc, (WhiflashError, ValueError)):
        return APIError(str(exc))
    return APIError(f"{type(exc).__name__}: {exc}", type="server_error", status=500)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body)}\n\n"


OPEN_ROUTES = ("/health",)   # answered without the API key


class KeyCheck:
    """ASGI middleware: with ServerLimits.api_key set, a request to any route but OPEN_ROUTES without that key as
    `Authorization: Bearer KEY` is answered 401 before it is read."""

    def __init__(self, app, limits: ServerLimits) -> None:
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["path"] not in OPEN_ROUTES
                and not self.limits.authorized(Headers(scope=scope).get("authorization"))):
            error = APIError("a valid API key is required: send it as Authorization: Bearer KEY",
                             code="invalid_api_key", status=401)
            await JSONResponse(error.body(), status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class OpenAIServer:
    def __init__(self, engine: Engine, scheduler: Scheduler, model_name: str,
                 limits: ServerLimits = ServerLimits()) -> None:
        self.engine, self.scheduler, self.model_name, self.limits = engine, scheduler, model_name, limits
        self.metrics = ServerMetrics(engine, scheduler)
        # One thread tokenizes every request, off the event loop (the tokenizer is not used by two encodes at once)
        self._parser = ThreadPoolExecutor(1, thread_name_prefix="whiflash-parse")

    def app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_app):
            self.scheduler.start()
            yield
            self.scheduler.close()
            self._parser.shutdown(wait=False, cancel_futures=True)

        app = FastAPI(title="whiflash-trt OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)

        @app.exception_handler(HTTPException)
        async def http_error(request: HTTPRequest, exc: HTTPException):
            code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
            message = f"{exc.detail}: {request.method} {request.url.path}"
            return JSONResponse(APIError(message, code=code, status=exc.status_code).body(),
                                status_code=exc.status_code)

        app.add_middleware(KeyCheck, limits=self.limits)
        app.get("/health")(self.health)
        app.get("/metrics")(self.prometheus)
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        return app

    async def health(self) -> JSONResponse:
        """200 while the engine's worker runs, else 503; with the queue and the KV blocks in use."""
        allocator, alive = self.engine.kv.allocator, self.scheduler.alive
        body = {"status": "ok" if alive else "worker_stopped", "model": self.model_name,
                "queue_length": self.scheduler.num_waiting, "running": self.scheduler.num_running,
                "kv_blocks_free": allocator.num_free, "kv_blocks_used": allocator.num_blocks - allocator.num_free,
                "kv_blocks_total": allocator.num_blocks}
        return JSONResponse(body, status_code=200 if alive else 503)

    async def prometheus(self) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "whiflash-trt"}]}

    async def completions(self, request: HTTPRequest) -> Response:
        return await self._serve(request, "completions", parse_completion, CompletionFormat)

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._serve(request, "chat", parse_chat, ChatFormat)

    async def _serve(self, http: HTTPRequest, endpoint: str, parse, response_format) -> Response:
        try:
            self._check_queue()   # before the body is read or planned: a full server spends nothing on it
            body = await read_json(http, self.limits)
            parsed: ParsedRequest = await asyncio.get_running_loop().run_in_executor(
                self._parser, parse, body, self.engine, self.model_name, self.limits)
            self._check_queue()   # again with no await before submit: others may have queued meanwhile
        except APIError as e:
            self.metrics.refused(endpoint)
            return JSONResponse(e.body(), status_code=e.status)
        events = _Events(asyncio.get_running_loop(), lambda kind, value: self._count(endpoint, kind, value),
                         parsed.stream)
        request = Request(parsed.prompt_ids, parsed.gen, parsed.plan, events)
        self.scheduler.submit(request)
        fmt = response_format(self.model_name)
        if parsed.stream:
            return StreamingResponse(self._stream(request, events, fmt, parsed), media_type="text/event-stream")
        return await self._whole(http, request, events, fmt)

    def _check_queue(self) -> None:
        """429 while limits.max_queue requests wait."""
        if self.scheduler.num_waiting >= self.limits.max_queue:
            raise APIError(f"the server is busy: {self.scheduler.num_waiting} requests are waiting (its "
                           f"--max-queue); retry later", type="server_busy", code="queue_full", status=429)

    def _count(self, endpoint: str, kind: str, value) -> None:
        if kind == "finished":
            self.metrics.finished(endpoint, value)
        elif kind == "failed":
            self.metrics.refused(endpoint)
        else:
            self.metrics.cancelled(endpoint)

    async def _whole(self, http: HTTPRequest, request: Request, events: _Events, fmt: ResponseFormat) -> Response:
        while True:   # only the final event comes (no token events without streaming)
            try:
                kind, value = await asyncio.wait_for(events.queue.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    request.cancel()
                continue
            if kind == "finished":
                return JSONResponse(fmt.full(value))
            if kind == "failed":
                error = error_of(value)
                return JSONResponse(error.body(), status_code=error.status)
            if kind == "cancelled":
                return Response(status_code=499)   # nobody reads it: the client is gone

    async def _stream(self, request: Request, events: _Events, fmt: ResponseFormat,
                      parsed: ParsedRequest) -> AsyncIterator[str]:
        """Server-sent events: OpenAI chunks, the last choice chunk with finish_reason and `whiflash`, then (with
        include_usage) a usage chunk, then `data: [DONE]`. Leaving early (client gone) cancels the request."""
        text, usage = TextStream(self.engine.decode, parsed.gen.stop_strings), parsed.include_usage
        done = False
        try:
            for chunk in fmt.first_chunks(usage):
                yield _sse(chunk)
            while not done:
                kind, value = await events.queue.get()
                done = kind != "tokens"
                if kind == "tokens":
                    delta = text.add(value)
                    if delta:
                        yield _sse(fmt.chunk(delta, usage))
                elif kind == "finished":
                    yield _sse(fmt.final_chunk(text.rest(value.text), value, usage))
                    if usage:
                        yield _sse(fmt.usage_chunk(value))
                elif kind == "failed":
                    yield _sse(error_of(value).body())
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                request.cancel()
