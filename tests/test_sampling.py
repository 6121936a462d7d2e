"""Sampling and stopping: the filtered target distribution, seeded reproducibility, top_k=1 == greedy, stop strings,
max_new_tokens and EOS."""
from __future__ import annotations

import math

import pytest
import torch

from whiflash_trt.config import GenerationConfig, SamplingConfig
from whiflash_trt.runtime.engine import Engine
from whiflash_trt.spec.sampling import target_probs

PROMPT = "Hello world! The quick brown fox"
NEW = 24


@pytest.fixture(scope="module")
def engine(tiny_engine) -> Engine:
    return Engine.load(tiny_engine("llama"))


@pytest.fixture(scope="module")
def prompt_ids(engine) -> list[int]:
    return engine.encode(PROMPT)


@pytest.fixture(scope="module")
def greedy(engine, prompt_ids):
    return engine.generate(prompt_ids, GenerationConfig(max_new_tokens=NEW, ignore_eos=True))


def sampled(temperature=1.0, top_k=0, top_p=1.0, seed=None, **gen) -> GenerationConfig:
    return GenerationConfig(**{"max_new_tokens": NEW, "ignore_eos": True, **gen},
                            sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed))


# ----- the distribution -------------------------------------------------------------------------------------------

def test_temperature_scales_logits_before_softmax():
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    probs = target_probs(logits, SamplingConfig(temperature=0.5))
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))


def test_top_k_keeps_the_k_largest_and_renormalises():
    logits = torch.tensor([1.0, 3.0, 2.0, 0.5, -2.0])
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    expected = torch.zeros(5)
    expected[[1, 2]] = torch.softmax(torch.tensor([3.0, 2.0]), -1)
    assert torch.allclose(probs, expected)
    assert (probs == 0).tolist() == [True, False, False, True, True]
    # k >= vocab filters nothing
    assert torch.allclose(target_probs(logits, SamplingConfig(temperature=1.0, top_k=9)), torch.softmax(logits, -1))


@pytest.mark.parametrize("top_p, kept", [(0.7, [0, 1]), (0.85, [0, 1, 2]), (0.1, [0]), (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_the_smallest_prefix_reaching_p_and_renormalises(top_p, kept):
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    order = torch.tensor([2, 0, 3, 1])          # token ids of p's entries: not sorted in the vocabulary
    logits = torch.empty(4)
    logits[order] = p.log()
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_p=top_p))
    expected = torch.zeros(4)
    expected[order[kept]] = p[kept] / p[kept].sum()
    assert torch.allclose(probs, expected, atol=1e-6)
    assert math.isclose(probs.sum().item(), 1.0, abs_tol=1e-6)


def test_top_k_and_top_p_together_on_a_batch():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0],
                           [0.0, 0.0, 5.0, 0.0, 0.0]])
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_k=3, top_p=0.9))
    k3 = torch.softmax(torch.tensor([4.0, 3.0, 2.0]), -1)   # 0.665, 0.245, 0.090: top_p 0.9 drops the third
    assert torch.allclose(probs[0], torch.tensor([k3[0], k3[1], 0, 0, 0]) / (k3[0] + k3[1]), atol=1e-6)
    assert torch.equal(probs[1] > 0, torch.tensor([False, False, True, False, False]))
    assert torch.allclose(probs.sum(-1), torch.ones(2))


def test_draws_come_only_from_kept_tokens_in_proportion():
    logits = torch.tensor([0.0, 2.0, 1.0, 1.5, -1.0])
    probs = target_probs(logits, SamplingConfig(temperature=1.0, top_k=2))
    draws = torch.multinomial(probs, 20000, replacement=True, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draws, minlength=5).float() / draws.numel()
    assert counts[[0, 2, 4]].sum() == 0
    assert torch.allclose(counts, probs, atol=0.015)


# ----- generation -------------------------------------------------------------------------------------------------

def test_sampling_with_a_seed_is_reproducible(engine, prompt_ids, greedy):
    first = engine.generate(prompt_ids, sampled(seed=1234)).token_ids
    assert engine.generate(prompt_ids, sampled(seed=1234)).token_ids == first
    assert engine.generate(prompt_ids, sampled(seed=4321)).token_ids != first
    assert first != greedy.token_ids   # it really sampled


def test_top_k_1_equals_greedy(engine, prompt_ids, greedy):
    result = engine.generate(prompt_ids, sampled(temperature=1.5, top_k=1, seed=7))
    assert result.token_ids == greedy.token_ids


def test_max_new_tokens_is_respected(engine, prompt_ids, greedy):
    for n in (1, 5):
        result = engine.generate(prompt_ids, GenerationConfig(max_new_tokens=n, ignore_eos=True))
        assert result.token_ids == greedy.token_ids[:n]
        assert result.finish_reason == "length" and result.stats["new_tokens"] == n
    assert len(greedy.token_ids) == NEW and greedy.finish_reason == "length"


