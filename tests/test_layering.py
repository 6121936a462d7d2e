"""The dependency rule of the package layout: models and spec build on config/errors only (models also on the
plugins' custom ops and the kernels), the kernels on nothing but spec (the torch formulation of an op off the
kernels), runtime does not reach into the builder, and nothing imports the CLI."""
from __future__ import annotations

import ast
from pathlib import Path

import whiflash_trt

PACKAGE = Path(whiflash_trt.__file__).parent


def imports(path: Path) -> set[str]:
    """Every whiflash_trt module a file imports (top-level or lazy), relative imports resolved."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) + 1 - node.level]) if node.level else ""
            name = ".".join(p for p in (base, node.module) if p)
            if name == "whiflash_trt" or node.module is None:  # `from whiflash_trt import config`, `from . import x`
                found |= {f"{name}.{alias.name}" for alias in node.names}
            else:
                found.add(name)
    return {m for m in found if m == "whiflash_trt" or m.startswith("whiflash_trt.")}


def test_package_layers_import_only_downwards():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 10
    problems = []
    for path in files:
        layer = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for m in imports(path):
            sub = m.split(".")[1] if "." in m else ""
            if sub == "cli" and layer != "cli":
                problems.append(f"{path.name}: imports {m} (nothing imports the CLI)")
            allowed = {"models": ("config", "errors", "plugins", "kernels", "models"),
                       "spec": ("config", "errors", "spec"), "kernels": ("kernels", "spec")}
            if layer in allowed and sub not in allowed[layer]:
                problems.append(f"{layer}/{path.name}: imports {m} ({layer} may use {', '.join(allowed[layer])})")
            if layer == "runtime" and sub == "builder":
                problems.append(f"runtime/{path.name}: imports {m} (runtime must not depend on the builder)")
    assert not problems, "\n".join(problems)


def test_runtime_has_no_import_cycle():
    """runtime/ modules import each other one way (engine -> batch -> round, never back), lazy imports included."""
    runtime = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p
               for p in (PACKAGE / "runtime").rglob("*.py")}
    graph = {m: {i for i in imports(p) if i in runtime and i != m} for m, p in runtime.items()}
    state: dict[str, str] = {}

    def cycle_from(m: str, path: list[str]) -> list[str] | None:
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                return path + [m, n]
            if n not in state and (found := cycle_from(n, path + [m])):
                return found
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = cycle_from(m, [])
            assert found is None, " -> ".join(found)
