"""Per-request state: tokens, committed length, the pending bonus token, the block table, drafter frontiers.

Invariant after every verify: tokens x_0..x_{N-1} are committed and the target's K/V for them are in the pool at
logical slots 0..N-1; the bonus token b (the target's own next token) is pending at position N and not yet cached.
A drafter's frontier says up to which position its own cache is filled (<= N).
"""
from __future__ import annotations

import torch

from whiflash_trt.runtime.kv_cache import BlockAllocator


class Sequence:
    def __init__(self, prompt_ids: list[int], allocator: BlockAllocator, block_size: int) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty: at least one token is needed")
        self.prompt_ids: list[int] = list(prompt_ids)
        self.tokens: list[int] = []  # committed (= cached) tokens; prefill commits the prompt
        self.pending: int | None = None
        self.frontiers: dict[str, int] = {}
        # Captured target features of positions [features_start, N): the drafters' pending backlog, the first
        # N - features_start rows of a buffer with room to grow (a round appends its rows in place: a copy of the
        # whole backlog per round would grow with the rounds a drafter sits out, 47 us at 1000 rows)
        self._features: torch.Tensor | None = None
        self.features_start = 0
        self.block_table: list[int] = []
        self._allocator = allocator
        self._block_size = block_size
        self._slot_map = torch.empty(0, dtype=torch.long)   # physical slot of every reserved logical slot

    @property
    def num_committed(self) -> int:
        return len(self.tokens)

    @property
    def features(self) -> torch.Tensor | None:
        """[N - features_start, F] the backlog's features (a view), None before any were committed."""
        return None if self._features is None else self._features[:self.num_committed - self.features_start]

    @property
    def capacity(self) -> int:
        return len(self.block_table) * self._block_size

    def reserve(self, num_slots: int) -> None:
        """Make logical slots [0, num_slots) addressable; all or nothing (raises KVCacheExhausted)."""
        missing = -(-num_slots // self._block_size) - len(self.block_table)
        if missing > 0:
            self.block_table += self._allocator.allocate(missing)
            table = torch.tensor(self.block_table, dtype=torch.long)
            self._slot_map = (table[:, None] * self._block_size + torch.arange(self._block_size)).flatten()

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Physical slots of logical positions [start, end) -> [end - start] int64: a view of the slot map made at
        reserve (a round asks for slots ~5 times; computing them from the block table took 6 ops each). Read-only."""
        if end > self.capacity:
            raise IndexError(f"logical slot {end - 1} beyond reserved capacity {self.capacity}")
        return self._slot_map[start:end]

    def commit(self, tokens: list[int], pending: int | None, features: torch.Tensor | None = None,
               frontiers: dict[str, int] | None = None) -> None:
        """Append tokens whose target K/V already sit at slots [N, N + len(tokens)); set the next bonus token.

        `features` [len(tokens), F] are their captured target features; `frontiers` are drafter frontiers the
        round advanced. Features no drafter still needs are dropped.
        """
        if self.num_committed + len(tokens) > self.capacity:
            raise IndexError("committing tokens beyond the reserved KV capacity")
        if features is not None:
            if features.shape[0] != len(tokens):
                raise ValueError(f"{features.shape[0]} feature rows for {len(tokens)} tokens")
            self._append_features(features)
        self.tokens += tokens
        self.pending = pending
        self.frontiers.update(frontiers or {})
        if self._features is not None and self.frontiers:
            drop = min(self.frontiers.values()) - self.features_start
            if drop > 0:
                self._features = self._features[drop:]   # a view: the rows stay until the buffer grows
                self.features_start += drop

    def _append_features(self, rows: torch.Tensor) -> None:
        used = self.num_committed - self.features_start
        if self._features is None or used + len(rows) > len(self._features):
            grown = rows.new_empty((2 * (used + len(rows)), rows.shape[1]))
            if used:
                grown[:used] = self._features[:used]
            self._features = grown
        self._features[used:used + len(rows)] = rows

    def features_between(self, start: int, end: int) -> torch.Tensor:
        """Captured features of positions [start, end) (must still be in the backlog)."""
        if self._features is None or start < self.features_start or end > self.num_committed:
            raise IndexError(f"features of positions [{start}, {end}) are not in the backlog "
                             f"[{self.features_start}, {self.num_committed})")
        return self._features[start - self.features_start:end - self.features_start]

    def compaction(self, path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots to copy so the accepted tree nodes at logical N + path[i] land at N + i (path strictly increasing)."""
        if any(b <= a for a, b in zip(path, path[1:])) or (path and path[0] < 0):
            raise ValueError(f"accepted path offsets must be increasing and non-negative, got {path}")
        n = self.num_committed
        moved = [(n + p, n + i) for i, p in enumerate(path) if p != i]
        if not moved:
            empty = torch.empty(0, dtype=torch.long)
            return empty, empty
        src, dst = zip(*moved)
        return self._slot_map[list(src)], self._slot_map[list(dst)]

    def free(self) -> None:
        if self.block_table:
            self._allocator.free(self.block_table)
        self.block_table = []
        self._slot_map = torch.empty(0, dtype=torch.long)
