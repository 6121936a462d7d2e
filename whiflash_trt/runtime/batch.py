"""Continuous batching: many requests advance together, one target forward per round.

Each step, every running request routes on its own signal and catches up its chosen drafter (lazy, per sequence);
the requests that chose the same drafter (and tree shape) propose together; then ONE target forward verifies every
request's tree or chain and prefills the requests that joined, and each request verifies and commits on its own. The target's rows do not depend on the other sequences of the call
(models/attention.py), so a request's greedy output is exactly its output alone, and its sampling draws come from its
own generator.

A request holds the KV blocks of its whole length (Engine.slots_needed) from admission, so a running sequence never
runs out: a request that does not fit yet waits, in arrival order, and one that could never fit is refused.
"""
from __future__ import annotations

import time
from collections import deque

from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.kv_cache import KVCacheExhausted
from whiflash_trt.runtime.request import Request


class Batch:
    def __init__(self, engine: Engine, max_running: int = 1) -> None:
        if max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {max_running}")
        self.engine, self.max_running = engine, max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def submit(self, req: Request) -> Request:
        """Queue a request; raises KVCacheExhausted (nothing allocated) if it needs more KV memory than there is."""
        slots = self.engine.slots_needed(req)
        blocks = self._blocks(slots)
        allocator = self.engine.kv.allocator
        if blocks > allocator.num_blocks:
            prompt, limit = len(req.seq.prompt_ids), req.gen.max_new_tokens
            needed = self.engine.kv_mb(slots)
            raise KVCacheExhausted(f"KV cache exhausted: this request ({prompt} prompt tokens, up to {limit} new) "
                                   f"needs {blocks} blocks and the pool has {allocator.num_blocks}; on its own it "
                                   f"needs {needed} MB of KV memory", needed)
        self.waiting.append(req)
        return req

    def cancel(self, req: Request, error: Exception) -> None:
        """End a waiting or running request between steps with `error`; its blocks are freed."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        req.error = req.error or error
        req.seq.free()

    def run(self) -> None:
        while self.busy:
            self.step()

    def step(self) -> list[Request]:
        """Admit what fits, run one round for everyone; -> the requests that ended (their blocks freed)."""
        joining = self._admit()
        everyone = joining + self.running
        if not everyone:
            return []
        try:
            drafts = self.engine.draft(self.running)
            feeds = ([self.engine.prefill_feed(req) for req in joining]
                     + [self.engine.verify_feed(req, d) for req, d in zip(self.running, drafts)])
            start = time.perf_counter()
            outs = self.engine.runner.step_many(feeds, capture=any(req.proposers for req in everyone))
            verify_seconds = time.perf_counter() - start
            for req, out in zip(joining, outs):
                self.engine.prefilled(req, out)
            for req, draft, out in zip(self.running, drafts, outs[len(joining):]):
                self.engine.commit(req, draft, out, verify_seconds)
            if len(everyone) == 1 and drafts:   # a request alone: the round's seconds are its choice's cost
                self.engine.observe_round(drafts[0])
        except BaseException as e:   # an engine failure ends every request of the step; none keeps its blocks
            for req in everyone:
                self.cancel(req, e)
            raise
        ended = [req for req in everyone if req.done]
        self.running = [req for req in everyone if not req.done]
        for req in ended:
            req.seq.free()
        return ended

    def _admit(self) -> list[Request]:
        """Waiting requests, in arrival order, while a slot and their KV blocks are free."""
        joining = []
        while self.waiting and len(self.running) + len(joining) < self.max_running:
            req = self.waiting[0]
            slots = self.engine.slots_needed(req)
            if self._blocks(slots) > self.engine.kv.allocator.num_free:
                break
            req.seq.reserve(slots)
            joining.append(self.waiting.popleft())
        return joining

    def _blocks(self, slots: int) -> int:
        return -(-slots // self.engine.kv.block_size)
