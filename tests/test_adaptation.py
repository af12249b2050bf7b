"""The adaptation study (benchmarks/studies/adaptation.py): a dense teacher converted to dsa starts
exactly as neighborhood, for both architectures; the study end to end at the smallest size, and
resumed with a dsa variant; the temporal-consistency score and the Wan text stand-in."""

import importlib.util
import json

import numpy as np
import pytest
import torch

from benchmarks.studies import adaptation, offset_extent
from benchmarks.studies.consistency import temporal_consistency
from benchmarks.studies.harness import study_config
from benchmarks.studies.wan_motion import WAN_OVERRIDES, caption_condition, caption_text
from megaslide_ray.data import motion_set as M
from megaslide_ray.data.manifest import read_manifest
from megaslide_ray.evaluation import motion_score as MM
from megaslide_ray.models.registry import build_model
from megaslide_ray.training.baseline import InProcessTrainer

SMALL = {"model.depth": 2, "attention.window": "3,3,3"}


@pytest.fixture(scope="module")
def small_motion_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("motion")
    train, val = M.ensure_motion_dataset(root, num_train=16, num_val=8)
    return train, val


@pytest.fixture
def stand_in(small_motion_set, monkeypatch):
    monkeypatch.setattr(M, "ensure_motion_dataset", lambda *a, **k: small_motion_set)
    return small_motion_set


def _teacher(arch: str) -> tuple[dict, dict]:
    """A dense model's weights, every parameter moved off its initial value (zero-initialised
    layers included), and the overrides of its architecture."""
    over = {**SMALL, **(WAN_OVERRIDES if arch == "wan" else {}), "attention.kind": "dense"}
    model = build_model(study_config("tiny-motion", over), seed=3)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.clone() for k, v in model.state_dict().items()}, over


@pytest.mark.parametrize("arch", ["videodit", "wan"])
def test_dsa_adapted_from_a_dense_teacher_starts_exactly_as_neighborhood(arch):
    teacher, over = _teacher(arch)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 16, 16, 3, generator=g)
    t = torch.tensor([0.3, 0.9])
    if arch == "wan":
        cond, cond_len = (torch.from_numpy(np.concatenate(z)) for z in zip(
            caption_condition("a red circle moving right fast on a dark blue background"),
            caption_condition("a blue square moving up slowly on a black background")))
    else:
        cond, cond_len = torch.randint(0, 255, (2, 128), dtype=torch.uint8), torch.tensor([40, 60])
    outs, losses = {}, {}
    for kind in ("neighborhood", "dsa"):
        cfg = study_config("tiny-motion", {**over, "attention.kind": kind})
        trainer = InProcessTrainer(cfg, threads=1)
        fresh = adaptation.load_teacher(trainer.model, teacher)
        assert all(".offsets." in n for n in fresh) and (len(fresh) > 0) == (kind == "dsa")
        with torch.no_grad():
            outs[kind] = trainer.model(x, t, cond, cond_len)
        batch = ({"latents": x.numpy(), "text": cond.numpy(), "text_len": cond_len.numpy()} if arch == "wan" else
                 {"video": ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy(), "caption": cond.numpy(),
                  "caption_len": cond_len.numpy()})
        losses[kind] = trainer.train_step(batch).loss
    # bit for bit: the converted model is neighborhood attention until its offsets move
    assert torch.equal(outs["dsa"], outs["neighborhood"])
    assert losses["dsa"] == losses["neighborhood"]


def test_a_teacher_that_does_not_fit_is_refused():
    teacher, over = _teacher("videodit")
    model = build_model(study_config("tiny-motion", {**over, "model.depth": 3}))
    with pytest.raises(ValueError, match="does not fit"):
        adaptation.load_teacher(model, teacher)


