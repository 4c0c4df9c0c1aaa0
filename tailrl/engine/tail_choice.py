"""How a speculative engine steps its tail where plain steps can be launched ahead (a GPU's
engine): verifying drafts one step at a time, or plain and launched ahead, whichever the
rollout itself measures faster (``SpeculativeConfig.tail="measured"``).

A speculative step waits for the device and runs the host's drafting, building and settling
in series with it; a plain step launched ahead overlaps them with the device. Which way
finishes the tail sooner depends on the model's step cost, the host's speed and the drafts:
on an H200 (stop 46) every speculative setting lost to plain steps launched ahead (the 0.5b
stand-in's rollout: 1.11-1.80 s against 1.03 s; a speculative step 3.4-4.1 ms, a plain one
1.7), where on a CPU no step is launched ahead at all.

A way's rate is the new tokens a row gains per second, for the rows that gain least (the
lower quartile of a step's rows: the rollout ends with its slowest rows), an average over
that way's recent steps (``ALPHA``). The tail starts speculating. After ``TRY`` steps of one
way the rates decide, once the other way has ``TRY`` steps measured too (until then it is
tried); the faster way steps on, and after ``probe`` steps of it the other way steps ``TRY``
times more, so that its rate follows the tail as the tail changes; each probe that leaves the
choice as it was doubles ``probe`` (``PROBE`` up to ``MAX_PROBE``), one that changes it
resets it. Each rollout measures speculation afresh (``new_rollout``). The choice never
changes a token: both ways give plain decoding's outputs. With a learned drafter too: a plain
step launched ahead hands out its hidden states when it settles (``ahead.HandOut``), so the
drafter's pasts have no gaps and its drafts root where a speculative step's would.
"""
from __future__ import annotations

ALPHA = 0.25                # weight of a way's newest step in its rate
TRY = 4                     # steps of a way measured before its rate counts, and a probe's length
PROBE = 32                  # steps of the faster way before the slower is measured again
MAX_PROBE = 512
WAYS = ("speculate", "plain")
# methods with a learned drafter: the engine's measured choice per step where none is launched
# ahead (``one_at_a_time``) and rows drafting inside steps launched ahead (``ahead_drafts``) are
# not built for them
DRAFTER_METHODS = ("drafter", "hybrid")


class Alternation:
    """The schedule by which two ways take turns: ``way`` steps until ``TRY`` of its steps are
    measured; a way never measured ``TRY`` times is tried next; then the faster way steps on,
    and after ``probe`` of its steps the slower one steps ``TRY`` times more; a probe that
    leaves the choice as it was doubles ``probe`` (up to ``MAX_PROBE``), one that changes it
    resets it. The rates are the caller's (``stepped``)."""

    def __init__(self, ways: tuple[str, str], first: str) -> None:
        self.ways = ways
        self.measured = {w: 0 for w in ways}         # steps recorded, ever
        self.restart(first)

    def restart(self, way: str) -> None:
        """Step ``way`` next, the probes' interval reset."""
        self.way, self.run, self.probe, self.probing = way, 0, PROBE, False

    def stepped(self, way: str, rates: dict[str, float | None]) -> None:
        """A step of ``way`` was measured; ``rates``: each way's rate now (higher: faster)."""
        self.measured[way] += 1
        if way != self.way:
            return
        self.run += 1
        if self.run < TRY:
            return
        other = self.ways[1 - self.ways.index(way)]
        if self.measured[other] < TRY:                  # not measured yet: try it
            self._switch(other)
            return
        faster = way if rates[way] >= rates[other] else other
        if self.probing:                                # a probe's end: back, or stay where it was faster
            self.probing = False
            self.probe = min(2 * self.probe, MAX_PROBE) if faster == other else PROBE
            self._switch(faster)
        elif faster == other:
            self.probe = PROBE
            self._switch(other)
        elif self.run >= self.probe:                    # the slower way measured again, TRY steps
            self._switch(other)
            self.probing = True

    def _switch(self, way: str) -> None:
        if way != self.way:
            self.way, self.run = way, 0


class TailChoice:
    """``prefix``: its metrics' (``rollout/<prefix>_<way>_steps``, ``_rate``). An engine that
    launches no step ahead (a CPU's) measures every step's two ways with one (``"steps"``):
    there a plain step waits as a speculative one does, and speculating can lose where the
    model's step is cheap next to the speculator's own host work."""

    def __init__(self, prefix: str = "tail") -> None:
        self.prefix = prefix
        self.turns = Alternation(WAYS, "speculate")
        self.rate: dict[str, float | None] = {w: None for w in WAYS}    # tokens a slow row gains a second
        self.steps = {w: 0 for w in WAYS}                               # steps recorded since ``new_rollout``

    @property
    def way(self) -> str:
        return self.turns.way

    def plain(self) -> bool:
        """Whether the next step is plain (launched ahead, where the engine can)."""
        return self.turns.way == "plain"

    def record(self, way: str, seconds: float, row_tokens: list[int]) -> None:
        """One tail step's outcome: ``way`` it stepped, its ``seconds`` (a speculative step: from
        its scheduling to its last commit; a plain step launched ahead: since the step settled
        before it) and the new tokens of each row that sampled."""
        if way not in WAYS:
            raise ValueError(f"tail: way must be one of {WAYS}, got {way!r}")
        if seconds <= 0 or not row_tokens:
            return
        slow = sorted(row_tokens)[len(row_tokens) // 4] / seconds
        old = self.rate[way]
        self.rate[way] = slow if old is None else old + ALPHA * (slow - old)
        self.steps[way] += 1
        self.turns.stepped(way, self.rate)

    def new_rollout(self) -> None:
        """A rollout starts: its tail steps counted from zero, and speculation measured afresh
        from its first tail steps (its drafts come from a history the last rollout did not have:
        an RL run's first round has none); plain steps' rate, the host's and the device's, carries
        on."""
        self.steps = {w: 0 for w in WAYS}
        self.rate["speculate"], self.turns.measured["speculate"] = None, 0
        self.turns.restart("speculate")

    def metrics(self) -> dict[str, float]:
        return way_metrics(self.prefix, self.steps, self.rate)


def way_metrics(prefix: str, steps: dict[str, int], rate: dict[str, float | None]) -> dict[str, float]:
    """``rollout/<prefix>_<way>_steps`` of each way, and ``_rate`` of each way measured."""
    out = {f"rollout/{prefix}_{w}_steps": float(n) for w, n in steps.items()}
    out.update({f"rollout/{prefix}_{w}_rate": r for w, r in rate.items() if r is not None})
    return out
