"""The repository keeps its layers: every folder is assigned (a package to a layer, any other
folder to ``FOLDERS``), every import between the project's packages follows ``LAYERS``, every
``importlib.import_module`` / ``__import__`` / ``spec_from_file_location`` call is listed in
``DYNAMIC``, no module imports another in a circle (benchmarks and tests included), no product
module is over 700 lines, and a product module imports the project at its top (a function-local
import of a project module says why on its line, ``# lazy: ...``). Everything is computed from
the code; a checker that meets a folder, a package or a dynamic import it does not know fails."""

from __future__ import annotations

import ast
import fnmatch
import functools
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("megaslide_ray", "actors", "kernels", "pipelines")
"""The product's top-level packages (the local-import and module-length rules hold there)."""

M = "megaslide_ray."
BASE = {M + "config", M + "runtime"}
BELOW_ACTORS = BASE | {"kernels", M + "models", M + "data", M + "training", M + "state"}
LAYERS: dict[str, tuple[set[str], str]] = {
    # package: (the packages its modules may import besides itself, why that is the rule), bottom up
    "kernels": (set(), "the operator stands alone: its tests and the GPU check run it without the trainer"),
    M + "config": (set(), "every layer reads the configuration, so it reads nothing of the project"),
    M + "runtime": (set(), "fault points and Ray metrics are called from every process; they know no layer"),
    M + "models": ({M + "config", "kernels"}, "a model is built from its config and calls the attention kernels; "
                   "it does not know how its weights are placed or streamed"),
    M + "data": (BASE, "clips, manifests and data sets need no model of this project: a decoder process builds none"),
    M + "training": ({M + "config", M + "models"}, "the objective and AdamW act on a model's outputs and shards"),
    M + "state": ({M + "config", M + "models"}, "state and checkpoints are laid out by the model's shards"),
    M + "planning": ({M + "config", M + "models", "kernels"}, "the planner counts from the config, the shard "
                     "layout and the kernels' scratch, and runs nothing"),
    "actors": (BELOW_ACTORS, "the actors are plain classes over the library; they know nothing of Ray's wiring"),
    "pipelines": (BELOW_ACTORS | {"actors"}, "the wiring makes the actors remote; the actors never see it"),
    M + "evaluation": (BELOW_ACTORS | {"actors"}, "sampling and validation stream through the compute actor's class"),
    M + "driver": (BELOW_ACTORS | {"actors", "pipelines", M + "evaluation"}, "the loop drives the pipeline and "
                    "the evaluations"),
    "megaslide_ray": (BELOW_ACTORS | {"actors", "pipelines", M + "evaluation", M + "driver", M + "planning"},
                      "the command lines (python -m megaslide_ray.NAME) parse, then call the library: the top"),
    "benchmarks": ({"*"}, "benchmarks measure the product; nothing of the product imports them"),
    "benchmarks.gpu_check": ({"*"}, "the GPU check measures the product; nothing of the product imports it"),
    "benchmarks.studies": ({"*"}, "the studies train and score the product; nothing of the product imports them"),
    "tests": ({"*"}, "the tests reach every layer; nothing imports them"),
}
"""The layer rule, package by package: the same table is written down, with its reasons, in
docs/architecture.md ("The layer rule"), and a test holds the two equal."""

FOLDERS: dict[str, str] = {
    "docs": "the documentation pages: no code",
    ".ci": "the CI script (bash): no Python",
}
"""Folders that are not packages, and why; they may hold no Python file."""

DYNAMIC: dict[str, tuple[dict[str, tuple[str, ...]], str]] = {
    # module: ({first argument of the call, as written: project modules it can import}, why)
    "kernels": ({'f"{__name__}.dsa_triton"': ("kernels.dsa_triton",)},
                "the Triton kernels load on first use: triton may be absent or broken, and the reference still runs"),
    M + "__main__": ({"COMMANDS[name][0]": ("megaslide_ray.*",)},
                     "`megaslide NAME` imports only the chosen command's module"),
    "tests.test_dsa": ({'"kernels.dsa_cpu"': ("kernels.dsa_cpu",)},
                       "the module, which the package's function of the same name hides"),
    "tests.test_entry_points": ({"module": ("megaslide_ray.*",), "m": ("megaslide_ray.*",), "n": ("benchmarks.*",),
                                 '"kernels"': ()}, "each documented command's module, by name; a foreign `kernels`"),
    "tests.test_latents": ({'"sys"': ()}, "sys.modules, to hide diffusers"),
}
"""Every import by name at run time, with what it can import (``PKG.*``: any module of PKG), which
counts in the layer rule and the circle search like a written import."""

