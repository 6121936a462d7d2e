"""whiflash-bench: prompt sets, the losslessness checker, and an end-to-end run on a tiny random engine."""
from __future__ import annotations

import copy
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from whiflash_trt.bench.lossless import NEAR_TIE, check_lossless, first_difference
from whiflash_trt.bench.modes import BASE_MODES, base_mode, sweep_points
from whiflash_trt.bench.prompts import (CATEGORIES, COPY_CATEGORIES, SOURCE_CATEGORIES, builtin_set, load_prompts,
                                        prompt_set_digest)
from whiflash_trt.config import SpecConfig
from whiflash_trt.errors import WhiflashError

CATS = ",".join(CATEGORIES)


# ----- prompt sets ----------------------------------------------------------------------------------------------
def test_builtin_prompt_sets_are_versioned_and_complete():
    sizes = {c: len(load_prompts([c], None)) for c in CATEGORIES}
    assert sizes == {"code": 164, "math": 100, "json": 100, "chat": 80, "mix": 444, "edit": 47, "extract": 22,
                     "summarize": 22, "reformat": 24, "rewrite": 22}
    everything = load_prompts(None, None)
    assert len({p.id for p in everything}) == len(everything)
    assert prompt_set_digest(everything) == prompt_set_digest(load_prompts(None, None))
    assert all(p.prompt for p in everything)


def test_mix_interleaves_categories_without_repeating_the_first_prompts():
    mix = load_prompts(["mix"], 8)
    assert [p.id.split("/")[1] for p in mix[:4]] == ["HumanEval", "gsm_symbolic", "multiple_49", "mt_bench"]
    heads = {p.prompt for c in ("code", "math", "json", "chat") for p in load_prompts([c], 20)}
    assert not heads & {p.prompt for p in load_prompts(["mix"], 80)}


@pytest.mark.parametrize("category", COPY_CATEGORIES)
def test_copy_category_loads_at_least_20_prompts_with_unique_ids(category):
    prompts = builtin_set(category)
    assert len(prompts) >= 20 and len({p.id for p in prompts}) == len(prompts)
    assert all(p.category == category and p.source and p.prompt for p in prompts)


