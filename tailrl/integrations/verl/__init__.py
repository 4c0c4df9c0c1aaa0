"""tailrl as a verl rollout backend: ``actor_rollout_ref.rollout.name=tailrl``.

Written against verl 0.9.1 (the ``verl`` extra pins it). Importing this package registers
``tailrl`` in verl's two registries: the replica (``RolloutReplicaRegistry``: the servers that
verl's agent loop sends requests to, ``replica.py`` / ``server.py``) and the trainer-side
rollout (``get_rollout_class``: the weight-sync handle, ``adapter.py``). verl imports it by
itself: tailrl declares it as a ``verl.plugins`` entry point, which ``import verl`` loads.
How verl's per-sample requests become tailrl groups, prompt ids and noise: ``requests.py``.
"""
from __future__ import annotations

from tailrl.extras import require

NAME = "tailrl"


def _replica():
    from tailrl.integrations.verl.replica import TailRLReplica
    return TailRLReplica


def register() -> None:
    """Register ``rollout.name=tailrl`` with verl (idempotent)."""
    require("verl", "verl")
    from verl.workers.rollout import base, replica
    replica.RolloutReplicaRegistry.register(NAME, _replica)
    base._ROLLOUT_REGISTRY[(NAME, "async")] = "tailrl.integrations.verl.adapter.ServerAdapter"


register()
