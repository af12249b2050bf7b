"""Precomputed latents: ``python -m megaslide_ray.precompute`` on a tiny random Wan-like model
(VAE, UMT5, word-level tokenizer, built here: nothing is downloaded), the latent manifest, and the
decoder actors' latent batches."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import diffusers
import numpy as np
import pyarrow.parquet as pq
import pytest
import ray
import torch
import transformers
from wan_models import FRAMES, LATENT_SHAPE, SIZE, TEXT_DIM, Z

from actors import decoder as decoder_mod
from actors.decoder import VideoDecoder
from megaslide_ray import precompute as precompute_cli
from megaslide_ray.config import DataConfig
from megaslide_ray.data import encoders as E
from megaslide_ray.data import latents as L
from megaslide_ray.data.clips import decode_clip
from megaslide_ray.data.demo import ensure_demo_dataset, write_bad_videos
from megaslide_ray.data.latent_cache import clip_config
from megaslide_ray.data.manifest import ManifestEntry, read_manifest, write_manifest
from pipelines.encoder_pool import EncoderPool
from pipelines.latent_precompute import precompute

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A video manifest: three demo videos (the third with the first's caption) and a corrupt file."""
    root = tmp_path_factory.mktemp("videos")
    demo = read_manifest(ensure_demo_dataset(root / "cache", num_videos=3))
    bad = write_bad_videos(root / "bad")["not_a_video.mp4"]
    rows = [ManifestEntry(path=demo[0].path, caption=demo[0].caption),
            ManifestEntry(path=demo[1].path, caption=demo[1].caption),
            ManifestEntry(path=demo[2].path, caption=demo[0].caption),
            ManifestEntry(path=str(bad), caption="a broken file")]
    return write_manifest(rows, root / "manifest.parquet")


@pytest.fixture(scope="module")
def cache(ray_session, wan_dir, source, tmp_path_factory):
    """The CLI, as a user runs it, with a pool of two encoder actors (fp32 storage, for exact checks)."""
    out = tmp_path_factory.mktemp("latents") / "cache"
    code = precompute_cli.main(["--model-dir", str(wan_dir), "--data", str(source), "--out", str(out), "--frames", str(FRAMES),
                   "--height", str(SIZE), "--width", str(SIZE), "--dtype", "fp32", "--num-encoders", "2",
                   "--no-progress"])
    assert code == 0
    return out


def _vae(wan_dir):
    return diffusers.AutoencoderKLWan.from_pretrained(str(wan_dir / "vae")).eval()


# ---------------------------------------------------------------------------------------------
# precompute
# ---------------------------------------------------------------------------------------------


def test_frames_must_be_4k_plus_1(wan_dir, source, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"--frames 80 is not 4k\+1.*77 and 81"):
        E.check_frames(80)
    with pytest.raises(ValueError, match=r"nearest valid values are 1 and 5"):
        E.check_frames(2)
    E.check_frames(81)
    code = precompute_cli.main(["--model-dir", str(wan_dir), "--data", str(source), "--out", str(tmp_path / "c"), "--frames", "8",
                   "--height", "32", "--width", "32", "--num-encoders", "0"])
    assert code == 2 and "--frames 8 is not 4k+1" in capsys.readouterr().err and not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=r"--height 36.*multiples of the VAE's spatial compression 8"):
        precompute(wan_dir, source, tmp_path / "c", frames=9, height=36, width=32, num_encoders=0)


def test_missing_libraries_say_what_to_install(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "diffusers", None)
    with pytest.raises(ImportError, match="pip install diffusers transformers"):
        E.import_hf()


def test_latents_equal_a_direct_vae_encode(cache, source, wan_dir):
    manifest = cache / "manifest.parquet"
    rows, meta = L.read_latent_manifest(manifest)
    vae = _vae(wan_dir)
    mean = torch.tensor(vae.config.latents_mean).view(1, Z, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, Z, 1, 1, 1)
    data = clip_config(FRAMES, SIZE, SIZE, 0.0)
    sources = read_manifest(source)
    for row, entry in zip(rows, sources[:3]):
        assert L.resolve(manifest, row["source_path"]).resolve() == Path(entry.path).resolve()
        frames = decode_clip(entry.path, data, 0, 0).frames
        x = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
        with torch.no_grad():
            z = vae.encode(x).latent_dist.mode()
        want = ((z - mean) / std)[0].permute(1, 2, 3, 0)
        latents, text = L.load_latent_sample(manifest, row)
        assert latents.dtype == torch.float32 and tuple(latents.shape) == LATENT_SHAPE
        torch.testing.assert_close(latents, want, atol=1e-5, rtol=1e-5)
        assert (row["frame_start"], row["frame_end"], row["num_frames"], row["fps"]) == (0, FRAMES - 1, FRAMES, 8.0)
        assert (row["height"], row["width"], row["dtype"]) == (SIZE, SIZE, "float32")


