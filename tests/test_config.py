"""Config: presets, TOML + dotted overrides, and validation before any work starts."""

import subprocess
import sys

import pytest

from megaslide_ray.config import PRESETS, Config, ConfigError, build_config, describe_fields, to_toml, validate
from megaslide_ray.models.registry import param_count


@pytest.mark.parametrize("name,target", [("dit-105b", 105e9), ("dit-33b", 33.3e9), ("dit-28b", 28.4e9)])
def test_paper_presets_match_parameter_counts(name, target):
    cfg = build_config(name)
    assert abs(param_count(cfg) / target - 1) < 0.01
    assert cfg.attention.kind == "dsa"


def test_every_preset_defaults_to_dsa_and_validates():
    # all but tiny-motion, the CPU learning demo: at its 256 tokens dsa's CPU step is about 2.4x
    # its swin step, which would not fit its 10 minutes (benchmarks/RESULTS.md)
    for name in PRESETS:
        cfg = build_config(name)
        assert cfg.attention.kind == ("swin" if name == "tiny-motion" else "dsa"), name


def test_every_field_has_a_docstring():
    cfg = Config()
    import dataclasses

    for section in ("model", "attention", "data", "optim", "runtime", "training", "ray"):
        sec = getattr(cfg, section)
        docs = describe_fields(type(sec))
        missing = [f.name for f in dataclasses.fields(sec) if not docs.get(f.name)]
        assert not missing, f"{section}: {missing}"


def test_dotted_overrides_and_types():
    cfg = build_config("tiny", None, {"model.depth": "8", "attention.window": "3,5,5", "optim.lr": "2e-4",
                                      "data.random_crop": "false", "attention.kind": "dense"})
    assert cfg.model.depth == 8 and cfg.attention.window == (3, 5, 5)
    assert cfg.optim.lr == 2e-4 and cfg.data.random_crop is False and cfg.attention.kind == "dense"


def test_toml_round_trip(tmp_path):
    cfg = build_config("tiny", None, {"model.depth": 3, "optim.betas": "0.8,0.95", "training.seed": 7})
    path = tmp_path / "c.toml"
    path.write_text(to_toml(cfg))
    again = build_config(None, str(path))
    assert again == cfg


