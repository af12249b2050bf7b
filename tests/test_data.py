"""Video data side: demo set, manifest, indexer, decoder. CPU only, no Ray."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import decord
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors import decoder as decoder_mod
from actors.decoder import VideoDecoder
from megaslide_ray import demo_data as demo_data_cli
from megaslide_ray import index as index_cli
from megaslide_ray.config import DataConfig
from megaslide_ray.data import clips as clips_mod
from megaslide_ray.data import demo as demo_data
from megaslide_ray.data import video_index as index
from megaslide_ray.data.captions import encode_caption
from megaslide_ray.data.clips import clip_frame_indices, clip_offsets, read_frames, resize_crop
from megaslide_ray.data.demo import ensure_demo_dataset, write_video
from megaslide_ray.data.manifest import ManifestEntry, read_manifest, write_manifest


def _solid_video(path, num_frames=12, width=64, height=64, seed=0):
    """A small real mp4 whose frames differ (so decoding can be checked) and returns its frames."""
    rng = np.random.default_rng(seed)
    frames = np.empty((num_frames, height, width, 3), dtype=np.uint8)
    base = rng.integers(0, 256, size=3)
    for t in range(num_frames):
        frames[t] = (base + 10 * t) % 256
    write_video(path, frames)
    return frames


def _cfg(manifest, **kw):
    base = dict(manifest=str(manifest), num_frames=8, height=32, width=48, batch_size=3, frame_stride=2,
                prefetch=2, random_crop=True)
    base.update(kw)
    return DataConfig(**base)


def _batches(dec, k):
    return [dec.next_batch() for _ in range(k)]


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# ---------------------------------------------------------------------------------------------
# Demo dataset
# ---------------------------------------------------------------------------------------------


def test_demo_dataset_is_decodable_and_reused(manifest):
    demo_manifest = Path(manifest)  # conftest's demo set of 6 videos (its path as a str)
    entries = read_manifest(demo_manifest)
    assert len(entries) == 6
    assert {(e.width, e.height) for e in entries} == {(64, 64), (96, 64)}
    for e in entries:
        vr = decord.VideoReader(e.path, ctx=decord.cpu(0))
        assert len(vr) == e.num_frames and 32 <= e.num_frames <= 40
        assert vr[0].shape[:2] == (e.height, e.width)
        assert vr.get_avg_fps() == pytest.approx(8.0)
        assert e.caption.startswith("a ") and e.caption.endswith("background")
    mtime = os.path.getmtime(demo_manifest)
    assert ensure_demo_dataset(demo_manifest.parent.parent, num_videos=6) == demo_manifest
    assert os.path.getmtime(demo_manifest) == mtime
    assert not [p for p in demo_manifest.parent.parent.iterdir() if ".tmp-" in p.name]


def test_demo_dataset_is_deterministic(tmp_path, manifest):
    other = ensure_demo_dataset(tmp_path, num_videos=6)
    assert [e.caption for e in read_manifest(other)] == [e.caption for e in read_manifest(manifest)]
    a = decord.VideoReader(read_manifest(other)[1].path, ctx=decord.cpu(0))
    b = decord.VideoReader(read_manifest(manifest)[1].path, ctx=decord.cpu(0))
    np.testing.assert_array_equal(read_frames(a, np.arange(4)), read_frames(b, np.arange(4)))


def test_demo_dataset_crash_leaves_nothing_trusted(tmp_path, monkeypatch):
    calls = []

    def failing_write(path, frames, fps=8):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        return write_video(path, frames, fps)

    monkeypatch.setattr(demo_data, "write_video", failing_write)
    with pytest.raises(OSError, match="simulated"):
        ensure_demo_dataset(tmp_path, num_videos=3)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(demo_data, "write_video", write_video)
    manifest = ensure_demo_dataset(tmp_path, num_videos=3)
    assert len(read_manifest(manifest)) == 3


def test_demo_cli_and_default_cache(tmp_path, monkeypatch, capsys):
    assert demo_data_cli.main(["--out", str(tmp_path / "a"), "--num-videos", "2"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(tmp_path / "a" / "demo-v1-n2" / "manifest.parquet")
    monkeypatch.setenv("MEGASLIDE_CACHE", str(tmp_path / "env"))
    assert ensure_demo_dataset(num_videos=2) == tmp_path / "env" / "demo-v1-n2" / "manifest.parquet"


# ---------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------


def test_manifest_round_trip(tmp_path):
    rows = [
        ManifestEntry(path="clips/a.mp4", caption="a cat", num_frames=10, fps=8.0, width=64, height=48),
        {"path": str(tmp_path / "abs.mp4")},  # metadata optional
    ]
    out = write_manifest(rows, tmp_path / "m.parquet")
    got = read_manifest(out)
    assert got[0] == dataclasses.replace(rows[0], path=str(tmp_path.resolve() / "clips" / "a.mp4"))
    assert got[1] == ManifestEntry(path=str(tmp_path / "abs.mp4"))
    assert [p.name for p in tmp_path.iterdir()] == ["m.parquet"]  # no temp file left

    pq.write_table(pa.table({"path": ["x.mp4"]}), tmp_path / "only_path.parquet")
    assert read_manifest(tmp_path / "only_path.parquet") == [ManifestEntry(path=str(tmp_path.resolve() / "x.mp4"))]


def test_manifest_errors_name_the_problem(tmp_path):
    pq.write_table(pa.table({"file": ["a.mp4"], "caption": ["x"]}), tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"bad\.parquet.*'path'.*megaslide_ray\.index"):
        read_manifest(tmp_path / "bad.parquet")
    with pytest.raises(ValueError, match=r"nope\.parquet.*does not exist"):
        read_manifest(tmp_path / "nope.parquet")
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet"):
        read_manifest(tmp_path / "text.parquet")


# ---------------------------------------------------------------------------------------------
# Indexer
# ---------------------------------------------------------------------------------------------


def test_index_cli(tmp_path, capsys):
    videos = tmp_path / "videos"
    (videos / "sub").mkdir(parents=True)
    _solid_video(videos / "a.mp4", num_frames=12)
    (videos / "a.txt").write_text("sidecar caption\n")
    _solid_video(videos / "sub" / "b.mkv", num_frames=10, width=96, height=64)
    _solid_video(videos / "c.mp4", num_frames=9)
    _solid_video(videos / "single.mp4", num_frames=1)
    (videos / "empty.mp4").write_bytes(b"")
    (videos / "notes.mp4").write_text("this is a text file, not a video")
    (videos / "readme.txt").write_text("not a video extension: ignored")
    captions = tmp_path / "caps.jsonl"
    captions.write_text(json.dumps({"path": "sub/b.mkv", "caption": "from jsonl"}) + "\n")
    out = tmp_path / "out" / "manifest.parquet"

    rc = index_cli.main([str(videos), "--out", str(out), "--captions", str(captions)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "found 6 video files" in text and "3 usable" in text and "3 unreadable" in text
    assert "empty.mp4: zero bytes" in text
    assert "single.mp4: one frame" in text
    assert "notes.mp4: decord:" in text
    entries = {os.path.basename(e.path): e for e in read_manifest(out)}
    assert sorted(entries) == ["a.mp4", "b.mkv", "c.mp4"]
    assert entries["a.mp4"].caption == "sidecar caption"
    assert entries["b.mkv"].caption == "from jsonl"
    assert entries["c.mp4"].caption == ""
    assert (entries["b.mkv"].num_frames, entries["b.mkv"].width, entries["b.mkv"].height) == (10, 96, 64)
    assert entries["a.mp4"].fps == pytest.approx(8.0)
    stored = pq.read_table(out).column("path").to_pylist()
    assert all(not os.path.isabs(p) for p in stored)  # relative to the manifest: movable together
    assert os.path.samefile(entries["b.mkv"].path, videos / "sub" / "b.mkv")


def test_index_every_kind_of_bad_file(tmp_path, capsys):
    videos = tmp_path / "videos"
    good = [videos / f"good{i}.mp4" for i in range(3)]
    for i, p in enumerate(good):
        videos.mkdir(exist_ok=True)
        _solid_video(p, num_frames=10 + i, seed=i)
    bad = demo_data.write_bad_videos(videos)
    out = tmp_path / "manifest.parquet"
    assert index_cli.main([str(videos), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert f"found {len(good) + len(bad)} video files" in text
    assert f"{len(good)} usable" in text and f"{len(bad)} unreadable" in text
    reasons = {"zero_bytes.mp4": "zero bytes", "truncated.mp4": "decord: ", "not_a_video.mp4": "decord: ",
               "one_frame.mp4": "one frame", "undecodable_frames.mp4": "decord: "}
    assert sorted(reasons) == sorted(demo_data.BAD_VIDEO_KINDS)
    lines = [line for line in text.splitlines() if "unreadable: " in line]
    assert len(lines) == len(bad)
    for name, reason in reasons.items():
        assert any(name in line and reason in line for line in lines), (name, text)
    rows = read_manifest(out)
    assert sorted(os.path.basename(r.path) for r in rows) == [p.name for p in good]
    assert [r.num_frames for r in sorted(rows, key=lambda r: r.path)] == [10, 11, 12]


def test_index_csv_captions_and_no_usable_video(tmp_path, capsys):
    videos = tmp_path / "v"
    videos.mkdir()
    _solid_video(videos / "a.mp4")
    (tmp_path / "caps.csv").write_text("path,caption\na.mp4,\"from csv, with comma\"\n")
    rows, problems = index.index_videos(videos, tmp_path / "caps.csv")
    assert [r.caption for r in rows] == ["from csv, with comma"] and problems == []

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "x.mp4").write_bytes(b"")
    rc = index_cli.main([str(bad), "--out", str(tmp_path / "m.parquet")])
    captured = capsys.readouterr()
    assert rc == 1 and "no usable video" in captured.err
    assert not (tmp_path / "m.parquet").exists()


# ---------------------------------------------------------------------------------------------
# Decoder pieces
# ---------------------------------------------------------------------------------------------


def test_frame_indices_loop_short_videos():
    np.testing.assert_array_equal(clip_frame_indices(10, clip_offsets(6, 1), 7), [7, 8, 9, 0, 1, 2])
    np.testing.assert_array_equal(clip_frame_indices(5, clip_offsets(4, 2), 0), [0, 2, 4, 1])


def test_read_frames_handles_decord_width_quirk(tmp_path):
    """decord2 reports 4 channels for 96-wide frames and get_batch fails; we must still match PyAV."""
    import av

    path = tmp_path / "w96.mp4"
    _solid_video(path, num_frames=6, width=96, height=32)
    with av.open(str(path)) as c:
        ref = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])
    got = read_frames(decord.VideoReader(str(path), ctx=decord.cpu(0)), np.array([4, 0, 4, 2]))
    assert got.shape == (4, 32, 96, 3)
    np.testing.assert_array_equal(got, ref[[4, 0, 4, 2]])


def test_resize_center_crop_keeps_aspect():
    frames = np.zeros((2, 64, 96, 3), dtype=np.uint8)
    frames[:, :, :32] = (255, 0, 0)   # left third red
    frames[:, :, 32:64] = (0, 255, 0)  # middle third green
    frames[:, :, 64:] = (0, 0, 255)   # right third blue
    out = resize_crop(frames, 32, 32)  # center crop; scale 0.5 -> 32x48, crop x in [8, 40)
    assert out.shape == (2, 32, 32, 3) and out.dtype == np.uint8
    np.testing.assert_array_equal(out[0, 16, 16], (0, 255, 0))
    assert out[0, 16, 0, 0] > 200 and out[0, 16, 31, 2] > 200  # edges keep a bit of red / blue
    up = resize_crop(frames[:, :8, :12], 16, 16)  # upscale path
    assert up.shape == (2, 16, 16, 3)


def test_encode_caption_does_not_split_characters():
    assert encode_caption("héllo", 2) == b"h"
    assert encode_caption("abc", 10) == b"abc"


# ---------------------------------------------------------------------------------------------
# Decoder
# ---------------------------------------------------------------------------------------------


def test_decoder_batch_shapes_and_values(manifest):
    entries = read_manifest(manifest)
    with VideoDecoder(_cfg(manifest), seed=0, caption_max_bytes=24) as dec:
        b = dec.next_batch()
        assert b["video"].shape == (3, 8, 32, 48, 3) and b["video"].dtype == np.uint8
        assert b["caption"].shape == (3, 24) and b["caption"].dtype == np.uint8
        assert b["caption_len"].dtype == np.int32 and b["index"].dtype == np.int64
        assert b["position"].shape == () and int(b["position"]) == 3 and int(b["skipped"]) == 0
        assert b["video"].std() > 5  # real content: shapes on backgrounds
        for i in range(3):
            cap = entries[int(b["index"][i])].caption.encode()[:24]
            n = int(b["caption_len"][i])
            assert n == len(cap) and bytes(b["caption"][i, :n]) == cap and not b["caption"][i, n:].any()
        dec.next_batch()
        s = dec.stats()
        assert (s.position, s.batches, s.clips, s.skipped) == (6, 2, 6, 0)
        assert s.frames_decoded == 48 and s.decode_seconds > 0


def test_decoder_uses_demo_set_when_manifest_empty(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGASLIDE_CACHE", str(tmp_path))
    with VideoDecoder(_cfg("", batch_size=1), seed=0, caption_max_bytes=16) as dec:
        assert dec.next_batch()["video"].shape == (1, 8, 32, 48, 3)
        assert dec.manifest_path == tmp_path / "demo-v1" / "manifest.parquet"


def test_decoder_is_deterministic_and_resumes(manifest):
    cfg = _cfg(manifest, batch_size=4)  # 6 rows, 4 per batch: batches straddle epochs
    with VideoDecoder(cfg, seed=3, caption_max_bytes=32) as a, VideoDecoder(cfg, seed=3, caption_max_bytes=32) as b:
        run_a, run_b = _batches(a, 4), _batches(b, 4)
    for x, y in zip(run_a, run_b):
        _assert_same(x, y)
    with VideoDecoder(cfg, seed=3, caption_max_bytes=32, start_position=int(run_a[1]["position"])) as c:
        for x, y in zip(run_a[2:], _batches(c, 2)):
            _assert_same(x, y)
    with VideoDecoder(cfg, seed=4, caption_max_bytes=32) as d:
        other = np.concatenate([bt["index"] for bt in _batches(d, 3)])
    assert not np.array_equal(other, np.concatenate([bt["index"] for bt in run_a[:3]]))
    # order follows the documented permutation
    rows = np.concatenate([bt["index"] for bt in run_a])
    expected = np.concatenate([np.random.default_rng([3, e]).permutation(6) for e in range(3)])[:16]
    np.testing.assert_array_equal(rows, expected)


def test_decoder_ranks_split_positions(manifest):
    cfg = _cfg(manifest, batch_size=3, random_crop=False)
    with VideoDecoder(cfg, seed=1, caption_max_bytes=8) as single:
        rows = np.concatenate([b["index"] for b in _batches(single, 2)])
    for rank in (0, 1):
        with VideoDecoder(cfg, seed=1, caption_max_bytes=8, rank=rank, world_size=2) as dec:
            b = dec.next_batch()
        np.testing.assert_array_equal(b["index"], rows[rank::2])
        assert int(b["position"]) == 5 + rank


@pytest.mark.parametrize("crops", [dict(random_crop=False), dict(random_crop=True, spatial_crop="random")])
def test_clip_cache_serves_later_epochs_with_the_same_bytes(manifest, crops):
    """Three epochs of 6 rows: with the cache every batch equals the uncached decoder's; with
    fixed crops every clip after the first epoch comes from the cache, with random crops only
    the draws that repeat a (row, frames, crop) do."""
    plain_cfg = _cfg(manifest, batch_size=3, **crops)
    cached_cfg = dataclasses.replace(plain_cfg, clip_cache_mb=8)
    with VideoDecoder(plain_cfg, seed=2, caption_max_bytes=16) as plain, \
            VideoDecoder(cached_cfg, seed=2, caption_max_bytes=16) as cached:
        for x, y in zip(_batches(plain, 6), _batches(cached, 6)):
            _assert_same(x, y)
        assert plain.stats().clips_from_cache == 0
        hits = cached.stats().clips_from_cache
    if crops["random_crop"]:
        assert hits < 12
    else:
        assert hits == 12  # epochs 2 and 3


def test_clip_cache_decodes_a_changed_file_again(tmp_path):
    paths = [tmp_path / f"v{i}.mp4" for i in range(2)]
    for i, path in enumerate(paths):
        _solid_video(path, num_frames=8, seed=i)
    manifest = write_manifest([{"path": p.name, "caption": p.name} for p in paths], tmp_path / "m.parquet")
    cfg = _cfg(manifest, batch_size=2, num_frames=4, frame_stride=1, height=32, width=32, random_crop=False,
               clip_cache_mb=1, prefetch=1)
    with VideoDecoder(cfg, seed=0, caption_max_bytes=8) as dec:
        first = dec.next_batch()
        # The same name, other pixels; replaced atomically (the prefetch thread may be reading it).
        new_frames = _solid_video(tmp_path / "new.mp4", num_frames=8, seed=7)
        st = os.stat(paths[0])
        os.utime(tmp_path / "new.mp4", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        os.replace(tmp_path / "new.mp4", paths[0])
        batches = _batches(dec, 3)  # the prefetch thread may have drawn epoch 2 before the rewrite
        hits = dec.stats().clips_from_cache
    slot = {int(r): i for i, r in enumerate(batches[-1]["index"])}
    changed = batches[-1]["video"][slot[0]]
    assert abs(int(changed.astype(int).mean()) - int(new_frames[:4].astype(int).mean())) <= 3
    assert not np.array_equal(changed, first["video"][list(first["index"]).index(0)])
    np.testing.assert_array_equal(batches[-1]["video"][slot[1]], first["video"][list(first["index"]).index(1)])
    assert 3 <= hits <= 5  # v1 from the cache in each later epoch; v0 only while its rewrite was unseen


def test_clip_cache_keeps_the_most_recent_clips_within_its_budget():
    cache = clips_mod.ClipCache(max_bytes=300)
    clips = {k: np.full(100, k, dtype=np.uint8) for k in range(4)}
    for k in range(3):
        cache.put((k,), clips[k])
    assert cache.get((0,)) is clips[0]  # 0 is now the most recent
    cache.put((3,), clips[3])           # over budget: the least recent (1) goes
    assert cache.get((1,)) is None and len(cache) == 3 and cache.bytes == 300
    assert all(cache.get((k,)) is clips[k] for k in (0, 2, 3))
    cache.put((9,), np.zeros(301, dtype=np.uint8))  # larger than the budget: not kept
    assert cache.get((9,)) is None and cache.bytes == 300


@pytest.fixture
def mixed_manifest(tmp_path):
    good = [tmp_path / f"good{i}.mp4" for i in range(3)]
    for i, p in enumerate(good):
        _solid_video(p, num_frames=6 + 2 * i, seed=i)
    (tmp_path / "zero.mp4").write_bytes(b"")
    (tmp_path / "garbage.mp4").write_bytes(np.random.default_rng(0).bytes(4096))
    names = ["good0.mp4", "missing.mp4", "good1.mp4", "zero.mp4", "garbage.mp4", "good2.mp4"]
    return write_manifest([{"path": n, "caption": n} for n in names], tmp_path / "manifest.parquet"), names


def test_decoder_skips_bad_files(mixed_manifest, caplog):
    manifest, names = mixed_manifest
    cfg = _cfg(manifest, batch_size=2, num_frames=4, frame_stride=3, height=32, width=32)
    with caplog.at_level(logging.WARNING, logger=decoder_mod.__name__):
        with VideoDecoder(cfg, seed=7, caption_max_bytes=16) as dec:
            batches = _batches(dec, 6)
            stats = dec.stats()
    final = int(batches[-1]["position"])
    drawn = np.concatenate([np.random.default_rng([7, e]).permutation(6) for e in range(final // 6 + 1)])[:final]
    bad = {1, 3, 4}
    expected_skips = sum(int(r) in bad for r in drawn)
    assert expected_skips > 0
    assert int(batches[-1]["skipped"]) == stats.skipped == expected_skips
    assert stats.clips == 12 == final - expected_skips
    got_rows = np.concatenate([b["index"] for b in batches])
    np.testing.assert_array_equal(got_rows, [r for r in drawn if int(r) not in bad])
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert bad <= set(drawn.tolist())
    for row, reason in ((1, "missing file"), (3, "zero bytes"), (4, "decord could not open")):
        hits = [m for m in warned if names[row] in m]
        assert len(hits) == 1 and reason in hits[0]  # once per path, however often drawn
    assert set(stats.skipped_paths) <= {str(manifest.parent.resolve() / names[r]) for r in bad}

    # resuming across bad files reproduces the same continuation
    with VideoDecoder(cfg, seed=7, caption_max_bytes=16) as a:
        first = _batches(a, 4)
    with VideoDecoder(cfg, seed=7, caption_max_bytes=16, start_position=int(first[1]["position"])) as b:
        resumed = _batches(b, 2)
    for x, y in zip(first[2:], resumed):
        _assert_same({k: v for k, v in x.items() if k != "skipped"}, {k: v for k, v in y.items() if k != "skipped"})
    # ``skipped`` counts this decoder's own skips: the resumed one starts from zero
    assert int(resumed[-1]["skipped"]) == int(first[-1]["skipped"]) - int(first[1]["skipped"])


def test_decoder_all_bad_raises_clearly(tmp_path):
    (tmp_path / "zero.mp4").write_bytes(b"")
    manifest = write_manifest([{"path": "zero.mp4"}, {"path": "missing.mp4"}], tmp_path / "m.parquet")
    with VideoDecoder(_cfg(manifest), seed=0, caption_max_bytes=8) as dec:
        for _ in range(2):  # the error stays visible on later calls
            with pytest.raises(RuntimeError, match=r"no row of manifest.*(zero|missing)\.mp4"):
                dec.next_batch()


def test_decoder_thread_error_reaches_caller(manifest, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("resize bug (simulated)")

    monkeypatch.setattr(clips_mod, "resize_crop", broken)
    dec = VideoDecoder(_cfg(manifest), seed=0, caption_max_bytes=8)
    with pytest.raises(ValueError, match="simulated"):
        dec.next_batch()
    dec.close()
    dec.close()
    with pytest.raises(RuntimeError, match="after close"):
        dec.next_batch()


# ---------------------------------------------------------------------------------------------
# Clip-sampling options, bad-fraction stop, config checks
# ---------------------------------------------------------------------------------------------


def test_clip_offsets_and_starts():
    np.testing.assert_array_equal(clips_mod.clip_offsets(4, 3), [0, 3, 6, 9])
    # 30 fps source sampled at 8 fps: every 3.75 frames, rounded
    np.testing.assert_array_equal(clips_mod.clip_offsets(5, 1, 30.0, 8.0), [0, 4, 8, 11, 15])
    np.testing.assert_array_equal(clips_mod.clip_offsets(3, 1, 8.0, 16.0), [0, 1, 1])  # faster target: repeats
    assert clips_mod.clip_start(40, 16, 0, 5, random=False, fixed="first") == 0
    assert clips_mod.clip_start(40, 16, 0, 5, random=False, fixed="center") == 12
    starts = {clips_mod.clip_start(40, 16, 3, p, random=True) for p in range(50)}
    assert min(starts) >= 0 and max(starts) <= 24 and len(starts) > 5
    assert clips_mod.clip_start(10, 16, 3, 1, random=True) == 0  # does not fit: starts at 0 (then loops)


def test_fixed_center_fps_and_random_spatial_crop(tmp_path):
    path = tmp_path / "v.mp4"
    frames = np.zeros((40, 32, 64, 3), dtype=np.uint8)  # gray levels survive yuv420p; colours blur
    frames[:, :16] = (np.arange(40) * 6)[:, None, None, None]  # top half: the frame number
    frames[:, 16:] = (np.arange(64) * 4)[None, None, :, None]  # bottom half: the column
    write_video(path, frames)
    manifest = write_manifest([{"path": "v.mp4"}], tmp_path / "m.parquet")

    def clip(seed=0, **kw):
        cfg = _cfg(manifest, num_frames=4, height=32, width=32, batch_size=1, frame_stride=1, **kw)
        with VideoDecoder(cfg, seed=seed, caption_max_bytes=8) as dec:
            return dec.next_batch()["video"][0].astype(int)  # (F, H, W, 3)

    def frame_numbers(v):
        return np.round(v[:, 4, 16, 0] / 6).astype(int).tolist()

    assert frame_numbers(clip(random_crop=False)) == [0, 1, 2, 3]
    assert frame_numbers(clip(random_crop=False, fixed_start="center")) == [18, 19, 20, 21]
    # data.fps=4 on an 8 fps video: every second frame
    assert frame_numbers(clip(random_crop=False, fps=4.0)) == [0, 2, 4, 6]
    center = clip(random_crop=False)
    assert abs(center[0, 24, 0, 1] - 16 * 4) <= 8  # columns 16..47 of 64
    lefts = {int(round(clip(seed=s, random_crop=False, spatial_crop="random")[0, 24, 0, 1] / 4)) for s in range(6)}
    assert len(lefts) > 1 and all(0 <= x <= 32 for x in lefts)
    again = clip(seed=2, random_crop=False, spatial_crop="random")
    np.testing.assert_array_equal(again, clip(seed=2, random_crop=False, spatial_crop="random"))  # per seed


def test_short_clips_skip_or_loop(tmp_path):
    for i, n in enumerate((6, 20)):
        _solid_video(tmp_path / f"v{i}.mp4", num_frames=n, seed=i)
    manifest = write_manifest([{"path": "v0.mp4"}, {"path": "v1.mp4"}], tmp_path / "m.parquet")
    cfg = _cfg(manifest, num_frames=8, frame_stride=1, batch_size=2, max_bad_fraction=1.0)
    with VideoDecoder(cfg, seed=0, caption_max_bytes=8) as dec:
        assert sorted(dec.next_batch()["index"].tolist()) == [0, 1]  # looped
    with VideoDecoder(dataclasses.replace(cfg, short_clips="skip"), seed=0, caption_max_bytes=8) as dec:
        b = dec.next_batch()
        assert b["index"].tolist() == [1, 1] and int(b["skipped"]) >= 1
        assert "v0.mp4" in dec.stats().skipped_paths[0]


def test_decoder_stops_when_too_many_files_are_bad(tmp_path, caplog):
    _solid_video(tmp_path / "good.mp4")
    for i in range(3):
        (tmp_path / f"zero{i}.mp4").write_bytes(b"")
    names = ["good.mp4", "zero0.mp4", "zero1.mp4", "zero2.mp4"]
    manifest = write_manifest([{"path": n} for n in names], tmp_path / "m.parquet")
    with VideoDecoder(_cfg(manifest, batch_size=2), seed=0, caption_max_bytes=8) as dec:
        with pytest.raises(RuntimeError, match=r"3 of the 4 distinct manifest rows.*75% > data.max_bad_fraction=0.5"
                                               r".*zero\d\.mp4: zero bytes.*megaslide_ray\.index"):
            dec.next_batch()
    # at the limit it goes on; the rows known bad (from a replaced decoder) count as skipped, unlogged
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=decoder_mod.__name__):
        with VideoDecoder(_cfg(manifest, batch_size=2, max_bad_fraction=0.75), seed=0, caption_max_bytes=8,
                          skipped_before=5, bad_rows={1: "decode timed out after 1 s"}) as dec:
            b = dec.next_batch()
    assert b["index"].tolist() == [0, 0] and int(b["skipped"]) > 5
    assert not [r for r in caplog.records if "zero0.mp4" in r.getMessage()]
