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

from whiflash_trt.models.contracts import TargetOutput
from whiflash_trt.runtime.engine import Draft, Engine
from whiflash_trt.runtime.kv_cache import KVCacheExhausted
from whiflash_trt.runtime.request import Request
from whiflash_trt.runtime.target_runner import Feed


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
        """Admit what fits, run one round for everyone; -> the requests that ended (their blocks freed). A request
        whose round raises ends alone with that error; the others go on as if it had not been there."""
        joining = self._admit()
        everyone = joining + self.running
        if not everyone:
            return []
        try:
            self._round(joining, list(self.running))
        except BaseException as e:   # KeyboardInterrupt and the like end every request of the step
            for req in everyone:
                self.cancel(req, e)
            raise
        ended = [req for req in everyone if req.done]
        self.running = [req for req in everyone if not req.done]
        for req in ended:
            req.seq.free()
        return ended

    def _round(self, joining: list[Request], running: list[Request]) -> None:
        """Prefill `joining` and run one round of `running` in one target forward; a request whose part raises gets
        the error (Request.done) and drops out of the later phases."""
        drafts = self._drafts(running)
        running = [req for req in running if not req.done]
        drafts = [drafts[id(req)] for req in running]
        feeds = [self._guarded(req, self.engine.prefill_feed, req) for req in joining]
        feeds += [self._guarded(req, self.engine.verify_feed, req, d) for req, d in zip(running, drafts)]
        everyone = joining + running
        start = time.perf_counter()
        outs = self._forward([(req, f) for req, f in zip(everyone, feeds) if not req.done],
                             capture=any(req.proposers for req in everyone))
        verify_seconds = time.perf_counter() - start
        for req in joining:
            if not req.done:
                self._guarded(req, self.engine.prefilled, req, outs[id(req)])
        for req, draft in zip(running, drafts):
            if not req.done:
                self._guarded(req, self.engine.commit, req, draft, outs[id(req)], verify_seconds)
        if len(everyone) == 1 and drafts and running[0].error is None:   # alone: the round's seconds are its cost
            self._guarded(running[0], self.engine.observe_round, drafts[0])

    def _drafts(self, running: list[Request]) -> dict[int, Draft]:
        """id(request) -> its draft: all together (drafters propose in groups), or, when that raises, each request
        alone, so that only the one that raises again fails. (A request routed before the failure routes once
        more: its stateful router may then choose another drafter, which changes its speed and a sampled request's
        draws, not its output's distribution, and never greedy tokens.)"""
        try:
            return {id(req): d for req, d in zip(running, self.engine.draft(running))}
        except Exception:
            alone = {}
            for req in running:
                drafts = self._guarded(req, self.engine.draft, [req])
                if drafts is not None:
                    alone[id(req)] = drafts[0]
            return alone

    def _forward(self, pairs: list[tuple[Request, Feed]], capture: bool) -> dict[int, TargetOutput]:
        """id(request) -> its target output: one forward for every feed, or, when that raises, one per feed (a
        sequence's rows do not depend on the others', so each output is the same), so that only the feed that
        raises again fails."""
        if not pairs:
            return {}
        try:
            outs = self.engine.runner.step_many([f for _, f in pairs], capture=capture)
            return {id(req): out for (req, _), out in zip(pairs, outs)}
        except Exception:
            alone = {}
            for req, feed in pairs:
                out = self._guarded(req, self.engine.runner.step_many, [feed], capture=capture)
                if out is not None:
                    alone[id(req)] = out[0]
            return alone

    @staticmethod
    def _guarded(req: Request, phase, *args, **kwargs):
        """phase(*args, **kwargs), or None with the exception set as `req`'s error (the request then ends)."""
        try:
            return phase(*args, **kwargs)
        except Exception as e:
            req.error = req.error or e
            return None

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
