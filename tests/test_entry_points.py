"""Every documented command line answers: each ``python -m megaslide_ray.NAME`` and each
``megaslide COMMAND`` prints its help and exits 0, the dispatcher refuses an unknown command,
and every command README.md and docs/cli.md name is one the dispatcher or a module runs."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megaslide_ray.__main__ import COMMANDS
from megaslide_ray.__main__ import main as megaslide

ROOT = Path(__file__).resolve().parent.parent


def _help(run) -> tuple[int, str]:
    try:
        rc = run(["--help"])
    except SystemExit as e:  # argparse exits after printing the help
        rc = e.code
    return rc


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_prints_its_help(command, capsys):
    module, _ = COMMANDS[command]
    assert _help(importlib.import_module(module).main) == 0
    assert "usage:" in capsys.readouterr().out
    assert _help(lambda argv: megaslide([command, *argv])) == 0
    assert "usage:" in capsys.readouterr().out


def test_the_dispatcher_lists_commands_and_refuses_unknown_ones(capsys):
    assert megaslide(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)
    assert megaslide([]) == 2
    assert megaslide(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_the_console_script_is_installed_and_runs():
    """``pip install -e .`` (README's set-up) puts ``megaslide`` beside the interpreter."""
    script = Path(sys.executable).parent / "megaslide"
    assert script.is_file(), f"{script} is missing: install the project with pip install -e ."
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "train" in out.stdout, out.stderr[-1000:]
    out = subprocess.run([sys.executable, "-m", "megaslide_ray", "plan", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "--preset" in out.stdout, out.stderr[-1000:]


def test_documented_modules_exist():
    """Each ``python -m megaslide_ray.NAME`` and ``megaslide NAME`` in README.md and docs/ is real."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    modules = set(re.findall(r"python -m (megaslide_ray(?:\.\w+)*)", text)) - {"megaslide_ray.NAME"}
    missing = [m for m in sorted(modules) if importlib.util.find_spec(m) is None]
    assert not missing, f"documented but missing: {missing}"
    def runnable(m: str) -> bool:  # a module with main(), or a package with __main__
        return hasattr(importlib.import_module(m), "main") or importlib.util.find_spec(f"{m}.__main__") is not None

    not_runnable = sorted(m for m in modules if not runnable(m))
    assert not not_runnable, f"documented modules without a main(): {not_runnable}"
    for name in set(re.findall(r"\bmegaslide (\w[\w-]*)", text)) - {"COMMAND", "NAME"}:
        assert name in COMMANDS, f"docs run `megaslide {name}`, which is not a command"


def test_documented_benchmarks_and_studies_exist():
    """Each ``python -m benchmarks.NAME`` (and ``benchmarks.studies.NAME``) README.md, docs/ and
    benchmarks/RESULTS.md's newest sections name runs: the module exists and has a main()."""
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    names = set(re.findall(r"python -m (benchmarks(?:\.\w+)+)", text)) - {"benchmarks.NAME", "benchmarks.studies.NAME"}
    names |= {f"{package}.{n}" for package, listed in re.findall(r"`python -m (benchmarks(?:\.studies)?)\.NAME` "
                                                                 r"\(([^)]*)\)", text)
              for n in re.findall(r"`(\w+)`", listed)}
    cli = (ROOT / "docs" / "cli.md").read_text()  # the tables of its benchmarks and studies sections
    for heading, package in (("## benchmarks", "benchmarks"), ("## studies", "benchmarks.studies")):
        section = cli.split(heading + "\n", 1)[1].split("\n## ", 1)[0]
        names |= {f"{package}.{n}" for n in re.findall(r"^\| `(\w+)` \|", section, flags=re.M)}
    assert {"benchmarks.pipeline", "benchmarks.studies.quality"} <= names, sorted(names)
    assert names, "README.md names no benchmark"
    missing = sorted(n for n in names if importlib.util.find_spec(n) is None)
    assert not missing, f"documented but missing: {missing}"
    without_main = sorted(n for n in names if not hasattr(importlib.import_module(n), "main")
                          and importlib.util.find_spec(f"{n}.__main__") is None)
    assert not without_main, f"documented benchmarks without a main(): {without_main}"


def test_the_hub_kernels_package_is_refused_or_warned_with_the_fix(monkeypatch, tmp_path):
    """The Hub's `kernels` distribution shares this project's top-level import name: where `import
    kernels` finds theirs, refused; where it finds ours, a warning (transformers may break)."""
    import importlib.metadata
    import importlib.util
    import warnings

    import megaslide_ray

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        megaslide_ray.check_no_foreign_kernels()  # this environment: not installed, nothing said
    real = importlib.metadata.version

    def version(name):
        return "0.19.1" if name == "kernels" else real(name)

    monkeypatch.setattr(megaslide_ray._metadata, "version", version)
    with pytest.warns(RuntimeWarning, match=r"'kernels' 0\.19\.1 .*finds this project's.*transformers>=5,<5\.25"):
        megaslide_ray.check_no_foreign_kernels()
    theirs = tmp_path / "kernels"
    theirs.mkdir()
    (theirs / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location("kernels", theirs / "__init__.py")
    monkeypatch.setattr(megaslide_ray._util, "find_spec", lambda name: spec)
    with pytest.raises(ImportError, match=r"finds theirs .*cannot run.*uninstall -y kernels"):
        megaslide_ray.check_no_foreign_kernels()
