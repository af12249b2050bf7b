"""Buckets (``data.buckets``): the index records sizes, lengths and images; rows go to buckets
deterministically; every batch is one bucket's shape, in an order a start position resumes
exactly; a corrupt file is skipped and counted; the config refuses a bucket the model cannot read;
the planner answers for the largest bucket. The Ray training through buckets and its exact
resume are at the end."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from actors.decoder import VideoDecoder
from megaslide_ray.config import ConfigError, DataConfig, build_config
from megaslide_ray.config.buckets import Bucket, config_buckets, largest_bucket, parse_buckets
from megaslide_ray.data.buckets import BucketSchedule, assign_bucket, row_buckets
from megaslide_ray.data.clips import resize_crop
from megaslide_ray.data.demo import write_video
from megaslide_ray.data.manifest import read_manifest, write_manifest
from megaslide_ray.data.video_index import index_videos

BUCKETS = "16x16x4,16x24x4,16x16x1"


def _video(path, frames, height, width, seed):
    rng = np.random.default_rng(seed)
    clip = rng.integers(0, 256, size=(frames, height, width, 3), dtype=np.uint8)
    write_video(path, clip)
    return clip


def _image(path, height, width, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return pixels


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A folder of two video sizes and lengths, two images (png, webp) and a corrupt jpg; its
    manifest as the index writes it."""
    root = tmp_path_factory.mktemp("mixed")
    for i in range(3):
        _video(root / f"square{i}.mp4", 6 + 2 * i, 32, 32, seed=i)
        _video(root / f"wide{i}.mp4", 8, 16, 24, seed=10 + i)
    _image(root / "still.png", 20, 20, seed=20)
    _image(root / "still2.webp", 24, 24, seed=21)
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 10)
    rows, problems = index_videos(root)
    path = write_manifest(rows, root / "manifest.parquet")
    return root, path, rows, problems


def test_index_records_size_length_and_images(mixed):
    root, _, rows, problems = mixed
    by_name = {Path(r.path).name: r for r in rows}
    assert (by_name["square2.mp4"].width, by_name["square2.mp4"].height, by_name["square2.mp4"].num_frames) == (32, 32, 10)
    assert (by_name["wide0.mp4"].width, by_name["wide0.mp4"].height, by_name["wide0.mp4"].num_frames) == (24, 16, 8)
    assert (by_name["still.png"].width, by_name["still.png"].height, by_name["still.png"].num_frames) == (20, 20, 1)
    assert by_name["still2.webp"].num_frames == 1 and by_name["still.png"].fps == 0.0
    assert [Path(p).name for p, _ in problems] == ["broken.jpg"] and "Pillow" in problems[0][1]
    no_images, _ = index_videos(root, images=False)
    assert sorted(Path(r.path).name for r in no_images) == sorted(f"{k}{i}.mp4" for k in ("square", "wide")
                                                                  for i in range(3))


def test_assignment_nearest_aspect_with_enough_frames():
    b = parse_buckets("16x16x4,16x24x4,16x16x1,24x16x8")
    assert assign_bucket(32, 32, 10, b) == 0      # square video
    assert assign_bucket(24, 16, 8, b) == 1       # 3:2 video
    assert assign_bucket(20, 20, 1, b) == 2       # an image: only the one-frame bucket is short enough
    assert assign_bucket(16, 24, 9, b) == 3       # portrait, long enough for 8 frames
    assert assign_bucket(16, 24, 5, b) == 0       # portrait, too short for 24x16x8: nearest of the rest
    assert assign_bucket(24, 16, 1, parse_buckets("16x24x4,16x16x2")) == 1  # shorter than all: fewest frames


def test_assignment_counts_the_frames_a_clip_gets_at_its_stride_or_rate():
    from megaslide_ray.data.manifest import ManifestEntry

    b = parse_buckets("16x16x4,16x16x8")
    video = [ManifestEntry(path="v.mp4", num_frames=10, fps=30.0, width=16, height=16)]
    assert row_buckets(video, b, "m") == [1]             # 10 consecutive frames: 8 fit
    assert row_buckets(video, b, "m", stride=2) == [0]   # every 2nd frame: 5, too few for 8
    assert row_buckets(video, b, "m", fps=15.0) == [0]   # resampled 30 -> 15 fps: 5
    assert row_buckets(video, b, "m", fps=30.0) == [1]


