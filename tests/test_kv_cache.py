"""Block allocator, Sequence and KV pool bookkeeping: slot mapping, all-or-nothing reservation, compaction, double
frees, leaks under random traffic, the budget arithmetic, and the engine returning every block."""
from __future__ import annotations

import random

import pytest
import torch

from whiflash_trt.builder.build import BuildOptions, build_engine
from whiflash_trt.config import GenerationConfig
from whiflash_trt.errors import WhiflashError
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.runtime.kv_cache import (BlockAllocator, KVCacheExhausted, KVLayout, KVPool,
                                           num_blocks_for_budget)
from whiflash_trt.runtime.sequence import Sequence

BS = 4  # block size


def layout(num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32, name="target") -> KVLayout:
    return KVLayout(name, num_layers, kv_heads, head_dim, dtype)


def test_slots_follow_the_block_table():
    allocator = BlockAllocator(8)
    other = allocator.allocate(2)                 # blocks 0, 1 held elsewhere
    seq = Sequence([1, 2, 3], allocator, BS)
    seq.reserve(3)
    assert seq.block_table == [2] and seq.capacity == BS
    allocator.free(other)
    seq.reserve(10)                               # 3 blocks: one more than held + two freed ones
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert seq.block_table[0] == 2 and set(seq.block_table[1:]) <= {0, 1, 3}
    expected = [seq.block_table[i // BS] * BS + i % BS for i in range(10)]
    assert seq.slots(0, 10).tolist() == expected
    assert seq.slots(5, 9).tolist() == expected[5:9]
    seq.reserve(7)                                # already covered: no new block
    assert len(seq.block_table) == 3
    with pytest.raises(IndexError, match="beyond reserved capacity"):
        seq.slots(0, 13)


def test_reserve_exhaustion_raises_and_changes_nothing():
    allocator = BlockAllocator(5)
    seq = Sequence(list(range(6)), allocator, BS)
    seq.reserve(6)                                # 2 blocks
    table, free = list(seq.block_table), allocator.num_free
    with pytest.raises(KVCacheExhausted, match="KV cache exhausted: 4 blocks requested, 3 of 5 free"):
        seq.reserve(24)                           # needs 4 more, 3 free
    assert allocator.num_free == free
    assert seq.block_table == table
    assert seq.slots(0, 8).tolist() == [table[i // BS] * BS + i % BS for i in range(8)]
    seq.reserve(20)                               # exactly what is left still works
    assert allocator.num_free == 0
    seq.free()
    assert allocator.num_free == 5


def test_commit_beyond_capacity_is_refused():
    seq = Sequence([1, 2, 3], BlockAllocator(4), BS)
    seq.reserve(3)
    seq.commit([1, 2, 3], 9)
    with pytest.raises(IndexError, match="beyond the reserved KV capacity"):
        seq.commit([9, 9], 4)
    assert seq.tokens == [1, 2, 3] and seq.pending == 9


def test_the_feature_backlog_keeps_the_rows_no_drafter_has_caught_up_on():
    """Rows of positions [min frontier, N), whatever the rounds' sizes and however far a drafter falls behind."""
    rng = random.Random(0)
    seq = Sequence([1, 2, 3], BlockAllocator(64), BS)
    seq.reserve(200)
    rows = torch.arange(200 * 3, dtype=torch.float32).view(200, 3)   # row i: the features of position i
    seq.commit([1, 2, 3], 7, rows[:3], {"a": 0, "b": 0})
    frontiers = {"a": 0, "b": 0}
    while seq.num_committed < 190:
        n, k = seq.num_committed, rng.randint(1, 6)
        d = rng.choice("aab")                  # "b" catches up now and then: its backlog grows in between
        frontiers[d] = n
        seq.commit([7] * k, 7, rows[n:n + k], dict(frontiers))
        start = min(frontiers.values())
        assert seq.features_start == start
        assert torch.equal(seq.features, rows[start:seq.num_committed])
        assert torch.equal(seq.features_between(n, n + k), rows[n:n + k])
    assert seq.features_start > 0
    for start, end in ((seq.features_start - 1, seq.num_committed), (seq.features_start, seq.num_committed + 1)):
        with pytest.raises(IndexError, match="not in the backlog"):
            seq.features_between(start, end)


@pytest.mark.parametrize("path", [[0, 2, 5], [1, 2, 3], [3], [0, 1, 2], [2, 3, 6, 7]])
def test_compaction_moves_accepted_tree_nodes_to_contiguous_slots(path):
    allocator = BlockAllocator(16)
    allocator.free(allocator.allocate(16))        # freed in order: now handed out 15, 14, ...
    seq = Sequence([1, 2, 3, 4, 5], allocator, BS)
    seq.reserve(5 + 8)
    seq.commit([1, 2, 3, 4, 5], 0)
    pool = KVPool(layout(), 16, BS)
    n = seq.num_committed
    nodes = seq.slots(n, n + 8)                   # tree nodes at logical N..N+7, crossing a block boundary
    pool.k[:, nodes] = torch.arange(8, dtype=torch.float32).view(1, 8, 1, 1) + 100 * torch.arange(2).view(2, 1, 1, 1)
    pool.v[:, nodes] = -pool.k[:, nodes]
    context_k = pool.k[:, seq.slots(0, n)].clone()

    src, dst = seq.compaction(path)
    moved = [i for i, p in enumerate(path) if p != i]
    assert src.tolist() == [seq.slots(n + path[i], n + path[i] + 1).item() for i in moved]
    assert dst.tolist() == [seq.slots(n + i, n + i + 1).item() for i in moved]
    pool.copy_slots(src, dst)

    kept = seq.slots(n, n + len(path))
    expected = torch.tensor(path, dtype=torch.float32).view(1, -1, 1, 1) + 100 * torch.arange(2).view(2, 1, 1, 1)
    assert torch.equal(pool.k[:, kept], expected.expand(2, len(path), 2, 8))
    assert torch.equal(pool.v[:, kept], -expected.expand(2, len(path), 2, 8))
    assert torch.equal(pool.k[:, seq.slots(0, n)], context_k)  # committed context untouched


def test_compaction_of_an_in_place_path_moves_nothing():
    seq = Sequence([1, 2], BlockAllocator(4), BS)
    seq.reserve(6)
    seq.commit([1, 2], 3)
    src, dst = seq.compaction([0, 1, 2])
    assert src.numel() == 0 and dst.numel() == 0


@pytest.mark.parametrize("path", [[2, 1], [0, 0], [-1, 2]])
def test_compaction_refuses_a_path_that_is_not_increasing(path):
    seq = Sequence([1, 2], BlockAllocator(4), BS)
    seq.reserve(6)
    seq.commit([1, 2], 3)
    with pytest.raises(ValueError, match="increasing and non-negative"):
        seq.compaction(path)


def test_double_free_is_an_error():
    allocator = BlockAllocator(4)
    ids = allocator.allocate(2)
    allocator.free(ids[:1])
    with pytest.raises(ValueError, match=f"block {ids[0]} freed twice"):
        allocator.free(ids[:1])
    assert allocator.num_free == 3
    with pytest.raises(ValueError, match="block 3 freed twice"):
        allocator.free([3])                       # never allocated
    assert allocator.num_free == 3


def test_random_traffic_leaks_no_block_and_never_shares_one():
    rng = random.Random(0)
    allocator = BlockAllocator(64)
    live: list[Sequence] = []
    exhausted = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.2 or not live:
            seq = Sequence([1] * rng.randint(1, 20), allocator, BS)
            try:
                seq.reserve(len(seq.prompt_ids))
            except KVCacheExhausted:
                exhausted += 1
                continue
            seq.commit(seq.prompt_ids, 0)
            live.append(seq)
        elif op < 0.8:
            seq = rng.choice(live)
            k = rng.randint(1, 8)
            try:
                seq.reserve(seq.num_committed + k)
            except KVCacheExhausted:
                exhausted += 1
                continue
            seq.commit([0] * rng.randint(0, k), 0)
        else:
            live.pop(rng.randrange(len(live))).free()
        held = [b for s in live for b in s.block_table]
        assert len(held) == len(set(held)), "a block is in two sequences' tables"
        assert allocator.num_free + len(held) == allocator.num_blocks
    assert exhausted > 0, "the traffic never reached exhaustion; the test does not cover it"
    for seq in live:
        seq.free()
    assert allocator.num_free == allocator.num_blocks
    assert sorted(allocator.allocate(64)) == list(range(64))


def test_num_blocks_for_budget_counts_every_pool_per_block_id():
    fp32 = layout(num_layers=2, kv_heads=2, head_dim=8)
    assert fp32.bytes_per_block(16) == 2 * 2 * 16 * 2 * 8 * 4 == 4096
    bf16 = layout(num_layers=1, kv_heads=4, head_dim=16, dtype=torch.bfloat16, name="dflash")
    assert bf16.bytes_per_block(16) == 2 * 1 * 16 * 4 * 16 * 2 == 4096
    assert num_blocks_for_budget(10 * 4096, 16, [fp32]) == 10
    assert num_blocks_for_budget(10 * 4096 + 4095, 16, [fp32]) == 10
    assert num_blocks_for_budget(10 * 4096, 16, [fp32, bf16]) == 5
    assert num_blocks_for_budget(10 * 4096, 32, [fp32]) == 5
    with pytest.raises(ValueError, match="holds no block"):
        num_blocks_for_budget(4095, 16, [fp32])


def test_pool_shape_matches_the_layout():
    pool = KVPool(layout(num_layers=3, kv_heads=2, head_dim=8, dtype=torch.bfloat16), 5, BS)
    assert pool.k.shape == pool.v.shape == (3, 5 * BS, 2, 8)
    assert pool.k.dtype == torch.bfloat16


class CallbackFailed(Exception):
    pass


class FailingConsumer:
    """A streaming consumer that fails once it has seen 5 tokens."""

    def __init__(self) -> None:
        self.seen = 0

    def __call__(self, ids: list[int]) -> None:
        self.seen += len(ids)
        if self.seen >= 5:
            raise CallbackFailed


def test_engine_returns_every_block_after_finished_and_failed_requests(tiny_checkpoint, tmp_path):
    engine_dir = build_engine(BuildOptions(target=str(tiny_checkpoint("llama")), output=tmp_path / "engine",
                                           dtype="fp32", block_size=4, show_progress=False))
    # 2 KV heads x 16 dims x 3 layers x K,V x fp32: 768 bytes per token; 12 blocks of 4 tokens = 48 slots in all
    engine = Engine.load(engine_dir, kv_budget_bytes=12 * 4 * 768)
    allocator = engine.kv.allocator
    assert allocator.num_blocks == 12
    requests = [  # (prompt length, max_new_tokens, expected outcome)
        (10, 20, "ok"),
        (30, 30, KVCacheExhausted),     # the prompt fits, its whole length does not: refused before prefill
        (60, 1, KVCacheExhausted),      # prefill alone does not fit
        (40, 8, "ok"),                  # exactly the 48 slots (the last new token is never cached)
        (5, 30, CallbackFailed),        # the streaming consumer fails mid-generation
        (0, 5, WhiflashError),          # empty prompt, refused before any allocation
    ]
    rng = random.Random(0)
    for _ in range(2):
        for length, max_new, expected in requests:
            prompt = [rng.randrange(3, engine.target.config.vocab_size) for _ in range(length)]
            streamed = []
            callback = FailingConsumer() if expected is CallbackFailed else streamed.extend
            gen = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
            if expected == "ok":
                assert len(engine.generate(prompt, gen, on_tokens=callback).token_ids) == max_new
            else:
                with pytest.raises(expected):
                    engine.generate(prompt, gen, on_tokens=callback)
                assert streamed == [], "a request is refused before any output, never cut off mid-generation"
            assert allocator.num_free == allocator.num_blocks, f"blocks leaked by request {length, max_new}"
