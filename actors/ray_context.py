"""Where the calling process runs in Ray: whether Ray restarted its actor, and its node. Outside
Ray (tests that build the actor classes in one process) there is one node and no restart."""

from __future__ import annotations

import warnings


def was_reconstructed() -> bool:
    """True inside a Ray actor that Ray has restarted after a crash."""
    try:
        import ray

        if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
            return False
        with warnings.catch_warnings():  # the property reads Ray's deprecated actor_id internally
            warnings.simplefilter("ignore")
            return bool(ray.get_runtime_context().was_current_actor_reconstructed)
    except Exception:  # noqa: BLE001 - outside an actor: not reconstructed
        return False


def node_id() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except Exception:  # noqa: BLE001 - outside Ray there is one node
        return "local"
    return "local"