def test_schedule_is_deterministic_and_one_bucket_per_block():
    bucket_of = [0, 1, 0, 2, 1, 0, 0, 1, 2, 0]
    a, b = BucketSchedule(bucket_of, 3, 2, seed=7), BucketSchedule(bucket_of, 3, 2, seed=7)
    assert a.per_epoch == 3 + 2 + 1
    blocks = [a.block(p) for p in range(2 * a.per_epoch)]
    again = [b.block(p) for p in reversed(range(2 * b.per_epoch))][::-1]  # any order of asking: same blocks
    for (j, rows), (k, rows2) in zip(blocks, again):
        assert j == k and np.array_equal(rows, rows2)
        assert all(bucket_of[r] == j for r in rows)
    # an epoch's blocks cover every row of every bucket
    first = [r for j, rows in blocks[: a.per_epoch] for r in rows[:2]]
    assert set(first) == set(range(len(bucket_of)))
    other = BucketSchedule(bucket_of, 3, 2, seed=8)
    assert [j for j, _ in blocks] != [other.block(p)[0] for p in range(2 * a.per_epoch)]


def _data(manifest, **kw):
    return DataConfig(manifest=str(manifest), num_frames=4, height=16, width=16, batch_size=2, prefetch=1,
                      buckets=BUCKETS, **kw)


def test_decoder_batches_one_bucket_and_resumes(mixed):
    root, manifest, rows, _ = mixed
    d = _data(manifest)
    with VideoDecoder(d, 3, 32) as dec:
        batches = [dec.next_batch() for _ in range(8)]
    shapes = {b["video"].shape for b in batches}
    assert shapes == {(2, 4, 16, 16, 3), (2, 4, 16, 24, 3), (2, 1, 16, 16, 3)}
    entries = read_manifest(manifest)
    want = row_buckets(entries, parse_buckets(BUCKETS), "m")
    for b in batches:
        j = {(4, 16, 16): 0, (4, 16, 24): 1, (1, 16, 16): 2}[b["video"].shape[1:4]]
        assert all(want[r] == j for r in b["index"])
    assert [int(b["position"]) for b in batches] == list(range(1, 9))  # a bucketed position counts batches
    # an image row is its pixels, resized and centre-cropped
    image = next(b for b in batches if b["video"].shape[1] == 1)
    row = int(image["index"][0])
    pixels = np.array(Image.open(entries[row].path).convert("RGB"))[None]
    np.testing.assert_array_equal(image["video"][0], resize_crop(pixels, 16, 16))
    with VideoDecoder(d, 3, 32, start_position=5, skipped_before=int(batches[4]["skipped"])) as dec:
        resumed = [dec.next_batch() for _ in range(3)]
    for a, b in zip(batches[5:], resumed):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_decoder_ranks_split_the_blocks(mixed):
    """Two decoders of a pool: rank r's j-th batch is block r + 2 j of the one-decoder order."""
    d = _data(mixed[1])
    with VideoDecoder(d, 3, 32) as one:
        single = [one.next_batch() for _ in range(6)]
    for rank in (0, 1):
        with VideoDecoder(d, 3, 32, rank=rank, world_size=2) as dec:
            for j in range(3):
                got, want = dec.next_batch(), single[rank + 2 * j]
                for key in ("video", "index", "position", "caption"):
                    np.testing.assert_array_equal(got[key], want[key], err_msg=f"rank {rank} batch {j} {key}")


def test_index_cli_counts_images(mixed, tmp_path, capsys):
    from megaslide_ray.index import main

    assert main([str(mixed[0]), "--out", str(tmp_path / "m.parquet")]) == 0
    text = capsys.readouterr().out
    assert "8 usable" in text and "2 images" in text and "broken.jpg" in text
    assert main([str(mixed[0]), "--out", str(tmp_path / "v.parquet"), "--no-images"]) == 0
    assert "6 usable" in capsys.readouterr().out