DYNAMIC_CALLS = ("import_module", "__import__", "spec_from_file_location")
MAX_LINES = 700

SKIP = ("__pycache__", ".git", ".pytest_cache", ".ruff_cache", ".venv", "*.egg-info")


def tree_files(root: Path) -> list[Path]:
    """The repository's files, relative to ``root``: git's tracked and untracked-but-not-ignored
    files where ``root`` is a git checkout (so a new folder counts before its first commit),
    else every file outside the usual caches and what ``.gitignore`` names."""
    if (root / ".git").exists():
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "-z"],
                             capture_output=True, text=True, check=True).stdout
        return sorted(Path(p) for p in out.split("\0") if p and (root / p).is_file())
    ignore = (root / ".gitignore").read_text().split() if (root / ".gitignore").is_file() else []
    skip = (*SKIP, *(pattern.strip("/") for pattern in ignore if not pattern.startswith("#")))
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file()
                  and not any(fnmatch.fnmatch(part, s) for part in p.relative_to(root).parts for s in skip))


def modules(root: Path, files: list[Path], rules: dict) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file in a folder ``rules`` holds."""
    out = {}
    for f in files:
        if f.suffix == ".py" and ".".join(f.parent.parts) in rules:
            parts = f.with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = root / f
    return out


def package_of(module: str, path: Path) -> str:
    """The package a module belongs to: itself for a package's ``__init__``, else its folder."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def unassigned(files: list[Path], rules: dict, folders: dict) -> list[str]:
    """Every folder that neither ``rules`` nor ``folders`` names, every Python file in a
    ``folders`` folder, every module at the top of the repository."""
    out = []
    for d in sorted({f.parent for f in files} - {Path(".")}):
        if ".".join(d.parts) not in rules and d.as_posix() not in folders:
            out.append(f"{d.as_posix()}/: a folder no rule names; give it a layer in LAYERS (a package, with "
                       f"the packages it may import and why) or a line in FOLDERS (no code, and why)")
    for f in files:
        if f.suffix == ".py" and (f.parent == Path(".") or f.parent.as_posix() in folders):
            out.append(f"{f.as_posix()}: a Python file outside every package of LAYERS")
    return out


def _targets(t: str, mods: dict[str, Path]) -> list[str]:
    """The modules a listed dynamic target names (``PKG.*``: every module of PKG)."""
    if t.endswith(".*"):
        return [m for m, p in mods.items() if package_of(m, p) == t[:-2] and m != t[:-2]]
    return [t]


def imports(name: str, path: Path, mods: dict[str, Path], dynamic: dict):
    """(imported project module, line, function-local?, line text) for every import of ``name``,
    written or listed in ``dynamic``; and the problems of its dynamic imports."""
    source = path.read_text()
    tree, lines = _parsed(source), source.splitlines()
    is_pkg = path.name == "__init__.py"
    script_dir = not (path.parent / "__init__.py").exists()  # a folder pytest puts on sys.path (tests/)
    listed = {_normal(k): v for k, v in dynamic.get(name, ({}, ""))[0].items()}
    out, problems = [], []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        base = base[:len(base) - node.level + 1]
        return ".".join(base + ([node.module] if node.module else []))

    def project_module(t: str) -> str | None:
        folder = name.rpartition(".")[0]
        if script_dir and f"{folder}.{t.split('.')[0]}" in mods:  # a sibling module, imported by its bare name
            t = f"{folder}.{t}"
        while t and t not in mods:
            t = t.rpartition(".")[0]
        return t if t and t != name else None

    def visit(node, local):
        for child in ast.iter_child_nodes(node):
            # An import under ``if TYPE_CHECKING:`` counts too: an annotation that names a module is a
            # dependency on it, and a circle through one is still a circle for the reader.
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = ([a.name for a in child.names] if isinstance(child, ast.Import)
                           else [f"{resolve(child)}.{a.name}" for a in child.names])
                for t in filter(None, map(project_module, targets)):
                    out.append((t, child.lineno, local, lines[child.lineno - 1]))
            elif isinstance(child, ast.Call) and _dynamic_call(child):
                arg = ast.unparse(child.args[0]) if child.args else ""
                if arg not in listed:
                    problems.append(f"{path.name}:{child.lineno}: {ast.unparse(child.func)}({arg}) is not listed "
                                    f"in DYNAMIC (list it with the modules it can import and why)")
                for t in (m for target in listed.get(arg, ()) for m in _targets(target, mods)):
                    if t != name:
                        out.append((t, child.lineno, local, "# lazy: listed in DYNAMIC"))
            visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return out, problems


