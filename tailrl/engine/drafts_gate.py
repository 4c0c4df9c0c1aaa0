"""Whether the rows chosen to draft inside steps launched ahead (engine/ahead_drafts.py) draft
at all: whichever way the rollout measures faster (``SpeculativeConfig.ahead_drafts_gate=
"measured"``; ``"always"``: they always draft).

Drafting makes each step longer (the host drafts, builds and settles chain rows; the device
computes their nodes) and the chosen rows faster. Which wins depends on the host's speed, the
device's step cost and the drafts, so the rollout measures it, as the tail measures its two
ways (engine/tail_choice.py): a way's rate is the new tokens a second of the rows that gain
least, the lower quartile of the running rows. A rollout ends with its slowest rows. Over a
way's last ``WINDOW`` steps (a drafting row verifies every other step, so one step says
little of it), a row's gain is its new tokens a step: a chosen row's as counted (0 in a step
it sits out), every other row's 1 (a plain decode row's; rows prefilling or waiting for room
are so in both ways). The rate is the quartile row's gain times the window's steps a second.

So while fewer than a quarter of the rows draft (a rollout's bulk), the quartile row is a
plain one, and drafting wins only where it does not make steps longer: then every row gains
at least what it gains plainly. Trading the bulk's step time for the chosen rows' speed was
tried first and lost: rating drafting by the chosen rows' tokens a step, bounded by how much
longer the longest row was expected to run than the first row not chosen, drafted in 219 of
380 steps with 64 rows drafting and took 0.90x plain's time on the benchmark rollout (this
CPU); rating it by the whole batch's tokens a second took 0.91x and 0.985x in two runs. Which
rows run longest is a guess, and the chosen rows' speed is paid by every other row. In the
tail, where most running rows draft, the quartile row is a drafting one, and its gain counts.

A way keeps the rate of its last window until it steps again; a window starts afresh when its
way steps again after the other (the batch changes as a rollout runs). The ways take turns
as the tail's do (``tail_choice.Alternation``); each rollout measures both afresh, starting
with drafts. The gate never changes a token: both ways give plain decoding's.
"""
from __future__ import annotations

import bisect
from collections import deque

from tailrl.engine.tail_choice import Alternation, way_metrics

WAYS = ("draft", "plain")
WINDOW = 8                  # steps of a way its rate is measured over


class DraftsGate:
    def __init__(self) -> None:
        self.turns = Alternation(WAYS, "draft")
        self.new_rollout()

    def drafting(self) -> bool:
        """Whether the next step's chosen rows draft."""
        return self.turns.way == "draft"

    def record(self, way: str, seconds: float, running: int, chosen: dict[str, int]) -> None:
        """One step launched ahead has settled: ``way`` it stepped, its period (``seconds``: since
        the step settled before it), the rows running and each chosen row's new tokens (0 for
        one that sat the step out)."""
        if way not in WAYS:
            raise ValueError(f"ahead drafts: way must be one of {WAYS}, got {way!r}")
        if seconds <= 0 or running <= 0:
            return
        if way != self._last:
            self._window[way].clear()
        self._last = way
        self._window[way].append(seconds, running, chosen)
        self.rate[way] = self._window[way].rate()
        self.turns.stepped(way, self.rate)

    def new_rollout(self) -> None:
        """A rollout starts: both ways measured afresh, drafts first (their history is new)."""
        self.rate: dict[str, float | None] = {w: None for w in WAYS}    # tokens a second of the quartile row
        self._window = {w: Window() for w in WAYS}
        self._last: str | None = None
        self.turns.measured = {w: 0 for w in WAYS}       # the steps of each way in this rollout
        self.turns.restart("draft")

    def metrics(self) -> dict[str, float]:
        return way_metrics("ahead", self.turns.measured, self.rate)


class Window:
    """A way's last ``WINDOW`` steps, and each chosen row's new tokens and steps over them, kept
    as running sums (a step adds its rows and drops the oldest step's: no pass over the whole
    window each step)."""

    def __init__(self) -> None:
        self.steps: deque = deque()
        self.seconds = 0.0
        self._sums: dict[str, list[int]] = {}           # request id -> [tokens, steps chosen]

    def append(self, seconds: float, running: int, chosen: dict[str, int]) -> None:
        if len(self.steps) == WINDOW:
            old_seconds, _, old = self.steps.popleft()
            self.seconds -= old_seconds
            sums = self._sums
            for rid, n in old.items():
                got = sums[rid]
                if got[1] == 1:
                    del sums[rid]
                else:
                    got[0] -= n
                    got[1] -= 1
        self.steps.append((seconds, running, chosen))
        self.seconds += seconds
        sums = self._sums
        for rid, n in chosen.items():
            got = sums.get(rid)
            if got is None:
                sums[rid] = [n, 1]
            else:
                got[0] += n
                got[1] += 1

    def clear(self) -> None:
        self.steps.clear()
        self.seconds = 0.0
        self._sums.clear()

    def rate(self) -> float:
        """The lower quartile of the running rows' new tokens a step over the window, times its
        steps a second: the chosen rows running now at their counts (over the steps each was
        chosen in), the others at 1."""
        _, running, now = self.steps[-1]
        sums = self._sums
        gains = sorted(t / k for t, k in (sums[rid] for rid in now))
        plain = max(0, running - len(gains))           # rows at 1 token a step
        k = (len(gains) + plain) // 4
        below = bisect.bisect_left(gains, 1.0)         # chosen rows gaining less than a plain row
        q = gains[k] if k < below else 1.0 if k < below + plain else gains[k - plain]
        return q * len(self.steps) / self.seconds
