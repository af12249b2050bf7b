"""The Wan family's folders, as diffusers' own pipeline classes save them (tiny random models):
what each is is read from model_index.json and the transformer's config.json, and every folder
this project does not train (VACE, Animate, S2V, unknown) is refused by ``train --init-from``,
``precompute`` and ``sample --model-dir`` before any work, naming what it is (image-to-video
folders precompute, train and sample: test_wan_i2v_*.py); a Wan2.2 A14B folder is never trained as one transformer over every timestep."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import diffusers
import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from wan_models import BOUNDARY, FRAMES, LATENT_SHAPE, SIZE, make_family_dir, make_wan_dir

from actors.compute import ComputeActor, LocalStoreClient
from actors.param_store import ParameterStore
from megaslide_ray import precompute as precompute_cli
from megaslide_ray import train as train_cli
from megaslide_ray.config import ConfigError
from megaslide_ray.config.wan_folders import IMAGE_TO_VIDEO, describe_wan_folder
from megaslide_ray.data.demo import ensure_demo_dataset
from megaslide_ray.driver import Trainer
from megaslide_ray.evaluation.sampling import CheckpointWeights, check_model_files, sample_video
from megaslide_ray.evaluation.validation import evaluate_checkpoint
from megaslide_ray.models.diffusers_dsa import enable_dsa
from megaslide_ray.models.registry import expert_shards, num_shards
from megaslide_ray.models.wan_diffusers import from_diffusers
from megaslide_ray.state.checkpoint import latest_checkpoint, read_checkpoint_shards
from megaslide_ray.state.pretrained_io import (
    PretrainedMismatchError,
    check_pretrained,
    config_for_diffusers_dir,
    export_diffusers,
    model_names,
)
from megaslide_ray.training.flow import (
    HIGH,
    LOW,
    base_cdf,
    batch_flow_inputs,
    expert_t_range,
    flow_inputs,
    flow_loss,
    route_expert,
    step_expert,
)
from pipelines.latent_precompute import precompute

KINDS = ("t2v", "t2v-a14b", "i2v", "flf2v", "i2v-a14b", "vace")
CLIP = {"data.num_frames": 9, "data.height": 32, "data.width": 32, "attention.window": "3,1,1"}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """kind -> a tiny folder saved by diffusers' pipeline of that kind; also ``animate`` and
    ``s2v`` (a t2v folder whose model_index.json names those pipelines, which diffusers cannot
    build small here)."""
    root = tmp_path_factory.mktemp("family")
    base = make_wan_dir(root / "base")
    out = {kind: make_family_dir(base, root / kind, kind) for kind in KINDS}
    for kind, pipeline in (("animate", "WanAnimatePipeline"), ("s2v", "WanSpeechToVideoPipeline")):
        shutil.copytree(out["t2v"], root / kind)
        index = json.loads((root / kind / "model_index.json").read_text())
        (root / kind / "model_index.json").write_text(json.dumps({**index, "_class_name": pipeline}))
        out[kind] = root / kind
    return out


@pytest.mark.parametrize("kind", [*KINDS, "animate", "s2v"])
def test_the_kind_is_read_from_the_folder(family, kind):
    folder = describe_wan_folder(family[kind])
    assert folder.kind == kind
    assert folder.two_experts == (kind in ("t2v-a14b", "i2v-a14b"))
    assert folder.boundary_ratio == {"t2v-a14b": BOUNDARY, "i2v-a14b": 0.9}.get(kind)
    # A transformer folder is read with its model folder's model_index.json.
    expert = describe_wan_folder(family[kind] / "transformer")
    assert (expert.kind, expert.given) == (kind, "transformer")


REFUSED = {"i2v": "Wan2.1 image-to-video", "flf2v": "first-last-frame", "i2v-a14b": "I2V-A14B image-to-video",
           "vace": "Wan VACE", "animate": "Wan Animate", "s2v": "speech-to-video"}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_unsupported_folders_are_refused_everywhere_before_any_work(family, kind, tmp_path, capsys):
    path = family[kind]
    if kind not in IMAGE_TO_VIDEO:  # image-to-video trains: test_wan_i2v_train.py
        # train --init-from: refused while the config is built (before Ray), exit 2.
        assert train_cli.main(["--init-from", str(path), "--print-config"]) == 2
        err = capsys.readouterr().err
        assert REFUSED[kind] in err and str(path) in err
        # The launch path (check_pretrained, before Ray) refuses it as well.
        cfg = config_for_diffusers_dir(family["t2v"], None, None, CLIP)
        with pytest.raises(PretrainedMismatchError, match=REFUSED[kind]):
            check_pretrained(cfg, path)
    # precompute: refused before anything is read or written (image-to-video folders make their
    # image condition: test_wan_i2v_precompute.py).
    out = tmp_path / "cache"
    rc = precompute_cli.main(["--model-dir", str(path), "--data", str(tmp_path / "none.parquet"), "--out", str(out),
                              "--frames", "9", "--height", "32", "--width", "32", "--num-encoders", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert (REFUSED[kind] in err) == (kind not in IMAGE_TO_VIDEO)
    # sample --model-dir and from_diffusers (image-to-video: test_wan_i2v.py, test_wan_i2v_sample.py).
    if kind not in IMAGE_TO_VIDEO:
        with pytest.raises(ConfigError, match=REFUSED[kind]):
            check_model_files(path, ("vae",))
        with pytest.raises(ConfigError, match=REFUSED[kind]):
            from_diffusers(path)


def test_image_to_video_is_never_stored_as_text_to_video(family, tmp_path, capsys):
    """The tiny I2V-A14B's VAE makes 4 channels and its transformer reads 12 (noise, mask, image
    latents): the folder gives an image-to-video config, not a channel mismatch."""
    assert train_cli.main(["--init-from", str(family["i2v-a14b"]), "--training.expert", "both",
                           "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "in_channels = 12" in out and "out_channels = 4" in out


def test_a_two_expert_folder_needs_its_experts_named(family, capsys):
    """``--init-from`` an A14B model folder without ``training.expert`` is refused before Ray; a
    transformer folder of it sets its expert and the boundary; a contradiction is refused."""
    a14b = family["t2v-a14b"]
    assert train_cli.main(["--init-from", str(a14b), "--print-config"]) == 2
    err = capsys.readouterr().err
    assert "two-expert Wan2.2 A14B" in err and "--training.expert both" in err
    for part, expert in (("transformer", "high"), ("transformer_2", "low")):
        cfg = config_for_diffusers_dir(a14b / part, None, None, CLIP)
        assert (cfg.training.expert, cfg.training.boundary_ratio) == (expert, BOUNDARY)
    with pytest.raises(ConfigError, match="training.expert: the config has 'high', --init-from .* has 'low'"):
        config_for_diffusers_dir(a14b / "transformer_2", None, None, {**CLIP, "training.expert": "high"})


@pytest.mark.parametrize("expert", ["high", "low", "both"])
def test_the_named_experts_weights_are_the_source(family, expert):
    a14b = family["t2v-a14b"]
    cfg = config_for_diffusers_dir(a14b, None, None, {**CLIP, "training.expert": expert})
    source = check_pretrained(cfg, a14b)
    folders = {"high": ["transformer"], "low": ["transformer_2"], "both": ["transformer", "transformer_2"]}[expert]
    assert {Path(e.file).parent.name for e in source.values()} == set(folders)
    second = sorted(n for n in source if n.startswith("transformer_2."))
    assert bool(second) == (expert == "both")
    if expert == "both":  # the second expert's names are the first's under transformer_2.
        assert sorted(n.removeprefix("transformer_2.") for n in second) == sorted(
            n for n in source if not n.startswith("transformer_2."))


def test_text_to_video_folders_still_load(family, tmp_path):
    cfg = config_for_diffusers_dir(family["t2v"], None, None, CLIP)
    assert cfg.model.arch == "wan" and check_pretrained(cfg, family["t2v"])
    assert check_model_files(family["t2v-a14b"], ("vae",)) == family["t2v-a14b"].resolve()  # its encoders
    with pytest.raises(ConfigError, match="load one expert by its folder"):
        from_diffusers(family["t2v-a14b"])
    low = from_diffusers(family["t2v-a14b"] / "transformer_2")
    assert low.cfg.model.depth == 2


# ---------------------------------------------------------------------------------------------
# Both experts in one store
# ---------------------------------------------------------------------------------------------


def _both_config(a14b, tmp_path, **extra):
    return config_for_diffusers_dir(a14b, None, None, {
        **CLIP, "training.expert": "both", "attention.kind": "dense", "data.batch_size": 2, "training.flow_shift": 3.0,
        "training.t_sampling": "uniform", "optim.lr": 1e-3, "optim.grad_clip": 0.05, "runtime.device": "cpu", "runtime.state_dir": str(tmp_path / "state"),
        **extra})


def _latent_batch(cfg, seed: int) -> dict:
    """A batch as a latent decoder delivers it: (B, F', H', W', C) latents, text padded to 512."""
    g = torch.Generator().manual_seed(seed)
    B, m = cfg.data.batch_size, cfg.model
    text = torch.zeros(B, m.text_len, m.text_dim)
    text[:, :5] = torch.randn(B, 5, m.text_dim, generator=g)
    return {"latents": torch.randn(B, *LATENT_SHAPE, generator=g).numpy(), "text": text.numpy(),
            "text_len": np.array([5] * B), "position": seed}


def _diffusers_grads(folder, cfg, batch, step, expert):
    """diffusers' own WanTransformer3DModel of ``folder``: the flow loss of ``batch`` at step
    ``step``'s noise and t (in ``expert``'s range), its gradient by parameter name."""
    model = WanTransformer3DModel.from_pretrained(str(folder)).float()
    t = cfg.training
    fx = batch_flow_inputs(batch, t.seed, step, t.t_sampling, t.flow_shift, 0,
                           expert_t_range(t.boundary_ratio, expert))
    pred = model(hidden_states=fx.x_t.permute(0, 4, 1, 2, 3), timestep=1000 * fx.t,
                 encoder_hidden_states=torch.from_numpy(batch["text"]), return_dict=False)[0]
    flow_loss(pred.permute(0, 2, 3, 4, 1), fx.target).backward()
    return {n: p.grad for n, p in model.named_parameters()}, fx.t


@pytest.mark.parametrize("recompute", [True, False])
def test_both_experts_one_store_one_expert_per_step(family, tmp_path, recompute):
    """Each step trains the expert ``step_expert`` draws, with every clip's t in its range (diffusers'
    routing rule), streams only its shards, and leaves the other expert's master weights and AdamW
    moments bit-identical. The trained expert's first moment after its first step is (1 - beta1) x
    the clipped gradient of diffusers' own model of that expert's folder. With the blocks
    recomputed in the backward and with their graphs kept."""
    a14b = family["t2v-a14b"]
    cfg = _both_config(a14b, tmp_path, **{"runtime.recompute_blocks": recompute})
    per = expert_shards(cfg)
    assert num_shards(cfg) == 2 * per
    experts = [step_expert(cfg, k) for k in range(4)]
    assert set(experts) == {HIGH, LOW}, experts  # seed 0 draws both within 4 steps
    store = ParameterStore(cfg, str(tmp_path / "run"), init_from=str(a14b))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    names = model_names(cfg)
    seen: set[int] = set()
    try:
        for step, expert in enumerate(experts):
            batch = _latent_batch(cfg, step)
            before = [{k: s[k].clone() for k in ("master", "m", "v")} for s in store.seg]
            result = compute.train_step(batch, step)
            update = store.wait_step(step)
            assert result.expert == expert and len(result.t) == 2
            assert all(route_expert(t, BOUNDARY) == expert for t in result.t)  # WanPipeline's rule
            trained = range(expert * per, (expert + 1) * per)
            for i, s in enumerate(store.seg):
                same = all(torch.equal(s[k], before[i][k]) for k in ("master", "m", "v"))
                assert same == (i not in trained), (step, i)
            assert store.adam_step(step) == sum(e == expert for e in experts[:step])
            if expert in seen:
                continue
            seen.add(expert)
            grads, t = _diffusers_grads(a14b / ("transformer" if expert == HIGH else "transformer_2"), cfg, batch,
                                        step, expert)
            assert torch.allclose(t, torch.tensor(result.t))
            coef = update.clip_coef
            assert coef < 1.0  # the clipping is the expert's own norm: exercised
            prefix = "transformer_2." if expert == LOW else ""
            for name, grad in grads.items():
                _, shard, off = names[prefix + name]
                m = store.seg[shard]["m"][off:off + grad.numel()].view(grad.shape)
                torch.testing.assert_close(m, (1 - cfg.optim.betas[0]) * coef * grad, rtol=1e-4, atol=1e-9)
    finally:
        compute.close()
        store.close()
    assert seen == {HIGH, LOW}


def test_each_expert_keeps_its_own_moving_average(family, tmp_path):
    """``training.ema_decay`` with both experts: a step moves the average of the expert it trains
    towards that expert's new weights (``ema = lerp(ema, master, 1 - decay)``), and leaves the
    other expert's average as it was; a fresh store's average is the pretrained weights."""
    a14b = family["t2v-a14b"]
    decay = 0.7
    cfg = _both_config(a14b, tmp_path, **{"training.ema_decay": decay})
    per = expert_shards(cfg)
    experts = [step_expert(cfg, k) for k in range(3)]
    assert set(experts) == {HIGH, LOW}, experts
    store = ParameterStore(cfg, str(tmp_path / "run"), init_from=str(a14b))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        assert all(torch.equal(s["ema"], s["master"]) for s in store.seg)
        for step, expert in enumerate(experts):
            before = [s["ema"].clone() for s in store.seg]
            compute.train_step(_latent_batch(cfg, step), step)
            store.wait_step(step)
            trained = range(expert * per, (expert + 1) * per)
            for i, s in enumerate(store.seg):
                if i not in trained:
                    assert torch.equal(s["ema"], before[i]), (step, i)
                    continue
                want = decay * before[i] + (1 - decay) * s["master"]
                torch.testing.assert_close(s["ema"], want, rtol=1e-6, atol=1e-7)
            assert all(not torch.equal(store.seg[i]["ema"], before[i]) for i in trained[1:-1]), step  # blocks moved
    finally:
        compute.close()
        store.close()


def test_the_low_noise_expert_takes_its_own_learning_rate(family, tmp_path):
    """``training.low_expert_lr``: a step of the low-noise expert updates at the schedule's rate times
    ``low_expert_lr / optim.lr``, a step of the high-noise expert at the schedule's (the rate the
    store's AdamW takes for that step's shards). Refused without ``training.expert = both``."""
    from megaslide_ray.training.schedule import lr_at

    a14b = family["t2v-a14b"]
    cfg = _both_config(a14b, tmp_path, **{"training.low_expert_lr": 4e-3, "optim.schedule": "linear",
                                          "training.steps": 4})
    experts = [step_expert(cfg, k) for k in range(3)]
    assert set(experts) == {HIGH, LOW}, experts
    store = ParameterStore(cfg, str(tmp_path / "run"), init_from=str(a14b))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        for step, expert in enumerate(experts):
            compute.train_step(_latent_batch(cfg, step), step)
            want = lr_at(cfg.optim, 4, step) * (4.0 if expert == LOW else 1.0)
            assert store.wait_step(step).lr == pytest.approx(want), (step, expert)
    finally:
        compute.close()
        store.close()
    with pytest.raises(ConfigError, match="low_expert_lr"):
        config_for_diffusers_dir(a14b / "transformer_2", None, None, {**CLIP, "training.low_expert_lr": 1e-4})


@pytest.mark.parametrize("kind", ["dense", "dsa"])
def test_both_experts_export_to_a_wan_pipeline_that_routes_as_the_project(family, tmp_path, kind):
    """A checkpoint of both experts exports to transformer/, transformer_2/ and a model_index.json
    with the boundary; diffusers' WanPipeline loads it with the trained weights (``enable_dsa`` on
    both for a 3D-DSA model), runs each step on the expert its rule picks, and at every one of its
    calls the project's own predict (the checkpoint's weights, streamed, routed by t) gives the
    same velocity."""
    a14b = family["t2v-a14b"]
    cfg = _both_config(a14b, tmp_path, **{"attention.kind": kind})
    store = ParameterStore(cfg, str(tmp_path / "run"), init_from=str(a14b))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    try:
        for step in range(4):  # both experts train (test above: seed 0 draws both in 4 steps)
            compute.train_step(_latent_batch(cfg, step), step)
            store.wait_step(step)
        store.save_checkpoint(str(tmp_path / "run"), 4, {"data_position": 0})
        masters = [s["master"].clone() for s in store.seg]
    finally:
        compute.close()
        store.close()
    ckpt = latest_checkpoint(tmp_path / "run")
    out = tmp_path / "export"
    export_diffusers(ckpt, out)
    index = json.loads((out / "model_index.json").read_text())
    assert index["boundary_ratio"] == BOUNDARY and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    parts = {name: getattr(diffusers.WanPipeline.from_pretrained(str(a14b)), name)
             for name in ("vae", "text_encoder", "tokenizer", "scheduler")}
    pipe = diffusers.WanPipeline.from_pretrained(str(out), **parts)
    if kind == "dsa":
        enable_dsa(pipe)
    names = model_names(cfg)
    for prefix, model in (("", pipe.transformer), ("transformer_2.", pipe.transformer_2)):
        for name, p in model.state_dict().items():
            shape, shard, off = names[prefix + name]
            assert torch.equal(p.reshape(-1), masters[shard][off:off + p.numel()]), prefix + name
    calls = []
    for expert, model in ((HIGH, pipe.transformer), (LOW, pipe.transformer_2)):
        model.register_forward_hook(lambda mod, args, kwargs, out, e=expert: calls.append(
            (e, kwargs["hidden_states"].clone(), kwargs["timestep"].clone(), kwargs["encoder_hidden_states"].clone(),
             out[0].clone())), with_kwargs=True)
    pipe(prompt="a red circle moving right", height=32, width=32, num_frames=9, num_inference_steps=6,
         guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0))
    assert {e for e, *_ in calls} == {HIGH, LOW} and len(calls) == 6
    source = CheckpointWeights(ckpt, cfg, "master")
    ours = ComputeActor(cfg, source.shard_infos(), source, transport="object_ref")
    try:
        for expert, x, timestep, text, want in calls:
            t = timestep.float() / 1000
            assert route_expert(float(t[0]), BOUNDARY) == expert
            got = ours.predict(x.permute(0, 2, 3, 4, 1), t, text, torch.tensor([text.shape[1]]), source.step)
            torch.testing.assert_close(got.permute(0, 4, 1, 2, 3), want.float(), rtol=1e-4, atol=1e-5)
    finally:
        ours.close()
        source.close()


