"""The servers' worker thread (serving.scheduler.BatchScheduler) outlives whatever a request's sink raises: the error
is logged in one line, that request alone ends, and the next request is served with its single-request output."""
from __future__ import annotations

import logging
import time

from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.serving.scheduler import BatchScheduler, Request

WAIT_S = 60


class Sink:
    """Records one request's events; `raise_on` names the events that raise (each once), as a broken front end's."""

    def __init__(self, raise_on: tuple[str, ...] = ()) -> None:
        self.raise_on, self.events, self.tokens_seen = set(raise_on), [], []

    def _event(self, kind: str, value=None) -> None:
        self.events.append((kind, value))
        if kind in self.raise_on:
            self.raise_on.discard(kind)
            raise RuntimeError(f"the sink's {kind} broke")

    def tokens(self, new_ids):
        self.tokens_seen += new_ids
        self._event("tokens", new_ids)

    def finished(self, result):
        self._event("finished", result)

    def failed(self, error):
        self._event("failed", error)

    def cancelled(self):
        self._event("cancelled")


def run(scheduler: BatchScheduler, engine, sink: Sink, last: str = "finished") -> Sink:
    """Submit a request to `sink`; -> it once its event `last` has come (and returned or raised)."""
    ids = engine.encode("def add(a, b):")
    scheduler.submit(Request(ids, GenerationConfig(max_new_tokens=12), SpecConfig(mode="eagle3"), sink))
    deadline = time.monotonic() + WAIT_S
    while not sink.events or sink.events[-1][0] != last:
        assert time.monotonic() < deadline, f"no {last} event came ({sink.events}): the worker is dead"
        time.sleep(0.01)
    return sink


def test_a_sink_that_raises_once_is_logged_and_the_next_request_completes(spec_engine, caplog):
    expected = spec_engine.generate(spec_engine.encode("def add(a, b):"), GenerationConfig(max_new_tokens=12),
                                    spec=SpecConfig(mode="eagle3")).token_ids
    scheduler = BatchScheduler(spec_engine, threads=1, max_running=2)
    scheduler.start()
    try:
        with caplog.at_level(logging.ERROR, logger="whiflash.scheduler"):
            broken_final = run(scheduler, spec_engine, Sink(raise_on=("finished",)), last="failed")
            assert [k for k, _ in broken_final.events][-2:] == ["finished", "failed"], "no final event delivered"
            run(scheduler, spec_engine, Sink(raise_on=("tokens", "failed")), last="failed")
            assert scheduler.alive
            after = run(scheduler, spec_engine, Sink())
        kind, result = after.events[-1]
        assert kind == "finished" and result.token_ids == expected == after.tokens_seen
        logged = [r.getMessage() for r in caplog.records]
        assert any("finished report raised RuntimeError" in m for m in logged), logged
        assert any("failed report raised RuntimeError" in m for m in logged), logged
        assert all("\n" not in m for m in logged), "one line per caught error"
        allocator = spec_engine.kv.allocator
        assert allocator.num_free == allocator.num_blocks
    finally:
        scheduler.close()
    assert not scheduler.alive


def test_health_is_503_while_the_worker_does_not_run(spec_engine):
    from fastapi.testclient import TestClient

    from whiflash_trt.serving.openai_api.app import OpenAIServer

    scheduler = BatchScheduler(spec_engine, threads=1, max_running=1)
    server = OpenAIServer(spec_engine, scheduler, "tiny")
    app = server.app()
    with TestClient(app) as client:   # the app's lifespan starts the worker and closes it at exit
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert "whiflash_worker_up 1.0" in client.get("/metrics").text
        scheduler.close()   # the worker stops, as if it had died
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "worker_stopped"
        assert "whiflash_worker_up 0.0" in client.get("/metrics").text