def _ascii_piece(engine, token_id: int) -> str | None:
    piece = engine.decode([token_id])
    return piece if piece.isascii() and piece.strip() and len(piece) >= 2 else None


def test_stop_string_ends_generation_and_is_cut_from_the_text(engine, prompt_ids, greedy):
    tokens, full = greedy.token_ids, greedy.text
    # a token in the middle whose text first occurs exactly where that token starts
    j = next(j for j in range(4, NEW - 2) if (s := _ascii_piece(engine, tokens[j]))
             and full.find(s) == len(engine.decode(tokens[:j])))
    stop = engine.decode([tokens[j]])
    streamed = []
    result = engine.generate(prompt_ids, GenerationConfig(max_new_tokens=NEW, ignore_eos=True, stop_strings=(stop,)),
                             on_tokens=streamed.extend)
    assert result.finish_reason == "stop"
    assert result.token_ids == tokens[:j + 1]
    assert result.text == full[:full.find(stop)] and stop not in result.text
    assert streamed == result.token_ids


def test_stop_string_across_two_tokens_and_the_earliest_of_several(engine, prompt_ids, greedy):
    tokens, full = greedy.token_ids, greedy.text
    j = next(j for j in range(4, NEW - 2) if _ascii_piece(engine, tokens[j]) and _ascii_piece(engine, tokens[j + 1]))
    stop = engine.decode([tokens[j]])[-1] + engine.decode([tokens[j + 1]])[0]
    cut = full.find(stop)
    end = next(i for i in range(1, NEW + 1) if stop in engine.decode(tokens[:i]))  # the token completing it
    # a second stop string that first occurs only after the first one was completed
    later = next(full[i:i + 3] for i in range(len(engine.decode(tokens[:end])), len(full) - 3)
                 if full[i:i + 3].isascii() and full.find(full[i:i + 3]) == i)
    gen = GenerationConfig(max_new_tokens=NEW, ignore_eos=True, stop_strings=(later, stop))
    result = engine.generate(prompt_ids, gen)
    assert result.finish_reason == "stop"
    assert result.token_ids == tokens[:end]
    assert result.text == full[:cut]


def test_stop_check_decodes_a_window_and_finds_what_a_full_decode_finds(engine, greedy):
    from whiflash_trt.runtime.stopping import StopChecker

    output = greedy.token_ids * 11 + greedy.token_ids[::-1]   # a long output whose end differs from its start
    full, head = engine.decode(output), len(engine.decode(output[:-len(greedy.token_ids)]))
    late = next(full[i:i + 6] for i in range(head, len(full) - 6) if full.find(full[i:i + 6]) == i)
    stops = (late, "\x00never")                       # `late` first occurs in the last part
    reach = 4 * max(map(len, stops)) + 8
    seen: list[int] = []

    def decode(ids):
        seen.append(len(ids))
        return engine.decode(ids)

    def reference(out, first_new):                    # the earliest new token whose full prefix holds a stop
        return next((i + 1 for i in range(first_new, len(out)) if any(s in engine.decode(out[:i + 1]) for s in stops)),
                    None)

    gen = GenerationConfig(max_new_tokens=len(output) + 1, ignore_eos=True, stop_strings=stops)
    checker = StopChecker(gen, (), decode, len(output) + 1)
    n, found = 0, None
    while n < len(output) and found is None:
        step = 1 + n % 3                               # rounds of 1-3 tokens
        expected = reference(output[:n + step], n)
        seen.clear()
        decision = checker.check(output[:n + step], step)
        assert (decision.keep if decision.reason == "stop" else None) == expected
        if expected is None:                           # no stop: one decode of a window, not of the output
            assert seen == [min(n + step, reach + step)]
        found, n = expected, n + step
    assert found is not None and found > len(output) - len(greedy.token_ids) and late in engine.decode(output[:found])


def test_eos_ends_generation(engine, tiny_engine, prompt_ids, greedy):
    tokens = greedy.token_ids
    # the same weights with a config whose EOS is the greedy output's 6th token (first occurrence)
    k = next(k for k in range(5, NEW) if tokens[k] not in tokens[:k])
    eos_engine = Engine.load(tiny_engine("llama", eos_token_id=tokens[k]))
    assert tokens[k] in eos_engine.eos_ids
    result = eos_engine.generate(prompt_ids, GenerationConfig(max_new_tokens=NEW))
    assert result.finish_reason == "eos"
    assert result.token_ids == tokens[:k + 1]      # the EOS token is part of the output
    ignored = eos_engine.generate(prompt_ids, GenerationConfig(max_new_tokens=NEW, ignore_eos=True))
    assert ignored.token_ids == tokens and ignored.finish_reason == "length"
