"""Whether the rows chosen to draft inside steps launched ahead (engine/ahead_drafts.py) draft
at all: whichever the rollout measures to finish sooner (``SpeculativeConfig.ahead_drafts_gate
="measured"``; ``"always"``: they always draft).

Drafting makes each step longer (the host drafts, builds and settles chain rows; the device
computes their nodes) and the chosen rows faster. Which wins depends on the host's speed, the
device's step cost and the drafts, so the rollout measures it. What sets a makespan is the
rows that finish last: with R rows drafting, the R expected to run longest, sped up, or the
(R+1)-th, at the longer steps' pace. So a way's rate is the progress a second of the rows that
set the makespan, in plain decoding's tokens:

- ``plain``: 1 / the step's period;
- ``draft``: min(gain, spread) / the step's period. ``gain`` is the chosen rows' new tokens a
  step, a row's verifications and the steps it sits out included. ``spread`` is the longest
  row's expected tokens still to come over the (R+1)-th's (ahead_drafts.py's estimate); with
  at most R rows running, every row drafts and it does not bound the gain; with no lengths
  known (every row alike) it is 1, so drafts pay only where they cost no step time.

A step's period is the time since the step settled before it. A way's period and gain are
averages over its recent steps (``ALPHA``), restarted whenever the way steps again after the
other: a rollout's batch shrinks as it runs, so an old window's period is another batch's.
The ways take turns as the tail's do (``tail_choice.Alternation``); each rollout measures both
afresh, starting with drafts. The gate never changes a token: both ways give plain decoding's.
"""
from __future__ import annotations

from tailrl.engine.tail_choice import ALPHA, Alternation

WAYS = ("draft", "plain")


class DraftsGate:
    def __init__(self) -> None:
        self.turns = Alternation(WAYS, "draft")
        self.new_rollout()

    def drafting(self) -> bool:
        """Whether the next step's chosen rows draft."""
        return self.turns.way == "draft"

    def record(self, way: str, seconds: float, gain: float | None, spread: float) -> None:
        """One step launched ahead has settled: ``way`` it stepped, its period (``seconds``),
        the chosen rows' new tokens a row (``gain``; None: no chosen row ran) and the spread of
        the expected lengths now."""
        if way not in WAYS:
            raise ValueError(f"ahead drafts: way must be one of {WAYS}, got {way!r}")
        if seconds <= 0:
            return
        fresh = way != self._last
        self._last = way
        old = self.period[way]
        self.period[way] = seconds if fresh or old is None else old + ALPHA * (seconds - old)
        if way == "draft" and gain is not None:
            self.gain = gain if fresh or self.gain is None else self.gain + ALPHA * (gain - self.gain)
        self.steps[way] += 1
        self.turns.stepped(way, self.rates(spread))

    def rates(self, spread: float) -> dict[str, float | None]:
        """Each way's progress a second of the rows that set the makespan (None: not measured)."""
        d, p = self.period["draft"], self.period["plain"]
        return {"draft": None if d is None else min(self.gain if self.gain is not None else 1.0, spread) / d,
                "plain": None if p is None else 1.0 / p}

    def new_rollout(self) -> None:
        """A rollout starts: both ways measured afresh, drafts first (their history is new)."""
        self.period: dict[str, float | None] = {w: None for w in WAYS}
        self.gain: float | None = None
        self.steps = {w: 0 for w in WAYS}
        self._last: str | None = None
        self.turns.measured = {w: 0 for w in WAYS}
        self.turns.restart("draft")

    def metrics(self) -> dict[str, float]:
        out = {f"rollout/ahead_{w}_steps": float(self.steps[w]) for w in WAYS}
        if self.gain is not None:
            out["rollout/ahead_draft_gain"] = self.gain
        return out
