"""Decoding throughput: the decoder-actor pool (1 and 2 decoders) against plain single-process
decord on the same clips, and whether the pool keeps ahead of the ``tiny`` trainer.

    python -m benchmarks.decode [--clips 12] [--batches 12] [--repeats 3] [--trainer-steps 8] [--json]

Clips: ``--clips`` H.264 videos of 48 frames at each of two resolutions (128x128 and 256x256),
generated once into a temporary folder. Each row decodes 16-frame clips (stride 1, random
temporal start) at the source resolution, so the resize is a no-op and the pool's cost over
decord is its own (prefetch thread, batch assembly, Ray object transfer).

- ``decord``: one process, ``VideoReader`` + ``get_batch`` for the clips the pool draws, in order.
- ``decoder no-Ray``: one ``VideoDecoder`` in this process (its prefetch thread, batch assembly),
  no actor: what the decoder's own code costs over decord.
- ``pool nD``: a ``DecoderPool`` of n actors; the driver asks for the batches in step order as the
  pipeline does and fetches each one (timed from the first request, after two warm-up batches).
  ``per_decoder_ratio`` = pool frames/s / n / decord frames/s (goal >= 0.9: the actor machinery
  costs little). With n decoders on a machine with fewer free cores, the ratio drops for lack of
  cores, not of overhead.
- ``tiny nD`` (``--trainer-steps`` > 0): the ``tiny`` preset on the demo set; the data-wait
  fraction = sum(data_wait_seconds) / sum(step_seconds) over the steps after the first
  (goal < 5%).

Each timing is the median of ``--repeats`` runs (these machines are noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

from megaslide_ray.config import build_config
from megaslide_ray.data.demo import write_video
from megaslide_ray.data.manifest import write_manifest

RESOLUTIONS = ((128, 128), (256, 256))
VIDEO_FRAMES = 48
CLIP_FRAMES = 16
BATCH = 2


def make_clips(folder: Path, n: int, width: int, height: int) -> Path:
    """``n`` videos with moving gradients and a square (cheap to make, realistic to decode)."""
    rows = []
    ys, xs = np.mgrid[0:height, 0:width]
    for i in range(n):
        frames = np.empty((VIDEO_FRAMES, height, width, 3), dtype=np.uint8)
        for t in range(VIDEO_FRAMES):
            frames[t, ..., 0] = (xs * 255 // width + 4 * t + 13 * i) % 256
            frames[t, ..., 1] = (ys * 255 // height + 2 * t) % 256
            frames[t, ..., 2] = (37 * i) % 256
            s = (t * 3 + i * 7) % (width - 16)
            frames[t, 8:24, s:s + 16] = 255
        name = f"v{width}x{height}_{i:03d}.mp4"
        write_video(folder / name, frames)
        rows.append({"path": name, "caption": f"clip {i}"})
    return write_manifest(rows, folder / f"manifest_{width}x{height}.parquet")


def _config(manifest: Path, width: int, height: int, num_decoders: int, seed: int = 0):
    return build_config("tiny", None, {
        "data.manifest": str(manifest), "data.num_frames": CLIP_FRAMES, "data.height": height,
        "data.width": width, "data.batch_size": BATCH, "data.num_decoders": num_decoders,
        "data.prefetch": 2, "training.seed": seed})


def plain_decord(cfg, batches: int) -> float:
    """Frames/s of decord in this process for the clips (rows, starts) a one-decoder pool draws."""
    import decord

    from megaslide_ray.data.clips import clip_offsets, clip_start
    from megaslide_ray.data.manifest import read_manifest

    entries = read_manifest(cfg.data.manifest)
    n = len(entries)
    offsets = clip_offsets(CLIP_FRAMES, 1)
    frames = 0
    t0 = time.perf_counter()
    for p in range(batches * BATCH):
        row = int(np.random.default_rng([cfg.training.seed, p // n]).permutation(n)[p % n])
        reader = decord.VideoReader(entries[row].path, ctx=decord.cpu(0))
        start = clip_start(len(reader), int(offsets[-1]) + 1, cfg.training.seed, p, True)
        clip = reader.get_batch((start + offsets).tolist()).asnumpy()
        frames += clip.shape[0]
        del reader
    return frames / (time.perf_counter() - t0)


def inprocess_fps(cfg, batches: int) -> float:
    """Frames/s of one ``VideoDecoder`` in this process (no Ray): the decoder's own code against
    plain decord, so the pool's remaining cost is the actor boundary."""
    from actors.decoder import VideoDecoder

    with VideoDecoder(cfg.data, cfg.training.seed, cfg.model.caption_max_bytes) as decoder:
        for _ in range(2):  # warm-up, as for the pool
            decoder.next_batch()
        t0 = time.perf_counter()
        for _ in range(batches):
            decoder.next_batch()
        return batches * BATCH * CLIP_FRAMES / (time.perf_counter() - t0)


