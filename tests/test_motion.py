"""The motion set (shapes at stated speeds and directions, bounces, occluders, a held-out split)
and the model-free motion-fidelity metric: near-perfect on the ground-truth clips read back from
their mp4s, clearly worse on shuffled, frozen and jittered frames, on flicker and on a shape
that changes."""

import json
import math

import numpy as np
import pytest

from megaslide_ray import motion_metric as motion_metric_cli
from megaslide_ray.data import motion_set as M
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation import motion_score as MM


@pytest.fixture(scope="module")
def motion_set(tmp_path_factory):
    """``[(caption, frames decoded from the mp4, plan)]`` of a small set, train and val."""
    root = tmp_path_factory.mktemp("motion")
    train, val = M.ensure_motion_dataset(root, num_train=16, num_val=8)
    truth = M.load_ground_truth(train)
    clips = []
    for manifest in (train, val):
        for e in read_manifest(manifest):
            plan = truth[e.path.rsplit("/", 1)[-1]]
            clips.append((e.caption, MM.read_video(e.path), plan))
    return train, val, clips


@pytest.fixture
def stand_in_motion_set(motion_set, monkeypatch):
    """``motion_set``, which the studies (benchmarks/studies/) find where they look for the
    cached motion set (``ensure_motion_dataset``, whatever variant they ask for)."""
    train, val, _ = motion_set
    monkeypatch.setattr(M, "ensure_motion_dataset", lambda *a, **k: (train, val))
    return motion_set


def test_the_set_and_its_held_out_split(motion_set, tmp_path):
    train, val, clips = motion_set
    combo = [(p["colour"], p["shape"], p["direction"], p["speed"]) for _, _, p in clips]
    combos = {"train": combo[:16], "val": combo[16:]}  # the fixture lists train, then val
    assert len(combos["train"]) == 16 and len(combos["val"]) == 8
    assert all(M.is_held_out(*c) for c in combos["val"]) and not any(M.is_held_out(*c) for c in combos["train"])
    assert not set(combos["train"]) & set(combos["val"])
    for caption, frames, plan in clips:
        assert frames.shape == (M.NUM_FRAMES, M.HEIGHT, M.WIDTH, 3)
        want = MM.parse_caption(caption)
        assert (want.colour, want.shape, want.direction, want.speed) == (
            plan["colour"], plan["shape"], plan["direction"], plan["speed_px"])
        assert ("bouncing" in caption) == plan["bounces"] and ("gray bar" in caption) == bool(plan["occluder"])
        # the caption's velocity holds for the first steps
        v = np.diff(np.asarray(plan["centres"]), axis=0)[: M.CLEAR_STEPS]
        assert np.allclose(v, np.asarray(want.unit) * want.speed)
    plans = [p for _, _, p in clips]
    assert any(p["bounces"] for p in plans) and any(p["occluder"] for p in plans)
    # fast: more than 2 tokens of tiny's 4-px patches per 2-frame patch frame
    assert any(p["speed_px"] * 2 / 4 > 2 for p in plans)
    # deterministic: another build makes the same clips
    again_train, _ = M.ensure_motion_dataset(tmp_path, num_train=16, num_val=8)
    assert (again_train.parent / M.GROUND_TRUTH).read_text() == (train.parent / M.GROUND_TRUTH).read_text()


