"""Benchmark prompt sets: versioned files under bench/data (made by scripts/make_bench_prompts.py), or a user's file.

Categories and sources (disjoint from the drafter training data; the script's docstring has the details):
    code  HumanEval problems          math  reasoning-gym gsm_symbolic, generator seeds 0..99
    json  bfcl-eval simple_python / multiple as tool-call requests    chat  MT-Bench first turns
    mix   round-robin over code, math, json, chat, each taken from the END of its list, so a run of N <= half a
          set per category measures different prompts in mix than in the single categories
Categories where the answer copies from the request (a prompt-lookup drafter's ground), mix and held-out left out:
    edit       more-itertools functions, each with a stated change, answered with the whole modified function
    extract    a boltons docstring and a question answered by quoting it
    summarize  a boltons docstring to summarize
    reformat   palmerpenguins rows to JSON, JSON with renamed keys, or a tool call whose arguments are in the request
    rewrite    a first answer (a boltons docstring) quoted in the message, and a request to rewrite it
Every prompt is a user message (rewrite's second turn quotes the first answer rather than being a second turn);
the harness wraps it in the target's chat template.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from whiflash_trt.errors import WhiflashError
from whiflash_trt.prompt_lines import parse_prompt_lines

DATA_DIR = Path(__file__).resolve().parent / "data"
# mix and the held-out prompts draw from these four only, as before the copy categories came: their numbers stay
# comparable with older runs
MIX_CATEGORIES = ("code", "math", "json", "chat")
COPY_CATEGORIES = ("edit", "extract", "summarize", "reformat", "rewrite")
SOURCE_CATEGORIES = MIX_CATEGORIES + COPY_CATEGORIES   # one file each under bench/data
CATEGORIES = MIX_CATEGORIES + ("mix",) + COPY_CATEGORIES
HELD_OUT_FROM = 10   # the tools' held-out prompts start here in each set (the headline bench runs 5)


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    source: str
    prompt: str           # the user message (before the chat template)


def read_jsonl(path: Path, default_category: str | None = None) -> list[BenchPrompt]:
    """One JSON object per line: "prompt" (required), "id", "category", "source" (optional)."""
    return [BenchPrompt(id=str(record.get("id", f"{Path(path).stem}/{n}")),
                        category=str(record.get("category") or default_category or "custom"),
                        source=str(record.get("source", Path(path).name)), prompt=record["prompt"])
            for n, record in parse_prompt_lines(Path(path).read_text().splitlines(), str(path), non_empty=True)]


def builtin_set(category: str) -> list[BenchPrompt]:
    if category not in SOURCE_CATEGORIES:
        raise WhiflashError(f"unknown category {category!r}; expected one of {', '.join(CATEGORIES)}")
    return read_jsonl(DATA_DIR / f"{category}.jsonl", default_category=category)


def held_out_prompts(num_prompts: int, skip: int = HELD_OUT_FROM) -> list[BenchPrompt]:
    """Prompts skip .. skip + num_prompts - 1 of each of MIX_CATEGORIES, category by category: for tools that measure
    or tune outside the benchmark, which runs the first prompts of each set."""
    return [p for c in MIX_CATEGORIES for p in builtin_set(c)[skip:skip + num_prompts]]


def add_held_out_options(parser: argparse.ArgumentParser) -> None:
    """The options of the scripts that measure on held_out_prompts."""
    parser.add_argument("--num-prompts", type=int, default=5, help="prompts per category")
    parser.add_argument("--skip", type=int, default=HELD_OUT_FROM, help="first prompts of each category, left to "
                        "the benchmark")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)


def mix_set(sets: dict[str, list[BenchPrompt]]) -> list[BenchPrompt]:
    """Round-robin over MIX_CATEGORIES, each read from the end of its list."""
    out = []
    for i in range(max(len(sets[name]) for name in MIX_CATEGORIES)):
        for name in MIX_CATEGORIES:
            items = sets[name]
            if i < len(items):
                p = items[len(items) - 1 - i]
                out.append(BenchPrompt(id=f"mix/{p.id}", category="mix", source=p.source, prompt=p.prompt))
    return out


def load_prompts(categories: list[str] | None, num_prompts: int | None,
                 prompts_file: Path | None = None) -> list[BenchPrompt]:
    """The first `num_prompts` of each requested category (all categories of the source when None)."""
    if num_prompts is not None and num_prompts <= 0:
        raise WhiflashError(f"--num-prompts must be positive, got {num_prompts}")
    if prompts_file is not None:
        pool = read_jsonl(prompts_file)
        available = list(dict.fromkeys(p.category for p in pool))
        by_cat = {c: [p for p in pool if p.category == c] for c in available}
    else:
        available = list(CATEGORIES)
        by_cat = {c: builtin_set(c) for c in SOURCE_CATEGORIES}
        by_cat["mix"] = mix_set(by_cat)
    wanted = categories or available
    unknown = [c for c in wanted if c not in by_cat]
    if unknown:
        raise WhiflashError(f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                            f"this prompt source has {', '.join(available)}")
    prompts = [p for c in wanted for p in by_cat[c][:num_prompts]]
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise WhiflashError(f"prompt id {p.id!r} occurs twice; ids must be unique")
        seen.add(p.id)
    return prompts


def prompt_set_digest(prompts: list[BenchPrompt]) -> str:
    """sha256 over (id, category, prompt): two runs with the same digest measured the same work."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(json.dumps([p.id, p.category, p.prompt]).encode())
    return h.hexdigest()
