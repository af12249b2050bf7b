"""One configuration channel: every environment switch the code reads is a config field or the
documented default of one (the configuration reference names it), and those fields do what the
reference says: ``data.cache_dir`` places the built-in data sets, ``runtime.inject_fault``
reaches the actors, is checked before anything starts, and is never saved in config.toml."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
from conftest import CLI_SMALL
from test_bad_inputs import run_here

from megaslide_ray.config import Config
from megaslide_ray.data.folders import cache_root
from megaslide_ray.driver import launch as launch_module
from megaslide_ray.driver import loop as loop_module
from megaslide_ray.runtime import faults

ROOT = Path(__file__).resolve().parent.parent
CODE = ("megaslide_ray", "actors", "kernels", "pipelines", "benchmarks")


def project_switches(root: Path = ROOT, tops=CODE) -> dict[str, str]:
    """Every ``MEGASLIDE_*`` name a string in the code holds (an environment variable it reads or
    sets) -> the first file that names it."""
    out: dict[str, str] = {}
    for top in tops:
        for f in sorted((root / top).rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    for word in node.value.replace("$", " ").replace("`", " ").split():
                        name = word.strip(".,;:()'\"=")
                        if name.startswith("MEGASLIDE_") and name[10:].replace("_", "").isupper():
                            out.setdefault(name, str(f.relative_to(root)))
    return out


def test_the_configuration_reference_names_every_environment_switch():
    reference = (ROOT / "docs" / "configuration.md").read_text()
    found = project_switches()
    assert {"MEGASLIDE_CACHE", "MEGASLIDE_FAULT", "MEGASLIDE_FAULT_DIR"} <= set(found), found
    missing = {name: where for name, where in found.items() if f"${name}" not in reference}
    assert not missing, (f"environment switches the configuration reference does not name (make each a config "
                         f"field, or the documented default of one): {missing}")


def test_the_check_finds_a_switch(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text('import os\nX = os.environ.get("MEGASLIDE_NEW_KNOB")\n')
    assert project_switches(tmp_path, ("pkg",)) == {"MEGASLIDE_NEW_KNOB": "pkg/m.py"}


def test_cache_dir_places_the_demo_set_and_defaults_to_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASLIDE_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(str(tmp_path / "field")) == tmp_path / "field"
    monkeypatch.delenv("MEGASLIDE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "megaslide_ray"
    asked = []
    monkeypatch.setattr(loop_module, "ensure_demo_dataset", lambda cache_dir=None: asked.append(cache_dir) or "m")
    monkeypatch.setattr(loop_module, "check_data", lambda cfg: None)
    cfg = Config()
    cfg.data.cache_dir = str(tmp_path / "field")
    assert loop_module.resolve_data(cfg).data.manifest == "m" and asked == [str(tmp_path / "field")]
    loop_module.resolve_data(Config())
    assert asked[-1] is None  # empty: cache_root's default, $MEGASLIDE_CACHE


def _train(args, tmp_path, capsys):
    from megaslide_ray.train import main

    return run_here(main, [*CLI_SMALL, "--steps", "2", "--runtime.state_dir", str(tmp_path / "shm"),
                           "--run-dir", str(tmp_path / "run"), *args], capsys)


@pytest.fixture
def no_fault_env(monkeypatch):
    for name in (faults.ENV_SPEC, faults.ENV_DIR):
        monkeypatch.setenv(name, "x")  # recorded, so the test's changes are undone
        monkeypatch.delenv(name)


def test_inject_fault_field_is_checked_before_ray(tmp_path, capsys, monkeypatch, no_fault_env):
    monkeypatch.setattr(launch_module, "_run", lambda *a: pytest.fail("a refused fault spec reached Ray"))
    ran = _train(["--runtime.inject_fault", "no-such-point"], tmp_path, capsys)
    assert ran.rc == 2 and ran.message.startswith("runtime.inject_fault error:"), ran
    assert faults.ENV_SPEC not in os.environ and not ran.left


def test_inject_fault_field_reaches_the_actors_and_is_not_saved(tmp_path, capsys, monkeypatch, no_fault_env):
    seen = {}

    def started(cfg, *args):  # where Ray would start: what the actors would inherit
        seen.update(field=cfg.runtime.inject_fault, spec=os.environ.get(faults.ENV_SPEC),
                    marker_dir=os.environ.get(faults.ENV_DIR))
        return 0

    monkeypatch.setattr(launch_module, "_run", started)
    ran = _train(["--runtime.inject_fault", "store.mid_update@3"], tmp_path, capsys)
    assert ran.rc == 0, ran
    assert seen["spec"] == "store.mid_update@3" and seen["field"] == ""  # config.toml is written from cfg
    assert seen["marker_dir"] and not Path(seen["marker_dir"]).exists()  # a fresh folder, gone with the run
