"""No product function is over 80 lines (its signature, docstring and body): a longer one does
several things, and each gets a name. Computed from the code, like the layer rule."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("megaslide_ray", "actors", "kernels", "pipelines")
MAX_LINES = 80


def long_functions(root: Path = ROOT, tops=PRODUCT, limit: int = MAX_LINES) -> dict[str, int]:
    """``path:name`` -> lines of every function (or method) of ``tops`` longer than ``limit``."""
    out = {}
    for top in tops:
        for f in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > limit:
                        out[f"{f.relative_to(root).as_posix()}:{node.name}"] = lines
    return out


def test_no_product_function_is_over_80_lines():
    found = long_functions()
    assert not found, (f"functions over {MAX_LINES} lines (split each into named steps): "
                     + ", ".join(f"{k} ({v})" for k, v in sorted(found.items())))


def test_the_check_finds_a_long_function(tmp_path):
    (tmp_path / "pkg").mkdir()
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_LINES))
    (tmp_path / "pkg" / "m.py").write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}")
    assert long_functions(tmp_path, ("pkg",)) == {"pkg/m.py:long": MAX_LINES + 1}