def pool_fps(cfg, batches: int, status_dir: str) -> float:
    """Frames/s the pool delivers to the driver (batches fetched in step order)."""
    from pipelines.decoder_pool import DecoderPool

    pool = DecoderPool(cfg, status_dir)
    try:
        warm = 2
        pool.batch_ref(0)
        t0 = 0.0
        for k in range(warm + batches):
            if k == warm:
                t0 = time.perf_counter()
            pool.wait_ready(k)
            pool.batch_ref(k + 1)
            ray.get(pool.batch_ref(k))
            pool.commit(k)
        return batches * BATCH * CLIP_FRAMES / (time.perf_counter() - t0)
    finally:
        pool.close()


def trainer_data_wait(num_decoders: int, steps: int, run_dir: str) -> dict:
    from megaslide_ray.driver import Trainer

    cfg = build_config("tiny", None, {"data.num_decoders": num_decoders, "training.steps": steps,
                                      "training.log_every": steps})
    trainer = Trainer(cfg, run_dir=run_dir, progress=False)
    try:
        rows = [trainer.train_step(k) for k in range(steps)]
    finally:
        trainer.close()
    timed = rows[1:]
    wait = sum(r["data_wait_seconds"] for r in timed)
    total = sum(r["step_seconds"] for r in timed)
    return {"s_per_step": total / len(timed), "data_wait_fraction": wait / total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--clips", type=int, default=12, help="videos per resolution")
    p.add_argument("--batches", type=int, default=12, help="timed batches per pool run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--trainer-steps", type=int, default=8, help="tiny-trainer steps per decoder count (0: skip)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    ray.init(address="local", include_dashboard=False, namespace="megaslide", logging_level="ERROR")
    results = []
    try:
        with tempfile.TemporaryDirectory(prefix="megaslide-decode-bench-") as tmp:
            tmp_path = Path(tmp)
            for width, height in RESOLUTIONS:
                manifest = make_clips(tmp_path, args.clips, width, height)
                cfg1 = _config(manifest, width, height, 1)
                base = statistics.median(plain_decord(cfg1, args.batches) for _ in range(args.repeats))
                results.append({"row": f"decord {width}x{height}", "resolution": f"{width}x{height}",
                                "decoders": 0, "frames_per_s": base, "per_decoder_ratio": 1.0})
                local = statistics.median(inprocess_fps(cfg1, args.batches) for _ in range(args.repeats))
                results.append({"row": f"decoder no-Ray {width}x{height}", "resolution": f"{width}x{height}",
                                "decoders": 1, "frames_per_s": local, "per_decoder_ratio": local / base})
                for n in (1, 2):
                    cfg = _config(manifest, width, height, n)
                    fps = statistics.median(pool_fps(cfg, args.batches, str(tmp_path / f"status-{r}"))
                                            for r in range(args.repeats))
                    results.append({"row": f"pool {n}D {width}x{height}", "resolution": f"{width}x{height}",
                                    "decoders": n, "frames_per_s": fps, "per_decoder_ratio": fps / n / base})
            if args.trainer_steps > 1:
                for n in (1, 2):
                    r = trainer_data_wait(n, args.trainer_steps, str(tmp_path / f"run-{n}"))
                    results.append({"row": f"tiny {n}D", "decoders": n, **r})
    finally:
        ray.shutdown()

    if args.json:
        for r in results:
            print(json.dumps(r))
        return 0
    print(f"{'row':<22} {'frames/s':>10} {'per-decoder ratio':>18} {'s/step':>8} {'data wait':>10}")
    for r in results:
        fps = f"{r['frames_per_s']:.0f}" if "frames_per_s" in r else ""
        ratio = f"{r['per_decoder_ratio']:.2f}" if "per_decoder_ratio" in r else ""
        sps = f"{r['s_per_step']:.2f}" if "s_per_step" in r else ""
        wait = f"{100 * r['data_wait_fraction']:.1f}%" if "data_wait_fraction" in r else ""
        print(f"{r['row']:<22} {fps:>10} {ratio:>18} {sps:>8} {wait:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
