"""ParameterStore: every persistent byte of the model, in host shared memory, and CPU AdamW.

Per shard, four flat segments: ``w`` (the compute copy: bf16 for CUDA runs, fp32 for CPU
runs), ``master``, ``m``, ``v`` (fp32), plus a gradient landing buffer ``g`` (dtype of ``w``)
that the compute actor fills. Each segment is a file under the state directory
(``/dev/shm`` by default: RAM; a disk path lets state exceed RAM), mapped with
``torch.from_file(shared=True)``, so the compute actor on the same node maps the very same
pages: weights are never copied between processes on one node.

Versions: ``versions[l]`` is the step whose weights ``w_l`` holds. Step k's update of shard
l runs only after every shard reported its gradient for step k (exact global-norm clipping),
in shard order 0..L-1, so the next forward can start on shard 0 while the rest update.

The class is plain; ``pipelines/`` makes it a threaded Ray actor, so ``wait_version`` calls
block in their own threads while the update thread works.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from torch.optim.adamw import adamw as adamw_functional
from safetensors.torch import save_file

from megaslide_ray.config import Config
from megaslide_ray.model import build_shard, initialize_shard, num_shards
from megaslide_ray.schedule import clip_coefficient, lr_at
from megaslide_ray.shards import ShardLayout

log = logging.getLogger(__name__)

KINDS = ("w", "master", "m", "v", "g")
CHECKPOINT_KINDS = ("w", "master", "m", "v")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ShardInfo:
    index: int
    numel: int
    w_dtype: str
    paths: dict  # kind -> segment file
    layout: ShardLayout


@dataclass(frozen=True)
class UpdateResult:
    step: int               # the step whose gradients were applied (versions are now step + 1)
    grad_norm: float        # global L2 norm before clipping
    clip_coef: float
    lr: float
    optimizer_seconds: float
    skipped: bool = False   # non-finite gradients: no shard was updated


@dataclass(frozen=True)
class StoreStatus:
    versions: tuple[int, ...]
    state_dir: str
    state_bytes: int
    node_id: str


def default_state_root() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def state_key(run_dir: str | Path) -> str:
    """Stable name of a run's segments, so a restarted store finds them again."""
    return "megaslide-" + hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def map_segment(path: str | Path, numel: int, dtype: torch.dtype, create: bool = False) -> torch.Tensor:
    """Map a segment file as a flat tensor shared by every process that maps it."""
    path = Path(path)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if create:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    elif path.stat().st_size != nbytes:
        raise RuntimeError(f"segment {path} has {path.stat().st_size} bytes, expected {nbytes}; the state "
                           f"directory belongs to a different model: remove it or choose another runtime.state_dir")
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


