"""Drafts inside steps launched ahead (``SpeculativeConfig.ahead_drafts``): the rows expected to
run longest verify drafts every other step while the rest of the batch decodes plainly,
launched ahead (engine/ahead.py).

Why. A speculative step waits for the device and runs the host's drafting, building and
settling in series with it; a plain step launched ahead overlaps them with the device. On an
H200 (stop 46) the serial steps cost 3.4-4.1 ms where plain steps launched ahead took 1.7 ms,
and every speculative setting lost to plain. Yet a rollout's makespan is its longest
responses', and on the benchmark rollout those (search loops: "46+8=54 vs 40 no") accept
drafts well: each of the 12 responses at the 512-token cap took 1.5-2.4x fewer steps with
drafts (this CPU, the default speculation). Here they draft without stopping the pipeline.

How. A step launched ahead is built before the step in flight settles. A plain row emits one
token, so its next step is built with a placeholder fed on the device. A row that verifies a
draft emits 1 + accepted tokens, known only when its step settles: it sits out the next step
(no placeholder: its tokens are all computed, so the scheduler gives it nothing to compute)
and is settled, its tokens on the host, when the step after is built. Each chosen row drafts:

- settled (it sat out the step in flight): a chain continuing its tokens;
- waiting on a plain step's token (a placeholder): the chain continuing its settled tokens,
  less its first node, which guesses the token on the device (``Speculator.chain_from``). If
  the guess is wrong the nodes are rejected, as any wrong draft is.

So a drafting row verifies at most every other step: 1 + accepted tokens per two steps,
against plain's two. It drafts where the chain's path probabilities expect at least
``MIN_EXPECTED`` accepted nodes, however its last verifications went: a rollout's long
responses accept in bursts (loops), and a row stopped for poor verifications missed them (a
back-off of 8 steps after two, doubling up to 128, took 6-13% more steps on the benchmark
rollout: docs/speculation.md). Assuming its draft accepted whole instead of sitting out (its
next step void where it was not) took more steps too.

Which rows: the ``rows`` with the most expected tokens still to generate, chosen every
``REFRESH`` steps: critical.py's estimate from a request's length priors, else from the lengths
of its prompt's responses in the history store (the previous round's), else the tokens it has
generated (a long-tailed length's survivor runs about as long again). Chains only (trees are
not built here); not with a learned drafter (its past of hidden states needs every step's).

Whether the chosen rows draft at all is measured (engine/drafts_gate.py): drafting makes steps
longer, which pays only where the rows that gain least still gain more tokens a second.

Outputs never depend on drafts: every token and log-probability is plain decoding's
(tests/engine/test_ahead_drafts.py).
"""
from __future__ import annotations

import heapq
from typing import Any

from tailrl.engine.ahead import PENDING
from tailrl.engine.drafts_gate import DraftsGate
from tailrl.engine.request import Request
from tailrl.speculative.critical import expected_remaining, known_lengths
from tailrl.speculative.draft import Draft
from tailrl.speculative.history import HistoryStore

MIN_EXPECTED = 1.0          # expected accepted nodes a draft needs: a verify costs the row a step
REFRESH = 8                 # steps between choices of the rows that draft


class AheadDrafts:
    def __init__(self, speculator: Any, rows: int, history: HistoryStore | None = None,
                 measured: bool = True) -> None:
        self.speculator, self.rows, self.history = speculator, rows, history
        self.gate = DraftsGate() if measured else None    # None: the chosen rows always draft
        self._lengths: dict[str, list[int]] = {}         # prompt id -> its history's lengths, sorted
        self._chosen: set[str] = set()
        self._age = REFRESH

    def propose(self, rows: list[tuple[Request, int]], running: list[Request], budget: int) -> dict[str, Draft]:
        """Drafts for this step's chosen decode rows, at most ``budget`` nodes in all (none
        where the gate measures plain steps faster: then the rows are not ranked either, and
        are ranked anew at the first step that drafts)."""
        if not self.drafting():
            self._age = REFRESH
            return {}
        self._age += 1
        if self._age >= REFRESH:
            self._age, self._lengths = 0, {}
            best = heapq.nlargest(self.rows, running, key=self.expected_left)
            self._chosen = {r.request_id for r in best}
        out: dict[str, Draft] = {}
        for req, n in rows:
            rid = req.request_id
            if n != 1 or rid not in self._chosen or budget <= 0:
                continue
            room = min(req.remaining_tokens - 1, budget)
            if room <= 0:
                continue
            draft, expected = self._chain(req, room)
            if draft is not None and expected >= MIN_EXPECTED:
                out[rid] = draft
                budget -= len(draft)
        return out

    def drafting(self) -> bool:
        """Whether the chosen rows draft in the next step (the gate's way)."""
        return self.gate is None or self.gate.drafting()

    def tokens(self, plans: list, drafting: bool) -> dict[str, int]:
        """Each chosen row's new tokens in a settled step (``plans``: its rows; 0 for one that
        sat it out), read before the step's finished requests leave; none without a gate, nor
        for a step whose rows did not draft (each gains what a plain row gains)."""
        if self.gate is None or not drafting:
            return {}
        out = dict.fromkeys(self._chosen, 0)
        for p in plans:
            rid = p.req.request_id
            if rid in out:
                out[rid] = len(p.rows)
        return out

    def settled(self, drafting: bool, seconds: float, running: int, chosen: dict[str, int]) -> None:
        """A step launched ahead settled: whether its chosen rows drafted, its period, the rows
        running, ``tokens``."""
        if self.gate is not None:
            self.gate.record("draft" if drafting else "plain", seconds, running, chosen)

    def new_rollout(self) -> None:
        """A rollout starts: its rows ranked at its first step, the gate measuring afresh."""
        self._age = REFRESH
        if self.gate is not None:
            self.gate.new_rollout()

    def metrics(self) -> dict[str, float]:
        return self.gate.metrics() if self.gate is not None else {}

    def expected_left(self, req: Request) -> float:
        """Tokens ``req`` is expected still to generate (see the module docstring)."""
        g, cap = len(req.output_token_ids), req.params.max_tokens
        lengths = known_lengths(req) or self._history_lengths(req.prompt_id)
        return expected_remaining(lengths, g, cap) if lengths else float(min(g, cap - g))

    def _history_lengths(self, prompt_id: str) -> list[int]:
        if self.history is None or not prompt_id:
            return []
        got = self._lengths.get(prompt_id)
        if got is None:
            got = self._lengths[prompt_id] = sorted(self.history.lengths(prompt_id))
        return got

    def _chain(self, req: Request, room: int) -> tuple[Draft | None, float]:
        out = req.output_token_ids
        if not out or out[-1] != PENDING:
            return self.speculator.chain_from(req, 0, room)
        out.pop()                                   # the sources read the settled tokens
        try:
            return self.speculator.chain_from(req, 1, room)
        finally:
            out.append(PENDING)

    def finish(self, req: Request) -> None:
        self._chosen.discard(req.request_id)