def test_the_simple_variant_states_all_its_motion(tmp_path):
    from benchmarks.studies.harness import shows_prompt
    from megaslide_ray.data.clips import resize_crop

    train, val = M.ensure_motion_dataset(tmp_path, num_train=12, num_val=4, variant="simple")
    assert train.parent.name == f"{M.SIMPLE_VERSION}-n12-4"
    truth = M.load_ground_truth(train)
    shown = []
    for manifest, held_out in ((train, False), (val, True)):
        for e in read_manifest(manifest):
            plan = truth[e.path.rsplit("/", 1)[-1]]
            frames = MM.read_video(e.path)
            assert frames.shape == (M.SIMPLE_FRAMES, M.HEIGHT, M.WIDTH, 3) and e.num_frames == M.SIMPLE_FRAMES
            assert M.is_held_out(plan["colour"], plan["shape"], plan["direction"], plan["speed"]) == held_out
            assert plan["speed"] in M.SIMPLE_SPEEDS and plan["occluder"] is None and not plan["bounces"]
            assert e.caption == (f"a {plan['colour']} {plan['shape']} moving {plan['direction']} {plan['speed']} "
                                 f"on a {plan['background']} background")
            # the whole shape stays inside the frame: the caption's velocity holds at every step
            c = np.asarray(plan["centres"])
            r = M.SIMPLE_RADIUS
            assert (c >= r - 1e-9).all() and (c <= M.WIDTH - r + 1e-9).all()
            want = MM.parse_caption(e.caption)
            assert np.allclose(np.diff(c, axis=0), np.asarray(want.unit) * want.speed)
            # the clip, at the tiny-motion preset's 16x16, shows its caption to the metric
            shown.append(shows_prompt(MM.motion_fidelity(resize_crop(frames, 16, 16), e.caption)))
    assert sum(shown) >= 0.8 * len(shown), shown
    with pytest.raises(ValueError, match="variant='huge'"):
        M.ensure_motion_dataset(tmp_path, variant="huge")


def test_captions_parse_and_unknown_ones_are_refused():
    c = MM.parse_caption("a red circle moving up-right very fast on a dark blue background, bouncing off the edges")
    assert (c.colour, c.shape, c.direction, c.speed) == ("red", "circle", "up-right", 8.0)
    assert MM.parse_caption("A white square moving left at medium speed").speed == 2.5
    with pytest.raises(ValueError, match="does not say"):
        MM.parse_caption("a cat on a mat")


