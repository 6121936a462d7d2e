"""Continuous batching: requests are admitted, advance together one round (runtime.round) per step, and are freed.

A request holds the KV blocks of its whole length (Engine.slots_needed) from admission, so a running sequence never
runs out: a request that does not fit yet waits, in arrival order, and one that could never fit is refused.
"""
from __future__ import annotations

from collections import deque

from whiflash_trt.runtime.kv_cache import KVCacheExhausted
from whiflash_trt.runtime.request import Request
from whiflash_trt.runtime.round import Round


class Batch:
    def __init__(self, engine, max_running: int = 1) -> None:
        """`engine`: a runtime.engine.Engine (its KV pools, its target's runner and its round costs)."""
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
            Round(self.engine.runner, self.engine.target.config.max_position_embeddings,
                  self.engine.round_seconds).run(joining, list(self.running))
        except BaseException as e:   # KeyboardInterrupt and the like end every request of the step
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
