"""The sample writer: turns the samples taken during training into videos, off the training path.

The compute actor denoises a sample (the model's own forward passes, with the weights of that
step); what is left is this actor's: for a latent-space model the VAE decode (for ``wan`` also
the prompts' text embeddings, encoded once when the run starts, the text encoder then freed),
then the mp4, its ``.png`` contact sheet and one line of ``RUN_DIR/samples/samples.jsonl`` per
video. The driver hands a sample over and goes on training; on the CPU the decode overlaps the
next steps, on the GPU the driver waits for it between steps (``training.sample_device``).

A plain class; ``pipelines.sample_writer`` makes it a Ray actor, tests build it in-process.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from megaslide_ray.data.demo import write_video
from megaslide_ray.data.frames import contact_sheet, decode_latents, to_uint8_frames, write_png
from megaslide_ray.data.image_prompts import ImageSpec, image_condition

log = logging.getLogger(__name__)

INDEX = "samples.jsonl"
"""The file in ``RUN_DIR/samples`` listing every video written, one JSON line each (``WrittenSample``)."""


@dataclass(frozen=True)
class WrittenSample:
    """One video written: the step whose weights made it, the prompt (and its index in the
    prompts), the seed of its noise, the files, its size, and the seconds this actor spent on it
    (``decode_seconds``: the VAE, or the pixel conversion; ``write_seconds``: mp4 and sheet)."""
    step: int
    index: int
    prompt: str
    seed: int
    video: str
    sheet: str
    frames: int
    height: int
    width: int
    decode_seconds: float
    write_seconds: float


def writer_threads() -> int:
    """Torch threads of a CPU sample writer: a quarter of the machine's cores (at least one), so a
    decode beside training leaves the compute actor and the optimizer most of them."""
    return max(1, (os.cpu_count() or 1) // 4)


class SampleWriter:
    """Decodes and writes the samples of one run. ``model_dir``: the local diffusers folder whose
    ``vae/`` (and for ``wan`` ``text_encoder/``, ``tokenizer/``) a latent model needs (None: a
    pixel model, whose samples are the frames themselves); ``device``: ``cpu`` or ``cuda``."""

    def __init__(self, run_dir: str, model_dir: str | None = None, device: str = "cpu", fps: int = 8,
                 threads: int = 0):
        self.samples = Path(run_dir) / "samples"
        self.samples.mkdir(parents=True, exist_ok=True)
        self.fps = fps
        self.encoder = None
        if model_dir is not None:
            from megaslide_ray.config import DataConfig  # lazy: a pixel run needs no encoders
            from megaslide_ray.data.encoders import Encoder  # lazy: as above

            # The encoder's clip settings are those of precompute's video decoding: unused here. Its
            # dtype sets the text encoder's, as in precompute: bf16 on a GPU (the VAE is fp32 anyway).
            dtype = "bfloat16" if device == "cuda" else "float32"
            self.encoder = Encoder(model_dir, DataConfig(), device, dtype, threads or writer_threads())

    def encode_prompts(self, prompts: list[str]) -> list[np.ndarray]:
        """Each prompt's text embedding, float32 ``(L, text_dim)`` (its valid tokens), as
        precompute encodes captions; then the text encoder is freed and the VAE loaded."""
        if self.encoder is None:
            raise RuntimeError("this sample writer has no model folder: a pixel model reads its prompts as bytes")
        texts = [t.numpy() for t in self.encoder.encode_text(list(prompts))]
        self.encoder.load_vae()  # frees the text encoder now (on a GPU: before training's first step)
        return texts

    def encode_images(self, spec: ImageSpec, images: list[tuple[str, str | None]]) -> list[dict]:
        """An image-to-video model's condition of each prompt from its ``(image, last image)``
        (``image_condition``: as ``sample --image`` makes it), as numpy arrays; CLIP is freed after."""
        if self.encoder is None:
            raise RuntimeError("this sample writer has no model folder: image prompts need the model's VAE")
        out = [{k: (None if v is None else v.numpy()) for k, v in image_condition(self.encoder, spec, *pair).items()}
               for pair in images]
        self.encoder.image_encoder = None  # CLIP is needed only here
        return out

    def write(self, x: np.ndarray, step: int, index: int, prompt: str, seed: int, path: str) -> WrittenSample:
        """The denoised sample ``x`` (float32 ``(1, F, H, W, C)``: latents, or pixels in [-1, 1])
        as the mp4 ``path``, its contact sheet beside it and a line of ``samples.jsonl``."""
        t0 = time.perf_counter()
        if self.encoder is not None:
            torch.set_num_threads(self.encoder.threads)  # this call's thread (Ray sets 1 for an actor of no CPU)
        x = torch.from_numpy(np.array(x, dtype=np.float32))  # a copy: Ray hands over a read-only array
        frames = to_uint8_frames(x) if self.encoder is None else decode_latents(self.encoder.load_vae(), x)
        t1 = time.perf_counter()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        write_video(out, frames, self.fps)
        write_png(out.with_suffix(".png"), contact_sheet(frames))
        f, h, w, _ = frames.shape
        done = WrittenSample(step, index, prompt, seed, str(out), str(out.with_suffix(".png")), f, h, w, t1 - t0,
                             time.perf_counter() - t1)
        with (self.samples / INDEX).open("a") as index_file:  # one writer per run: appends never interleave
            index_file.write(json.dumps(asdict(done)) + "\n")
        return done

    def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
            self.encoder = None