def test_decoder_skips_and_counts_a_corrupt_file_in_its_bucket(mixed, tmp_path):
    root, manifest, _, _ = mixed
    entries = read_manifest(manifest)
    bad = tmp_path / "corrupt.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"junk" * 50)
    rows = [*entries, replace(entries[0], path=str(bad), width=20, height=20, num_frames=1, fps=0.0)]
    path = write_manifest(rows, tmp_path / "manifest.parquet")
    d = _data(path)
    with VideoDecoder(d, 3, 32) as dec:
        batches = [dec.next_batch() for _ in range(12)]
        stats = dec.stats()
    drawn_bad = sum(1 for b in batches if b["video"].shape[1] == 1)  # image blocks: the bad row is in that bucket
    assert drawn_bad > 0 and int(batches[-1]["skipped"]) > 0
    assert stats.skipped == int(batches[-1]["skipped"]) and str(bad) in stats.skipped_paths
    assert all(len(rows) - 1 not in b["index"] for b in batches)


def test_an_image_without_buckets_is_a_still_clip(mixed):
    from megaslide_ray.data.clips import decode_clip

    root = mixed[0]
    pixels = np.array(Image.open(root / "still.png").convert("RGB"))[None]
    clip = decode_clip(str(root / "still.png"), DataConfig(num_frames=3, height=12, width=16), 0, 0)
    assert clip.frames.shape == (3, 12, 16, 3) and clip.video_frames == 1
    for frame in clip.frames:
        np.testing.assert_array_equal(frame, resize_crop(pixels, 12, 16)[0])


def test_config_buckets_auto_and_refusals():
    cfg = build_config("tiny", None, {"data.buckets": "auto", "model.patch_size": "1,4,4",
                                      "attention.window": "1,3,3"})
    found = config_buckets(cfg)
    assert Bucket(64, 64, 16) in found and Bucket(64, 64, 1) in found
    assert all(b.height % 4 == 0 and b.width % 4 == 0 for b in found)
    assert "x" in cfg.data.buckets and "auto" not in cfg.data.buckets  # resolved: the run's config.toml lists them
    with pytest.raises(ConfigError, match="64x64x1.*patch size 2"):
        build_config("tiny", None, {"data.buckets": "64x64x16,64x64x1"})
    with pytest.raises(ConfigError, match="HEIGHTxWIDTHxFRAMES"):
        build_config("tiny", None, {"data.buckets": "64x64"})
    wan = build_config("wan2.1-t2v-1.3b", None, {"data.buckets": "480x832x81,720x1280x81,480x480x41"})
    big = largest_bucket(wan)
    assert (big.data.num_frames, big.data.height, big.data.width) == (81, 720, 1280)


def test_planner_answers_for_the_largest_bucket():
    from megaslide_ray.planning.estimate import plan

    base = build_config("wan2.1-t2v-1.3b", None, {"data.height": 720, "data.width": 1280})
    bucketed = build_config("wan2.1-t2v-1.3b", None, {"data.buckets": "480x832x81,720x1280x81"})
    a, b = plan(base), plan(bucketed)
    assert a.to_dict() == b.to_dict()
    assert plan(build_config("wan2.1-t2v-1.3b")).to_dict() != b.to_dict()  # the 480x832 bucket alone plans less


def test_rows_without_sizes_are_refused_with_the_fix(tmp_path):
    path = write_manifest([{"path": "a.mp4"}], tmp_path / "m.parquet")
    with pytest.raises(ValueError, match="megaslide_ray.index"):
        VideoDecoder(_data(path), 0, 32)


# ---------------------------------------------------------------------------------------------
# Through Ray: a short training on the mixed manifest, and its exact resume
# ---------------------------------------------------------------------------------------------

RAY_SMALL = {"model.depth": 2, "model.hidden_size": 32, "model.num_heads": 2, "model.caption_dim": 16,
             "model.patch_size": "1,4,4", "attention.window": "1,3,3", "data.num_frames": 4, "data.height": 16,
             "data.width": 16, "data.batch_size": 2, "data.buckets": BUCKETS, "training.log_every": 1,
             "training.steps": 6, "training.checkpoint_every": 3, "runtime.compute_threads": 1,
             "runtime.optimizer_threads": 1}