class ParameterStore:
    def __init__(self, cfg: Config, run_dir: str, w_dtype: str = "float32",
                 resume_checkpoint: str | None = None, attach: bool = False):
        if w_dtype not in DTYPES:
            raise ValueError(f"w_dtype={w_dtype!r}; use one of {list(DTYPES)}")
        threads = cfg.runtime.optimizer_threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        self.cfg = cfg
        self.w_dtype = w_dtype
        self.n = num_shards(cfg)
        root = Path(cfg.runtime.state_dir) if cfg.runtime.state_dir else default_state_root()
        self.dir = root / state_key(run_dir)
        self.layouts = [ShardLayout.of(build_shard(cfg, i, "meta"), i) for i in range(self.n)]
        self._lock = threading.Condition()
        self._pending: dict[int, dict[int, float]] = {}   # step -> {shard: ||g||^2}
        self._results: dict[int, UpdateResult] = {}
        self._closed = False
        self._error: BaseException | None = None

        attached = attach and (self.dir / "layout.json").is_file()
        if attached:
            self._check_layout()
        else:
            self._check_space(root)
            if self.dir.exists():
                shutil.rmtree(self.dir)
            self.dir.mkdir(parents=True)
        self.seg: list[dict[str, torch.Tensor]] = []
        for i, lay in enumerate(self.layouts):
            segs = {}
            for kind in KINDS:
                dtype = DTYPES[w_dtype] if kind in ("w", "g") else torch.float32
                segs[kind] = map_segment(self._path(i, kind), lay.numel, dtype, create=not attached)
            self.seg.append(segs)
        self.versions = map_segment(self.dir / "versions.i64", self.n, torch.int64, create=not attached)
        if not attached:
            if resume_checkpoint:
                self._load_checkpoint(resume_checkpoint)
            else:
                self._initialize(cfg.training.seed)
            (self.dir / "layout.json").write_text(json.dumps(self._layout_doc()))
        else:
            log.info("parameter store re-attached to %s at versions %s", self.dir, self.versions.tolist())
        # bf16 runs: gradients are upcast into one reused fp32 buffer (a fresh ``g.float()`` per
        # shard per step costs an allocation and page faults: ~3x slower, see benchmarks/adamw.py).
        self._grad32 = (torch.empty(max(lay.numel for lay in self.layouts), dtype=torch.float32)
                        if w_dtype != "float32" else None)
        self._queue: list[int] = []
        self._worker = threading.Thread(target=self._update_loop, name="adamw-updates", daemon=True)
        self._worker.start()

    # -- set-up -------------------------------------------------------------------------------
    def _path(self, shard: int, kind: str) -> Path:
        return self.dir / f"shard_{shard:04d}.{kind}"

    def _layout_doc(self) -> dict:
        return {"w_dtype": self.w_dtype, "numels": [lay.numel for lay in self.layouts]}

    def _check_layout(self) -> None:
        doc = json.loads((self.dir / "layout.json").read_text())
        if doc != self._layout_doc():
            raise RuntimeError(f"state in {self.dir} was made for another model/dtype ({doc['w_dtype']}, "
                               f"{len(doc['numels'])} shards); cannot re-attach")

    def _check_space(self, root: Path) -> None:
        need = self.state_bytes()
        free = shutil.disk_usage(root).free
        if need > free:
            raise RuntimeError(f"the parameter store needs {need / 1e9:.2f} GB in {root} but only {free / 1e9:.2f} GB "
                               f"are free; set runtime.state_dir to a larger disk or memory path")

    def state_bytes(self) -> int:
        wbytes = DTYPES[self.w_dtype].itemsize
        return sum(lay.numel * (2 * wbytes + 12) for lay in self.layouts)

    def _initialize(self, seed: int) -> None:
        """Shard by shard (a 105B model never exists whole in one process's memory)."""
        for i, lay in enumerate(self.layouts):
            module = build_shard(self.cfg, i, "cpu")
            initialize_shard(module, seed, i)
            lay.flatten_into(module, self.seg[i]["master"])
            self.seg[i]["w"].copy_(self.seg[i]["master"])
            self.seg[i]["m"].zero_()
            self.seg[i]["v"].zero_()
            del module
        self.versions.fill_(0)

    # -- queries ------------------------------------------------------------------------------
    def shard_infos(self) -> list[ShardInfo]:
        return [ShardInfo(i, lay.numel, self.w_dtype, {k: str(self._path(i, k)) for k in ("w", "g")}, lay)
                for i, lay in enumerate(self.layouts)]

    def status(self) -> StoreStatus:
        return StoreStatus(tuple(self.versions.tolist()), str(self.dir), self.state_bytes(), _node_id())

    def version(self, shard: int) -> int:
        return int(self.versions[shard])

    def wait_version(self, shard: int, step: int, timeout: float = 600.0) -> int:
        """Block until shard ``shard`` holds the weights of step ``step`` (or newer)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while int(self.versions[shard]) < step:
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"shard {shard} still at version {int(self.versions[shard])} after "
                                       f"{timeout:.0f} s waiting for step {step}")
                self._lock.wait(min(left, 1.0))
            return int(self.versions[shard])

    def get_weights(self, shard: int, step: int) -> np.ndarray:
        """Object-ref transport: the shard's ``w`` bytes once it is valid for ``step``."""
        self.wait_version(shard, step)
        return self.seg[shard]["w"].view(torch.uint8).numpy().copy()

    # -- gradients and updates ----------------------------------------------------------------
    def report_grad(self, shard: int, step: int, sqnorm: float, grad: np.ndarray | None = None) -> None:
        """The compute actor's gradient of ``shard`` for ``step`` is complete: in the ``g``
        segment already (shm transport) or in ``grad`` (object-ref transport, raw bytes)."""
        if grad is not None:
            g = self.seg[shard]["g"]
            g.view(torch.uint8).copy_(torch.from_numpy(np.asarray(grad)).view(torch.uint8))
        with self._lock:
            if int(self.versions[shard]) != step:
                raise RuntimeError(f"gradient of shard {shard} for step {step} arrived but the shard is at "
                                   f"version {int(self.versions[shard])}")
            got = self._pending.setdefault(step, {})
            got[shard] = float(sqnorm)
            if len(got) == self.n:
                self._queue.append(step)
                self._lock.notify_all()

    def wait_step(self, step: int, timeout: float = 600.0) -> UpdateResult:
        """Block until step ``step``'s update is applied to every shard."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while step not in self._results:
                self._raise_if_failed()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"update of step {step} not finished after {timeout:.0f} s")
                self._lock.wait(min(left, 1.0))
            return self._results.pop(step)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"parameter store update thread failed: {self._error!r}") from self._error

    def _update_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                step = self._queue.pop(0)
                sq = self._pending.pop(step)
            try:
                result = self._apply_update(step, sq)
            except BaseException as e:  # surfaced to every waiter
                log.exception("AdamW update of step %d failed", step)
                with self._lock:
                    self._error = e
                    self._lock.notify_all()
                return
            with self._lock:
                self._results[step] = result
                self._lock.notify_all()

    def _apply_update(self, step: int, sqnorms: dict[int, float]) -> UpdateResult:
        o = self.cfg.optim
        t0 = time.perf_counter()
        total = math.sqrt(sum(sqnorms.values()))
        lr = lr_at(o, self.cfg.training.steps, step)
        if not math.isfinite(total):
            log.warning("step %d: gradient norm is %s; update skipped on every shard", step, total)
            with self._lock:
                self.versions.add_(1)
                self._lock.notify_all()
            return UpdateResult(step, total, 0.0, lr, time.perf_counter() - t0, skipped=True)
        coef = clip_coefficient(total, o.grad_clip)
        step_t = torch.tensor(float(step), dtype=torch.float32)
        for i in range(self.n):  # shard order: the next forward needs shard 0 first
            s = self.seg[i]
            if self._grad32 is None:
                g = s["g"]
            else:
                g = self._grad32[:s["g"].numel()]
                g.copy_(s["g"])
            if coef < 1.0:
                g.mul_(coef)
            st = step_t.clone()
            # One fused pass over master, m, v and the gradient (torch's vectorised CPU kernel).
            adamw_functional([s["master"]], [g], [s["m"]], [s["v"]], [], [st], fused=True,
                             amsgrad=False, beta1=o.betas[0], beta2=o.betas[1], lr=lr,
                             weight_decay=o.weight_decay, eps=o.eps, maximize=False)
            s["w"].copy_(s["master"])  # the compute copy (a cast for bf16 runs)
            with self._lock:
                self.versions[i] = step + 1
                self._lock.notify_all()
        return UpdateResult(step, total, coef, lr, time.perf_counter() - t0)

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, run_dir: str, step: int, extra: dict) -> str:
        """Write ``run_dir/checkpoints/step_N`` shard by shard into a temporary directory,
        fsync, rename, then point ``latest`` at it. A crash leaves the previous one intact."""
        for i in range(self.n):
            self.wait_version(i, step)
        ckpt_root = Path(run_dir) / "checkpoints"
        ckpt_root.mkdir(parents=True, exist_ok=True)
        final = ckpt_root / f"step_{step}"
        tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.", dir=ckpt_root))
        try:
            for i, lay in enumerate(self.layouts):
                tensors = {kind: self.seg[i][kind] for kind in CHECKPOINT_KINDS}
                meta = {"names": json.dumps(lay.names), "shapes": json.dumps(lay.shapes),
                        "offsets": json.dumps(lay.offsets), "shard": str(i)}
                path = tmp / f"shard_{i:04d}.safetensors"
                save_file(tensors, str(path), metadata=meta)
                _fsync(path)
            doc = {"format": 1, "step": step, "num_shards": self.n, "w_dtype": self.w_dtype,
                   "config": self.cfg.to_dict(), **extra}
            (tmp / "state.json").write_text(json.dumps(doc, indent=1))
            _fsync(tmp / "state.json")
            _fsync(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync(ckpt_root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        latest_tmp = ckpt_root / ".latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        _fsync(latest_tmp)
        os.replace(latest_tmp, ckpt_root / "latest")
        _fsync(ckpt_root)
        return str(final)

    def _load_checkpoint(self, path: str) -> None:
        ckpt = Path(path)
        doc = json.loads((ckpt / "state.json").read_text())
        if doc["num_shards"] != self.n:
            raise RuntimeError(f"checkpoint {ckpt} has {doc['num_shards']} shards; this model has {self.n}")
        for i, lay in enumerate(self.layouts):
            with safe_open(str(ckpt / f"shard_{i:04d}.safetensors"), framework="pt") as f:
                for kind in CHECKPOINT_KINDS:
                    t = f.get_tensor(kind)
                    if t.numel() != lay.numel:
                        raise RuntimeError(f"checkpoint {ckpt} shard {i} {kind} has {t.numel()} values, the model "
                                           f"needs {lay.numel}: it was written for another configuration")
                    self.seg[i][kind].copy_(t)
        self.versions.fill_(int(doc["step"]))

    def close(self, remove_state: bool = True) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._worker.join(timeout=30)
        self.seg = []
        if remove_state:
            shutil.rmtree(self.dir, ignore_errors=True)


def read_checkpoint_state(path: str | Path) -> dict:
    return json.loads((Path(path) / "state.json").read_text())


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    ckpt = pointer.parent / pointer.read_text().strip()
    return ckpt if (ckpt / "state.json").is_file() else None


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray there is one node
        pass
    return "local"