def test_toml_then_cli_precedence(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[model]\ndepth = 6\nhidden_size = 96\nnum_heads = 4\n[training]\nsteps = 11\n')
    cfg = build_config(None, str(path), {"model.depth": "2"})
    assert (cfg.model.depth, cfg.model.hidden_size, cfg.training.steps) == (2, 96, 11)


@pytest.mark.parametrize("overrides,needle", [
    ({"model.num_heads": "3"}, "model.hidden_size=128 is not divisible by model.num_heads=3"),
    ({"attention.window": "3,4,3"}, "the height size 4 must be odd"),
    ({"attention.window": "3,3,17"}, "the width size 17 exceeds the token grid's 16"),
    ({"data.num_frames": "15"}, "data.num_frames=15 is not divisible by the patch size 2"),
    ({"model.depth": "0"}, "model.depth=0 must be > 0"),
    ({"attention.kind": "global"}, "attention.kind='global' is not one of"),
    ({"model.dept": "3"}, "unknown config key 'model.dept'"),
    ({"modle.depth": "3"}, "unknown config section 'modle'"),
    ({"optim.lr": "fast"}, "optim.lr='fast' is not a valid float"),
    ({"data.manifest": "no/such/manifest.parquet"}, "data.manifest='no/such/manifest.parquet' does not exist"),
    ({"data.fps": "8", "data.frame_stride": "2"}, "data.fps=8.0 and data.frame_stride=2 both set"),
    ({"data.fps": "-1"}, "data.fps=-1.0 must be >= 0"),
    ({"data.decode_timeout_s": "0"}, "data.decode_timeout_s=0.0 must be"),
    ({"data.max_bad_fraction": "1.5"}, "data.max_bad_fraction=1.5 must lie in [0, 1]"),
    ({"data.short_clips": "drop"}, "data.short_clips='drop' is not one of"),
    ({"data.num_decoders": "0"}, "data.num_decoders=0 must be > 0"),
    ({"model.in_channels": "4"}, "model.in_channels=4: the video decoders deliver RGB clips"),
    ({"runtime.prefetch_depth": "0"}, "runtime.prefetch_depth=0"),
    ({"runtime.offload_keep": "-1"}, "runtime.offload_keep=-1 must be >= 0"),
])
def test_invalid_values_are_refused_with_field_and_value(overrides, needle):
    with pytest.raises(ConfigError) as e:
        build_config("tiny", None, overrides)
    assert needle in str(e.value)


def test_swin_tiles_may_be_even_but_centred_windows_may_not():
    """swin cuts the grid into tiles (any size); dsa and neighborhood centre a window on each
    query (odd sizes only)."""
    cfg = build_config("tiny", None, {"attention.kind": "swin", "attention.window": "2,4,4"})
    assert cfg.attention.window == (2, 4, 4)
    for kind in ("dsa", "neighborhood"):
        with pytest.raises(ConfigError, match=f"the frames size 2 must be odd and positive for attention.kind='{kind}'"):
            build_config("tiny", None, {"attention.kind": kind, "attention.window": "2,4,4"})


def test_decoder_pool_and_fps_sampling_are_accepted():
    assert build_config("tiny", None, {"data.num_decoders": "3", "data.fps": "8"}).data.num_decoders == 3


def test_unknown_key_in_toml_is_refused(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[model]\nwidth = 3\n")
    with pytest.raises(ConfigError, match="unknown config key 'model.width'"):
        build_config(None, str(path))


def test_cli_refuses_bad_config_before_ray_starts(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "megaslide_ray.train", "--model.num_heads", "5",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "model.num_heads=5" in proc.stderr
    assert "Ray" not in proc.stdout and not (tmp_path / "run").exists()


def test_validate_checks_a_config_changed_after_building():
    # validate() is what every entry point calls on a config assembled in code: a preset that
    # was valid when built is refused once a field is set to a bad value, naming the field.
    for name in PRESETS:
        cfg = build_config(name)
        assert validate(cfg) is cfg
        cfg.model.num_heads = 7
        with pytest.raises(ConfigError, match=f"model.hidden_size={cfg.model.hidden_size} is not divisible by "
                                              f"model.num_heads=7"):
            validate(cfg)


@pytest.mark.parametrize("name", ["dit-105b", "dit-33b", "dit-28b"])
def test_paper_presets_read_vae_latents(name):
    cfg = build_config(name)
    m = cfg.model
    assert (m.arch, m.inputs, m.in_channels, m.patch_size, m.latent_compression) == \
        ("videodit", "latents", 16, (1, 2, 2), (4, 8, 8))
    assert cfg.latent_space and cfg.latent_grid == (21, 60, 104) and cfg.token_grid == (21, 30, 52)
    # the clip is in pixels, 4k+1 frames, height and width multiples of 8 x 2
    with pytest.raises(ConfigError, match="data.num_frames=80: the VAE encodes 4k\\+1 frames"):
        build_config(name, None, {"data.num_frames": 80})
    with pytest.raises(ConfigError, match="data.height=1080 is not divisible by 16"):
        build_config(name, None, {"data.height": 1080})
    # pixel space keeps refusing latent channel counts
    with pytest.raises(ConfigError, match="model.in_channels=16: the video decoders deliver RGB clips"):
        build_config(name, None, {"model.inputs": "pixels"})
    assert not build_config("tiny").latent_space


def test_a_scaled_down_latent_preset_runs_forward_and_backward():
    import torch

    from megaslide_ray.data.captions import caption_batch
    from megaslide_ray.models.registry import build_model

    cfg = build_config("dit-105b", None, {"model.hidden_size": 32, "model.depth": 2, "model.num_heads": 2,
                                          "model.caption_dim": 16, "data.num_frames": 9, "data.height": 80,
                                          "data.width": 96, "data.batch_size": 2})
    assert cfg.latent_grid == (3, 10, 12) and cfg.token_grid == (3, 5, 6)
    model = build_model(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    B = cfg.data.batch_size
    x_t = torch.randn(B, *cfg.latent_grid, 16, generator=g)
    cap, cap_len = (torch.from_numpy(a) for a in caption_batch("a red circle", cfg.model.caption_max_bytes, B))
    out = model(x_t, torch.rand(B, generator=g), cap, cap_len)
    assert out.shape == x_t.shape
    loss = (out - torch.randn(out.shape, generator=g)).pow(2).mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(gr).all() for gr in grads)
    assert model.blocks[0].mlp[0].weight.grad.abs().sum() > 0 or model.head.linear.weight.grad.abs().sum() > 0


def test_a_latent_videodit_needs_a_latent_manifest():
    from megaslide_ray.data.checks import check_data

    with pytest.raises(ConfigError, match="model.inputs='latents' .* trains on precomputed VAE latents"):
        check_data(build_config("dit-28b"))
    from megaslide_ray.evaluation.sampling import sample_model_dir

    cfg = build_config("dit-28b", None, {"training.sample_every": 5})  # its samples need the VAE's folder
    with pytest.raises(ConfigError, match=r"training.sample_every=5 with model.arch='videodit' on latents: .*its "
                                          r"vae/.*give --training.sample_model_dir DIR"):
        sample_model_dir(cfg)


def test_sampling_during_training_is_checked_before_any_work(tmp_path):
    from megaslide_ray.config import sample_prompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("  a red circle  \n# a comment\n\nthe second\n")
    cfg = build_config("tiny", None, {"training.sample_every": 2, "training.sample_prompts_file": str(prompts)})
    assert sample_prompts(cfg) == ["a red circle", "the second"]
    assert sample_prompts(build_config("tiny", None, {"training.sample_prompt": "x"})) == ["x"]
    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    for overrides, match in (
            ({"training.sample_prompts_file": str(tmp_path / "none.txt")}, r"sample_prompts_file=.*none.txt' cannot be "
                                                                           r"read"),
            ({"training.sample_prompts_file": str(tmp_path / "empty.txt")}, "holds no prompt"),
            ({"training.sample_steps": 0}, "training.sample_steps=0 must be > 0"),
            ({"training.sample_cfg_scale": float("nan")}, "training.sample_cfg_scale=nan must be finite")):
        with pytest.raises(ConfigError, match=match):
            build_config("tiny", None, {"training.sample_every": 2, **overrides})
    build_config("tiny", None, {"training.sample_prompts_file": str(tmp_path / "none.txt")})  # unused: no sampling


def test_a_sample_file_is_named_after_its_step_and_prompt(tmp_path):
    from megaslide_ray.evaluation.sampling import prompt_slug, sample_path

    assert prompt_slug("A Blue Square, moving up!") == "a-blue-square-moving-up"
    assert prompt_slug("a red circle moving right on a dark blue background") == "a-red-circle-moving-right-on-a-dark-blue"
    assert prompt_slug("x" * 50) == "x" * 40 and prompt_slug("") == prompt_slug("日本 ...") == "empty"
    assert sample_path(tmp_path, 12, 3, "Two  words") == tmp_path / "samples" / "step_000012_03_two-words.mp4"


def test_a_saved_run_lacking_later_fields_keeps_their_old_behaviour(tmp_path):
    """A run saved before ``model.caption_layers``, ``training.caption_dropout`` and
    ``model.cross_attention`` existed is resumed, evaluated and sampled as it was trained (its
    checkpoint holds a bag-of-bytes encoder and blocks without cross-attention); a config file a user writes gets today's defaults; an explicit override wins."""
    from megaslide_ray.config import ADDED_LATER, config_from_dict
    from megaslide_ray.train import build_parser, config_from_args

    cfg = build_config("tiny", None, {"model.depth": 3})
    cfg.model.cross_attention = True  # (not the default: shows a saved run lacking the field gets False)
    assert (cfg.model.caption_layers, cfg.training.caption_dropout) == (2, 0.1)
    doc = cfg.to_dict()
    assert config_from_dict(doc) == cfg  # everything recorded: taken as is
    for key in ADDED_LATER:
        section, name = key.split(".")
        del doc[section][name]
    old = config_from_dict(doc)
    assert (old.model.caption_layers, old.training.caption_dropout, old.model.depth) == (0, 0.0, 3)
    assert not old.model.cross_attention

    run = tmp_path / "run"
    run.mkdir()
    text = "\n".join(line for line in to_toml(cfg).splitlines()
                     if not line.startswith(("caption_layers", "caption_dropout", "cross_attention")))
    (run / "config.toml").write_text(text + "\n")

    def from_cli(*argv):
        args, extra = build_parser().parse_known_args(list(argv))
        return config_from_args(args, extra)

    resumed = from_cli("--resume", "--run-dir", str(run))
    assert (resumed.model.caption_layers, resumed.training.caption_dropout, resumed.model.depth) == (0, 0.0, 3)
    assert not resumed.model.cross_attention
    told = from_cli("--resume", "--run-dir", str(run), "--training.caption_dropout", "0.2")
    assert told.training.caption_dropout == 0.2
    written = build_config(None, str(run / "config.toml"))  # a file, not a saved run: today's defaults
    assert (written.model.caption_layers, written.training.caption_dropout) == (2, 0.1)
    assert not written.model.cross_attention  # today's default (off)


@pytest.mark.parametrize("nodes", [0, 5])
def test_runtime_nodes_between_one_and_the_shards(nodes):
    # depth 2: 4 shards; every node must own the optimizer state of at least one
    with pytest.raises(ConfigError, match=f"runtime.nodes={nodes} must be an integer from 1 to the model's 4 shards"):
        build_config("tiny", None, {"model.depth": 2, "runtime.nodes": nodes})
    assert build_config("tiny", None, {"model.depth": 2, "runtime.nodes": 4}).runtime.nodes == 4


def test_samples_decoded_on_the_gpu_need_a_gpu_run():
    from megaslide_ray.driver.preflight import check_devices

    cfg = build_config("tiny", None, {"training.sample_every": 2, "training.sample_device": "cuda"})
    with pytest.raises(ConfigError, match="training.sample_device='cuda' .* trains on no GPU .* --training.sample_device "
                                          "cpu"):
        check_devices(cfg, 0, 2, "this machine")
    check_devices(cfg, 1, 2, "this machine")
    cfg.training.sample_device = "cpu"
    check_devices(cfg, 0, 2, "this machine")
