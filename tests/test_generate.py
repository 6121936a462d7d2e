"""Training data comes from the runtime's own target forward: a sequence decoded among others in the batched generator
gets, bit for bit, the tokens, features and hidden states of the same sequence stepped alone."""
from __future__ import annotations

import pytest
import torch

from whiflash_trt.models.checkpoints import instantiate_target, load_hf_checkpoint
from whiflash_trt.runtime.kv_cache import BlockAllocator, KVLayout, KVPool
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.target_runner import TargetRunner
from whiflash_trt.train.generate import BatchedGenerator

CAPTURE = (0, 1)
PROMPTS = ([1, 5, 6, 7], [1, 8, 9], list(range(2, 80)), [3])


def alone(model, prompt: list[int], new_tokens: int):
    """Greedy decoding of one sequence, one target step per token: (tokens, features, hidden)."""
    cfg = model.config
    layout = KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.dtype)
    runner = TargetRunner(model, KVPool(layout, 16, 16), CAPTURE)
    seq = Sequence(prompt, BlockAllocator(16), 16)
    seq.reserve(len(prompt) + new_tokens + 1)
    feed, feats, hidden = list(prompt), [], []
    for _ in range(new_tokens + 1):   # the first step feeds the prompt
        out = runner.step(seq, feed, capture=True)   # logits and hidden states at every row
        feats.append(out.captured)
        hidden.append(out.hidden)
        seq.commit(feed, int(out.logits[-1].argmax()))
        feed = [seq.pending]
    return seq.tokens, torch.cat(feats), torch.cat(hidden)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_batched_generation_equals_each_sequence_alone(tiny_checkpoint, dtype):
    model = instantiate_target(load_hf_checkpoint(tiny_checkpoint("llama")), dtype)
    model.fuse_projections()
    gen = BatchedGenerator(model, CAPTURE, lanes=3, max_len=128, eos_ids=())
    g = torch.Generator().manual_seed(0)
    done, queue = [], list(enumerate(PROMPTS))
    while queue or gen.active:   # four prompts through three lanes: one joins when a lane frees
        while queue and gen.free:
            i, prompt = queue.pop(0)
            gen.add(prompt, {"index": i, "temperature": 0.0}, g)
        done += gen.step(6 + 3 * len(done), g)
    assert sorted(f.meta["index"] for f in done) == [0, 1, 2, 3]
    for f in done:
        prompt = PROMPTS[f.meta["index"]]
        tokens, feats, hidden = alone(model, prompt, len(f.tokens) - len(prompt))
        assert f.tokens == tokens and f.prompt_len == len(prompt)
        assert torch.equal(f.features, feats) and torch.equal(f.hidden, hidden)
    assert sorted(gen.free) == [0, 1, 2] and gen.allocator.num_free == gen.allocator.num_blocks
