"""Our TargetModel over a paged, scattered KV cache gives transformers' logits and hidden states (fp32, tiny random
checkpoints): prefill, one decode token, a 5-token step, captured layers and logits rows."""
from __future__ import annotations

import random

import pytest
import torch

from tiny_models import load_hf_model
from whiflash_trt import kernels
from whiflash_trt.models.checkpoints import instantiate_target, load_hf_checkpoint
from whiflash_trt.runtime.kv_cache import BlockAllocator, KVLayout, KVPool
from whiflash_trt.runtime.sequence import Sequence
from whiflash_trt.runtime.target_runner import TargetRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 40
PROMPT_LEN = 37   # positions beyond the llama3.1 variant's original_max_position_embeddings (32)
CHUNK = 5
ATOL = 1e-4


def scattered_allocator(seed: int) -> BlockAllocator:
    """An allocator whose next blocks come out of order with gaps: every third block stays held by someone else,
    the rest were freed in a shuffled order."""
    allocator = BlockAllocator(NUM_BLOCKS)
    ids = allocator.allocate(NUM_BLOCKS)
    rest = [b for i, b in enumerate(ids) if i % 3]
    random.Random(seed).shuffle(rest)
    allocator.free(rest)
    return allocator


def assert_scattered(block_table: list[int]) -> None:
    steps = [b - a for a, b in zip(block_table, block_table[1:])]
    assert any(s != 1 for s in steps), f"block table {block_table} is contiguous"
    assert any(s > 0 for s in steps) and any(s < 0 for s in steps), f"block table {block_table} is monotonic"


class Setup:
    def __init__(self, folder, capture_layers=()):
        ckpt = load_hf_checkpoint(folder)
        self.model = instantiate_target(ckpt, torch.float32)
        cfg = self.model.config
        self.pool = KVPool(KVLayout("target", cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32),
                           NUM_BLOCKS, BLOCK_SIZE)
        # NaN everywhere nobody wrote: a read of a slot outside the sequence poisons the logits
        self.pool.k.fill_(float("nan"))
        self.pool.v.fill_(float("nan"))
        self.runner = TargetRunner(self.model, self.pool, capture_layers)
        self.hf = load_hf_model(folder)
        gen = torch.Generator().manual_seed(1)
        self.tokens = torch.randint(0, cfg.vocab_size, (PROMPT_LEN + 1 + CHUNK,), generator=gen).tolist()
        with torch.no_grad():
            out = self.hf(torch.tensor([self.tokens]), output_hidden_states=True, use_cache=True)
        self.hf_logits = out.logits[0]                          # [T, vocab]
        self.hf_hidden = [h[0] for h in out.hidden_states]      # num_layers + 1 of [T, hidden]
        cache = out.cache if "cache" in out else out.past_key_values  # renamed in transformers 5
        # per layer [T, kv_heads, head_dim], keys after RoPE like our pool
        self.hf_keys = [layer.keys[0].transpose(0, 1) for layer in cache.layers]
        self.hf_values = [layer.values[0].transpose(0, 1) for layer in cache.layers]
        self.seq = Sequence(self.tokens[:PROMPT_LEN], scattered_allocator(seed=7), BLOCK_SIZE)


@pytest.fixture(params=["llama", "llama_tied", "llama3.1", "qwen3"])
def setup(request, tiny_checkpoint):
    return Setup(tiny_checkpoint(request.param))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


def test_logits_match_transformers_for_prefill_decode_and_multi_token_step(setup):
    s, toks, n = setup, setup.tokens, PROMPT_LEN
    assert s.hf_logits.std() > 0.1, "reference logits too flat for a 1e-4 tolerance to mean anything"

    s.seq.reserve(n)
    prefill = s.runner.step(s.seq, toks[:n])
    assert max_diff(prefill.logits, s.hf_logits[:n]) <= ATOL
    s.seq.commit(toks[:n], toks[n])

    s.seq.reserve(n + 1)
    decode = s.runner.step(s.seq, [toks[n]])
    assert max_diff(decode.logits, s.hf_logits[n:n + 1]) <= ATOL
    s.seq.commit([toks[n]], toks[n + 1])

    # the 5-token step spans a block boundary (positions 38..42, block size 4) on a scattered table
    s.seq.reserve(n + 1 + CHUNK)
    assert_scattered(s.seq.block_table)
    chunk = s.runner.step(s.seq, toks[n + 1:])
    assert max_diff(chunk.logits, s.hf_logits[n + 1:]) <= ATOL
    # the final-norm hidden state returned with the logits is transformers' last hidden state
    assert max_diff(chunk.hidden, s.hf_hidden[-1][n + 1:]) <= ATOL


def test_cache_holds_transformers_keys_and_values_at_the_sequence_slots(setup):
    s, toks, n = setup, setup.tokens, PROMPT_LEN
    s.seq.reserve(len(toks))
    s.runner.step(s.seq, toks[:n])
    s.seq.commit(toks[:n], toks[n])
    s.runner.step(s.seq, toks[n:])
    table = s.seq.block_table
    assert_scattered(table)
    slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(toks))])
    for layer in range(s.model.config.num_layers):
        assert max_diff(s.pool.k[layer, slots], s.hf_keys[layer]) <= ATOL
        assert max_diff(s.pool.v[layer, slots], s.hf_values[layer]) <= ATOL


