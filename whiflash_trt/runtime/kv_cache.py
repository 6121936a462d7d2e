"""Paged KV memory: one block allocator, one physical pool per model, all indexed by the same block ids.

A sequence's block table therefore addresses the target's pool and both drafters' pools at once: logical slot i of
a sequence lives at physical slot block_table[i // block_size] * block_size + i % block_size in every pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from whiflash_trt.config import CacheConfig
from whiflash_trt.errors import WhiflashError


class KVCacheExhausted(WhiflashError):
    """Raised before anything is written when a request needs more KV blocks than are free. `needed_mb`, where the
    engine knows it, is the KV budget one such request needs on its own."""

    def __init__(self, message: str, needed_mb: int | None = None) -> None:
        super().__init__(message)
        self.needed_mb = needed_mb


@dataclass(frozen=True)
class KVLayout:
    """Shape of one model's KV pool, per block."""
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem

    def to_dict(self) -> dict:
        from whiflash_trt.config import dtype_name
        return {"name": self.name, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": dtype_name(self.dtype)}


def kv_layouts(configs: dict, dtype: torch.dtype) -> list[KVLayout]:
    """One pool layout per model: pool name -> that model's config (ModelConfig, Eagle3Config or DFlashConfig)."""
    return [KVLayout(name, c.num_layers, c.num_kv_heads, c.head_dim, dtype) for name, c in configs.items()]


def num_blocks_for_budget(budget_bytes: int, block_size: int, layouts: list[KVLayout]) -> int:
    """How many block ids fit when every block id has a block in each layout's pool."""
    per_block = sum(layout.bytes_per_block(block_size) for layout in layouts)
    num_blocks = budget_bytes // per_block
    if num_blocks < 1:
        raise ValueError(f"KV memory budget of {budget_bytes} bytes holds no block ({per_block} bytes per block id)")
    return int(num_blocks)


class BlockAllocator:
    """Free list over block ids 0..num_blocks-1; each block is held by one sequence at a time."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._held: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVCacheExhausted(
                f"KV cache exhausted: {n} blocks requested, {len(self._free)} of {self.num_blocks} free")
        ids = [self._free.pop() for _ in range(n)]
        self._held.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for b in ids:
            if b not in self._held:
                raise ValueError(f"block {b} freed twice")
            self._held.remove(b)
            self._free.append(b)


class KVPool:
    """One model's physical K and V: [num_layers, num_blocks * block_size, kv_heads, head_dim] each."""

    def __init__(self, layout: KVLayout, num_blocks: int, block_size: int, device: torch.device | str = "cpu"):
        self.layout = layout
        shape = (layout.num_layers, num_blocks * block_size, layout.num_kv_heads, layout.head_dim)
        self.k = torch.zeros(shape, dtype=layout.dtype, device=device)
        self.v = torch.zeros(shape, dtype=layout.dtype, device=device)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Move K/V of src slots to dst slots in every layer (compaction of an accepted tree path)."""
        if src.numel() == 0:
            return
        # Gather first (index_select copies): src and dst ranges may overlap.
        self.k.index_copy_(1, dst, self.k.index_select(1, src))
        self.v.index_copy_(1, dst, self.v.index_select(1, src))


class KVCache:
    """The allocator and every model's pool, sized together: each block id has a block in every pool."""

    def __init__(self, layouts: list[KVLayout], cache: CacheConfig, device: torch.device | str = "cpu") -> None:
        self.block_size = cache.block_size
        self.bytes_per_block_id = sum(layout.bytes_per_block(cache.block_size) for layout in layouts)
        num_blocks = num_blocks_for_budget(cache.memory_budget_bytes, cache.block_size, layouts)
        self.allocator = BlockAllocator(num_blocks)
        self.pools = {layout.name: KVPool(layout, num_blocks, cache.block_size, device) for layout in layouts}