def test_text_is_the_encoders_valid_tokens_once_per_caption(cache, source, wan_dir):
    manifest = cache / "manifest.parquet"
    rows, meta = L.read_latent_manifest(manifest)
    tok = transformers.AutoTokenizer.from_pretrained(str(wan_dir / "tokenizer"))
    te = transformers.UMT5EncoderModel.from_pretrained(str(wan_dir / "text_encoder")).eval()
    for row in rows:
        # as the Wan pipeline does it: padded to 512, cut to the mask's length
        batch = tok([row["caption"]], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
        n = int(batch["attention_mask"].sum())
        with torch.no_grad():
            want = te(batch["input_ids"], batch["attention_mask"]).last_hidden_state[0, :n]
        _, text = L.load_latent_sample(manifest, row)
        assert row["text_len"] == n == text.shape[0] == len(row["caption"].split()) + 1
        torch.testing.assert_close(text, want, atol=1e-5, rtol=1e-5)
    assert [r["caption"] for r in rows][0] == rows[2]["caption"]
    assert rows[0]["text_path"] == rows[2]["text_path"] != rows[1]["text_path"]
    assert len(list((cache / "text").glob("*.safetensors"))) == 2  # the bad video's caption is not encoded


def test_manifest_metadata_and_skipped_file(cache, source, wan_dir):
    manifest = cache / "manifest.parquet"
    assert L.is_latent_manifest(manifest) and not L.is_latent_manifest(source)
    assert not L.is_latent_manifest(cache / "nope.parquet")
    rows, meta = L.read_latent_manifest(manifest)
    assert len(rows) == 3 and all(r["latent_shape"] == LATENT_SHAPE for r in rows)
    vae_cfg = json.loads((wan_dir / "vae" / "config.json").read_text())
    assert meta["kind"] == "latent" and meta["format_version"] == L.FORMAT_VERSION
    assert meta["latents_mean"] == vae_cfg["latents_mean"] and meta["latents_std"] == vae_cfg["latents_std"]
    assert meta["compression"] == [4, 8, 8] and meta["latent_channels"] == Z and meta["text_dim"] == TEXT_DIM
    assert meta["text_len"] == 512 and meta["model_dir"] == "wan-tiny" and meta["layout"] == "FHWC"
    assert meta["clip"] == {"frames": FRAMES, "height": SIZE, "width": SIZE, "fps": 0.0, "frame_stride": 1}
    raw = pq.read_schema(manifest).metadata
    assert raw[b"kind"] == b"latent"
    assert set(pq.read_schema(manifest).names) == set(L.COLUMNS)
    skipped = json.loads((cache / "skipped.json").read_text())
    assert [Path(s["path"]).name for s in skipped] == ["not_a_video.mp4"] and "decord" in skipped[0]["reason"]
    info = L.latent_manifest_info(manifest)
    assert (info.latent_shape, info.text_dim, info.compression, info.text_len, info.rows) == (
        LATENT_SHAPE, TEXT_DIM, (4, 8, 8), 512, 3)
    assert not list(cache.rglob(".*tmp*"))  # no temporary file left behind


def test_second_run_skips_everything_and_other_settings_are_refused(cache, source, wan_dir):
    files = sorted(cache.rglob("*.safetensors"))
    mtimes = [f.stat().st_mtime_ns for f in files]
    rep = precompute(wan_dir, source, cache, frames=FRAMES, height=SIZE, width=SIZE, dtype="fp32",
                     num_encoders=0, progress=False)
    assert (rep.clips, rep.encoded, rep.reused, rep.texts_encoded, rep.texts_reused) == (3, 0, 3, 0, 2)
    assert [Path(p).name for p, _ in rep.skipped] == ["not_a_video.mp4"]  # still listed (tried again)
    assert [f.stat().st_mtime_ns for f in sorted(cache.rglob("*.safetensors"))] == mtimes
    with pytest.raises(ValueError, match=r"other settings \(frames: 9 -> 5"):
        precompute(wan_dir, source, cache, frames=5, height=SIZE, width=SIZE, dtype="fp32", num_encoders=0)


def test_resume_redoes_only_what_is_missing(cache, source, wan_dir, tmp_path):
    out = tmp_path / "cache"
    shutil.copytree(cache, out)
    rows, _ = L.read_latent_manifest(out / "manifest.parquet")
    (out / rows[1]["latent_path"]).unlink()
    (out / rows[1]["text_path"]).write_bytes(b"junk")  # a corrupt file is made again
    before = L.load_latent_sample(cache / "manifest.parquet", rows[1])
    rep = precompute(wan_dir, source, out, frames=FRAMES, height=SIZE, width=SIZE, dtype="fp32",
                     num_encoders=0, progress=False)
    assert (rep.encoded, rep.reused, rep.texts_encoded, rep.texts_reused) == (1, 2, 1, 1)
    after = L.load_latent_sample(out / "manifest.parquet", rows[1])
    torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)