def test_model_has_the_checkpoint_embedding_tie(setup):
    tied = setup.model.config.tie_word_embeddings
    assert tied == setup.hf.config.tie_word_embeddings
    assert (setup.model.lm_head.weight.data_ptr() == setup.model.embed_tokens.weight.data_ptr()) == tied


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_captured_layers_equal_transformers_hidden_states(tiny_checkpoint, variant):
    # layers 0 and 1 of 3; the last layer is left out: transformers' hidden_states[-1] is after the final norm
    s = Setup(tiny_checkpoint(variant), capture_layers=(0, 1))
    hidden = s.model.config.hidden_size
    s.seq.reserve(PROMPT_LEN)
    out = s.runner.step(s.seq, s.tokens[:PROMPT_LEN], capture=True)
    assert out.captured.shape == (PROMPT_LEN, 2 * hidden)
    assert max_diff(out.captured[:, :hidden], s.hf_hidden[1][:PROMPT_LEN]) <= ATOL
    assert max_diff(out.captured[:, hidden:], s.hf_hidden[2][:PROMPT_LEN]) <= ATOL

    s.seq.commit(s.tokens[:PROMPT_LEN], s.tokens[PROMPT_LEN])
    s.seq.reserve(PROMPT_LEN + 1 + CHUNK)
    out = s.runner.step(s.seq, s.tokens[PROMPT_LEN:PROMPT_LEN + 1 + CHUNK], capture=True)
    assert max_diff(out.captured[:, hidden:], s.hf_hidden[2][PROMPT_LEN:]) <= ATOL


def test_no_capture_returns_no_features(tiny_checkpoint):
    s = Setup(tiny_checkpoint("llama"))
    s.seq.reserve(PROMPT_LEN)
    assert s.runner.step(s.seq, s.tokens[:PROMPT_LEN]).captured is None


def test_logits_indices_return_only_the_asked_rows(tiny_checkpoint):
    s = Setup(tiny_checkpoint("llama"))
    rows = [2, 11, PROMPT_LEN - 1]
    s.seq.reserve(PROMPT_LEN)
    out = s.runner.step(s.seq, s.tokens[:PROMPT_LEN], logits_rows=rows)
    assert out.logits.shape == (len(rows), s.model.config.vocab_size)
    assert out.hidden.shape == (len(rows), s.model.config.hidden_size)
    assert max_diff(out.logits, s.hf_logits[rows]) <= ATOL
    assert max_diff(out.hidden, s.hf_hidden[-1][rows]) <= ATOL


def test_capture_layer_out_of_range_is_refused(tiny_checkpoint):
    s = Setup(tiny_checkpoint("llama"))
    with pytest.raises(ValueError, match=r"capture layers \[3\] out of range for a 3-layer target"):
        TargetRunner(s.model, s.runner.pool, capture_layers=(0, 3))


@pytest.mark.skipif(not kernels.registered(), reason="the kernels are not loaded on this machine")
@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_bf16_layers_on_the_kernels_match_the_torch_modules(tiny_checkpoint, variant):
    """In bf16 on the kernels every layer runs its kernel form (norms_in_gemms: its residual adds, norms and SwiGLU
    inside the GEMMs: kernels.linear_norm); the torch modules' forward over the same weights gives the same logits and
    captured layers but for a norm's last bit here and there (the sum of squares is ordered otherwise)."""
    target = instantiate_target(load_hf_checkpoint(tiny_checkpoint(variant)), torch.bfloat16)
    assert all(layer.norms_in_gemms for layer in target.layers)
    cfg, t = target.config, 23
    ids = torch.randint(0, cfg.vocab_size, (t,), generator=torch.Generator().manual_seed(3))
    outs = []
    for on_kernels in (True, False):
        for layer in target.layers:
            layer.norms_in_gemms = on_kernels
        pools = [torch.zeros(cfg.num_layers, 32, cfg.num_kv_heads, cfg.head_dim, dtype=torch.bfloat16)
                 for _ in range(2)]
        with torch.inference_mode():
            outs.append(target(ids, torch.arange(t), *pools, torch.arange(t), torch.arange(t),
                               torch.ones(t, t, dtype=torch.bool).tril(), capture_layers=(0, 2)))
    fused, modules = outs
    for got, want in ((fused.logits, modules.logits), (fused.captured, modules.captured)):
        assert got.dtype == torch.bfloat16 and (got == want).float().mean() > 0.9
        assert (got.float() - want.float()).abs().max() <= 0.02 * want.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_traced_by_halves_equals_the_eager_form_bit_for_bit(dtype):
    """apply_rope's traced form (per half, what a compiled step exports) rounds every product and sum as the eager
    form does: the compiled engine's q and k are the eager engine's."""
    from whiflash_trt.config import RopeConfig
    from whiflash_trt.models.layers import RotaryTable, apply_rope

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, 64, generator=gen).to(dtype)
    cos, sin = RotaryTable(64, 512, RopeConfig(theta=10000.0))(torch.tensor([0, 3, 100, 101, 250, 400, 511]), dtype)
    traced = torch.compile(apply_rope, backend="eager", fullgraph=True)(x, cos, sin)
    eager = apply_rope(x, cos, sin)
    assert torch.equal(traced, eager)
    assert not torch.equal(eager, x * cos)   # the rotation took part
