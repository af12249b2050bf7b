"""Precomputed latents: which storage reads faster, and the encoder pool against one encoder.

    python -m benchmarks.latents [--part read|encode|both] [--json]

``read`` (the storage format of ``megaslide_ray.data.latents``): ``--clips`` random bf16 latents of
``--shape`` (default ``21,60,104,16``: Wan at 81 x 480 x 832) plus text embeddings of
``--text-len`` x ``--text-dim`` tokens (one per clip), written both ways into a temporary folder:

- ``safetensors``: one file per clip (``latents``) and one per caption (``text``), read with
  ``safetensors.safe_open`` as ``load_latent_sample`` does;
- ``parquet``: shards of ``--shard-rows`` clips, the tensors as raw-bytes columns (the most
  favourable encoding: no compression, one row per row group so a random row reads alone), read
  with an open ``ParquetFile`` per shard (``read_row_group``), bytes -> tensors.

Both are read in the same random order (training draws a permutation), to float32, ``--rounds``
times each, alternating; ``warm`` reads come from the page cache, ``cold`` ones after
``posix_fadvise(DONTNEED)`` on every file (no root needed: our own files' clean pages). Rows:
clips/s and MB/s (median over rounds) and the ratio ``safetensors / parquet`` in clips/s.

``encode`` (``python -m megaslide_ray.precompute``'s pool): a small random Wan-like model (VAE
base_dim 16, z_dim 16; UMT5 d_model 64, 2 layers) written to a temporary ``WAN_DIR``, and
``--videos`` demo videos (``--enc-frames`` frames at ``--enc-size`` pixels). ``in-process``: one
``Encoder`` in this process (``--num-encoders 0``); ``pool N``: N Ray actors, for each N of
``--pool`` (default 1,2), each with ``CPUs / N`` torch threads. Each run
starts from an empty cache. ``clips_per_s``: videos / the whole ``precompute`` call (actor
start-up and model loading included, Ray's own start-up not); ``steady``: over the last three
quarters of the clips (``PrecomputeReport.steady_clips_per_s``), what a long run sees. Ratios =
run / in-process; medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (files just written) are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_both(folder: Path, clips: int, shape: tuple[int, ...], text_len: int, text_dim: int, shard_rows: int):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from megaslide_ray.data.latents import LATENT_KEY, TEXT_KEY, save_tensor_file

    g = torch.Generator().manual_seed(0)
    st_files, rows = [], []
    shards: list[Path] = []
    batch: list[dict] = []
    schema = pa.schema([("latents", pa.binary()), ("text", pa.binary())])

    def flush():
        path = folder / f"shard_{len(shards):04d}.parquet"
        pq.write_table(pa.Table.from_pylist(batch, schema=schema), path, compression="none", row_group_size=1)
        shards.append(path)
        batch.clear()

    for i in range(clips):
        lat = torch.randn(shape, generator=g).to(torch.bfloat16)
        txt = torch.randn((text_len, text_dim), generator=g).to(torch.bfloat16)
        lp = save_tensor_file(folder / "st" / f"clip_{i:05d}.safetensors", LATENT_KEY, lat)
        tp = save_tensor_file(folder / "st" / f"text_{i:05d}.safetensors", TEXT_KEY, txt)
        st_files.append((lp, tp))
        batch.append({"latents": lat.view(torch.int16).numpy().tobytes(),
                      "text": txt.view(torch.int16).numpy().tobytes()})
        rows.append((len(shards), len(batch) - 1))
        if len(batch) == shard_rows:
            flush()
    if batch:
        flush()
    return st_files, shards, rows


def read_safetensors(files, order) -> int:
    from safetensors import safe_open

    nbytes = 0
    for i in order:
        lp, tp = files[i]
        with safe_open(str(lp), framework="pt") as f:
            lat = f.get_tensor("latents").float()
        with safe_open(str(tp), framework="pt") as f:
            txt = f.get_tensor("text").float()
        nbytes += (lat.numel() + txt.numel()) * 2
    return nbytes


def read_safetensors_bytes(files, order) -> int:
    """The same files read with one ``read()`` each (no mmap), parsed by ``safetensors.torch.load``."""
    from safetensors.torch import load

    nbytes = 0
    for i in order:
        lp, tp = files[i]
        lat = load(Path(lp).read_bytes())["latents"].float()
        txt = load(Path(tp).read_bytes())["text"].float()
        nbytes += (lat.numel() + txt.numel()) * 2
    return nbytes


def read_parquet(shards, rows, order, shape, text_len, text_dim) -> int:
    import pyarrow.parquet as pq

    handles = {}
    nbytes = 0
    for i in order:
        s, r = rows[i]
        if s not in handles:
            handles[s] = pq.ParquetFile(shards[s])
        t = handles[s].read_row_group(r)
        lat_b, txt_b = t.column("latents")[0].as_buffer(), t.column("text")[0].as_buffer()
        lat = torch.frombuffer(lat_b, dtype=torch.bfloat16).reshape(shape).float()
        txt = torch.frombuffer(txt_b, dtype=torch.bfloat16).reshape(text_len, text_dim).float()
        nbytes += (lat.numel() + txt.numel()) * 2
    for h in handles.values():
        h.close()
    return nbytes


def bench_read(args) -> list[dict]:
    shape = tuple(int(x) for x in args.shape.split(","))
    out = []
    with tempfile.TemporaryDirectory(prefix="latents-bench-") as tmp:
        folder = Path(tmp)
        files, shards, rows = write_both(folder, args.clips, shape, args.text_len, args.text_dim, args.shard_rows)
        all_st = [p for pair in files for p in pair]
        order = list(range(args.clips))
        random.Random(0).shuffle(order)
        readers = {
            "safetensors": (lambda: read_safetensors(files, order), all_st),
            "safetensors-read": (lambda: read_safetensors_bytes(files, order), all_st),
            "parquet": (lambda: read_parquet(shards, rows, order, shape, args.text_len, args.text_dim), shards),
        }
        for mode in ("warm", "cold"):
            times: dict[str, list[float]] = {f: [] for f in readers}
            nbytes = {}
            for _ in range(args.rounds):
                for fmt, (read, paths) in readers.items():
                    if mode == "cold":
                        _evict(paths)
                    elif not times[fmt]:  # warm: one untimed pass fills the cache
                        read()
                    t0 = time.perf_counter()
                    nbytes[fmt] = read()
                    times[fmt].append(time.perf_counter() - t0)
            med = {f: statistics.median(t) for f, t in times.items()}
            for fmt in readers:
                out.append({"part": "read", "mode": mode, "format": fmt, "clips": args.clips, "shape": list(shape),
                            "clips_per_s": round(args.clips / med[fmt], 2),
                            "MB_per_s": round(nbytes[fmt] / med[fmt] / 1e6, 1),
                            "seconds": [round(t, 4) for t in times[fmt]],
                            "ratio_over_parquet": round(med["parquet"] / med[fmt], 3)})
    return out


def make_model_dir(folder: Path, base_dim=16, z_dim=16, d_model=64, layers=2) -> Path:
    """A small random Wan-like model folder: ``vae/``, ``text_encoder/``, ``tokenizer/``."""
    from diffusers import AutoencoderKLWan
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

    from megaslide_ray.data.demo import BACKGROUNDS, COLOURS, DIRECTIONS, SHAPES

    torch.manual_seed(0)
    g = np.random.default_rng(0)
    AutoencoderKLWan(base_dim=base_dim, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                     latents_mean=g.normal(size=z_dim).round(3).tolist(),
                     latents_std=(1 + g.random(z_dim)).round(3).tolist()).save_pretrained(folder / "vae")
    words = sorted({w for name in (*COLOURS, *BACKGROUNDS, *SHAPES, *DIRECTIONS) for w in name.split()}
                   | {"a", "moving", "on", "and", "background"})
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(folder / "tokenizer")
    cfg = UMT5Config(vocab_size=len(vocab), d_model=d_model, d_kv=d_model // 4, d_ff=2 * d_model, num_layers=layers,
                     num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=32)
    UMT5EncoderModel(cfg).save_pretrained(folder / "text_encoder")
    return folder


def bench_encode(args) -> list[dict]:
    import ray

    from megaslide_ray.data.demo import ensure_demo_dataset
    from pipelines.latent_precompute import precompute

    out = []
    with tempfile.TemporaryDirectory(prefix="latents-enc-") as tmp:
        root = Path(tmp)
        model = make_model_dir(root / "wan")
        manifest = ensure_demo_dataset(root / "cache", num_videos=args.videos)
        ray.init(address="local", include_dashboard=False, namespace="megaslide", logging_level="ERROR")
        try:
            runs = {}
            for rnd in range(args.rounds):
                for name, n in (("in-process", 0), *((f"pool {k}", k) for k in args.pool)):
                    t0 = time.perf_counter()
                    rep = precompute(model, manifest, root / f"out-{n}-{rnd}", frames=args.enc_frames,
                                     height=args.enc_size, width=args.enc_size, num_encoders=n, progress=False,
                                     dtype="bf16", device="cpu")
                    runs.setdefault(name, []).append((time.perf_counter() - t0, rep.encoded, rep.steady_clips_per_s()))
        finally:
            ray.shutdown()
        med = {name: statistics.median(t for t, _, _ in r) for name, r in runs.items()}
        steady = {name: statistics.median(s for _, _, s in r) for name, r in runs.items()}
        base = args.videos / med["in-process"]
        for name, r in runs.items():
            cps = args.videos / med[name]
            out.append({"part": "encode", "run": name, "videos": args.videos, "frames": args.enc_frames,
                        "size": args.enc_size, "clips_per_s": round(cps, 3),
                        "steady_clips_per_s": round(steady[name], 3),
                        "seconds": [round(t, 2) for t, _, _ in r], "encoded": r[0][1],
                        "ratio_over_in_process": round(cps / base, 3),
                        "steady_ratio_over_in_process": round(steady[name] / steady["in-process"], 3)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.latents", description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("read", "encode", "both"), default="both")
    p.add_argument("--clips", type=int, default=48)
    p.add_argument("--shape", default="21,60,104,16", help="latent F,H,W,C")
    p.add_argument("--text-len", type=int, default=120)
    p.add_argument("--text-dim", type=int, default=4096)
    p.add_argument("--shard-rows", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--videos", type=int, default=48)
    p.add_argument("--enc-frames", type=int, default=29, help="4k+1, at most 32 (the demo videos have 32-40 frames)")
    p.add_argument("--enc-size", type=int, default=64)
    p.add_argument("--pool", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2],
                   help="encoder actors of the pool runs, comma-separated")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = []
    if args.part in ("read", "both"):
        rows += bench_read(args)
    if args.part in ("encode", "both"):
        rows += bench_encode(args)
    for r in rows:
        if args.json:
            print(json.dumps(r))
        elif r["part"] == "read":
            print(f"read   {r['mode']:4s} {r['format']:16s} {r['clips_per_s']:9.2f} clips/s {r['MB_per_s']:8.1f} MB/s  "
                  f"ratio to parquet {r['ratio_over_parquet']:.3f}")
        else:
            print(f"encode {r['run']:11s} {r['clips_per_s']:8.3f} clips/s (steady {r['steady_clips_per_s']:8.3f})  "
                  f"ratio to in-process {r['ratio_over_in_process']:.3f} "
                  f"(steady {r['steady_ratio_over_in_process']:.3f})"
                  f"  runs {r['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