def _train(cfg, run_dir, steps=None, resume=False):
    from megaslide_ray.driver import Trainer

    trainer = Trainer(cfg, run_dir=str(run_dir), resume=resume, progress=False)
    try:
        if steps is None:
            return trainer.train()
        for step in range(trainer.start_step, steps):
            trainer.train_step(step)
        return None
    finally:
        trainer.close()


@pytest.mark.slow  # 70 s (three runs); test_wan_trains_through_latent_buckets runs buckets through Ray by default
def test_ray_training_through_buckets_resumes_bit_identical(ray_session, mixed, tmp_path):
    from megaslide_ray.state.checkpoint import read_checkpoint_shards

    _, source, _, _ = mixed
    entries = read_manifest(source)
    bad = tmp_path / "corrupt.png"  # in the image bucket: skipped, counted, its place taken by another image
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"junk" * 50)
    entries.append(replace(entries[0], path=str(bad), width=20, height=20, num_frames=1, fps=0.0))
    manifest = write_manifest(entries, tmp_path / "manifest.parquet")
    cfg = build_config("tiny", None, {**RAY_SMALL, "data.manifest": str(manifest)})
    straight = _train(cfg, tmp_path / "straight")
    metrics = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6] and all(np.isfinite(m["loss"]) for m in metrics)
    assert metrics[-1]["data_position"] == 6  # one block per step
    # each step's tokens are its bucket's: 2 clips of 4x4x4, 4x4x6 or 1x4x4 tokens
    assert {m["tokens"] for m in metrics} == {2 * 4 * 4 * 4, 2 * 4 * 4 * 6, 2 * 1 * 4 * 4}
    # the skipped draws of the corrupt row, from the documented block order
    schedule = BucketSchedule(row_buckets(entries, parse_buckets(BUCKETS), "m"), 3, 2, cfg.training.seed)
    expected = 0
    for p in range(6):
        rows, filled, t = schedule.block(p)[1], 0, 0
        while filled < 2:
            expected += int(rows[t % len(rows)]) == len(entries) - 1
            filled += int(rows[t % len(rows)]) != len(entries) - 1
            t += 1
    assert expected > 0 and metrics[-1]["skipped_files"] == expected

    _train(cfg, tmp_path / "resumed", steps=3)  # interrupted after the step-3 checkpoint
    resumed = _train(cfg, tmp_path / "resumed", resume=True)
    assert resumed.first_step == 3 and resumed.last_step == 6
    for i, (x, y) in enumerate(zip(read_checkpoint_shards(Path(resumed.checkpoint)),
                                   read_checkpoint_shards(Path(straight.checkpoint)))):
        assert torch.equal(x, y), f"shard {i} differs after resume"
    # resuming with other buckets (or none) would read the positions as other batches: refused
    from megaslide_ray.driver.preflight import check_resume_config

    check_resume_config(cfg, resumed.checkpoint)
    for other in ("16x16x4,16x16x1", ""):
        changed = build_config("tiny", None, {**RAY_SMALL, "data.manifest": str(manifest), "data.buckets": other})
        with pytest.raises(ConfigError, match="data.buckets"):
            check_resume_config(changed, resumed.checkpoint)


# ---------------------------------------------------------------------------------------------
# Precomputed latents keyed by bucket (the tiny random Wan folder)
# ---------------------------------------------------------------------------------------------

LATENT_BUCKETS = "32x32x9,32x48x9,32x32x1"


@pytest.fixture(scope="module")
def bucket_latents(wan_dir, tmp_path_factory):
    from pipelines.bucket_precompute import precompute_buckets

    root = tmp_path_factory.mktemp("latent-src")
    for i in range(2):
        _video(root / f"square{i}.mp4", 10, 32, 32, seed=30 + i)
        _video(root / f"wide{i}.mp4", 10, 32, 48, seed=40 + i)
    _image(root / "still.png", 40, 40, seed=50)
    rows, _ = index_videos(root)
    source = write_manifest(rows, root / "manifest.parquet")
    out = tmp_path_factory.mktemp("latents") / "cache"
    reports = precompute_buckets(wan_dir, source, out, parse_buckets(LATENT_BUCKETS), device="cpu", dtype="fp32",
                                 num_encoders=0, progress=False)
    return out / "manifest.parquet", reports