class DyingEncoder(E.Encoder):
    """Its process ends (as a segfault in a codec would end it) on any clip of a file named die*."""

    def encode_clips(self, tasks):
        if any(Path(t["source"]).name.startswith("die") for t in tasks):
            os._exit(1)
        return super().encode_clips(tasks)


@pytest.mark.slow  # about 16 s of Ray drill: the default run keeps it under 10 minutes
def test_an_encoder_that_dies_is_replaced_and_the_clip_listed(ray_session, wan_dir, source, tmp_path, monkeypatch):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test file
    entries = read_manifest(source)
    die = tmp_path / "die.mp4"
    shutil.copy(entries[0].path, die)
    manifest = write_manifest([entries[0], ManifestEntry(path=str(die), caption="x"), entries[1]],
                              tmp_path / "m.parquet")
    monkeypatch.setattr(EncoderPool, "encoder_cls", DyingEncoder)
    rep = precompute(wan_dir, manifest, tmp_path / "out", frames=FRAMES, height=SIZE, width=SIZE,
                     num_encoders=1, progress=False)
    assert rep.clips == 2 and rep.encoded == 2
    assert [p for p, _ in rep.skipped] == [str(die)] and "the encoder process died on it twice" in rep.skipped[0][1]


def test_bf16_storage(wan_dir, source, cache, tmp_path):
    one = write_manifest(read_manifest(source)[:1], tmp_path / "one.parquet")
    rep = precompute(wan_dir, one, tmp_path / "bf16", frames=FRAMES, height=SIZE, width=SIZE,
                     num_encoders=0, progress=False)
    rows, meta = L.read_latent_manifest(rep.manifest)
    assert meta["dtype"] == rows[0]["dtype"] == "bfloat16"
    lat, text = L.load_latent_sample(rep.manifest, rows[0])
    ref_lat, ref_text = L.load_latent_sample(cache / "manifest.parquet", L.read_latent_manifest(
        cache / "manifest.parquet")[0][0])
    assert lat.dtype == torch.float32
    torch.testing.assert_close(lat, ref_lat.bfloat16().float())
    torch.testing.assert_close(text, ref_text.bfloat16().float())


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------


def test_load_errors_name_the_file(cache, source, tmp_path):
    manifest = cache / "manifest.parquet"
    rows, _ = L.read_latent_manifest(manifest)
    with pytest.raises(L.LatentFileError, match=r"latent file .*missing\.safetensors.* is missing.*precompute"):
        L.load_latent_sample(manifest, {**rows[0], "latent_path": "latents/missing.safetensors"})
    with pytest.raises(L.LatentFileError,
                       match=r"holds torch.float32 \(3, 4, 4, 4\).*says torch.float32 \(3, 4, 4, 8\)"):
        L.load_latent_sample(manifest, {**rows[0], "latent_shape": (3, 4, 4, 8)})
    with pytest.raises(L.LatentFileError, match=r"says torch.bfloat16"):
        L.load_latent_sample(manifest, {**rows[0], "dtype": "bfloat16"})
    with pytest.raises(L.LatentFileError, match=r"text file .*holds .*\(\d+, 16\).*says .*\(99, 16\)"):
        L.load_latent_sample(manifest, {**rows[0], "text_len": 99}, text_dim=16)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x00" * 5)
    with pytest.raises(L.LatentFileError, match=r"unreadable"):
        L.load_latent_sample(tmp_path / "m.parquet", {**rows[0], "latent_path": str(junk)})
    with pytest.raises(ValueError, match="is not a latent manifest"):
        L.read_latent_manifest(source)  # a video manifest
    with pytest.raises(ValueError, match="is not a readable Parquet file"):
        L.read_latent_manifest(ROOT / "pyproject.toml")
    padded = L.pad_text(torch.ones(3, 2), 5)
    assert padded.shape == (5, 2) and padded[:3].eq(1).all() and padded[3:].eq(0).all()
    with pytest.raises(ValueError, match="more than length=2"):
        L.pad_text(torch.ones(3, 2), 2)


# ---------------------------------------------------------------------------------------------
# decoder actors
# ---------------------------------------------------------------------------------------------


def _data(manifest, **kw):
    return DataConfig(**{"manifest": str(manifest), "batch_size": 2, "prefetch": 1, **kw})