@pytest.mark.parametrize("category", SOURCE_CATEGORIES)
def test_make_bench_prompts_check_reproduces_the_committed_file(category):
    """Skipped where a source package is missing or at another version (the script's exit status 3)."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "make_bench_prompts.py"
    run = subprocess.run([sys.executable, str(script), "--check", category], capture_output=True, text=True)
    if run.returncode == 3:
        pytest.skip(run.stderr.strip())
    assert run.returncode == 0, run.stderr


def test_prompts_file_keeps_its_categories_and_rejects_unknown_ones(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a", "category": "x"}\n{"prompt": "b"}\n{"prompt": "c", "category": "x"}\n')
    assert [(p.category, p.prompt) for p in load_prompts(None, None, f)] == [("x", "a"), ("x", "c"), ("custom", "b")]
    assert [p.prompt for p in load_prompts(["x"], 1, f)] == ["a"]
    with pytest.raises(WhiflashError, match="unknown category"):
        load_prompts(["code"], None, f)


def test_sweep_points_skip_the_default_and_name_their_threshold():
    neural = base_mode("whiflash-neural", SpecConfig())
    points = sweep_points(neural, 0.0, None)
    assert [p.spec.threshold for p in points] == [-1.0, -0.5, 0.5, 1.0]
    assert points[0].name == "whiflash-neural@-1" and points[0].base == "whiflash-neural"
    entropy = sweep_points(base_mode("whiflash-entropy", SpecConfig()), 2.0, [1.0, 2.0, 3.0])
    assert [p.spec.threshold for p in entropy] == [1.0, 3.0]


def _run(prompt_id, mode, tokens, seconds, trace, catch_up=0.0):
    phases = {"route": 0.0, "drafter_prefill": 0.0, "catch_up": catch_up, "draft": 0.0,
              "verify": seconds / 2 - catch_up, "commit": 0.0}
    return {"prompt_id": prompt_id, "category": "code", "mode": mode, "stats": {
        "new_tokens": tokens, "seconds": seconds, "prefill_seconds": seconds / 2, "trace": trace,
        "switches": sum(a[0] != b[0] for a, b in zip(trace, trace[1:])), "catch_up_tokens": 0,
        "phase_seconds": phases}}


def test_summary_speedup_is_the_median_of_per_prompt_ratios_and_tau_is_per_round():
    from whiflash_trt.bench.summary import summarize

    records = [_run("a", "ar", 10, 1.0, [["none", 1]] * 10), _run("b", "ar", 10, 2.0, [["none", 1]] * 10),
               _run("c", "ar", 10, 4.0, [["none", 1]] * 10),
               _run("a", "dflash", 10, 0.5, [["dflash", 4], ["dflash", 6]], catch_up=0.05),     # 2x
               _run("b", "dflash", 10, 0.5, [["dflash", 10]]),                                   # 4x
               _run("c", "dflash", 10, 8.0, [["eagle3", 1]] * 5 + [["dflash", 5]])]             # 0.5x
    cell = summarize(records)["code"]["dflash"]
    assert cell["speedup"] == 2.0
    assert cell["tau"] == pytest.approx(30 / 9, abs=1e-4)
    assert cell["round_share"] == {"dflash": pytest.approx(4 / 9, abs=1e-4), "eagle3": pytest.approx(5 / 9, abs=1e-4)}
    assert cell["switches_per_100_tokens"] == pytest.approx(100 / 30, abs=1e-3)
    assert cell["switching_overhead"] == pytest.approx(0.05 / 4.5, abs=1e-4)


# ----- lossless checker on synthetic records --------------------------------------------------------------------
def _records(ar_tokens, mode_tokens, mode="eagle3"):
    return [{"prompt_id": "p", "category": "code", "mode": "ar", "token_ids": ar_tokens},
            {"prompt_id": "p", "category": "code", "mode": mode, "token_ids": mode_tokens}]


def _peaked_logits(winner: int, runner_up: int, gap: float, vocab: int = 10):
    def fn(ids):
        logits = torch.zeros(vocab)
        logits[winner], logits[runner_up] = 5.0, 5.0 - gap
        return logits
    return fn


def test_first_difference_covers_token_and_length_mismatches():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 9, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_lossless_check_accepts_a_flip_at_a_near_tie():
    report = check_lossless(_records([1, 2, 3], [1, 4, 3]), {"p": [0]}, _peaked_logits(2, 4, 0.01), 0.25)
    (d,) = report["divergences"]
    assert d["position"] == 1 and d["near_tie"] and d["top2_gap"] == pytest.approx(0.01)
    assert report["bugs"] == 0 and report["by_mode"]["eagle3"]["code"]["exact_match_rate"] == 0.0


def test_lossless_check_flags_a_flip_far_from_a_tie():
    report = check_lossless(_records([1, 2, 3], [1, 4, 3]), {"p": [0]}, _peaked_logits(2, 4, 3.0), 0.25)
    assert report["bugs"] == 1 and not report["divergences"][0]["near_tie"]


def test_lossless_check_is_exact_by_default_in_bf16_and_fp32():
    """bf16 and fp32 target rows are bit-identical in every verify shape: even a flip at an exact tie is a bug."""
    assert NEAR_TIE["bf16"] == NEAR_TIE["fp32"] == 0
    report = check_lossless(_records([1, 2, 3], [1, 4, 3]), {"p": [0]}, _peaked_logits(2, 4, 0.0), NEAR_TIE["bf16"])
    assert report["bugs"] == 1 and not report["divergences"][0]["near_tie"]


def test_lossless_check_counts_a_failed_run_as_a_bug():
    records = _records([1, 2], [1, 2])
    records[1] = {k: v for k, v in records[1].items() if k != "token_ids"} | {"error": "IndexError: boom"}
    report = check_lossless(records, {"p": [0]}, _peaked_logits(1, 2, 1.0), 0.25)
    assert report["bugs"] == 1 and report["errors"][0]["error"] == "IndexError: boom"


# ----- end to end on a tiny random engine -----------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A 64-wide model gains nothing from a second thread, and on a loaded 2-core machine OpenMP barriers make each
    tiny matmul ~100x slower with two threads than with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def bench_run(bench_engine_dir, tmp_path_factory):
    from whiflash_trt.bench.cli import main

    out = tmp_path_factory.mktemp("bench-out")
    # fp32: speculative output must then equal target-only output token for token. Eager catch-up: see
    # test_lazy_catch_up_survives_a_first_switch for the lazy default.
    rc = main(["--engine", str(bench_engine_dir), "--categories", CATS, "--modes", ",".join(BASE_MODES),
               "--num-prompts", "2", "--max-new-tokens", "8", "--dtype", "fp32", "--catch-up", "eager",
               "--threshold-sweep", "--entropy-thresholds", "1", "--neural-thresholds", "-0.5", "--oracle",
               "--out", str(out), "--no-progress"])
    return rc, out, json.loads((out / "results.json").read_text())


def test_bench_writes_results_json_with_every_section(bench_run):
    rc, _, results = bench_run
    assert rc == 0
    for key in ("command_line", "options", "environment", "engine", "prompts", "modes", "summary", "lossless",
                "threshold_sweep", "oracle", "goals", "records", "plots"):
        assert key in results, key
    assert len(results["engine"]["manifest_sha256"]) == 64
    assert results["environment"]["versions"]["torch"] == torch.__version__
    assert len(results["records"]) == len(CATEGORIES) * 2 * (len(BASE_MODES) + 2)
    for cat in CATEGORIES:
        for mode in BASE_MODES:
            cell = results["summary"][cat][mode]
            assert cell["num_prompts"] == 2 and cell["errors"] == 0
            assert cell["tau"] >= 1.0 and cell["tokens_per_s"] > 0 and cell["speedup"] > 0
            assert set(cell["phase_share"]) == {"route", "drafter_prefill", "catch_up", "draft", "verify", "commit"}
    assert results["summary"]["code"]["ar"]["tau"] == 1.0
    assert {p["mode"] for p in results["threshold_sweep"]["whiflash-neural"]} == {"whiflash-neural",
                                                                                  "whiflash-neural@-0.5"}
    # The fixture's router routes to both learned drafters (and the suffix drafter's offers win some rounds), so the
    # losslessness check covers switching.
    assert {"eagle3", "dflash"} <= set(results["summary"]["all"]["whiflash-neural"]["round_share"]) <= {
        "eagle3", "dflash", "suffix", "none"}


def test_bench_times_the_roofline_beside_every_prompt(bench_run):
    """Each prompt's records carry the plain read timed just before them; a cell's x roofline is the median over its
    prompts of decode rate / that prompt's limit (one step's bytes at its read rate)."""
    results = bench_run[2]
    step_bytes = results["roofline"]["bytes"]["total"]
    by_prompt = {}
    for r in results["records"]:
        assert r["read_gbs"] > 0
        by_prompt.setdefault(r["prompt_id"], set()).add(r["read_gbs"])
    assert all(len(reads) == 1 for reads in by_prompt.values())   # one read per prompt, shared by its modes
    for cat in CATEGORIES:
        records = [r for r in results["records"] if r["category"] == cat and r["mode"] == "ar"]
        limits = sorted(r["read_gbs"] * 1e9 / step_bytes for r in records)
        cell = results["summary"][cat]["ar"]
        assert cell["roofline_tokens_per_s"] == pytest.approx(sum(limits) / 2, rel=1e-3)   # the median of two
        ratios = [(r["stats"]["new_tokens"] - 1) / (r["stats"]["seconds"] - r["stats"]["prefill_seconds"])
                  / (r["read_gbs"] * 1e9 / step_bytes) for r in records]
        assert cell["x_roofline"] == pytest.approx(sum(ratios) / 2, abs=1e-4)   # kept to 4 digits


def test_bench_modes_run_interleaved_in_rotating_order(bench_run):
    records = bench_run[2]["records"]
    firsts = [r["mode"] for r in records if r["order"] == 0]
    assert len(set(firsts[:len(BASE_MODES)])) == len(BASE_MODES)


def test_bench_every_mode_matches_ar_on_the_tiny_engine_in_fp32(bench_run):
    lossless = bench_run[2]["lossless"]
    assert lossless["bugs"] == 0 and not lossless["divergences"]
    for cells in lossless["by_mode"].values():
        assert all(c["exact_match_rate"] == 1.0 for c in cells.values())


def test_bench_results_md_has_the_tables(bench_run):
    md = (bench_run[1] / "results.md").read_text()
    for heading in ("## Acceptance and speed", "## Routing and switching", "## Time per phase",
                    "## Losslessness", "## Oracle headroom", "## Router threshold sweep", "## Goals"):
        assert heading in md
    for cat in CATEGORIES:
        for mode in BASE_MODES:
            assert f"| {cat} | {mode} |" in md


def test_oracle_replay_reproduces_the_static_runs_and_its_dp_beats_brute_force(bench_run):
    from test_oracle import _brute_force

    from whiflash_trt.bench.oracle import CHOICES, STATIC, replay, solve

    results = bench_run[2]
    oracle = results["oracle"]
    costs = oracle["round_seconds"]
    assert set(costs) == set(CHOICES) and all(c > 0 for c in costs.values())
    runs = {(r["prompt_id"], r["mode"]): r for r in results["records"]}
    for p in oracle["prompts"]:
        acc = p["accepted"]
        assert p["new_tokens"] == len(runs[(p["prompt_id"], "ar")]["token_ids"])
        assert all(len(a) == p["new_tokens"] - 1 for a in acc.values())
        # The replayed drafters accept what the engine's own static runs accepted, round by round (fp32).
        for choice in ("eagle3", "dflash"):
            trace = [t for _, t in runs[(p["prompt_id"], STATIC[choice])]["stats"]["trace"]]
            walked = replay(acc, costs, lambda i, c=choice: c)
            i, taus = 0, []
            for _ in walked.choices:
                taus.append(acc[choice][i] + 1)
                i += taus[-1]
            assert taus[:-1] == trace[:len(taus) - 1] and taus[-1] <= trace[len(taus) - 1]
        # Same costs: the oracle is the brute-force optimum and no static mode beats it.
        assert p["seconds"] == pytest.approx(_brute_force(acc, costs)) == pytest.approx(solve(acc, costs).seconds)
        assert all(p["seconds"] <= s + 1e-12 for s in p["static_seconds"].values())
        # Without skipping: between the full oracle and the better drafter replayed alone.
        assert p["seconds"] - 1e-12 <= p["drafters_only_seconds"]
        assert p["drafters_only_seconds"] <= min(p["static_seconds"][m] for m in ("eagle3", "dflash")) + 1e-12
    for cat, cell in oracle["categories"].items():
        assert sum(cell["round_share"].values()) == pytest.approx(1.0)
        assert all(cell["decode_tokens_per_s"] >= t for t in cell["replayed_decode_tokens_per_s"].values())
        assert cell["gain_over_best_replayed"] >= max(1.0, cell["drafters_only_gain"] - 1e-3)
        assert set(cell["measured_tokens_per_s"]) >= set(BASE_MODES)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_bench_plots_are_valid_pngs(bench_run):
    from PIL import Image

    _, out, results = bench_run
    assert set(results["plots"]) == {"tau.png", "speedup.png", "trace.png", "threshold_sweep.png"}
    for name in results["plots"]:
        w, h = _png_size(out / name)
        assert w > 100 and h > 100
        with Image.open(out / name) as img:
            img.verify()


def test_lossless_check_flags_a_corrupted_mode(bench_run, bench_engine_dir):
    from whiflash_trt.runtime.engine import Engine

    engine = Engine.load(bench_engine_dir)
    records = copy.deepcopy([r for r in bench_run[2]["records"] if r["category"] == "code"])
    victim = next(r for r in records if r["mode"] == "dflash" and len(r["token_ids"]) > 3)
    ids = {r["prompt_id"]: engine.encode(p.prompt, chat=True) for r in records
           for p in load_prompts(["code"], 2) if p.id == r["prompt_id"]}
    # The test double: replace one token by the target's LEAST likely token there.
    logits = engine.target_logits
    pos = 2
    victim["token_ids"][pos] = int(logits(ids[victim["prompt_id"]] + victim["token_ids"][:pos]).argmin())
    report = check_lossless(records, ids, logits, tolerance=1e-3)
    assert report["bugs"] == 1
    (d,) = report["divergences"]
    assert (d["mode"], d["prompt_id"], d["position"], d["near_tie"]) == ("dflash", victim["prompt_id"], pos, False)
    assert d["mode_deficit"] > d["top2_gap"] >= 0


def test_lazy_catch_up_survives_a_first_switch(bench_engine_dir, tmp_path):
    """The default (lazy) catch-up, with a router that uses both drafters: no run may fail."""
    from whiflash_trt.bench.cli import main

    rc = main(["--engine", str(bench_engine_dir), "--categories", "chat", "--modes", "ar,whiflash-neural",
               "--num-prompts", "1", "--max-new-tokens", "16", "--dtype", "fp32", "--out", str(tmp_path),
               "--no-progress", "--warmup", "0"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, results["lossless"]["errors"]


def test_bench_cli_rejects_an_unknown_category(bench_engine_dir, tmp_path, capsys):
    from whiflash_trt.bench.cli import main

    assert main(["--engine", str(bench_engine_dir), "--categories", "poetry", "--out", str(tmp_path)]) == 2
    assert "unknown category" in capsys.readouterr().err


def test_bench_dflash_tree_budget_reaches_the_dflash_mode_and_stays_lossless(bench_engine_dir, tmp_path):
    from whiflash_trt.bench.cli import main

    rc = main(["--engine", str(bench_engine_dir), "--categories", "code", "--modes", "ar,dflash",
               "--num-prompts", "1", "--max-new-tokens", "12", "--dtype", "fp32", "--out", str(tmp_path),
               "--no-progress", "--warmup", "0", "--dflash-tree-total-tokens", "10", "--dflash-tree-top-k", "3",
               "--dflash-tree-min-prob", "0.1"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert rc == 0, results["lossless"]
    assert results["modes"]["dflash"]["dflash_tree"] == {"total_tokens": 10, "top_k": 3, "min_prob": 0.1}
