"""The code keeps its layers: every import between the project's packages follows the rule
below, the import graph has no circle, no product module is over 700 lines, and a product
module imports the project at its top (a function-local import of a project module says why on
its line, ``# lazy: ...``). Everything is computed from the code; a new package has to be given
its rule here before its first import counts."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("megaslide_ray", "actors", "kernels", "pipelines")
"""The product's top-level packages (``benchmarks`` and ``tests`` may import any of them)."""

M = "megaslide_ray."
BASE = {M + "config", M + "runtime"}
MODEL = BASE | {"kernels", M + "models"}
BELOW_ACTORS = MODEL | {M + "data", M + "training", M + "state"}
LAYERS: dict[str, set[str]] = {
    # package: the packages its modules may import (besides itself), bottom up
    "kernels": set(),
    M + "config": set(),
    M + "runtime": set(),
    M + "models": {M + "config", "kernels"},
    M + "data": BASE,
    M + "training": {M + "config", M + "models"},
    M + "state": {M + "config", M + "models"},
    M + "planning": {M + "config", M + "models", "kernels"},
    "actors": BELOW_ACTORS,
    "pipelines": BELOW_ACTORS | {"actors"},
    M + "evaluation": BELOW_ACTORS | {"actors"},
    M + "trainer": BELOW_ACTORS | {"actors", "pipelines", M + "evaluation"},
    "megaslide_ray": BELOW_ACTORS | {"actors", "pipelines", M + "evaluation", M + "trainer", M + "planning"},
    "benchmarks": {"*"},
}
"""The layer rule. ``megaslide_ray`` itself is the command-line layer (``python -m megaslide_ray.NAME``:
parse, then call the library), the top of the stack. ``benchmarks`` may import anything."""

MAX_LINES = 700


def modules(root: Path = ROOT, tops=(*PRODUCT, "benchmarks")) -> dict[str, Path]:
    out = {}
    for top in tops:
        for f in sorted((root / top).rglob("*.py")):
            parts = f.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = f
    return out


def package_of(module: str, is_pkg: bool, rules: dict) -> str | None:
    """The longest package name in ``rules`` that holds ``module`` (a package's own
    ``__init__`` belongs to it)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in rules and (n < len(parts) or is_pkg or cand == module and n == 1):
            return cand
    return None


def imports(name: str, path: Path, mods: dict[str, Path]):
    """(imported project module, line, function-local?, line text) for every import of ``name``."""
    tree = ast.parse(path.read_text())
    lines = path.read_text().splitlines()
    is_pkg = path.name == "__init__.py"
    out = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: not imported when the code runs
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = ([a.name for a in child.names] if isinstance(child, ast.Import)
                           else [f"{resolve(child)}.{a.name}" for a in child.names])
                for t in targets:
                    while t and t not in mods:
                        t = t.rpartition(".")[0]
                    if t and t != name:
                        out.append((t, child.lineno, local, lines[child.lineno - 1]))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out


def violations(root: Path = ROOT, rules: dict = LAYERS, tops=(*PRODUCT, "benchmarks"),
               product=PRODUCT) -> dict[str, list[str]]:
    """Every problem found, by kind: ``unruled`` (a module no rule covers), ``layer`` (an import
    the rule forbids), ``cycle`` (a circle of module imports), ``local`` (a function-local import of
    a project module without ``# lazy:``), ``long`` (a product module over ``MAX_LINES``)."""
    mods = modules(root, tops)
    found = {"unruled": [], "layer": [], "cycle": [], "local": [], "long": []}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        pkg = package_of(name, path.name == "__init__.py", rules)
        if pkg is None:
            found["unruled"].append(f"{name}: no package of LAYERS holds it; give its package a rule")
            continue
        in_product = name.split(".")[0] in product
        if in_product and len(path.read_text().splitlines()) > MAX_LINES:
            found["long"].append(f"{name}: {len(path.read_text().splitlines())} lines (at most {MAX_LINES})")
        for target, line, local, text in imports(name, path, mods):
            graph[name].add(target)
            tpkg = package_of(target, mods[target].name == "__init__.py", rules)
            allowed = rules[pkg]
            if tpkg != pkg and "*" not in allowed and tpkg not in allowed:
                found["layer"].append(f"{path.relative_to(root)}:{line}: {pkg} imports {target} ({tpkg}), "
                                      f"which is not below it")
            if in_product and local and "# lazy:" not in text:
                found["local"].append(f"{path.relative_to(root)}:{line}: function-local import of {target} "
                                      f"(import it at the top, or say on the line why not: '# lazy: ...')")
    found["cycle"] = [" -> ".join(c) for c in cycles(graph)]
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


@pytest.fixture(scope="module")
def found():
    return violations()


@pytest.mark.parametrize("kind", ["unruled", "layer", "cycle", "local", "long"])
def test_the_code_keeps_its_layers(found, kind):
    assert not found[kind], f"{len(found[kind])} {kind} problem(s):\n  " + "\n  ".join(found[kind])


def test_the_checker_finds_each_kind_of_problem(tmp_path):
    """The rule can fail: a small tree with one problem of each kind."""
    def write(rel, text):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)

    write("low/__init__.py", "")
    write("low/a.py", "import high.b\n")                     # layer: low may not import high
    write("high/__init__.py", "")
    write("high/b.py", "import high.c\n")
    write("high/c.py", "def f():\n    import high.b\n" + "x = 1\n" * (MAX_LINES + 1))  # circle, local, long
    write("stray/__init__.py", "")                           # no rule
    tops = ("low", "high", "stray")
    got = violations(tmp_path, {"low": set(), "high": {"low"}}, tops=tops, product=tops)
    assert any("low imports high.b" in v for v in got["layer"]), got
    assert any("high.b" in c and "high.c" in c for c in got["cycle"]), got
    assert any("function-local import of high.b" in v for v in got["local"]), got
    assert any(v.startswith("high.c:") for v in got["long"]), got
    assert any(v.startswith("stray") for v in got["unruled"]), got