def test_decoder_yields_latent_batches(cache):
    manifest = cache / "manifest.parquet"
    rows, _ = L.read_latent_manifest(manifest)
    # video options do not apply to latents: odd values change nothing
    with VideoDecoder(_data(manifest, num_frames=7, height=8, width=8), seed=3, caption_max_bytes=8) as dec:
        batches = [dec.next_batch() for _ in range(3)]
    b = batches[0]
    assert set(b) == {"latents", "text", "text_len", "index", "position", "skipped"}
    assert b["latents"].dtype == np.float32 and b["latents"].shape == (2, *LATENT_SHAPE)
    assert b["text"].dtype == np.float32 and b["text"].shape == (2, 512, TEXT_DIM)
    assert b["text_len"].dtype == np.int32 and b["index"].dtype == np.int64 and int(b["position"]) == 2
    for batch in batches:
        for i, row in enumerate(batch["index"]):
            lat, text = L.load_latent_sample(manifest, rows[row])
            n = int(batch["text_len"][i])
            assert n == rows[row]["text_len"]
            np.testing.assert_array_equal(batch["latents"][i], lat.numpy())
            np.testing.assert_array_equal(batch["text"][i], L.pad_text(text).numpy())
            assert not batch["text"][i, n:].any()
    # the order is a function of (seed, position): the same seed again, and a decoder resumed
    # at batch 1's position, give the same batches
    with VideoDecoder(_data(manifest), seed=3, caption_max_bytes=8) as dec:
        again = [dec.next_batch() for _ in range(3)]
    with VideoDecoder(_data(manifest), seed=3, caption_max_bytes=8,
                      start_position=int(batches[0]["position"])) as dec:
        resumed = [dec.next_batch() for _ in range(2)]
    for a, c in zip(batches, again):
        for key in a:
            np.testing.assert_array_equal(a[key], c[key], err_msg=key)
    for a, c in zip(batches[1:], resumed):
        for key in a:
            np.testing.assert_array_equal(a[key], c[key], err_msg=key)
    with VideoDecoder(_data(manifest), seed=4, caption_max_bytes=8) as dec:
        other = [dec.next_batch()["index"].tolist() for _ in range(3)]
    assert other != [x["index"].tolist() for x in batches]


def test_decoder_skips_a_missing_latent_file(cache, tmp_path, caplog):
    out = tmp_path / "cache"
    shutil.copytree(cache, out)
    manifest = out / "manifest.parquet"
    rows, _ = L.read_latent_manifest(manifest)
    (out / rows[1]["latent_path"]).unlink()
    with caplog.at_level(logging.WARNING, logger=decoder_mod.__name__):
        with VideoDecoder(_data(manifest, max_bad_fraction=1.0), seed=0, caption_max_bytes=8) as dec:
            batches = [dec.next_batch() for _ in range(3)]  # 6 clips = 7 draws (2 epochs + 1) minus skips
            stats = dec.stats()
    used = [int(r) for b in batches for r in b["index"]]
    assert 1 not in used and int(batches[-1]["skipped"]) == stats.skipped >= 2
    assert stats.skipped_paths == (str(out / rows[1]["latent_path"]),)
    assert sum("skipping latent file" in r.message and "is missing" in r.message for r in caplog.records) == 1


def test_mixed_latent_shapes_are_refused(cache, tmp_path):
    rows, meta = L.read_latent_manifest(cache / "manifest.parquet")
    rows[2] = {**rows[2], "latent_shape": (5, 4, 4, Z)}
    mixed = L.write_latent_manifest(rows, meta, tmp_path / "mixed.parquet")
    msg = r"mixes 2 latent shapes \(\[3, 4, 4, 4\] x 2, \[5, 4, 4, 4\] x 1\).*precompute all clips at one.*split"
    with pytest.raises(ValueError, match=msg):
        L.latent_manifest_info(mixed)
    with pytest.raises(ValueError, match=msg):
        VideoDecoder(_data(mixed), seed=0, caption_max_bytes=8)


def test_decoder_pool_serves_latent_batches(ray_session, cache, small_config, tmp_path):
    from pipelines.decoder_pool import DecoderPool

    cfg = small_config(**{"data.manifest": str(cache / "manifest.parquet"), "data.num_decoders": 2})
    pool = DecoderPool(cfg, tmp_path / "status")
    try:
        refs = [pool.batch_ref(k) for k in range(3)]
        infos = [pool.wait_ready(k).info for k in range(3)]
        batches = ray.get(refs)
    finally:
        pool.close()
    assert [i.rank for i in infos] == [0, 1, 0]
    assert all(b["latents"].shape == (2, *LATENT_SHAPE) and b["text"].shape == (2, 512, TEXT_DIM) for b in batches)
    with VideoDecoder(cfg.data, cfg.training.seed, 8, rank=1, world_size=2) as dec:
        np.testing.assert_array_equal(dec.next_batch()["latents"], batches[1]["latents"])