@functools.lru_cache(maxsize=None)
def _parsed(source: str) -> ast.Module:
    """``ast.parse`` once per text: the checks below parse a copy of the tree whose files are this one's."""
    return ast.parse(source)


def _normal(source: str) -> str:
    return ast.unparse(ast.parse(source, mode="eval").body)


def _dynamic_call(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Name) and f.id in DYNAMIC_CALLS) or (isinstance(f, ast.Attribute)
                                                                   and f.attr in DYNAMIC_CALLS)


KINDS = ("unassigned", "layer", "dynamic", "cycle", "local", "long")


def violations(root: Path = ROOT, rules: dict = LAYERS, folders: dict = FOLDERS, dynamic: dict = DYNAMIC,
               product=PRODUCT) -> dict[str, list[str]]:
    """Every problem found, by kind: ``unassigned`` (a folder or file no rule covers), ``layer`` (an
    import the rule forbids), ``dynamic`` (an import by name that ``dynamic`` does not list, or a
    listed module that does none), ``cycle`` (a circle of module imports), ``local`` (a
    function-local import of a project module without ``# lazy:``), ``long`` (a product module
    over ``MAX_LINES``)."""
    files = tree_files(root)
    mods = modules(root, files, rules)
    found = {k: [] for k in KINDS}
    found["unassigned"] = unassigned(files, rules, folders)
    found["dynamic"] = [f"{m}: listed in DYNAMIC, but no such module" for m in dynamic if m not in mods]
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        pkg = package_of(name, path)
        in_product = name.split(".")[0] in product
        n_lines = len(path.read_text().splitlines())
        if in_product and n_lines > MAX_LINES:
            found["long"].append(f"{name}: {n_lines} lines (at most {MAX_LINES})")
        found_imports, problems = imports(name, path, mods, dynamic)
        found["dynamic"] += [f"{path.parent.relative_to(root).as_posix()}/{p}" for p in problems]
        for target, line, local, text in found_imports:
            graph[name].add(target)
            tpkg = package_of(target, mods[target])
            allowed = rules[pkg][0]
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


def layer_table(rules: dict = LAYERS) -> str:
    """The layer rule as docs/architecture.md writes it down."""
    rows = ["| package | may import (besides itself) | why |", "|---|---|---|"]
    for pkg, (allowed, why) in rules.items():
        below = "anything" if "*" in allowed else ", ".join(f"`{p}`" for p in sorted(allowed)) or "nothing"
        rows.append(f"| `{pkg}` | {below} | {why} |")
    return "\n".join(rows) + "\n"


@pytest.fixture(scope="module")
def found():
    return violations()


@pytest.mark.parametrize("kind", KINDS)
def test_the_code_keeps_its_layers(found, kind):
    assert not found[kind], f"{len(found[kind])} {kind} problem(s):\n  " + "\n  ".join(found[kind])


