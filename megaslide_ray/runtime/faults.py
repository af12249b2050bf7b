"""Fault injection: make a chosen actor die (or hang) at a chosen point, once.

Off unless the environment variable ``MEGASLIDE_FAULT`` is set (``runtime.inject_fault``, or
the CLI's hidden ``--inject-fault``, sets it before Ray starts, so every actor inherits it). Its value is a
comma-separated list of specs ``POINT[@STEP][/NODE][:ACTION]``:

- ``POINT``: one of ``FAULT_POINTS`` (for example ``compute.mid_backward``);
- ``STEP``: the 1-based training step it fires in (the step numbers of the log and
  ``metrics.jsonl``), or a range ``A-B`` (once in each of those steps); omitted: the
  first time the point is reached;
- ``NODE``: on a run on several nodes (``runtime.nodes``), fire only in the actors of node
  ``NODE`` (0-based; the stores and compute actors say which node they are on, ``set_node``);
  omitted: any node;
- ``ACTION``: ``exit`` (default: the process ends at once, like a kill -9; nothing is
  flushed or cleaned up), ``hang`` (the calling thread blocks forever), ``raise`` (a
  ``FaultInjected`` exception), ``enospc`` (an ``OSError`` "No space left on device", as a
  full disk gives), or ``nan`` (nothing happens here: ``fault_point`` returns ``"nan"`` and
  the caller poisons its value; the compute actor's ``compute.loss`` point makes the loss NaN),
  or ``lose_node`` (the whole node goes: the Ray node manager (raylet) of the process is killed,
  and with it every actor on that node, then the process ends; a lost machine, for the drills of a
  run on several nodes).

Each spec fires **once per run** (per step of a range): before firing, it creates a marker file in
``MEGASLIDE_FAULT_DIR`` (exclusively; an existing marker means it already fired, so a
restarted actor that reaches the same point again goes on). Without ``MEGASLIDE_FAULT_DIR``
the markers go to a directory in the system temp dir named after the spec list.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ENV_SPEC = "MEGASLIDE_FAULT"
ENV_DIR = "MEGASLIDE_FAULT_DIR"

FAULT_POINTS = {
    "compute.before_weights": "compute actor, start of a step, before any weight is fetched",
    "compute.after_weights": "compute actor, after the first shard's weights arrived",
    "compute.mid_forward": "compute actor, halfway through the forward blocks",
    "compute.mid_backward": "compute actor, halfway through the backward blocks (some gradients sent)",
    "store.after_last_report": "parameter store, a step's last gradient report counted (its update may start) "
                               "but not yet answered",
    "store.mid_update": "parameter store, between two shards of an AdamW update",
    "store.mid_shard_update": "parameter store, inside one shard's update (marker written, shard half done)",
    "store.mid_checkpoint": "parameter store, halfway through writing a checkpoint's shards",
    "decoder.mid_batch": "decoder actor, while decoding a batch",
    "compute.loss": "compute actor, the loss of a step (use with the action nan)",
    "driver.after_step": "the training driver, after a step's update was confirmed",
}
ACTIONS = ("exit", "hang", "raise", "enospc", "nan", "lose_node")


class FaultInjected(RuntimeError):
    """Raised by a fault point whose action is ``raise``."""


@dataclass(frozen=True)
class FaultSpec:
    point: str
    first: int | None  # 1-based steps first..last, or None: the first time the point is reached
    last: int | None
    action: str
    node: int | None = None  # only in the actors of this node (several nodes); None: any

    @property
    def text(self) -> str:
        steps = "" if self.first is None else f"@{self.first}" + (f"-{self.last}" if self.last != self.first else "")
        node = "" if self.node is None else f"/{self.node}"
        return f"{self.point}{steps}{node}:{self.action}"

    def matches(self, point: str, step: int | None) -> bool:
        """``step`` is 0-based (the code's numbering); the spec's steps are 1-based."""
        if point != self.point or (self.node is not None and self.node != _node):
            return False
        return self.first is None or (step is not None and self.first <= step + 1 <= self.last)

    def marker_name(self, step: int | None) -> str:
        key = self.text + ("" if self.first is None or step is None else f"#{step + 1}")
        return "fired-" + hashlib.sha1(key.encode()).hexdigest()[:16]


def parse_faults(value: str) -> list[FaultSpec]:
    """``"a@3,b:hang"`` -> specs; a clear ``ValueError`` for anything unknown."""
    specs = []
    for raw in (p.strip() for p in value.split(",")):
        if not raw:
            continue
        head, _, action = raw.partition(":")
        action = action or "exit"
        head, _, node = head.partition("/")
        point, _, step = head.partition("@")
        if point not in FAULT_POINTS:
            raise ValueError(f"fault point {point!r} (in {ENV_SPEC}={value!r}) is unknown; "
                             f"use one of: {', '.join(sorted(FAULT_POINTS))}")
        if action not in ACTIONS:
            raise ValueError(f"fault action {action!r} (in {raw!r}) is unknown; use one of {ACTIONS}")
        first = last = None
        if step:
            a, _, b = step.partition("-")
            if not a.isdigit() or int(a) < 1 or (b and (not b.isdigit() or int(b) < int(a))):
                raise ValueError(f"fault step {step!r} (in {raw!r}) must be a step number >= 1 or a range A-B")
            first, last = int(a), int(b or a)
        if node and not node.isdigit():
            raise ValueError(f"fault node {node!r} (in {raw!r}) must be a node index >= 0")
        specs.append(FaultSpec(point, first, last, action, int(node) if node else None))
    return specs


_lock = threading.Lock()
_cache: tuple[str, list[FaultSpec]] | None = None
_node: int | None = None


def set_node(node: int | None) -> None:
    """The node (index in a run on several nodes) of this process's actor, for specs with ``/NODE``."""
    global _node
    _node = node


def lose_node() -> None:
    """Kill this process's Ray node manager (its parent, the raylet), then end the process: the
    node is lost as when its machine goes down. Refuses when the parent is not a raylet."""
    import signal

    parent = os.getppid()
    try:
        name = Path(f"/proc/{parent}/comm").read_text().strip()
    except OSError:
        name = ""
    if name != "raylet":
        raise RuntimeError(f"fault action lose_node: the parent process {parent} is {name!r}, not a Ray raylet")
    os.kill(parent, signal.SIGKILL)
    os._exit(17)


def _active() -> list[FaultSpec]:
    global _cache
    value = os.environ.get(ENV_SPEC, "")
    if not value:
        return []
    if _cache is None or _cache[0] != value:
        _cache = (value, parse_faults(value))
    return _cache[1]


def marker_dir() -> Path:
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given)
    digest = hashlib.sha1(os.environ.get(ENV_SPEC, "").encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"megaslide-faults-{digest}"


def _claim(spec: FaultSpec, step: int | None) -> bool:
    """True exactly once per spec (and step of its range) per marker dir, across processes."""
    d = marker_dir()
    d.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(d / spec.marker_name(step), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, spec.text.encode())
    os.fsync(fd)
    os.close(fd)
    return True


def fault_point(point: str, step: int | None = None) -> str | None:
    """Fire the configured fault for ``point`` at 0-based ``step`` (``None``: not tied to a
    step). Returns ``"nan"`` when a ``nan`` fault fired (the caller poisons its value), else
    ``None``. Costs one environment lookup when no fault is configured."""
    return fire_fault(arm_fault(point, step))


def arm_fault(point: str, step: int | None = None) -> FaultSpec | None:
    """The first half of ``fault_point``: claim the fault configured for ``point`` at ``step`` now
    (its marker file written and synced) and return it for ``fire_fault``, or None. For a point
    that must fire right after a call that lets another thread or node go on: claimed before the
    call, the fault fires within microseconds of it, not after a file write and an fsync."""
    if point not in FAULT_POINTS:  # a typo in the code would silently never fire
        raise ValueError(f"unknown fault point {point!r}")
    specs = _active()
    if not specs:
        return None
    for spec in specs:
        if not spec.matches(point, step):
            continue
        with _lock:
            if _claim(spec, step):
                return spec
    return None


def fire_fault(spec: FaultSpec | None) -> str | None:
    """Carry out the action of a spec ``arm_fault`` claimed (None: nothing; see ``fault_point``)."""
    if spec is None:
        return None
    log.warning("fault injection: %s fires now (pid %d)", spec.text, os.getpid())
    if spec.action == "exit":
        os._exit(17)
    if spec.action == "raise":
        raise FaultInjected(f"injected fault {spec.text}")
    if spec.action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected fault {spec.text})")
    if spec.action == "nan":
        return "nan"
    if spec.action == "lose_node":
        lose_node()
    threading.Event().wait()  # hang
    return None


def fired(spec_text: str, step: int | None = None, directory: Path | None = None) -> bool:
    """Whether the spec ``spec_text`` has fired (in ``step``, 0-based; ``None``: in any step)."""
    spec = parse_faults(spec_text)[0]
    d = directory or marker_dir()
    if step is None and spec.first is not None:
        return any((d / spec.marker_name(s - 1)).exists() for s in range(spec.first, spec.last + 1))
    return (d / spec.marker_name(step)).exists()
