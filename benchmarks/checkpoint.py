"""Checkpoint size and write time with and without the compute copy ``w``.

    python -m benchmarks.checkpoint [--params 1e8] [--shards 8] [--dir DIR] [--json]

A checkpoint stores ``master``, ``m`` and ``v`` (fp32) per shard; ``w`` is ``master`` cast to the
run's ``w_dtype`` and is rebuilt on load. This measures what storing ``w`` as well would cost:
bytes on disk and the seconds of ``megaslide_ray.state.checkpoint.write_checkpoint`` (fsyncs
included), for bf16 and fp32 compute copies, best of ``--repeats`` writes, both variants in
the same run and alternating (so a burst of disk or CPU load hits both). ``--dir`` is where the
checkpoints go (default: a temporary directory on the system temp disk); the ratio, not the
absolute seconds, is the figure to compare.

``--checksums`` measures instead what the per-tensor checksums and the finiteness check cost on
one large shard (``--params`` parameters in one file): the checksum alone (GB/s), the write with
and without them (checksums and the NaN/Inf check switched off by replacing them with no-ops),
and the read of every tensor with and without checking the checksum, alternating, best of
``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from megaslide_ray.models.shards import ShardLayout
from megaslide_ray.state import checkpoint as ckpt_mod


def _shards(params: int, shards: int, w_dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    per = params // shards
    out = []
    for i in range(shards):
        master = torch.randn(per, generator=gen)
        lay = ShardLayout(i, ("weight",), ((per,),), (0,), per)
        out.append((lay, {"w": master.to(w_dtype, copy=True), "master": master, "m": 0.01 * master,
                          "v": 1e-4 * master.abs()}))
    return out


def _write(root: Path, shards, kinds: tuple[str, ...]) -> tuple[float, int]:
    saved = ckpt_mod.CHECKPOINT_KINDS
    ckpt_mod.CHECKPOINT_KINDS = kinds  # the writer stores exactly these kinds
    try:
        if root.exists():
            shutil.rmtree(root)
        t0 = time.perf_counter()
        path = ckpt_mod.write_checkpoint(root, 1, iter(shards), {"w_dtype": "x"})
        seconds = time.perf_counter() - t0
    finally:
        ckpt_mod.CHECKPOINT_KINDS = saved
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    return seconds, size


def run(params: int, shards: int, repeats: int, where: Path) -> list[dict]:
    rows = []
    for name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        data = _shards(params, shards, dtype)
        variants = {"without w (stored)": ("master", "m", "v"), "with w": ("w", "master", "m", "v")}
        best = {k: (float("inf"), 0) for k in variants}
        for _ in range(repeats):
            for label, kinds in variants.items():
                secs, size = _write(where / "ckpt", data, kinds)
                best[label] = (min(best[label][0], secs), size)
        base_s, base_b = best["without w (stored)"]
        for label, (secs, size) in best.items():
            rows.append({"w_dtype": name, "variant": label, "params": params, "bytes": size,
                         "bytes_per_param": size / params, "seconds": secs, "gbps": size / secs / 1e9,
                         "size_ratio": size / base_b, "time_ratio": secs / base_s})
        shutil.rmtree(where / "ckpt", ignore_errors=True)
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _read_all(path: str, verify: bool) -> None:
    with ckpt_mod.CheckpointReader(path) as ckpt:
        if not verify:
            ckpt._sums = {}  # what a checkpoint without checksums reads: no check
        for i in range(ckpt.num_shards):
            for kind in ckpt_mod.CHECKPOINT_KINDS:
                ckpt.tensor(i, kind)


def run_checksums(params: int, repeats: int, where: Path) -> list[dict]:
    """Checksum, write and read costs of one shard of ``params`` parameters (see the docstring)."""
    data = _shards(params, 1, torch.bfloat16)
    nbytes = 12 * params
    crc = min(_timed(lambda: [ckpt_mod.tensor_checksum(data[0][1][k]) for k in ckpt_mod.CHECKPOINT_KINDS])
              for _ in range(repeats))
    best = {"write, checked": float("inf"), "write, unchecked": float("inf"),
            "read, checked": float("inf"), "read, unchecked": float("inf")}
    real = (ckpt_mod.tensor_checksum, ckpt_mod.nonfinite_kinds)
    for _ in range(repeats):
        for checked in (True, False):
            if not checked:
                ckpt_mod.tensor_checksum, ckpt_mod.nonfinite_kinds = (lambda t: "0"), (lambda ts: [])
            try:
                label = "checked" if checked else "unchecked"
                best[f"write, {label}"] = min(best[f"write, {label}"], _write(where / "ckpt", data,
                                                                               ckpt_mod.CHECKPOINT_KINDS)[0])
            finally:
                ckpt_mod.tensor_checksum, ckpt_mod.nonfinite_kinds = real
            path = str(where / "ckpt" / "checkpoints" / "step_1")
            best[f"read, {label}"] = min(best[f"read, {label}"], _timed(lambda: _read_all(path, checked)))
    shutil.rmtree(where / "ckpt", ignore_errors=True)
    rows = [{"what": "checksum alone", "bytes": nbytes, "seconds": crc, "gbps": nbytes / crc / 1e9,
             "threads": ckpt_mod.CHECKSUM_THREADS}]
    rows += [{"what": k, "bytes": nbytes, "seconds": v, "gbps": nbytes / v / 1e9,
              "threads": ckpt_mod.CHECKSUM_THREADS} for k, v in best.items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=1e8, help="parameters in all (default 1e8)")
    p.add_argument("--shards", type=int, default=8, help="shard files (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="writes per variant; the best counts (default 3)")
    p.add_argument("--dir", default="", help="where to write (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.add_argument("--checksums", action="store_true",
                   help="measure the checksums' cost on one shard of --params parameters instead")
    a = p.parse_args(argv)
    if a.params < a.shards or a.shards < 1 or a.repeats < 1:
        p.error(f"--params {a.params:g} / --shards {a.shards} / --repeats {a.repeats}: need params >= shards >= 1 "
                f"and repeats >= 1")
    where = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="megaslide-ckpt-bench-"))
    where.mkdir(parents=True, exist_ok=True)
    try:
        rows = (run_checksums(int(a.params), a.repeats, where) if a.checksums
                else run(int(a.params), a.shards, a.repeats, where))
    finally:
        if not a.dir:
            shutil.rmtree(where, ignore_errors=True)
    if a.checksums and not a.json:
        print(f"{'what':<20}{'GB':>8}{'seconds':>9}{'GB/s':>7}")
        for r in rows:
            print(f"{r['what']:<20}{r['bytes'] / 1e9:>8.2f}{r['seconds']:>9.2f}{r['gbps']:>7.2f}")
        return 0
    if a.json:
        for r in rows:
            print(json.dumps(r))
        return 0
    print(f"{'w_dtype':<10}{'variant':<22}{'GB':>8}{'B/param':>9}{'seconds':>9}{'GB/s':>7}{'size x':>8}{'time x':>8}")
    for r in rows:
        print(f"{r['w_dtype']:<10}{r['variant']:<22}{r['bytes'] / 1e9:>8.2f}{r['bytes_per_param']:>9.2f}"
              f"{r['seconds']:>9.2f}{r['gbps']:>7.2f}{r['size_ratio']:>8.2f}{r['time_ratio']:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