def test_the_layer_rule_is_written_down():
    """docs/architecture.md holds LAYERS as a table, each package with the reason for its rule."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert layer_table() in page, ("docs/architecture.md's table under 'The layer rule' differs from LAYERS; "
                                   "replace it with:\n" + layer_table())


def _write(root: Path, rel: str, text: str = "") -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_the_checker_finds_each_kind_of_problem(tmp_path):
    """The rule can fail: a small tree with one problem of each kind."""
    _write(tmp_path, "low/__init__.py")
    _write(tmp_path, "low/a.py", "import high.b\n")                     # layer: low may not import high
    _write(tmp_path, "high/__init__.py")
    _write(tmp_path, "high/b.py", "import high.c\n")
    _write(tmp_path, "high/c.py", "def f():\n    import high.b\n" + "x = 1\n" * (MAX_LINES + 1))  # circle, local, long
    _write(tmp_path, "high/d.py", "import importlib\nimportlib.import_module('low.a')\n")  # not listed
    _write(tmp_path, "stray/__init__.py")                           # no rule
    rules = {"low": (set(), ""), "high": ({"low"}, "")}
    got = violations(tmp_path, rules, folders={}, dynamic={}, product=("low", "high", "stray"))
    assert any("low imports high.b" in v for v in got["layer"]), got
    assert any("high.b" in c and "high.c" in c for c in got["cycle"]), got
    assert any("function-local import of high.b" in v for v in got["local"]), got
    assert any(v.startswith("high.c:") for v in got["long"]), got
    assert any(v.startswith("stray/") for v in got["unassigned"]), got
    assert any("d.py:2: importlib.import_module('low.a') is not listed" in v for v in got["dynamic"]), got
    # listed, the dynamic import counts like a written one: low -> high.b -> low.a is then a circle
    (tmp_path / "high" / "d.py").unlink()
    _write(tmp_path, "high/b.py", "import importlib\nimportlib.import_module('low.a')\n")
    _write(tmp_path, "low/a.py", "import importlib\nimportlib.import_module(name)\n")
    dynamic = {"high.b": ({"'low.a'": ("low.a",)}, ""), "low.a": ({"name": ("high.*",)}, "")}
    got = violations(tmp_path, {**rules, "low": ({"high"}, "")}, folders={}, dynamic=dynamic, product=())
    assert any("high.b" in c and "low.a" in c for c in got["cycle"]), got
    assert not got["dynamic"], got


def test_a_new_folder_or_sub_package_without_a_rule_fails(tmp_path):
    """A copy of this repository passes the folder check; a new sub-package, a new top-level
    package, a new folder of data and a module at the top each fail it until given a rule."""
    for f in tree_files(ROOT):
        _write(tmp_path, f.as_posix(), (ROOT / f).read_text() if f.suffix == ".py" else "")
    assert violations(tmp_path)["unassigned"] == []
    _write(tmp_path, "megaslide_ray/serving/__init__.py")
    _write(tmp_path, "megaslide_ray/serving/api.py", "from megaslide_ray.config import Config\n")
    _write(tmp_path, "tools/bump.py")
    _write(tmp_path, "docs/img/plot.png")
    _write(tmp_path, "setup.py")
    got = violations(tmp_path)["unassigned"]
    for new in ("megaslide_ray/serving/:", "tools/:", "docs/img/:", "setup.py:"):
        assert any(v.startswith(new) for v in got), (new, got)
    assert len(got) == 4, got
    rules = {**LAYERS, "megaslide_ray.serving": ({M + "config"}, "a test"), "tools": ({"*"}, "a test")}
    _write(tmp_path, "setup.py", "")
    (tmp_path / "setup.py").unlink()
    got = violations(tmp_path, rules, folders={**FOLDERS, "docs/img": "a test"})
    assert got["unassigned"] == [] and got["layer"] == [], got


def test_no_command_line_module_shares_its_name_with_a_library_module():
    """``python -m megaslide_ray.NAME`` modules (the command lines) parse and call the library; a
    library module of the same name (``megaslide_ray/*/NAME.py``) would make a newcomer guess which
    is which, so none exists (the library's have names of what they hold)."""
    commands = {p.stem for p in (ROOT / "megaslide_ray").glob("*.py")} - {"__init__", "__main__"}
    clashes = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "megaslide_ray").glob("*/*.py") if p.stem in commands)
    assert not clashes, f"library modules named like a command line: {clashes}"
    assert not (ROOT / "megaslide_ray" / "trainer").exists()  # the driver beside `training/` (the objective, AdamW)
