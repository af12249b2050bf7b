"""ParameterStore: every persistent byte of the model, in host shared memory, and CPU AdamW.

Per shard, four flat segments: ``w`` (the compute copy: bf16 for CUDA runs, fp32 for CPU
runs), ``master``, ``m``, ``v`` (fp32): 14 bytes per parameter in bf16, and nothing else.
There is no gradient buffer: shard l's gradient lands in its own ``w`` segment. ``w_l`` is dead
between shard l's backward (its weights are already on the device, or, on the CPU, the
backward that read them in place has returned before the gradient is written) and its update,
which reads the gradient from ``w_l`` and then rewrites ``w_l`` from ``master``. So between a
step's backward and its update, ``w_l`` of a shard at version k holds step k's gradient, not
weights: weights are read only once the shard is at the version asked for (``wait_version``),
and every path that abandons a step's gradients (a skipped step, a replaced compute actor, a
re-attached store) restores ``w`` from ``master``. Each segment is a file under the state directory
(``/dev/shm`` by default: RAM; a disk path lets state exceed RAM), mapped with
``torch.from_file(shared=True)``, so the compute actor on the same node maps the very same
pages: weights are never copied between processes on one node.

Versions: ``versions[l]`` is the step whose weights ``w_l`` holds. Step k's update of shard
l runs only after every shard reported its gradient for step k (exact global-norm clipping),
in shard order 0..L+1, so the next forward can start on shard 0 while the rest update.

Device shards (``runtime.device_shards`` N): the compute actor keeps shards 0..N-1 and updates
them on its device; here their versions move on with each step (their norms count towards the
global one) and their segments hold the state of the last ``put_device_state`` (before a checkpoint).

Two experts (``training.expert = both``): each step trains one; ``actors/store_experts.py``.
Distillation (``training.distill_weight``): the frozen dense teacher's segments; ``actors/store_teacher.py``.

The moving average of the weights (``training.ema_decay``): one more fp32 segment per owned
shard, ``ema``, updated after the shard's AdamW inside its crash marker; ``actors/store_average.py``.

Restarts: the segments outlive the store's process. A store constructed again over a state
directory that holds a ``layout.json`` (``attach=True``, or Ray re-running ``__init__`` after a
crash) maps the same segments instead of initialising. Two small control segments make an
update crash-consistent: ``updating[l]`` holds the step whose update of shard l is in progress
(-1 when none), written before the shard is touched and cleared after its version is bumped;
``records`` keeps the global norm, clipping coefficient and learning rate of recent steps,
written before the first shard is updated. On re-attach:

* a shard marked mid-update has a half-written state: the store refuses to start and says to
  resume from the latest checkpoint;
* versions k+1 on some shards and k on the rest (a cut between two shards): the update of
  step k is finished from the gradients still in the ``w`` segments of the shards at k
  (nothing overwrites them before every shard reached k+1) with the recorded coefficient, so
  every shard gets step k exactly once;
* all versions equal: nothing was in flight in the state; the norms reported for the next
  step lived in the old process only, so the driver redoes that step
  (``pipelines/streaming.py``), and ``w`` is restored from ``master`` on every shard (the
  compute actor may already have written some of that step's gradients into it).

The update thread, the crash markers and records, and the recovery on re-attach:
``actors/store_update.py``. AdamW kernels (``optim.adamw``, or the ``adamw=`` argument):
``megaslide_ray/training/adamw.py``.

Several compute actors (``compute_actors`` > 1): each reports its gradient of a shard through a
gradient slot, and ``actors/grad_reduce.py`` sums the N of them in fp32, in actor order, into the
shard's ``w`` once every actor is done reading it; from there the step goes on as above.

The class is plain; ``pipelines/`` makes it a threaded Ray actor, so ``wait_version`` calls
block in their own threads while the update thread works.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import torch

from actors.grad_reduce import GradientReducer, GradSlots
from actors.node_sync import NodeSync, NodeSyncMethods
from actors.ray_context import node_id as _node_id
from actors.ray_context import was_reconstructed as _was_reconstructed
from actors.store_average import AverageMethods
from actors.store_checkpoints import CheckpointMethods
from actors.store_experts import ExpertMethods
from actors.store_teacher import TeacherMethods
from actors.store_types import GradientsLostError, ShardInfo, StoreStatus, UpdateResult
from actors.store_update import RECORD_FIELDS, RECORDS, UpdateMethods
from megaslide_ray.config import Config
from megaslide_ray.models.registry import build_shard, initialize_shard, num_experts, num_shards
from megaslide_ray.models.shards import ShardLayout, grad_slot_numel
from megaslide_ray.runtime.faults import arm_fault, fault_point, fire_fault
from megaslide_ray.runtime.faults import set_node as set_fault_node
from megaslide_ray.state.kept import dir_bytes, is_kept, keep_state, unkeep_state
from megaslide_ray.state.preflight import StateSpaceError, shm_advice
from megaslide_ray.state.pretrained_io import load_pretrained_into
from megaslide_ray.state.segments import (
    DTYPES,
    default_state_root,
    map_segment,
    node_state_key,
    run_owner,
    sweep_stale_states,
    write_owner,
)
from megaslide_ray.training.adamw import choose_adamw

log = logging.getLogger(__name__)


class ParameterStore(UpdateMethods, NodeSyncMethods, CheckpointMethods, ExpertMethods, AverageMethods, TeacherMethods):
    """The store of one node (module docstring). The update thread with its crash consistency,
    checkpoints, several nodes, two experts, the moving average and the distillation teacher are
    mixins beside it (``actors/store_*.py``, ``node_sync.py``): each concern reads alone, all act on the one state this class maps (segments,
    versions, lock), which a separate object would need whole; Ray makes the one class an actor."""

    def __init__(self, cfg: Config, run_dir: str, w_dtype: str = "float32",
                 resume_checkpoint: str | None = None, attach: bool = False, init_from: str | None = None,
                 adamw: str | None = None, owner: dict | None = None, compute_actors: int = 1,
                 nodes: int = 1, node: int = 0):
        """``run_dir`` names the state (a restarted store finds it again); ``w_dtype`` is the
        compute copy's dtype. Fresh state comes from ``resume_checkpoint`` (everything, at its
        step), else ``init_from`` (pretrained weights, moments zero, step 0; see
        ``megaslide_ray/state/pretrained_io.py``), else the seeded initialisation. ``attach`` maps an
        existing state instead (Ray restarts attach by themselves). ``adamw``: ``fused``,
        ``compiled`` or ``auto`` (default: ``cfg.optim.adamw``). ``owner``: the
        process whose run this is and its machine (``segments.run_owner()`` taken in the driver;
        default this process): a fresh state records it, and first removes states under the same
        root whose recorded owner, on this machine, is gone.
        ``compute_actors``: how many compute actors report each shard's gradient (N > 1: through
        ``runtime.grad_slots`` gradient slots each, summed here; see ``actors/grad_reduce.py``).
        ``nodes``, ``node``: a run on several nodes (``runtime.nodes``), this store being node
        ``node``'s: it keeps ``w`` of every shard and ``master``, ``m``, ``v`` of the shards it owns
        (shard l on node l % nodes) only; ``connect`` then gives it the other nodes' stores
        (``actors/node_sync.py``)."""
        if w_dtype not in DTYPES:
            raise ValueError(f"w_dtype={w_dtype!r}; use one of {list(DTYPES)}")
        self._set_fields(cfg, run_dir, w_dtype, compute_actors, nodes, node)
        # Ray re-runs __init__ with the original arguments when it restarts a crashed store.
        attached = (attach or _was_reconstructed()) and (self.dir / "layout.json").is_file()
        set_fault_node(self.node)
        # Several nodes: a restarted store re-attaches but takes part in nothing (no report, no other
        # node's message counts) until the driver's recovery (``sync_pause``, actors/node_sync.py).
        self._awaiting_recovery = attached and self.nodes > 1
        if attached:
            self._check_layout()
        else:
            self._make_state_dir(owner)
        self._map_state(attached, resume_checkpoint)
        # bf16 runs: gradients are upcast into one reused fp32 buffer of the largest shard's size
        # (a fresh ``g.float()`` per shard per step costs an allocation and page faults: ~3x
        # slower, see benchmarks/adamw.py). Private memory, not state: the planner counts it.
        self._grad32 = (torch.empty(max(lay.numel for lay in self.layouts), dtype=torch.float32)
                        if w_dtype != "float32" else None)
        # Several nodes: the owner of a shard sums the nodes' gradients of it here (node_sync).
        self.sync = NodeSync(self) if self.nodes > 1 else None
        if self.compute_actors > 1:
            self.reducer = GradientReducer(self.dir, self.compute_actors, cfg.runtime.grad_slots,
                                           [s["w"] for s in self.seg], w_dtype, not attached, self.threads,
                                           self._reduced, slot_numel=self._slot_numel())
            self.reducer.reset(self._generation)
        self.adamw, self._single_pass = choose_adamw(adamw or cfg.optim.adamw, sum(lay.numel for lay in self.layouts),
                                                     cfg.optim, DTYPES[self.w_dtype])
        if not attached:
            self._fill_state(resume_checkpoint, init_from)
        else:
            self._reattached(owner)
        self._queue: list[int] = []
        self._worker = threading.Thread(target=self._update_loop, name="adamw-updates", daemon=True)
        self._worker.start()

    # -- set-up -------------------------------------------------------------------------------
    def _set_fields(self, cfg: Config, run_dir: str, w_dtype: str, compute_actors: int, nodes: int,
                    node: int) -> None:
        """The store's settings, shard layouts and bookkeeping, before any state is touched."""
        threads = cfg.runtime.optimizer_threads or os.cpu_count() or 1
        torch.set_num_threads(threads)
        self.threads = threads  # the update thread sets them again for itself (_update_loop)
        self.cfg = cfg
        self.w_dtype = w_dtype
        self.n = num_shards(cfg)
        self.ema_decay = float(cfg.training.ema_decay)  # > 0: an ``ema`` segment per owned shard
        self._experts = num_experts(cfg)  # two: both experts of a two-expert model, one trained per step
        self.compute_actors = int(compute_actors)
        self.nodes, self.node = int(nodes), int(node)
        self.owned = [i for i in range(self.n) if i % self.nodes == self.node]  # optimizer state kept here
        # runtime.device_shards: the compute actor updates these on its device; here their versions
        # move on with the step, and their segments hold the state of the last ``put_device_state``.
        self.device_shards = range(cfg.runtime.device_shards)
        self._middle = self.owned[len(self.owned) // 2]  # where the mid-update fault points fire
        self._root = Path(cfg.runtime.state_dir) if cfg.runtime.state_dir else default_state_root()
        self.dir = self._root / node_state_key(run_dir, self.nodes, self.node)
        self.layouts = [ShardLayout.of(build_shard(cfg, i, "meta"), i) for i in range(self.n)]
        self.teacher_layouts = self._teacher_layouts()
        self._lock = threading.Condition()
        self._pending: dict[int, dict[int, float]] = {}   # step -> {shard: ||g||^2}
        self._results: dict[int, UpdateResult] = {}
        self._inflight: set[int] = set()                  # steps queued or being applied here
        self._closed = False
        self._error: BaseException | None = None
        self._saving = 0                                  # checkpoints being written: no update starts
        self._applying = False                            # the update thread is inside an update
        self._reduce_seconds: dict[int, float] = {}       # step -> seconds summing its gradients (N > 1)
        self._totals: dict[int, float] = {}               # several nodes: step -> global squared norm
        self.reducer: GradientReducer | None = None

    def _make_state_dir(self, owner: dict | None) -> None:
        """A fresh, empty state directory (stale states of gone owners swept, the space checked)."""
        root = self._root
        root.mkdir(parents=True, exist_ok=True)
        sweep_stale_states(root, keep=self.dir)
        self._check_space(root)
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, mode=0o700)
        os.chmod(self.dir, 0o700)  # only the user who runs the job reads its weights
        write_owner(self.dir, owner or run_owner())

    def _map_state(self, attached: bool, resume_checkpoint: str | None) -> None:
        """Map every shard's segments (created, or the existing ones when ``attached``) and the
        control segments; a full filesystem while creating them is a ``StateSpaceError``."""
        self.seg: list[dict[str, torch.Tensor]] = []
        try:
            for i, lay in enumerate(self.layouts):
                segs = {}
                for kind in self._kinds(i):  # another node owns its master, m, v
                    dtype = DTYPES[self.w_dtype] if kind == "w" else torch.float32
                    segs[kind] = map_segment(self._path(i, kind), lay.numel, dtype, create=not attached)
                self.seg.append(segs)
            self._map_teacher(attached)
        except OSError as e:
            if attached or e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.seg = []
            shutil.rmtree(self.dir, ignore_errors=True)  # a fresh state: nothing in it to keep
            raise StateSpaceError(
                f"the parameter store could not reserve its {self.state_bytes() / 1e9:.2f} GB of state in "
                f"{self._root}: {e.strerror} (the filesystem filled up after the driver's check). Nothing was written; free "
                f"space there or set runtime.state_dir to a filesystem with room, then start again"
                + (" (--resume continues from the latest checkpoint)" if resume_checkpoint else "")) from None
        self.versions = map_segment(self.dir / "versions.i64", self.n, torch.int64, create=not attached)
        self.updating = map_segment(self.dir / "updating.i64", self.n, torch.int64, create=not attached)
        self.records = map_segment(self.dir / "records.f64", RECORDS * RECORD_FIELDS, torch.float64,
                                   create=not attached).view(RECORDS, RECORD_FIELDS)
        # The compute actor whose reports count outlives a restart of this process: otherwise a
        # restarted store would drop every report of the current (replaced) compute actor.
        self._generation_seg = map_segment(self.dir / "generation.i64", 1, torch.int64, create=not attached)
        if not attached:
            self._generation_seg.zero_()
        self._generation = int(self._generation_seg[0])

    def _fill_state(self, resume_checkpoint: str | None, init_from: str | None) -> None:
        """Fill a fresh state from the checkpoint, the pretrained weights or the seed."""
        try:
            self.updating.fill_(-1)
            self.records[:, 0] = -1
            if resume_checkpoint:
                self._load_checkpoint(resume_checkpoint)
            elif init_from:
                load_pretrained_into(self, init_from)
                self._start_average()
            else:
                self._initialize(self.cfg.training.seed)
                self._start_average()
            self._fill_teacher(self.cfg.training.init_from or init_from)
            (self.dir / "layout.json").write_text(json.dumps(self._layout_doc()))
        except BaseException:
            # A fresh state that could not be filled (a damaged checkpoint or source) holds
            # nothing to keep: it goes, so a refused start leaves no RAM behind.
            self.seg = []
            shutil.rmtree(self.dir, ignore_errors=True)
            raise

    def _reattached(self, owner: dict | None) -> None:
        """After re-attaching: recover the update in flight (one node), or wait for the driver's
        recovery (several nodes)."""
        if self.nodes > 1:  # the driver decides, with every node's state, how the step in flight ends
            log.warning("parameter store of node %d re-attached to %s at versions %s; waiting for the driver's "
                        "recovery", self.node, self.dir, self.versions.tolist())
        else:
            self._recover()
            if is_kept(self.dir):  # a failed run kept it; this run owns it again from here
                write_owner(self.dir, owner or run_owner())
                unkeep_state(self.dir)
            log.warning("parameter store re-attached to %s at versions %s", self.dir, self.versions.tolist())

    def _path(self, shard: int, kind: str) -> Path:
        return self.dir / f"shard_{shard:04d}.{kind}"

    def _layout_doc(self) -> dict:
        doc = {"w_dtype": self.w_dtype, "numels": [lay.numel for lay in self.layouts]}
        doc.update({"ema": True} if self.ema_decay else {})  # a state without the average is refused
        teacher = {"teacher_numels": [lay.numel for lay in self.teacher_layouts]} if self.teacher_layouts else {}
        return {**doc, **teacher}

    def _check_layout(self) -> None:
        doc = json.loads((self.dir / "layout.json").read_text())
        if doc != self._layout_doc():
            raise RuntimeError(f"state in {self.dir} was made for another model/dtype ({doc['w_dtype']}, "
                               f"{len(doc['numels'])} shards); cannot re-attach")

    def _check_space(self, root: Path) -> None:
        need = self.state_bytes() + self.slot_bytes() + self.teacher_bytes()
        usage = shutil.disk_usage(root)
        if need > usage.free:
            raise StateSpaceError(f"the parameter store needs {need / 1e9:.2f} GB in {root} but only "
                                  f"{usage.free / 1e9:.2f} GB are free; " + shm_advice(root, need, usage.free, usage.total))

    def owns(self, shard: int) -> bool:
        """Whether this store keeps shard ``shard``'s optimizer state (always, on one node)."""
        return shard % self.nodes == self.node

    def state_bytes(self) -> int:
        """Host bytes of the state: ``w`` of every shard, ``master``, ``m``, ``v`` of the owned ones."""
        wbytes = DTYPES[self.w_dtype].itemsize
        own = 12 + (4 if self.ema_decay else 0)  # master, m, v (and the average) on the owner
        return sum(lay.numel * (wbytes + (own if self.owns(i) else 0)) for i, lay in enumerate(self.layouts))

    def scratch_bytes(self) -> int:
        """Beside the state: gradient slots and sums (several compute actors; several nodes)."""
        return ((self.reducer.scratch_bytes() if self.reducer is not None else 0)
                + (self.sync.scratch_bytes() if self.sync is not None else 0))

    def _slot_numel(self) -> int:
        """One gradient slot's elements: ``runtime.grad_slot_mb``, at most the largest shard."""
        return grad_slot_numel(max(lay.numel for lay in self.layouts), self.cfg.runtime.grad_slot_mb,
                               DTYPES[self.w_dtype].itemsize)

    def slot_bytes(self) -> int:
        """Several compute actors: the gradient slots beside the state (``compute_actors x
        runtime.grad_slots`` slots of ``runtime.grad_slot_mb``, at most the largest shard, in the
        compute dtype); 0 with one."""
        if self.compute_actors == 1:
            return 0
        return self.compute_actors * self.cfg.runtime.grad_slots * self._slot_numel() * DTYPES[self.w_dtype].itemsize

    def _initialize(self, seed: int) -> None:
        """Shard by shard (a 105B model never exists whole in one process's memory)."""
        for i, lay in enumerate(self.layouts):
            module = build_shard(self.cfg, i, "cpu")
            initialize_shard(module, seed, i)
            if not self.owns(i):  # every node draws the same weights; the owner keeps the master
                master = torch.empty(lay.numel, dtype=torch.float32)
                lay.flatten_into(module, master)
                self.seg[i]["w"].copy_(master)
                del module, master
                continue
            lay.flatten_into(module, self.seg[i]["master"])
            self.seg[i]["w"].copy_(self.seg[i]["master"])
            self.seg[i]["m"].zero_()
            self.seg[i]["v"].zero_()
            del module
        self.versions.fill_(0)

    # -- queries ------------------------------------------------------------------------------
    def shard_infos(self) -> list[ShardInfo]:
        teacher = lambda i: {"teacher": str(self._path(i, "teacher"))} if self.teacher_layouts else {}  # noqa: E731
        return [ShardInfo(i, lay.numel, self.w_dtype, {"w": str(self._path(i, "w")), **teacher(i)}, lay)
                for i, lay in enumerate(self.layouts)]

    def grad_slots(self) -> GradSlots | None:
        """Where the compute actors' gradient slots are (None with one compute actor)."""
        return self.reducer.info if self.reducer is not None else None

    def status(self) -> StoreStatus:
        return StoreStatus(tuple(self.versions.tolist()), str(self.dir), self.state_bytes(), _node_id(),
                           pid=os.getpid(),
                           scratch_bytes=self.scratch_bytes(), node=self.node, nodes=self.nodes)

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

    # -- shards kept on the compute device (runtime.device_shards) -----------------------------
    def device_state(self, step: int) -> dict[int, dict[str, np.ndarray]]:
        """The state the compute actor starts its device shards from: their ``master``, ``m`` and
        ``v`` once they are at version ``step`` (copies)."""
        out = {}
        for i in self.device_shards:
            self.wait_version(i, step)
            out[i] = {kind: self.seg[i][kind].numpy().copy() for kind in ("master", "m", "v")}
        return out

    def put_device_state(self, step: int, states: dict[int, dict[str, np.ndarray]]) -> None:
        """The compute actor's device shards after ``step`` steps (their version ``step``) written into
        their segments, before a checkpoint or a failed run's kept state reads them (``states`` empty:
        the compute actor has not taken them since they came from here). Each shard is
        written inside its crash marker (``updating[i] = step`` while ``versions[i] == step``: a store
        cut in the middle finds it half-written and refuses to re-attach)."""
        if not states:  # the compute actor never took them: the copies here are current
            return
        if sorted(states) != list(self.device_shards):
            raise ValueError(f"put_device_state got shards {sorted(states)}; this run keeps shards "
                             f"{list(self.device_shards)} on the device (runtime.device_shards)")
        for i, state in states.items():
            self.wait_version(i, step)
            with self._lock:
                if int(self.versions[i]) != step:
                    raise RuntimeError(f"device shard {i}'s state is that of step {step}, but the store holds it at "
                                       f"version {int(self.versions[i])}")
                self.updating[i] = step
            s = self.seg[i]
            for kind in ("master", "m", "v"):
                s[kind].copy_(torch.from_numpy(np.asarray(state[kind])))
            s["w"].copy_(s["master"])
            with self._lock:
                self.updating[i] = -1

    # -- gradients and updates ----------------------------------------------------------------
    def report_grad(self, shard: int, step: int, sqnorm: float, grad: np.ndarray | None = None,
                    generation: int | None = None, actor: int = 0, slot: int = -1, piece: int = 0) -> None:
        """The compute actor's gradient of ``shard`` for ``step`` is complete: in the shard's ``w``
        segment already (shm transport: the compute actor wrote it there) or in ``grad``
        (object-ref transport, raw bytes, copied into ``w`` here). ``generation`` names the
        compute actor (see ``set_client_generation``). Several compute actors: the gradient of
        compute actor ``actor`` is in (or, as ``grad``, goes to) its gradient slot ``slot``, and the
        shard counts as reported once the N of them are summed into ``w`` (a shard larger than a
        slot comes in pieces, ``piece`` naming which: ``actors/grad_reduce.py``)."""
        if self._awaiting_recovery:  # a restarted store of several nodes: nothing counts before the recovery
            return
        if self.reducer is not None:
            with self._lock:
                if generation is None:
                    generation = self._generation
                if generation == self._generation and int(self.versions[shard]) != step:
                    raise RuntimeError(f"gradient of shard {shard} for step {step} arrived but the shard is at "
                                       f"version {int(self.versions[shard])}")
            self.reducer.add(shard, step, actor, slot, sqnorm, generation, grad, piece)
            return
        with self._lock:
            if generation is not None and generation != self._generation:
                log.warning("dropped a gradient report of shard %d for step %d from a replaced compute actor",
                            shard, step + 1)
                return
            if int(self.versions[shard]) != step:
                # Checked before anything is written: w holds this shard's weights (or another
                # step's gradient) and must not be overwritten by a report that does not belong.
                raise RuntimeError(f"gradient of shard {shard} for step {step} arrived but the shard is at "
                                   f"version {int(self.versions[shard])}")
        if grad is not None:
            # The shard is at version ``step`` and its update cannot start before this report
            # is counted below, so nothing else reads or writes w_shard meanwhile.
            self.seg[shard]["w"].view(torch.uint8).copy_(torch.from_numpy(np.asarray(grad)).view(torch.uint8))
        self._count_report(shard, step, sqnorm, generation)

    def wait_grad_slot(self, actor: int, slot: int, generation: int | None = None) -> None:
        """Several compute actors: block until compute actor ``actor``'s gradient slot ``slot`` is
        free (``actors/grad_reduce.py``); ``generation``: the caller's (default: the current one)."""
        self.reducer.wait_slot(actor, slot, self._generation if generation is None else generation)

    def _reduced(self, shard: int, step: int, sqnorm: float, generation: int, seconds: float) -> None:
        """The reducer summed every compute actor's gradient of ``shard`` into its ``w``."""
        with self._lock:
            self._reduce_seconds[step] = self._reduce_seconds.get(step, 0.0) + seconds
        self._count_report(shard, step, sqnorm, generation)

    def _count_report(self, shard: int, step: int, sqnorm: float, generation: int | None) -> None:
        """Shard ``shard``'s gradient of ``step`` is in its ``w``: count it; the last one queues
        the update. Several nodes: it is this node's sum, and goes to the shard's owner
        (``actors/node_sync.py``), which queues the update once it has the global norm."""
        with self._lock:
            if (generation is not None and generation != self._generation) or self._awaiting_recovery:
                return  # the compute actor was replaced while this report was on its way
            current = self._generation
            if self.sync is not None:
                self._inflight.add(step)
        if self.sync is not None:
            # The backward's last shard (0) sends this node's part of the step. The fault is claimed
            # before the send and fires right after it: claimed after, its marker's fsync let the
            # other nodes answer and this store begin its update first (a cut update, not this drill).
            armed = arm_fault("store.after_last_report", step) if shard == 0 else None
            self.sync.node_grad_ready(shard, step, sqnorm, current)
            fire_fault(armed)
            return
        with self._lock:
            got = self._pending.setdefault(step, {})
            got[shard] = float(sqnorm)
            last = len(got) == len(self.step_shards(step))
            if last:
                self._queue.append(step)
                self._inflight.add(step)
                self._lock.notify_all()
        if last:  # the update may run (and the store die) before this report is answered
            fault_point("store.after_last_report", step)

    def set_client_generation(self, generation: int, timeout: float = 600.0) -> tuple[int, ...]:
        """The driver replaced the compute actor: from now on only reports of ``generation``
        count, and partial reports of unfinished steps are forgotten (the step is redone).
        Returns the versions once the updates already queued are applied; ``w`` then holds
        weights again on every shard (the replaced actor may have written gradients of the
        abandoned step into some of them)."""
        deadline = time.monotonic() + timeout
        if self.reducer is not None:  # partial sums of the abandoned step go; w is restored below
            self.reducer.reset(generation)
        with self._lock:
            self._generation = generation
            self._generation_seg[0] = generation
            self._pending.clear()
            self._reduce_seconds.clear()
            while self._inflight:
                self._raise_if_failed()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"updates of steps {sorted(self._inflight)} not finished after {timeout:.0f} s")
                self._lock.wait(1.0)
            self._restore_w()
            return tuple(self.versions.tolist())

    def _restore_w(self, shards=None) -> None:
        """``w = master`` (cast) on ``shards`` (default all): drop gradients of an abandoned step.
        Only when no update is running on those shards (``w`` is then either weights equal to
        ``master`` cast, or a gradient nobody will apply). Owned shards only (several nodes)."""
        for i in self.owned if shards is None else shards:
            self.seg[i]["w"].copy_(self.seg[i]["master"])

    def wait_step(self, step: int, timeout: float = 600.0) -> UpdateResult:
        """Block until step ``step``'s update is applied to every shard."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while step not in self._results:
                self._raise_if_failed()
                if step not in self._inflight and not (self.reducer is not None and self.reducer.holds(step)):
                    # One node: the caller has seen every report of ``step`` acknowledged, so the
                    # step is queued here (or, several compute actors, still being summed), applied
                    # here (in _results), or applied by an earlier process. Several nodes: applied
                    # before a recovery (actors/node_sync.py), or not yet reported.
                    done = self._record(step) if int(self.versions.min()) > step else None
                    if done is not None:
                        return done
                    if self.sync is None:
                        raise GradientsLostError(
                            f"step {step + 1}: this parameter store process holds no gradients of that step (it was "
                            f"restarted after they were reported; versions {self.versions.tolist()}): redo the step")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"update of step {step + 1} not finished after {timeout:.0f} s")
                self._lock.wait(min(left, 1.0))
            return self._results.pop(step)

    def _raise_if_failed(self) -> None:
        if self.reducer is not None:
            self.reducer.raise_if_failed()
        if self.sync is not None:
            self.sync.raise_if_failed()
        if self._error is not None:
            raise RuntimeError(f"parameter store update thread failed: {self._error!r}") from self._error

    def settle(self, timeout: float = 120.0) -> tuple[int, ...]:
        """The versions once the updates already queued are applied (the driver stopped sending
        steps: a run that failed asks this before it keeps or releases the state)."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while self._inflight and self._error is None and time.monotonic() < deadline:
                self._lock.wait(1.0)
            return tuple(self.versions.tolist())

    def keep(self, doc: dict) -> tuple[str, int]:
        """Stop and leave the state in place, marked kept and resumable from ``doc`` (``step``
        and the data cursor; ``megaslide_ray.state.kept``). Returns its path and size."""
        self.close(remove_state=False)
        keep_state(self.dir, doc)
        return str(self.dir), dir_bytes(self.dir)

    def close(self, remove_state: bool = True) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._worker.join(timeout=30)
        if self.reducer is not None:
            self.reducer.close()
        self.seg, self.teacher_seg = [], []
        if remove_state:
            shutil.rmtree(self.dir, ignore_errors=True)
