"""Training prompt sources that install offline, each disjoint from what the benchmark uses.

Every prompt is a PromptRecord: a category (code, json, math, prose), its source, and chat messages. Disjointness:
- reasoning-gym: seeds >= 1000 only (the benchmark draws seeds < 1000);
- bfcl-eval: every subset except BFCL_v4_simple_python and BFCL_v4_multiple (the benchmark's);
- code: signatures + docstrings of Python standard-library functions and methods (never HumanEval);
- prose: questions about standard-library modules and functions, from their docstrings.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import json
import random
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

from whiflash_trt.errors import WhiflashError

CATEGORIES = ("code", "json", "math", "prose")
RG_MIN_SEED = 1000
BFCL_BENCHMARK_SUBSETS = ("BFCL_v4_simple_python", "BFCL_v4_multiple")
BFCL_TRAIN_SUBSETS = ("BFCL_v4_parallel", "BFCL_v4_parallel_multiple", "BFCL_v4_live_simple", "BFCL_v4_live_multiple",
                      "BFCL_v4_live_parallel", "BFCL_v4_live_parallel_multiple", "BFCL_v4_simple_java",
                      "BFCL_v4_simple_javascript")
RG_TASKS = ("gsm_symbolic", "basic_arithmetic", "chain_sum", "simple_equations", "fraction_simplification",
            "decimal_arithmetic", "leg_counting", "gcd", "lcm", "prime_factorization", "number_sorting",
            "word_sorting", "calendar_arithmetic", "time_intervals", "base_conversion")
# module -> the command that installs it (bfcl-eval with --no-deps: only its data files are read, and its declared
# dependencies are a long list of API clients)
PROMPT_PACKAGES = {"reasoning_gym": "pip install reasoning-gym==0.1.25",
                   "bfcl_eval": "pip install --no-deps bfcl-eval==2026.3.23"}


def require_prompt_packages() -> None:
    """Raise a WhiflashError naming the install command of every prompt package that is missing."""
    missing = [cmd for module, cmd in PROMPT_PACKAGES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise WhiflashError(f"training prompts need packages that are not installed: {' && '.join(missing)}")


@dataclass(frozen=True)
class PromptRecord:
    category: str
    source: str
    messages: tuple[dict, ...]

    def to_json(self) -> dict:
        return asdict(self) | {"messages": list(self.messages)}

    @classmethod
    def from_json(cls, d: dict) -> "PromptRecord":
        return cls(d["category"], d["source"], tuple(d["messages"]))


def _user(text: str, system: str | None = None) -> tuple[dict, ...]:
    return (({"role": "system", "content": system},) if system else ()) + ({"role": "user", "content": text},)


# ----- math: reasoning-gym ----------------------------------------------------------------------------------------
def math_prompts(n: int, seed: int) -> list[PromptRecord]:
    import reasoning_gym

    if seed < RG_MIN_SEED:
        raise ValueError(f"reasoning-gym seeds below {RG_MIN_SEED} are the benchmark's; got {seed}")
    per_task = -(-n // len(RG_TASKS))
    out = []
    for i, task in enumerate(RG_TASKS):
        data = reasoning_gym.create_dataset(task, size=per_task, seed=seed + i)
        for item in data:
            text = item["question"] + "\nExplain your reasoning step by step, then give the final answer."
            out.append(PromptRecord("math", f"reasoning-gym/{task}", _user(text)))
    random.Random(seed).shuffle(out)
    return out[:n]


# ----- json: bfcl-eval function calling ---------------------------------------------------------------------------
BFCL_SYSTEM = ("You are a function-calling assistant. Given the available functions (JSON schema) and the user's "
               "request, answer only with a JSON list of calls: "
               '[{"name": "<function>", "arguments": {"<param>": <value>, ...}}].')


def bfcl_dir() -> Path:
    require_prompt_packages()
    return Path(importlib.util.find_spec("bfcl_eval").origin).parent / "data"


def bfcl_prompt(record: dict) -> tuple[dict, ...]:
    turns = record["question"][0]
    question = "\n".join(t["content"] for t in turns if t.get("role") == "user")
    functions = json.dumps(record["function"], ensure_ascii=False)
    return _user(f"Available functions:\n{functions}\n\nRequest: {question}", BFCL_SYSTEM)


def json_prompts(n: int, seed: int) -> list[PromptRecord]:
    out = []
    for subset in BFCL_TRAIN_SUBSETS:
        assert subset not in BFCL_BENCHMARK_SUBSETS
        path = bfcl_dir() / f"{subset}.json"
        for line in path.read_text().splitlines():
            if line.strip():
                out.append(PromptRecord("json", f"bfcl-eval/{subset}", bfcl_prompt(json.loads(line))))
    random.Random(seed).shuffle(out)
    return out[:n]


# ----- code and prose: the Python standard library ----------------------------------------------------------------
def _documented(node) -> str | None:
    """The docstring of a public function worth a prompt (40-1200 characters), else None."""
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node)
    return doc if doc and 40 <= len(doc) <= 1200 else None


@functools.cache
def _stdlib_documented() -> tuple[tuple[tuple[str, str, str, str], ...], tuple[tuple[str, str, str, str], ...]]:
    """(functions, methods) of the standard library (tests and demos left out), each entry (kind, owner,
    signature, docstring): documented public top-level functions (owner: the module) and documented public methods
    of public classes (owner: module.Class). One parse of the library, cached."""
    root = Path(sysconfig.get_paths()["stdlib"])
    functions, methods = [], []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/[!_]*.py")):
        if any(part in ("test", "tests", "idlelib", "lib2to3", "site-packages", "turtledemo") for part in path.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in tree.body:
            if doc := _documented(node):
                functions.append(("function", module, f"def {node.name}({ast.unparse(node.args)}):", doc))
            elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                methods += [("method", f"{module}.{node.name}", f"def {m.name}({ast.unparse(m.args)}):", doc)
                            for m in node.body if (doc := _documented(m))]
    return tuple(functions), tuple(methods)


PROSE_TEMPLATES = (
    "In Python's `{module}` module, the function `{name}` is documented as:\n\"{doc}\"\nExplain in plain English "
    "what it does, when you would use it, and give a short example.",
    "What is the purpose of `{module}.{name}` in Python? Its documentation says: \"{doc}\" Describe it for a "
    "beginner.",
    "Write a short paragraph explaining this Python standard library function to a colleague: `{module}.{name}` "
    "- {doc}",
)


def code_and_prose_prompts(n_code: int, n_prose: int, seed: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    # Functions first, then methods, each shuffled on its own, and the role fixed by position (even: code, odd:
    # prose): a larger request keeps every prompt, and its role, of a smaller one, so a data folder can grow
    # without a function moving from a held-out prompt of one kind to a training prompt of the other.
    funcs, methods = map(list, _stdlib_documented())
    rng = random.Random(seed)
    rng.shuffle(funcs)
    random.Random(seed + 1).shuffle(methods)
    funcs += methods
    code, prose = [], []
    for i, (kind, module, sig, doc) in enumerate(funcs):
        if i % 2 == 0 and len(code) < n_code:
            body = doc.replace("\n", "\n    ")
            what = "Python function" if kind == "function" else f"method of the Python class `{module}`"
            text = f'Implement this {what} (standard-library style, with the docstring):\n\n{sig}\n    """{body}"""\n'
            code.append(PromptRecord("code", f"stdlib-code/{module}", _user(text)))
        elif i % 2 == 1 and len(prose) < n_prose:
            name = sig[4:sig.index("(")]
            first = doc.split("\n\n")[0].replace("\n", " ")
            text = PROSE_TEMPLATES[i % len(PROSE_TEMPLATES)].format(module=module, name=name, doc=first)
            prose.append(PromptRecord("prose", f"stdlib-doc/{module}", _user(text)))
    return code, prose


def build_prompts(per_category: int, seed: int) -> list[PromptRecord]:
    """A shuffled mix with `per_category` prompts of each category (fewer where a source has fewer)."""
    code, prose = code_and_prose_prompts(per_category, per_category, seed)
    records = math_prompts(per_category, RG_MIN_SEED + seed) + json_prompts(per_category, seed) + code + prose
    random.Random(seed).shuffle(records)
    return records
