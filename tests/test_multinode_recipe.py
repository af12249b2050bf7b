"""README's two-machine recipe, run as written on one machine: one token for the cluster
(``RAY_AUTH_MODE=token``, ``RAY_AUTH_TOKEN``), ``ray start --head``, ``ray start --address
HEAD:PORT``, then ``python -m megaslide_ray.train --ray-address HEAD:PORT --runtime.nodes 2``.

The two nodes get their own temp dirs and free ports (other Ray clusters may run on this
machine), and are stopped by ending the sessions their ``ray start`` ran in rather than by ``ray
stop``, which stops every Ray cluster of the machine. A driver without the token, or with
another one, ends in one line that says what to set."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import CLI_SMALL, run_cli
from test_bad_inputs import LOG_LINE, _session_processes

RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_start(args: list[str], env: dict, sessions: list[int]) -> subprocess.CompletedProcess:
    """``ray start ARGS`` in a session of its own (its daemons stay in it: ``_stop``)."""
    proc = subprocess.Popen([RAY, "start", *args, "--disable-usage-stats"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    sessions.append(proc.pid)
    out, _ = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def _stop(sid: int, wait_s: float = 20.0) -> list[str]:
    """End every process of session ``sid`` (SIGTERM, then SIGKILL); what is still there after."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for line in _session_processes(sid):
            try:
                os.kill(int(line.split(":")[0]), sig)
            except OSError:
                pass
        deadline = time.monotonic() + wait_s / 2
        while _session_processes(sid) and time.monotonic() < deadline:
            time.sleep(0.3)
    return _session_processes(sid)


def _message(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip() and not LOG_LINE.match(line)
            and not line.startswith("[")]


@pytest.mark.core  # CI runs it every time: README's recipe must work as written
@pytest.mark.slow  # two Ray nodes, a 2-step run over them, two refused drivers: about 90 s
def test_readme_two_node_recipe_with_token_auth(tmp_path):
    token = secrets.token_hex(32)
    env = {**os.environ, "MEGASLIDE_CACHE": str(tmp_path / "cache"), "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"}
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    port = _free_port()
    head = f"127.0.0.1:{port}"
    sessions: list[int] = []
    temp = Path(tempfile.mkdtemp(prefix="msr-"))  # short: Ray's socket paths under it must fit 107 bytes
    try:
        started = _ray_start(["--head", "--port", str(port), "--temp-dir", str(temp / "head"), "--num-cpus", "1",
                              "--include-dashboard", "false", "--dashboard-agent-listen-port", str(_free_port())],
                             env, sessions)
        assert started.returncode == 0, started.stdout[-3000:]
        joined = _ray_start(["--address", head, "--temp-dir", str(temp / "other"), "--num-cpus", "1",
                             "--dashboard-agent-listen-port", str(_free_port())], env, sessions)
        assert joined.returncode == 0, joined.stdout[-3000:]

        no_token = {k: v for k, v in env.items() if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}
        no_token["HOME"] = str(tmp_path / "home")  # no ~/.ray/auth_token there
        recipe = [*CLI_SMALL, "--steps", "2", "--ray-address", head, "--runtime.nodes", "2"]
        with ThreadPoolExecutor(3) as pool:
            run = pool.submit(run_cli, [*recipe, "--run-dir", str(tmp_path / "run")], env)
            missing = pool.submit(run_cli, [*recipe, "--run-dir", str(tmp_path / "missing")], no_token)
            wrong = pool.submit(run_cli, [*recipe, "--run-dir", str(tmp_path / "wrong")],
                                {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)})
            run, missing, wrong = run.result(), missing.result(), wrong.result()
        assert run.returncode == 0, run.stderr[-3000:]
        assert "done: steps 0->2" in run.stdout
        assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_2"

        for proc, say in ((missing, "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the head's token"),
                          (wrong, "this command's token is not the cluster's: set RAY_AUTH_TOKEN to the head's")):
            lines = _message(proc)
            assert proc.returncode == 2, proc.stderr[-3000:]
            assert len(lines) == 1 and lines[0].startswith(f"ray error: could not join the Ray cluster at "
                                                           f"--ray-address {head}") and say in lines[0], lines
            assert "Traceback" not in proc.stderr and not (tmp_path / proc.args[-1]).exists()
    finally:
        left = [p for sid in sessions for p in _stop(sid)]
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, left


def test_readme_gives_the_recipe_this_module_runs():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for step in ("ray get-auth-token --generate", "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=", "`ray start --head`",
                 "`ray start --address HEAD:6379`", "--ray-address HEAD:6379 --runtime.nodes 2"):
        assert step in readme, f"README's two-machine recipe lost {step!r}: this module runs it as written"