@pytest.mark.slow  # 10 s of Ray: the study's parts have unit tests in the default run
def test_the_study_end_to_end_and_a_variant_added_on_resume(stand_in, tmp_path, capsys):
    out = tmp_path / "adaptation"
    args = ["--teacher-steps", "2", "--steps", "2", "--evals", "1", "--seeds", "0", "--samples", "1",
            "--val-clips", "2", "--threads", "1", "--set", "model.depth", "1", "--out", str(out)]
    assert adaptation.main(args) == 0
    runs = [json.loads(line)["run"] for line in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in runs] == ["teacher", "dense", "swin", "neighborhood", "dsa"]
    by = {r["kind"]: r for r in runs}
    # step 0 is the teacher converted: dsa and neighborhood the same to the bit, the teacher's
    # own numbers for dense
    for key in ("loss", "x0", "teacher_dist", "train_split_loss"):
        assert by["dsa"]["curve"][0][key] == by["neighborhood"]["curve"][0][key]
    assert by["dense"]["curve"][0]["loss"] == by["teacher"]["loss"] and by["dense"]["curve"][0]["teacher_dist"] == 0
    assert [p["step"] for p in by["dsa"]["curve"]] == [0, 2]
    for r in runs:
        assert len(r["buckets"]) == 4 and abs(r["loss_ge25"] - np.mean(r["buckets"][1:])) < 1e-12
        assert len(r["train_samples"]) == len(r["samples"]) == 1 and 0 <= r["train_temporal_consistency"] <= 1
    assert len(by["dsa"]["offset_buckets"]) == 4 and "offset_buckets" not in by["neighborhood"]
    # the offsets' extent per head call (what the GPU kernels' choice follows), recorded by the run
    # and recomputed from the saved model by offset_extent: the same to the bit
    ext = by["dsa"]["offset_extent"]
    assert ext["calls"] > 0 and 0 <= ext["p99"] <= ext["p999"] <= ext["max"] and ext["median"] <= ext["max"]
    assert set(ext["over"]) == {"1.5", "2", "3"} and "offset_extent" not in by["neighborhood"]
    # the (query, head) pairs past each bound of the backward's split mode: some call has one past a
    # bound exactly when the largest extent passes it; fewer pairs past a larger bound
    marks = ["1", "1.5", "2", "2.5", "3"]
    assert list(ext["pairs_over"]) == list(ext["pairs_over_max"]) == marks
    for m in marks:
        assert (ext["pairs_over_max"][m] > 0) == (ext["max"] > float(m)) and ext["pairs_over"][m] <= ext["pairs_over_max"][m]
    assert all(ext["pairs_over"][a] >= ext["pairs_over"][b] for a, b in zip(marks, marks[1:]))
    assert offset_extent.extents(out) == [{"kind": "dsa", "seed": 0, "offset_extent": ext, "max_offset": None}]
    # each call's extent and shares, priced on a GPU shape by offset_extent --predict
    assert len(ext["per_call"]) == ext["calls"] and max(c[0] for c in ext["per_call"]) == round(ext["max"], 5)
    assert [max(c[i + 1] for c in ext["per_call"]) for i in range(len(marks))] == [
        round(ext["pairs_over_max"][m], 5) for m in marks]
    if importlib.util.find_spec("triton") is not None:
        priced = offset_extent.price(ext["per_call"], (21, 30, 52), (3, 7, 7), 128, None)
        assert priced["fwd_ms"] > 0 and priced["bwd_ms"] > 0
        assert abs(sum(priced["fwd"].values()) - 1) < 1e-9 and abs(sum(priced["bwd"].values()) - 1) < 1e-9
        assert priced["far"] == len(ext["per_call"])  # unbounded offsets: every call takes the split mode
        assert set(priced["bwd"]) == {"split"} and priced["far_bwd_ms"] == priced["bwd_ms"]
    text = (out / "adaptation.md").read_text()
    assert "Goals for `dsa`" in text and (out / "adaptation_videodit_curves.png").is_file()
    assert (out / "teachers" / "videodit_seed0.safetensors").is_file()
    capsys.readouterr()
    # a variant added to the finished study: only its run is trained, the teacher read back
    assert adaptation.main(args + ["--resume", "--kinds", "--dsa", "frozen", "study.offset_freeze=2"]) == 0
    err = capsys.readouterr().err
    assert "teacher seed 0: from" in err and "dsa+frozen seed 0:" in err and "swin seed 0:" not in err
    runs = [json.loads(line)["run"] for line in (out / "runs.jsonl").read_text().splitlines()]
    frozen = runs[-1]
    assert frozen["kind"] == "dsa+frozen" and len(runs) == 6
    # offsets held still for both steps: the run is neighborhood's to the bit
    assert frozen["offset_buckets"] == [0.0] * 4 and frozen["loss"] == by["neighborhood"]["loss"]
    assert "Goals for `dsa+frozen`" in (out / "adaptation.md").read_text()


def test_the_consistency_score_holds_for_the_motion_sets_clips_and_drops_for_noise(small_motion_set):
    train, _ = small_motion_set
    rng = np.random.default_rng(0)
    for e in read_manifest(train)[:4]:
        clip = MM.read_video(e.path)[:8]
        real = temporal_consistency(clip)
        assert real["subject_consistency"] > 0.8 and real["background_consistency"] > 0.97
        noisy = np.clip(clip.astype(int) + rng.normal(0, 40, clip.shape), 0, 255).astype(np.uint8)
        assert temporal_consistency(noisy)["temporal_consistency"] < real["temporal_consistency"] - 0.1
        gone = clip.copy()
        gone[1::2] = np.median(clip[0].reshape(-1, 3), axis=0).astype(np.uint8)  # the object in every other frame
        assert temporal_consistency(gone)["subject_consistency"] < 0.6
    blank = np.zeros((8, 16, 16, 3), dtype=np.uint8)
    assert temporal_consistency(blank) == {"subject_consistency": 0.0, "background_consistency": 1.0,
                                           "temporal_consistency": 0.5}


def test_the_wan_text_stand_in_keeps_words_and_their_order():
    a = caption_text("a red circle on a dark blue background")
    b = caption_text("a blue circle on a dark red background")
    assert a.shape == (8, 32) and torch.equal(a, caption_text("a red circle on a dark blue background"))
    assert not torch.allclose(a, b)
    text, n = caption_condition("a red circle")
    assert text.shape == (1, 16, 32) and n.tolist() == [3] and not text[0, 3:].any()
