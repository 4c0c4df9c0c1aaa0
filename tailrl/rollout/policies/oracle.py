"""`oracle`: knows every request's true length; longest remaining first. Evaluation only.

The reference the practical policies are measured against (Seer's "Oracle": ideal
longest-first scheduling in the same divided-rollout system). Everything else is as in
`divided` and `context`: the same chunks, the same KV reservation per chunk (a full chunk,
although it could know better), the same preference for local KV at equal rank. So the
gap between `context` and `oracle` is the cost of not knowing the lengths when ordering.
"""
from __future__ import annotations

from tailrl.rollout.buffer import BufferEntry
from tailrl.rollout.policies.base import PolicyConfig, SchedulerPolicy
from tailrl.rollout.policies.ranked import RankedQueue


class OraclePolicy(SchedulerPolicy):
    name = "oracle"
    ranked = True

    def __init__(self, true_lengths: dict[int, int], config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self.true_lengths = dict(true_lengths)  # request id -> tokens it will generate

    def _setup(self) -> None:
        missing = [r.request_id for r in self._buf() if r.request_id not in self.true_lengths]
        if missing:
            raise ValueError(f"true_lengths is missing {len(missing)} requests, e.g. {missing[:3]}")
        self._queue = RankedQueue(self.num_instances, self._live)  # (-true remaining, ticket, rid)

    def _true_remaining(self, r: BufferEntry) -> int:
        return max(1, min(self.true_lengths[r.request_id], r.max_tokens) - r.generated)

    def _expected_remaining(self, r: BufferEntry) -> int:
        return self._true_remaining(r)

    def known_lengths(self, r: BufferEntry) -> tuple[int, ...]:
        return (min(self.true_lengths[r.request_id], r.max_tokens),)

    def _enqueue(self, r: BufferEntry, now: float, front: bool = False) -> None:
        self._queue.push((-self._true_remaining(r), self._stamp(r), r.request_id), r.location)

    def _pop(self, instance: int, now: float) -> int | None:
        return self._queue.pop(instance)


class GroupOraclePolicy(OraclePolicy):
    """Knows one statistic of each group's true lengths (`stat`: "max" or "mean"), nothing
    about which member is which: the ceiling of any rule that orders by a group estimate.

    Every member of a group is ranked by the group's statistic minus what it has generated
    (longest first); a member that outran the statistic is ranked at its max length, as in
    `context`. With "max" it starts every member of a group that holds one very long
    response as early as the oracle starts that response; with "mean" it knows exactly
    what a perfect per-group predictor of typical length would know. Evaluation only.
    """

    name = "group-oracle"

    def __init__(self, true_lengths: dict[int, int], config: PolicyConfig | None = None,
                 stat: str = "max") -> None:
        if stat not in ("max", "mean"):
            raise ValueError(f"stat must be 'max' or 'mean', got {stat!r}")
        super().__init__(true_lengths, config)
        self.stat = stat

    def _setup(self) -> None:
        super()._setup()
        buf, pick = self._buf(), (max if self.stat == "max" else lambda xs: sum(xs) / len(xs))
        self._group_len = {g: pick([min(self.true_lengths[r.request_id], r.max_tokens) for r in buf.group(g)])
                           for g in buf.group_ids()}

    def known_lengths(self, r: BufferEntry) -> tuple[int, ...]:
        return (round(self._group_len[r.group_id]),)

    def _true_remaining(self, r: BufferEntry) -> int:
        est = self._group_len[r.group_id]
        return max(1, round(est - r.generated)) if r.generated < est else r.max_tokens - r.generated