def test_t_in_an_experts_range_has_the_distribution_conditioned_on_it():
    """An expert's t is the usual draw conditioned on its range: the in-range draws of the full
    distribution and the range's own draws have the same quantiles; both experts' probabilities
    are their ranges' masses."""
    x0 = torch.zeros(20000, 1, 1, 1, 1)
    for sampling in ("uniform", "logit_normal"):
        full = flow_inputs(x0, 0, 0, sampling, 3.0).t
        for expert, keep in ((HIGH, full >= BOUNDARY), (LOW, full < BOUNDARY)):
            t = flow_inputs(x0, 0, 1, sampling, 3.0, t_range=expert_t_range(BOUNDARY, expert)).t
            assert all(route_expert(x, BOUNDARY) == expert for x in t.tolist())
            q = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
            torch.testing.assert_close(torch.quantile(t, q), torch.quantile(full[keep], q), atol=0.01, rtol=0)
        high = 1 - base_cdf(BOUNDARY, sampling, 3.0)
        assert abs(float((full >= BOUNDARY).float().mean()) - high) < 0.01


@pytest.mark.slow  # about a minute: precompute, Ray, two runs, export, evaluate, sample
def test_both_experts_precompute_train_resume_evaluate_sample(ray_session, family, tmp_path):
    a14b = family["t2v-a14b"]
    videos = ensure_demo_dataset(tmp_path / "videos", num_videos=3)
    precompute(a14b, videos, tmp_path / "cache", FRAMES, SIZE, SIZE, device="cpu", dtype="fp32", num_encoders=0,
               progress=False)
    manifest = tmp_path / "cache" / "manifest.parquet"

    def config(steps):
        return config_for_diffusers_dir(a14b, None, None, {
            "data.manifest": str(manifest), "data.val_manifest": str(manifest), "data.num_frames": FRAMES,
            "data.height": SIZE, "data.width": SIZE, "data.batch_size": 1, "attention.kind": "dsa",
            "attention.window": "3,1,1", "training.steps": steps, "training.expert": "both",
            "training.t_sampling": "uniform", "training.flow_shift": 3.0, "training.log_every": 1, "optim.lr": 1e-3,
            "runtime.state_dir": str(tmp_path / "state")})

    def train(cfg, run, resume=False):
        trainer = Trainer(cfg, run_dir=str(run), resume=resume, progress=False, init_from=None if resume else str(a14b))
        try:
            return trainer.train()
        finally:
            trainer.close()

    straight = train(config(4), tmp_path / "straight")
    train(config(2), tmp_path / "resumed")
    resumed = train(config(4), tmp_path / "resumed", resume=True)
    assert (resumed.first_step, resumed.last_step) == (2, 4)
    for a, b in zip(read_checkpoint_shards(straight.checkpoint), read_checkpoint_shards(resumed.checkpoint)):
        assert torch.equal(a, b)  # both experts, their moments and the per-step expert continue exactly
    cfg = config(4)
    rows = [json.loads(line) for line in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "expert" in r]
    assert [r["expert"] for r in rows] == [("high", "low")[step_expert(cfg, k)] for k in range(4)]
    assert {r["expert"] for r in rows} == {"high", "low"}
    assert all(route_expert(t, BOUNDARY) == ("high", "low").index(r["expert"]) for r in rows for t in r["t"])

    out = tmp_path / "export"
    export_diffusers(straight.checkpoint, out, drop_offsets=True)
    for part in ("transformer", "transformer_2"):
        assert json.loads((out / part / "config.json").read_text())["megaslide_dsa"]["kind"] == "dsa"
        trained = WanTransformer3DModel.from_pretrained(str(out / part)).state_dict()
        pretrained = WanTransformer3DModel.from_pretrained(str(a14b / part)).state_dict()
        assert any(not torch.equal(trained[n], pretrained[n]) for n in trained), part

    result = evaluate_checkpoint(tmp_path / "straight", clips=2, buckets=4, device="cpu")
    assert {name for name, _ in result.expert_losses} == {"high", "low"}
    proc = subprocess.run([sys.executable, "-m", "megaslide_ray.evaluate", "--checkpoint", str(tmp_path / "straight"),
                           "--clips", "2", "--device", "cpu"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "high-noise expert (transformer)" in proc.stdout, proc.stderr[-2000:]
    video = tmp_path / "a14b.mp4"
    proc = subprocess.run([sys.executable, "-m", "megaslide_ray.sample", "--checkpoint", str(tmp_path / "straight"),
                           "--model-dir", str(a14b), "--prompt", "a red circle moving right", "--steps", "3",
                           "--device", "cpu", "--out", str(video)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert video.is_file()


def test_the_base_preset_has_the_folders_number_of_experts(tmp_path):
    """A Wan2.1 14B folder starts from wan2.1-t2v-14b (one transformer) and a Wan2.2 A14B folder
    of the same shape from wan2.2-t2v-a14b (both experts, its boundary): never the other way round."""
    from megaslide_ray.config import build_config
    from megaslide_ray.models.wan_diffusers import diffusers_config

    transformer = json.dumps(diffusers_config(build_config("wan2.1-t2v-14b")))
    vae = json.dumps({"_class_name": "AutoencoderKLWan", "z_dim": 16})
    for name, parts in (("wan21", ("transformer",)), ("wan22", ("transformer", "transformer_2"))):
        for part in (*parts, "vae"):
            (tmp_path / name / part).mkdir(parents=True)
            (tmp_path / name / part / "config.json").write_text(vae if part == "vae" else transformer)
    (tmp_path / "wan22" / "model_index.json").write_text(json.dumps({
        "_class_name": "WanPipeline", "boundary_ratio": BOUNDARY, "transformer": ["diffusers", "WanTransformer3DModel"],
        "transformer_2": ["diffusers", "WanTransformer3DModel"]}))
    one = config_for_diffusers_dir(tmp_path / "wan21", None, None, {})
    assert (one.preset, one.training.expert, one.training.boundary_ratio) == ("wan2.1-t2v-14b", "", 0.0)
    both = config_for_diffusers_dir(tmp_path / "wan22", None, None, {})
    assert (both.preset, both.training.expert, both.training.boundary_ratio) == ("wan2.2-t2v-a14b", "both", BOUNDARY)
    low = config_for_diffusers_dir(tmp_path / "wan22" / "transformer_2", None, None, {})
    assert (low.training.expert, num_shards(low)) == ("low", 42)


@pytest.mark.parametrize("expert", ["high", "low"])
def test_one_expert_trains_its_own_weights_in_its_range(family, tmp_path, expert):
    """``training.expert`` high / low: the store holds that expert's transformer (the folder's
    ``transformer/`` or ``transformer_2/``), every step's t is in its range, and the export is that
    transformer's folder; sampling it alone is refused."""
    a14b = family["t2v-a14b"]
    cfg = _both_config(a14b, tmp_path, **{"training.expert": expert})
    folder = a14b / ("transformer" if expert == "high" else "transformer_2")
    store = ParameterStore(cfg, str(tmp_path / "run"), init_from=str(a14b))
    compute = ComputeActor(cfg, store.shard_infos(), LocalStoreClient(store), "shm")
    names = model_names(cfg)
    try:
        assert num_shards(cfg) == expert_shards(cfg)
        start = WanTransformer3DModel.from_pretrained(str(folder)).state_dict()
        for name, p in start.items():
            _, shard, off = names[name]
            assert torch.equal(store.seg[shard]["master"][off:off + p.numel()], p.reshape(-1)), name
        for step in range(3):
            result = compute.train_step(_latent_batch(cfg, step), step)
            store.wait_step(step)
            assert result.expert == ("high", "low").index(expert)
            assert all(route_expert(t, BOUNDARY) == result.expert for t in result.t)
        store.save_checkpoint(str(tmp_path / "run"), 3, {"data_position": 0})
    finally:
        compute.close()
        store.close()
    export_diffusers(latest_checkpoint(tmp_path / "run"), tmp_path / "export")
    trained = WanTransformer3DModel.from_pretrained(str(tmp_path / "export")).state_dict()
    assert set(trained) == set(start) and any(not torch.equal(trained[n], start[n]) for n in start)
    with pytest.raises(ConfigError, match="holds one expert of a two-expert model"):
        sample_video(tmp_path / "run", "a red circle", tmp_path / "x.mp4", model_dir=a14b, device="cpu")


def test_a_cut_update_of_one_expert_is_finished_on_reattach(tmp_path):
    """A store of both experts killed between two shards of a step's update re-attaches, finishes
    the trained expert's shards from their gradients and moves the idle expert's on untouched: the
    same state as an uncut update."""
    import math

    from megaslide_ray.config import build_config
    from megaslide_ray.training.schedule import clip_coefficient, lr_at

    cfg = build_config("wan2.1-t2v-1.3b", None, {
        **CLIP, "model.hidden_size": 16, "model.num_heads": 2, "model.depth": 2, "model.ffn_dim": 24,
        "model.text_dim": 16, "model.in_channels": 4, "model.out_channels": 4, "model.latent_compression": "4,8,8",
        "training.expert": "both", "training.boundary_ratio": BOUNDARY, "runtime.device": "cpu",
        "runtime.state_dir": str(tmp_path)})
    per, expert = expert_shards(cfg), step_expert(cfg, 0)
    trained = range(expert * per, (expert + 1) * per)

    def report(store):
        gen = torch.Generator().manual_seed(1)
        sq = {}
        for i in trained:
            store.seg[i]["w"].copy_(torch.randn(store.seg[i]["w"].numel(), generator=gen))
            sq[i] = float(store.seg[i]["w"].pow(2).sum())
        return sq

    def state(store):
        return [{k: s[k].clone() for k in ("w", "master", "m", "v")} for s in store.seg]

    whole = ParameterStore(cfg, str(tmp_path / "whole"))
    try:
        before = state(whole)
        for i, sq in report(whole).items():
            whole.report_grad(i, 0, sq)
        whole.wait_step(0)
        expected = state(whole)
    finally:
        whole.close()
    for i in range(2 * per):  # the idle expert untouched, the trained one moved
        assert all(torch.equal(expected[i][k], before[i][k]) for k in ("master", "m", "v")) == (i not in trained)

    cut = ParameterStore(cfg, str(tmp_path / "cut"))
    sq = report(cut)
    total = math.sqrt(sum(sq.values()))
    coef, lr = clip_coefficient(total, cfg.optim.grad_clip), lr_at(cfg.optim, cfg.training.steps, 0)
    cut._write_record(0, total, coef, lr, skipped=False, seconds=0.0)
    for i in range(trained[0] + 2):  # what _apply_update does, cut after the trained expert's second shard
        if i in trained:
            cut._update_shard(i, 0, coef, lr)
        else:
            cut._pass_shard(i, 0)
    assert sorted(set(cut.versions.tolist())) == [0, 1]
    cut.close(remove_state=False)
    again = ParameterStore(cfg, str(tmp_path / "cut"), attach=True)
    try:
        assert again.status().versions == (1,) * again.n
        for i, (got, want) in enumerate(zip(state(again), expected)):
            for k in got:
                assert torch.equal(got[k], want[k]), (i, k)
    finally:
        again.close()