def _scores(clips, corrupt=None, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for caption, frames, plan in clips:
        f = frames if corrupt is None else corrupt(frames.copy(), rng)
        out.append(MM.motion_fidelity(f, caption))
    return out


def test_ground_truth_scores_near_perfect(motion_set):
    _, _, clips = motion_set
    scores = _scores(clips)
    for r in scores:
        assert r["detection_rate"] >= 0.9
        assert r["trajectory_error"] < 0.6 and r["speed_error"] < 0.4, r
        assert r["area_cv"] < 0.1 and r["colour_std"] < 4 and r["flicker"] < 1.0, r
    mean = {k: np.mean([r[k] for r in scores]) for k in MM.KEYS}
    assert mean["trajectory_error"] < 0.3 and mean["direction_error_deg"] < 10
    assert min(r["shape_match"] for r in scores) >= 0.9, [r["shape_match"] for r in scores]


def test_a_downscaled_clip_is_judged_at_its_own_scale(motion_set):
    # a 32x32 run (``--data.height 32 --data.width 32``) sees the set at half size: half the speeds
    _, _, clips = motion_set
    for caption, frames, plan in clips:
        small = frames.reshape(len(frames), 32, 2, 32, 2, 3).mean(axis=(2, 4)).round().astype(np.uint8)
        r = MM.motion_fidelity(small, caption)
        assert r["speed"] == pytest.approx(plan["speed_px"] / 2)
        # detection: the 18-px triangle behind the occluder drops below min_area in some frames
        assert r["detection_rate"] >= 0.6 and r["trajectory_error"] < 0.6 and r["direction_error_deg"] < 30, r


def test_noise_holds_no_object():
    # what an untrained model samples: every colour appears in scattered pixels, never as a shape
    rng = np.random.default_rng(0)
    for frames in (rng.standard_normal((16, 64, 64, 3)), rng.integers(0, 256, (16, 64, 64, 3), dtype=np.uint8)):
        r = MM.motion_fidelity(frames, "a red circle moving right fast on a black background")
        assert r["detection_rate"] == 0.0 and np.isnan(r["direction_error_deg"]), r


def test_a_caption_naming_another_shape_does_not_match(motion_set):
    _, _, clips = motion_set
    for caption, frames, _ in clips:
        said = MM.parse_caption(caption).shape
        for other in MM.SHAPES:
            if other != said:
                r = MM.motion_fidelity(frames, caption.replace(f" {said} ", f" {other} "))
                assert r["shape_match"] <= 0.1, (caption, other, r["shape_match"])


def _shuffle(f, rng):
    perm = rng.permutation(len(f))
    while (perm == np.arange(len(f))).all():
        perm = rng.permutation(len(f))
    return f[perm]


def _freeze(f, rng):
    return f[np.arange(len(f)) // 2 * 2]  # every second frame held: the clip stutters


def _jitter(f, rng):
    for t in range(len(f)):
        dy, dx = rng.integers(-3, 4, size=2)
        f[t] = np.roll(f[t], (dy, dx), axis=(0, 1))
    return f


@pytest.mark.parametrize("corrupt", [_shuffle, _freeze, _jitter], ids=["shuffled", "frozen", "jitter"])
def test_corrupted_motion_scores_clearly_worse(motion_set, corrupt):
    _, _, clips = motion_set
    truth, bad = _scores(clips), _scores(clips, corrupt)
    worse = [b["trajectory_error"] - t["trajectory_error"] for t, b in zip(truth, bad)
             if np.isfinite(b["trajectory_error"])]
    assert len(worse) >= 0.9 * len(clips)
    # every clip is worse by more than half a pixel per frame, on average by more than 2 (GT: about 0.1;
    # measured: shuffled about 15, frozen 4, jitter 3.7)
    assert min(worse) > 0.5 and np.mean(worse) > 2.0, worse


def test_a_frozen_clip_scores_its_speed(motion_set):
    _, _, clips = motion_set
    for caption, frames, plan in clips:
        r = MM.motion_fidelity(np.repeat(frames[:1], len(frames), axis=0), caption)
        assert r["speed_error"] == pytest.approx(plan["speed_px"], abs=0.05)
        assert r["trajectory_error"] > 0.8 * plan["speed_px"]


def test_flicker_and_shape_changes_are_caught(motion_set):
    _, _, clips = motion_set
    truth = _scores(clips)

    def flicker(f, rng):  # the brightness alternates by 10 levels from frame to frame
        offset = 20 + 10 * (np.arange(len(f)) % 2)
        return np.clip(f.astype(int) + offset[:, None, None, None], 0, 255).astype(np.uint8)

    flick = _scores(clips, flicker)
    assert all(b["flicker"] > t["flicker"] + 8 for t, b in zip(truth, flick)), [b["flicker"] for b in flick]
    grown, recoloured = [], []
    for (caption, frames, _), t in zip(clips, truth):
        rgb = MM.parse_caption(caption).rgb
        mask = np.abs(frames.astype(int) - rgb).max(axis=-1) <= 50
        big, dim = frames.copy(), frames.copy()
        for i in range(1, len(frames), 2):  # odd frames: the object 2 px larger all round, or dimmer
            m = mask[i].copy()
            for dy, dx in ((1, 0), (-1, 0), (0, 1), (0, -1), (2, 0), (-2, 0), (0, 2), (0, -2)):
                m |= np.roll(mask[i], (dy, dx), axis=(0, 1))
            big[i][m] = rgb
            dim[i][mask[i]] = (np.asarray(rgb) * 0.85).astype(np.uint8)  # still within the colour tolerance
        grown.append(MM.motion_fidelity(big, caption)["area_cv"] - t["area_cv"])
        recoloured.append(MM.motion_fidelity(dim, caption)["colour_std"] - t["colour_std"])
    assert np.mean(grown) > 0.2 and sum(g > 0.1 for g in grown) >= 0.9 * len(grown), grown
    assert min(recoloured) > 3 and np.mean(recoloured) > 6, recoloured


def test_float_clips_score_like_uint8(motion_set):
    caption, frames, _ = motion_set[2][0]
    want = MM.motion_fidelity(frames, caption)
    for scaled in (frames / 127.5 - 1.0, frames / 255.0, frames.astype(np.float32)):
        got = MM.motion_fidelity(scaled, caption)
        assert got["trajectory_error"] == pytest.approx(want["trajectory_error"], abs=1e-9)


def test_metric_cli(motion_set, capsys):
    train, _, clips = motion_set
    caption, _, _ = clips[0]
    path = read_manifest(train)[0].path
    assert motion_metric_cli.main([path, "--caption", caption, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["trajectory_error"] < 0.6 and r["detection_rate"] >= 0.9
    assert motion_metric_cli.main([str(train)]) == 0
    out = capsys.readouterr().out
    assert out.count("trajectory_error") == 17 and out.splitlines()[-1].startswith("mean:")
    assert motion_metric_cli.main([path]) == 2


def test_train_demo_motion_sets_the_data_and_validation(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGASLIDE_CACHE", str(tmp_path))
    from megaslide_ray.train import main

    assert main(["--demo", "motion", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert f'manifest = "{tmp_path / M.MOTION_VERSION / M.TRAIN_MANIFEST}"' in out
    assert f'val_manifest = "{tmp_path / M.MOTION_VERSION / M.VAL_MANIFEST}"' in out
    assert "eval_every = 10" in out


def test_train_demo_motion_simple_with_its_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGASLIDE_CACHE", str(tmp_path))
    from megaslide_ray.train import main

    assert main(["--preset", "tiny-motion", "--demo", "motion-simple", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert f'manifest = "{tmp_path / M.SIMPLE_VERSION / M.TRAIN_MANIFEST}"' in out
    assert f'val_manifest = "{tmp_path / M.SIMPLE_VERSION / M.VAL_MANIFEST}"' in out
    assert "eval_every = 600" in out and 'preset = "tiny-motion"' in out


@pytest.mark.slow  # a benchmark end to end (10-20 s): the default run stays under 10 minutes
def test_learning_benchmark_scores_samples_at_each_checkpoint(stand_in_motion_set, tmp_path):
    # benchmarks.studies.learning end to end at the smallest size: an untrained model samples noise,
    # which holds no object, so no sample shows its prompt yet
    from benchmarks.studies import learning
    from benchmarks.studies.harness import shows_prompt

    out = tmp_path / "learning"
    assert learning.main(["--steps", "2", "--every", "1", "--prompts", "2", "--threads", "1", "--out", str(out),
                          "--set", "model.depth", "1", "--set", "data.height", "32", "--set", "data.width", "32"]) == 0
    got = json.loads((out / "learning.json").read_text())
    assert [p["step"] for p in got["points"]] == [1, 2]
    for p in got["points"]:
        assert len(p["samples"]) == 2 and p["shown"] == 0.0 and p["detection_rate"] < 0.2
    assert got["meta"]["first_step_half_shown"] is None
    assert (out / "learning_step_2.png").is_file() and "none within 2 steps" in (out / "learning.md").read_text()
    # the criterion can be met: every ground-truth clip shows its caption; a frozen one does not
    _, _, clips = stand_in_motion_set
    assert all(shows_prompt(r) for r in _scores(clips))
    assert not any(shows_prompt(r) for r in _scores(clips, lambda f, rng: np.repeat(f[:1], len(f), 0)))


@pytest.mark.slow  # a benchmark end to end (about 15 s): the default run stays under 10 minutes
def test_quality_benchmark_resumes_the_runs_it_has(stand_in_motion_set, tmp_path, capsys):
    # benchmarks.studies.quality writes each finished (kind, seed) to runs.jsonl; --resume reuses them
    # and runs only the rest, and refuses a file made with other settings
    from benchmarks.studies import quality

    out = tmp_path / "quality"
    args = ["--steps", "2", "--evals", "1", "--samples", "1", "--val-clips", "2", "--threads", "1", "--json",
            "--kinds", "swin", "dsa", "--out", str(out), "--set", "model.depth", "1",
            "--set", "data.height", "32", "--set", "data.width", "32"]
    assert quality.main(args + ["--seeds", "0"]) == 0
    first = [json.loads(line)["run"] for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["seed"]) for r in first] == [("swin", 0), ("dsa", 0)]
    # the same fixed-noise loss on training clips: other clips than the held-out ones
    for r in first:
        assert math.isfinite(r["train_split_loss"]) and r["train_split_loss"] != r["val_loss"]
        assert [p["train_split_loss"] for p in r["val_curve"]][-1] == r["train_split_loss"]
    capsys.readouterr()
    assert quality.main(args + ["--seeds", "0", "1", "--resume"]) == 0
    captured = capsys.readouterr()
    assert captured.err.count("from ") == 2 and "swin seed 1:" in captured.err
    rows = {r["kind"]: r for r in map(json.loads, captured.out.splitlines())}
    assert rows["swin"]["seeds"] == rows["dsa"]["seeds"] == 2
    got = json.loads((out / "quality.json").read_text())
    assert got["runs"][:2] == first and got["meta"]["resumed_runs"] == 2
    assert all(0.0 <= r["shown"] <= 1.0 for r in got["summary"])
    with pytest.raises(SystemExit, match="other settings"):
        quality.main([a if a != "2" else "3" for a in args] + ["--seeds", "0", "--resume"])

    # benchmarks.studies.region_loss on the same folder: every saved kind, both splits, object and
    # background
    from benchmarks.studies import region_loss

    cfg, _, _ = quality.saved_model(out, "dsa", 0)
    capsys.readouterr()
    assert region_loss.main(["--quality", str(out), "--clips", "2", "--threads", "1", "--json"]) == 0
    regions = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in regions] == ["swin", "dsa"]
    for r in regions:
        for split in ("held_out", "train"):
            got_split = r[split]
            assert 0 < got_split["object_pixels"] < 0.5 and len(got_split["object_buckets"]) == cfg.training.val_t_buckets
            assert all(math.isfinite(got_split[k]) and got_split[k] > 0 for k in ("object", "background"))


@pytest.mark.slow  # a benchmark end to end (10-20 s): the default run stays under 10 minutes
def test_offset_signal_benchmark(stand_in_motion_set, capsys):
    # the fresh model's attention gates are zero (adaLN-Zero): no gradient reaches the offsets,
    # every cosine is exactly 0; a few steps later the gradient exists and the cosines are real numbers
    from benchmarks.studies import offset_signal

    assert offset_signal.main(["--seeds", "0", "--steps", "0", "3", "--clips", "4", "--threads", "1", "--json",
                               "--set", "model.depth", "1", "--set", "data.height", "32",
                               "--set", "data.width", "32"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in rows] == [0, 3]
    assert sum(g["clips"] for g in rows[0]["groups"].values()) == 4
    assert all(c == 0.0 for g in rows[0]["groups"].values() for k in ("cosine_by_block", "offset_cosine_by_block")
               for c in g[k])  # (the fresh offset head is zero too)
    later = [c for g in rows[1]["groups"].values() for c in g["cosine_by_block"]]
    assert all(-1.0 <= c <= 1.0 for c in later) and any(c != 0.0 for c in later), later


def test_region_masks_cover_the_object_and_the_background():
    # benchmarks.studies.region_loss splits the loss by the ground truth: inside one radius of the
    # centre the rendered frames hold the object's colour, beyond 1.5 radii the background's; also at a
    # lower resolution, as the decoder resizes the clips
    from benchmarks.studies.region_loss import region_masks
    from megaslide_ray.data.clips import resize_crop

    rng = np.random.default_rng(3)
    for shape in ("circle", "square", "triangle"):
        plan = {**M.plan_simple_clip(rng, held_out=False), "shape": shape}
        frames = M.render_clip(plan)
        fg = np.asarray(M.COLOURS[plan["colour"]], dtype=np.float64)
        bg = np.asarray(M.BACKGROUNDS[plan["background"]], dtype=np.float64)
        for size in (M.HEIGHT, M.HEIGHT // 4):
            clip = frames if size == M.HEIGHT else resize_crop(frames, size, size)
            obj, back = region_masks(plan, len(clip), size, size)
            assert obj.any() and back.any() and not (obj & back).any()
            pixels = clip.astype(np.float64)
            tol = 8 if size == M.HEIGHT else 40  # a 4x downscale blends the outline into its neighbours
            if shape == "circle":  # the triangle and square do not fill their radius' circle
                assert np.abs(pixels[obj.numpy()] - fg).mean() < tol, (shape, size)
            assert np.abs(pixels[back.numpy()] - bg).max() < (1 if size == M.HEIGHT else 2 * tol), (shape, size)
