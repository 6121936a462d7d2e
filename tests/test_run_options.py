"""whiflash-run's options, through the real console script: the engine's default policy, --threads, bad values
caught before the engine loads, options a mode would ignore, several prompts, KV exhaustion naming the flag."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from whiflash_trt.cli import PROMPT_SEPARATOR
from whiflash_trt.config import GenerationConfig, SpecConfig
from whiflash_trt.runtime.device import default_threads
from whiflash_trt.runtime.policy import resolve_spec

BIN = Path(sys.executable).parent


def run(*argv, check_rc: int | None = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(BIN / "whiflash-run"), *map(str, argv)], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr
    if check_rc is not None:
        assert proc.returncode == check_rc, proc.stderr
    return proc


def error_line(*argv) -> str:
    proc = run(*argv, check_rc=2)
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: ")
    return proc.stderr.strip()


def test_auto_resolves_to_the_best_the_engine_holds():
    both = {"eagle3", "dflash"}
    assert resolve_spec(SpecConfig(), both, True).mode == "whiflash"
    assert resolve_spec(SpecConfig(), both, True).router == "neural"
    assert resolve_spec(SpecConfig(), both, False).router == "entropy"
    assert resolve_spec(SpecConfig(), {"dflash"}, False).mode == "dflash"
    assert resolve_spec(SpecConfig(), {"eagle3"}, False).mode == "eagle3"
    assert resolve_spec(SpecConfig(), set(), False).mode == "ar"
    assert resolve_spec(SpecConfig("ar", "entropy"), both, True) == SpecConfig("ar", "entropy")


def test_engine_default_is_what_it_holds_from_every_front_end(spec_engine, spec_engine_dir):
    # the Python API with no spec, and a spec left at "auto", get the engine's best mode: both drafters, routed
    # by the neural router (this engine ships router weights)
    ids, gen = [5, 9, 13, 2, 7], GenerationConfig(max_new_tokens=12, ignore_eos=True)
    api = spec_engine.generate(ids, gen)
    assert (api.stats["mode"], api.stats["router"]) == ("whiflash", "neural")
    assert spec_engine.resolve_spec(SpecConfig(mode="whiflash")).router == "neural"
    assert spec_engine.resolve_spec(SpecConfig(mode="eagle3")).mode == "eagle3"
    ar = spec_engine.generate(ids, gen, spec=SpecConfig("ar"))
    assert api.token_ids == ar.token_ids
    cli = json.loads(run("--engine", spec_engine_dir, "--prompt", "abc def", "--max-new-tokens", 12,
                         "--json").stdout)
    assert (cli["stats"]["mode"], cli["stats"]["router"]) == ("whiflash", "neural")


def test_threads_sets_torch_threads_and_defaults_to_half_the_cores(tiny_engine):
    engine = tiny_engine()
    assert json.loads(run("--engine", engine, "--prompt", "hi", "--max-new-tokens", 3, "--json",
                          "--threads", 1).stdout)["stats"]["threads"] == 1
    assert json.loads(run("--engine", engine, "--prompt", "hi", "--max-new-tokens", 3,
                          "--json").stdout)["stats"]["threads"] == default_threads()
    assert "--threads must be >= 1, got 0" in error_line("--engine", engine, "--prompt", "hi", "--threads", 0)


def test_a_dflash_tree_run_gives_the_ar_output(spec_engine_dir):
    base = ("--engine", spec_engine_dir, "--prompt", "abc def", "--max-new-tokens", 20, "--json")
    ar = json.loads(run(*base, "--mode", "ar").stdout)
    tree = json.loads(run(*base, "--mode", "dflash", "--dflash-tree-total-tokens", 14, "--dflash-tree-top-k", 3).stdout)
    assert tree["token_ids"] == ar["token_ids"] and tree["stats"]["mode"] == "dflash"


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu"], "unknown device 'tpu'; expected cpu, cuda or cuda:N"),
    (["--tree-top-k", "0"], "tree needs top_k >= 1"),
    (["--kv-budget-mb", "0"], "--kv-budget-mb must be positive, got 0"),
    (["--stream", "--json"], "--stream and --json do not combine"),
    (["--mode", "ar", "--router", "neural"], "--router applies only to --mode whiflash; this request's mode is ar"),
    (["--mode", "eagle3", "--threshold", "1", "--catch-up", "eager"],
     "--threshold, --catch-up apply only to --mode whiflash"),
    (["--mode", "dflash", "--tree-depth", "3"], "--tree-depth applies only to the EAGLE-3 drafter"),
    (["--mode", "eagle3", "--dflash-tree-total-tokens", "8"],
     "--dflash-tree-total-tokens applies only to the DFlash drafter; this request's mode is eagle3"),
    (["--dflash-tree-total-tokens", "1"], "DFlash tree total_tokens must be >= 2"),
    (["--mode", "dflash", "--dflash-tree-total-tokens", "9", "--dflash-tree-top-k", "1"],
     "a DFlash tree of 9 nodes does not fit this drafter: 5 drafts per block with top_k 1 hold at most 6 nodes"),
    (["--tree-min-prob", "1"], "a draft tree's min_prob must be in [0, 1), got 1.0"),
    (["--mode", "eagle3", "--dflash-tree-min-prob", "-0.1"], "a draft tree's min_prob must be in [0, 1), got -0.1"),
    (["--mode", "dflash", "--tree-min-prob", "0.1"], "--tree-min-prob applies only to the EAGLE-3 drafter"),
    (["--mode", "eagle3", "--dflash-tree-min-prob", "0.1"], "--dflash-tree-min-prob applies only to the DFlash "
                                                            "drafter"),
], ids=["device", "tree", "kv-budget", "stream-json", "router-with-ar", "threshold-with-eagle3", "tree-with-dflash",
        "dflash-tree-with-eagle3", "dflash-tree-too-small", "dflash-tree-too-big", "floor-of-one", "negative-floor",
        "floor-with-dflash", "dflash-floor-with-eagle3"])
def test_bad_or_ignored_options_are_one_error_line(spec_engine_dir, argv, message):
    assert message in error_line("--engine", spec_engine_dir, "--prompt", "hi", *argv)


def test_cuda_on_a_torch_without_cuda_is_one_error_line(tiny_engine):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "--device cuda: this torch" in error_line("--engine", tiny_engine(), "--prompt", "hi", "--device", "cuda")


def test_bad_options_fail_before_the_engine_loads(tmp_path):
    # no engine at this path: the option error must come first
    missing = tmp_path / "no-engine"
    assert "unknown device" in error_line("--engine", missing, "--prompt", "hi", "--device", "tpu")


def test_an_empty_prompt_in_a_file_names_its_line_before_any_output(tmp_path, tiny_engine):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n\n{"prompt": ""}\n')
    assert f"{prompts}:3:" in error_line("--engine", tiny_engine(), "--prompts-file", prompts)


def test_several_prompts_in_plain_text_are_separated(tmp_path, tiny_engine):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "def f(x):"}\n{"prompt": "1, 2, 3"}\n')
    out = run("--engine", tiny_engine(), "--prompts-file", prompts, "--max-new-tokens", 5).stdout
    assert out.count(PROMPT_SEPARATOR + "\n") == 2
    assert all(part.strip() for part in out.split(PROMPT_SEPARATOR + "\n"))


def test_kv_exhaustion_names_the_flag_and_a_budget_that_works(tiny_engine):
    # head_dim 512: 24 KiB of K and V per token, so 1 MiB holds 2 blocks of 16 tokens
    engine = tiny_engine("llama", head_dim=512)
    err = error_line("--engine", engine, "--prompt", "hello", "--kv-budget-mb", 1, "--max-new-tokens", 100)
    assert "KV cache exhausted" in err and "run with --kv-budget-mb" in err
    needed = int(err.split("run with --kv-budget-mb ")[1].split()[0])
    run("--engine", engine, "--prompt", "hello", "--kv-budget-mb", needed, "--max-new-tokens", 100)


@pytest.mark.parametrize("script", ["whiflash-run", "whiflash-build", "whiflash-serve", "whiflash-bench",
                                    "whiflash-train"])
def test_every_option_has_help_text(script):
    from whiflash_trt.bench.cli import parser as bench_parser
    from whiflash_trt.cli import build_parser, run_parser, serve_parser
    from whiflash_trt.train.cli import parser as train_parser

    out = subprocess.run([str(BIN / script), "--help"], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith(f"usage: {script}")
    parsers = {"whiflash-run": run_parser, "whiflash-build": build_parser, "whiflash-serve": serve_parser,
               "whiflash-bench": bench_parser, "whiflash-train": train_parser}[script]()
    for p in _with_subparsers(parsers):
        for action in p._actions:
            assert action.help, f"{script} {p.prog}: {action.option_strings or action.dest} has no help text"


def _with_subparsers(p) -> list:
    import argparse

    subs = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
    return [p] + [sp for a in subs for sp in a.choices.values()]


def test_run_names_what_runs_the_linears_in_its_json_stats_and_a_slow_bf16_path_in_one_line(spec_engine_dir):
    proc = run("--engine", spec_engine_dir, "--prompt", "abc def", "--max-new-tokens", 4, "--json", "--dtype", "bf16")
    compute = json.loads(proc.stdout)["stats"]["compute"]
    # this fp32 engine carries no kernels, so its bf16 run takes a path without them: said in one line
    assert compute.startswith(("oneDNN bf16 (", "bf16 widened to fp32 on MKL (")), compute
    notes = [line for line in proc.stderr.splitlines() if line.startswith("whiflash: linears on ")]
    assert notes == [f"whiflash: linears on {compute}"], proc.stderr
    fp32 = run("--engine", spec_engine_dir, "--prompt", "abc def", "--max-new-tokens", 4, "--json")
    assert json.loads(fp32.stdout)["stats"]["compute"] == "MKL fp32 (whiflash kernels not loaded)"
    assert "whiflash: linears on" not in fp32.stderr
