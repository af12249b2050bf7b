"""Room for the host state: refused in the driver before Ray starts (one message, exit 2), a
filesystem that fills up later gives a clear error and no SIGBUS, Ray's object store is sized to
leave the state its room, and the state is private to the user who runs the job."""

import os
import shutil
import stat
import subprocess
import uuid
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from actors.param_store import ParameterStore
from megaslide_ray.config import build_config
from megaslide_ray.state import preflight
from megaslide_ray.state.preflight import StateSpaceError, plan_state_space
from megaslide_ray.train import main as train_main

SMALL = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2}
Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 8 MB tmpfs (mounting needs root and CAP_SYS_ADMIN); None where this machine does
    not allow it."""
    where = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)],
                              capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        done = None
    if done is None or done.returncode != 0:
        yield None
        return
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


def _fake_fs(monkeypatch, total: int, free: int) -> None:
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: Usage(total, total - free, free))


def test_a_state_dir_without_room_is_refused_before_ray_starts(small_tmpfs, tmp_path, monkeypatch, capsys):
    import ray

    if small_tmpfs is None:  # no mount here: the same check against a filesystem that reports 8 MB
        small_tmpfs = tmp_path / "state"
        small_tmpfs.mkdir()
        _fake_fs(monkeypatch, 8 * 2**20, 8 * 2**20)
    # As a new user would: the default job (tiny preset, demo data) with its state on 8 MB.
    rc = train_main(["--runtime.state_dir", str(small_tmpfs), "--run-dir", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert not ray.is_initialized(), "the refusal must come before Ray starts"
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("state dir error:"), err
    assert str(small_tmpfs) in err and "GB" in err and "--runtime.state_dir" in err
    assert not (tmp_path / "run").exists(), "nothing may be started or written"


def test_dev_shm_advice_says_how_to_enlarge_it(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "SHM", tmp_path)  # the state root is "the" /dev/shm here
    _fake_fs(monkeypatch, 10**9, 10**6)
    cfg = build_config("tiny", None, {**SMALL, "runtime.state_dir": str(tmp_path)})
    with pytest.raises(StateSpaceError) as e:
        plan_state_space(cfg, wbytes=2)
    msg = str(e.value)
    assert "half of RAM" in msg and "mount -o remount,size=" in msg and "--shm-size=" in msg
    # the size it suggests covers what is missing
    gb = int(msg.split("remount,size=")[1].split("G")[0])
    need = preflight.state_bytes(cfg, 2) + preflight.MARGIN_BYTES
    assert gb * 10**9 >= 10**9 + need - 10**6


def test_ray_object_store_is_sized_to_leave_the_state_its_room(tmp_path, monkeypatch):
    monkeypatch.setattr(preflight, "SHM", tmp_path)
    cfg = build_config("tiny", None, {**SMALL, "runtime.state_dir": str(tmp_path)})
    need = preflight.state_bytes(cfg, 4) + preflight.MARGIN_BYTES
    monkeypatch.setattr(preflight, "ray_default_object_store", lambda: 40 * 10**9)
    _fake_fs(monkeypatch, 100 * 10**9, 100 * 10**9)  # room for both: Ray's own choice
    plan = plan_state_space(cfg, wbytes=4)
    assert plan.on_shm and plan.object_store_bytes == 0 and plan.plasma_dir == ""
    _fake_fs(monkeypatch, 100 * 10**9, need + 10 * 10**9)  # the default would eat the state's room
    plan = plan_state_space(cfg, wbytes=4)
    assert plan.object_store_bytes == 10 * 10**9 and plan.plasma_dir == ""
    assert plan.object_store_bytes + plan.need_bytes <= plan.free_bytes
    _fake_fs(monkeypatch, 100 * 10**9, need + 10**6)  # no room left for an object store at all
    plan = plan_state_space(cfg, wbytes=4)
    assert plan.plasma_dir and Path(plan.plasma_dir) != tmp_path
    # a remote cluster keeps its object store where it is
    assert plan_state_space(cfg, local_ray=False, wbytes=4).object_store_bytes == 0


def test_a_filesystem_that_fills_up_gives_a_clear_error_not_sigbus(small_tmpfs, tmp_path, monkeypatch):
    if small_tmpfs is None:
        pytest.skip("mounting a small tmpfs is not permitted on this machine")
    cfg = build_config("tiny", None, {**SMALL, "model.hidden_size": 64, "runtime.state_dir": str(small_tmpfs)})
    assert preflight.state_bytes(cfg, 4) < 8 * 2**20
    filler = small_tmpfs / "other-users-file"
    with open(filler, "wb") as f:  # the space went elsewhere after the driver's check
        f.write(b"\0" * (8 * 2**20 - preflight.state_bytes(cfg, 4) // 2))
    monkeypatch.setattr(ParameterStore, "_check_space", lambda self, root: None)
    with pytest.raises(StateSpaceError, match=r"could not reserve .* No space left on device.*Nothing was written"):
        ParameterStore(cfg, str(tmp_path / "run"))
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["other-users-file"], "the partial state is removed"
    filler.unlink()  # with the room back, the same store starts and its pages are all there
    store = ParameterStore(cfg, str(tmp_path / "run"))
    try:
        for s in store.seg:
            s["m"].fill_(1.0)
        assert all(bool((s["m"] == 1.0).all()) for s in store.seg)
    finally:
        store.close()


def test_state_dir_and_segments_are_private(tmp_path):
    cfg = build_config("tiny", None, {**SMALL, "runtime.state_dir": str(tmp_path)})
    old = os.umask(0o022)  # a typical umask: files would be world-readable
    try:
        store = ParameterStore(cfg, str(tmp_path / "run"), w_dtype="bfloat16")
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(store.dir.stat().st_mode) == 0o700
        segments = [p for p in store.dir.iterdir() if p.name.startswith("shard_") or p.suffix in (".i64", ".f64")]
        assert segments and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in segments)
        # blocks reserved up front: no sparse segment left to fault in later
        w = store.dir / "shard_0001.w"
        assert w.stat().st_blocks * 512 >= w.stat().st_size
        assert store.seg[1]["w"].dtype is torch.bfloat16
    finally:
        store.close()
    assert not shutil.os.path.exists(store.dir)


def test_offloaded_block_inputs_count_one_slot_per_block_not_kept_on_the_device():
    cfg = build_config("tiny", None, {**SMALL, "model.depth": 4, "runtime.offload_activations": "true"})
    one = cfg.data.batch_size * cfg.tokens_per_sample * cfg.model.hidden_size * 2
    assert preflight.offload_bytes(cfg, 2) == 4 * one
    cfg.runtime.offload_keep = 1
    assert preflight.offload_bytes(cfg, 2) == 3 * one
    cfg.runtime.offload_keep = 9  # more than the depth: nothing offloaded
    assert preflight.offload_bytes(cfg, 2) == 0
    cfg.runtime.offload_activations = False
    assert preflight.offload_bytes(cfg, 2) == 0