def test_precompute_keys_latents_by_bucket(bucket_latents, wan_dir, tmp_path):
    from megaslide_ray.data.checks import check_data
    from megaslide_ray.data.latents import load_latents, read_latent_manifest
    from megaslide_ray.state.pretrained_io import config_for_diffusers_dir

    manifest, reports = bucket_latents
    assert [(str(b), r.clips) for b, r in reports] == [("32x32x9", 2), ("32x48x9", 2), ("32x32x1", 1)]
    rows, meta = read_latent_manifest(manifest)
    shapes = sorted({(r["num_frames"], r["height"], r["width"], tuple(r["latent_shape"])) for r in rows})
    assert shapes == [(1, 32, 32, (1, 4, 4, 4)), (9, 32, 32, (3, 4, 4, 4)), (9, 32, 48, (3, 4, 6, 4))]
    assert meta["buckets"] == ["32x32x9", "32x48x9", "32x32x1"]
    for r in rows:  # the merged manifest's paths reach the sub-folders' files
        assert tuple(load_latents(manifest, r).shape) == tuple(r["latent_shape"])

    cfg = config_for_diffusers_dir(wan_dir, None, None, {
        "data.manifest": str(manifest), "data.num_frames": 9, "data.height": 32, "data.width": 32,
        "data.buckets": LATENT_BUCKETS, "data.batch_size": 1, "attention.kind": "dense",
        "runtime.state_dir": str(tmp_path)})
    check_data(cfg)  # every row's latents are its bucket's grid
    with VideoDecoder(cfg.data, 0, 32) as dec:
        got = {tuple(dec.next_batch()["latents"].shape) for _ in range(10)}
    assert got == {(1, 3, 4, 4, 4), (1, 3, 4, 6, 4), (1, 1, 4, 4, 4)}
    with pytest.raises(ConfigError, match="none of data.buckets"):
        check_data(replace(cfg, data=replace(cfg.data, buckets="32x32x9,32x48x9")))


@pytest.mark.slow  # 20 s: a Wan run through two buckets; the buckets' batching has unit tests in the default run
def test_wan_trains_through_latent_buckets(ray_session, bucket_latents, wan_dir, tmp_path):
    """The Wan model (rotary positions, DSA) takes a new latent shape every step through the actors."""
    from megaslide_ray.state.pretrained_io import config_for_diffusers_dir

    manifest, _ = bucket_latents
    cfg = config_for_diffusers_dir(wan_dir, None, None, {
        "data.manifest": str(manifest), "data.num_frames": 9, "data.height": 32, "data.width": 32,
        "data.buckets": LATENT_BUCKETS, "data.batch_size": 1, "attention.kind": "dsa", "attention.window": "1,1,1",
        "training.steps": 5, "training.log_every": 1, "runtime.state_dir": str(tmp_path)})
    summary = _train(cfg, tmp_path / "run")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary.last_step == 5 and all(np.isfinite(m["loss"]) for m in metrics)
    # 1 clip of 3x2x2, 3x2x3 or 1x2x2 tokens (1x2x2 patches of the latent grid): all three buckets seen
    assert {m["tokens"] for m in metrics} == {12, 18, 4}


def test_precompute_cli_takes_buckets_or_a_shape(tmp_path, capsys):
    from megaslide_ray import precompute as cli

    base = ["--model-dir", str(tmp_path), "--data", "m.parquet", "--out", str(tmp_path / "out")]
    for extra in ([], ["--buckets", "32x32x9", "--frames", "9", "--height", "32", "--width", "32"]):
        with pytest.raises(SystemExit) as e:
            cli.main(base + extra)
        assert e.value.code == 2 and "--buckets" in capsys.readouterr().err
