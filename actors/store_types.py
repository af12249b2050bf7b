"""What the parameter store hands out: shard descriptions, update results, its status, and the
errors its callers act on (a state cut mid-update, a step whose gradients a restarted store lost).
Frozen dataclasses, so the compute actors and the driver get small values over Ray."""

from __future__ import annotations

from dataclasses import dataclass

from megaslide_ray.models.shards import ShardLayout


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
    reduce_seconds: float = 0.0  # several compute actors: the store's time summing their gradients
    network_bytes: int = 0       # several nodes: bytes this store sent to the other nodes for this step


@dataclass(frozen=True)
class StoreStatus:
    versions: tuple[int, ...]
    state_dir: str
    state_bytes: int
    node_id: str
    pid: int = 0    # the store's process (a restarted store has another)
    scratch_bytes: int = 0  # several compute actors: the gradient slots and the fp32 accumulator
    node: int = 0           # several nodes (runtime.nodes): this store's node index, and how many
    nodes: int = 1


class StateNotTrustedError(RuntimeError):
    """The store's shared state was cut in the middle of an update: resume from a checkpoint."""


class GradientsLostError(RuntimeError):
    """Asked for a step whose gradients this store process never received (it was restarted
    after they were reported): the driver redoes the step."""
