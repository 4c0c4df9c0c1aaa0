"""Scheduler policies: plain objects, no I/O, shared by the simulator and the real pool.

See docs/scheduling.md for the protocol. `make_policy` builds one by name.
"""
from __future__ import annotations

from tailrl.rollout.policies.base import Assignment, InstanceView, PolicyConfig, SchedulerPolicy
from tailrl.rollout.policies.context import ContextPolicy
from tailrl.rollout.policies.divided import DividedPolicy
from tailrl.rollout.policies.history import HistoryPolicy
from tailrl.rollout.policies.oracle import GroupOraclePolicy, OraclePolicy
from tailrl.rollout.policies.static import StaticPolicy

POLICY_NAMES = ("static", "divided", "context", "history", "oracle", "group-oracle")


def make_policy(name: str, config: PolicyConfig | None = None, *,
                history: dict[int | str, list[int]] | None = None,
                true_lengths: dict[int, int] | None = None) -> SchedulerPolicy:
    """Build policy `name`; `history` feeds `history`, `true_lengths` feeds `oracle` and `group-oracle`."""
    if name == "static":
        return StaticPolicy(config)
    if name == "divided":
        return DividedPolicy(config)
    if name == "context":
        return ContextPolicy(config)
    if name == "history":
        return HistoryPolicy(history or {}, config)
    if name in ("oracle", "group-oracle"):
        if true_lengths is None:
            raise ValueError(f"true_lengths is required by the {name} policy")
        return (OraclePolicy if name == "oracle" else GroupOraclePolicy)(true_lengths, config)
    raise ValueError(f"policy must be one of {POLICY_NAMES}, got {name!r}")


__all__ = ["Assignment", "InstanceView", "PolicyConfig", "SchedulerPolicy", "StaticPolicy",
           "DividedPolicy", "ContextPolicy", "HistoryPolicy", "OraclePolicy", "GroupOraclePolicy", "POLICY_NAMES",
           "make_policy"]
