"""Whether a speculative engine's next step verifies drafts or is a plain step launched ahead.

A step that verifies drafts needs the previous step's tokens on the host, so it runs one step
at a time: the GPU waits for the host's Python between two such steps. A plain step can be
launched before the previous one's tokens are back (ahead.py; on an H100, plain decoding of
the 0.5b stand-in's rollout took 1.49-1.62 s so against 1.80-1.91 s one step at a time). The
speculator's policy prices drafts against plain steps taken one at a time, so where drafts save
less than stepping ahead does, a speculative engine on a GPU ran slower than plain decoding
(0.78x in one measurement). ``ModeChoice`` measures both instead of pricing them: per bucket of
batch sizes (powers of two), an exponential average of the seconds per emitted token of the
steps of each mode (steps without prefill), and it takes the cheaper. The other mode is tried
again for ``TRIAL`` steps every ``interval`` steps of the bucket: ``EXPLORE`` at first, doubled
each time the trial loses (up to ``MAX_EXPLORE``), back to ``EXPLORE`` when it wins. A fresh
bucket tries drafting first, then stepping ahead. Outputs never depend on the mode.

Only an engine that steps ahead at all (``async_scheduling``, by default a GPU's with CUDA
graphs) chooses, and only while no source or collector reads hidden states (the drafter's past
and the spot trainer's buffer take every position's state, which steps launched ahead do not
hand out): otherwise every step may draft, as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DRAFT, AHEAD = "draft", "ahead"
MODES = (DRAFT, AHEAD)
TRIAL = 4                 # steps a mode is tried for
EXPLORE = 64              # steps of a bucket between two trials of the mode that lost
MAX_EXPLORE = 1024
DECAY = 0.3               # weight of a new step in a mode's average


def bucket(rows: int) -> int:
    return max(1, rows).bit_length()


@dataclass
class _Bucket:
    cost: dict = field(default_factory=dict)             # mode -> seconds per token (average)
    trial: list = field(default_factory=lambda: [DRAFT] * TRIAL + [AHEAD] * TRIAL)   # modes of the next steps
    since: int = 0                                         # steps since the last trial ended
    interval: int = EXPLORE
    tried: str | None = None                               # the mode of the trial running or just ended

    def best(self) -> str:
        return min(MODES, key=lambda m: self.cost.get(m, float("inf")))


class ModeChoice:
    def __init__(self) -> None:
        self._buckets: dict[int, _Bucket] = {}
        self.trials = 0

    def choose(self, rows: int) -> str:
        """The mode of the next step, which has about ``rows`` rows."""
        b = self._buckets.setdefault(bucket(rows), _Bucket())
        if b.trial:
            mode = b.trial.pop(0)
        else:
            if b.tried is not None:                        # a trial ended: keep exploring at its pace
                won = b.best() == b.tried
                b.interval = EXPLORE if won else min(2 * b.interval, MAX_EXPLORE)
                b.tried = None
            mode = b.best()
            b.since += 1
            if b.since >= b.interval:
                b.since = 0
                other = AHEAD if mode == DRAFT else DRAFT
                b.trial, b.tried = [other] * (TRIAL - 1), other
                self.trials += 1
                mode = other
        return mode

    def observe(self, mode: str, rows: int, seconds: float, tokens: int) -> None:
        """A step of ``mode`` without prefill: ``rows`` rows emitted ``tokens`` tokens in
        ``seconds`` (a step launched ahead: the time since the step settled before it)."""
        if tokens <= 0 or seconds <= 0:
            return
        b = self._buckets.setdefault(bucket(rows), _Bucket())
        x = seconds / tokens
        old = b.cost.get(mode)
        b.cost[mode] = x if old is None else (1 - DECAY) * old + DECAY * x

    def costs(self) -> dict[int, dict[str, float]]:
        """Per bucket (rows up to 2^(b-1) .. 2^b - 1): each mode's seconds per token."""
        return {k: dict(b.cost) for k, b in sorted(self._buckets.items())}
