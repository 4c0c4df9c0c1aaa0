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
draft emits 1 + accepted tokens, known only when its step settles, so the next step can not
continue it: there it follows the draft up (``batch.FollowUps``) for the ``FOLLOW_UPS``
accept lengths the draft most likely gets (from its path probabilities): for each length, the
token the target emits after that many accepted nodes (a placeholder fed on the device) at
its position, its K/V at a scratch position past the draft. When the draft's step settles,
the follow-up of the length it got, if there is one, is the row's next token (its K/V moved
into place), sampled while the host did not know it yet; the others are dropped. A row whose
follow-ups missed (or that has none) computes its last token in the step after. On the
benchmark rollout (this CPU, 64 rows drafting) the follow-ups took 316 steps down to 254
(docs/speculation.md; 268 with today's admission): a verification gains 2 + accepted tokens
in two steps, not 1 + accepted (an offline replay of the 40 longest responses: all accept
lengths followed up 245 steps for the longest, the top three 249, two 257, one 277, none
289). Each chosen row drafts:

- settled (its draft's follow-ups missed, or it decoded plainly two steps ago): a chain
  continuing its tokens;
- waiting on a plain step's token or a follow-up's (a placeholder): the chain continuing its
  settled tokens, less its first node, which guesses the token on the device
  (``Speculator.chain_from``). If the guess is wrong the nodes are rejected, as any wrong
  draft is.

So a drafting row verifies at most every other step: 2 + accepted tokens per two steps where
its follow-ups hit, against plain's two. It drafts where the chain's path probabilities expect
at least ``MIN_EXPECTED`` accepted nodes, however its last verifications went: a rollout's
long responses accept in bursts (loops), and a row stopped for poor verifications missed them
(a back-off of 8 steps after two, doubling up to 128, took 6-13% more steps on the benchmark
rollout: docs/speculation.md). Assuming its draft accepted whole instead (one follow-up,
drafting on from it, void where it missed) took more steps too.

Which rows: the ``rows`` with the most expected tokens still to generate, chosen every
``REFRESH`` steps: critical.py's estimate from a request's length priors, else from the lengths
of its prompt's responses in the history store (the previous round's), else the tokens it has
generated (a long-tailed length's survivor runs about as long again). Chains only: in the
replay above, trees of up to 4 or 8 paths took the longest response 284 steps against the
chains' 289. Not with a learned drafter (its past of hidden states needs every step's).

Whether the chosen rows draft at all is measured (engine/drafts_gate.py): drafting makes steps
longer, which pays only where the rows that gain least still gain more tokens a second.

Outputs never depend on drafts: every token and log-probability is plain decoding's
(tests/engine/test_ahead_drafts.py).
"""
from __future__ import annotations

import heapq
from typing import Any

from tailrl.engine.ahead import PENDING
from tailrl.engine.batch import FollowUps, RowPlan
from tailrl.engine.drafts_gate import DraftsGate
from tailrl.engine.request import Request
from tailrl.speculative.critical import expected_remaining, known_lengths
from tailrl.speculative.draft import Draft
from tailrl.speculative.history import HistoryStore

MIN_EXPECTED = 1.0          # expected accepted nodes a draft needs: a verify costs the row a step
REFRESH = 8                 # steps between choices of the rows that draft
FOLLOW_UPS = 3              # accept lengths a verifying row follows up in the next step


class AheadDrafts:
    def __init__(self, speculator: Any, rows: int, history: HistoryStore | None = None,
                 measured: bool = True) -> None:
        self.speculator, self.rows, self.history = speculator, rows, history
        self.gate = DraftsGate() if measured else None    # None: the chosen rows always draft
        self._lengths: dict[str, list[int]] = {}         # prompt id -> its history's lengths, sorted
        self._chosen: set[str] = set()
        self._age = REFRESH
        self._reach: dict[str, list[float]] = {}         # request id -> P(accepted >= k), k = 0 .. nodes
        self.follow_ups = self.follow_hits = 0           # queries launched; rows whose accept length they had

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
                path = draft.path_probs             # given a guessed first token right: scaled to it
                scale = expected / sum(path)
                self._reach[rid] = [1.0] + [q * scale for q in path]
        return out

    def follow(self, plans: list[RowPlan], rows: list[tuple[Request, int]], budget: int) -> dict[str, FollowUps]:
        """Follow-ups (``batch.FollowUps``) for this step's rows that verify a draft in the step
        before (``plans``, still on the device) and have nothing to compute: each the
        ``FOLLOW_UPS`` accept lengths its draft most likely gets (from its path probabilities),
        at most ``budget`` queries in all."""
        verifying = {id(p.req): p for p in plans if p.draft_tokens}
        out: dict[str, FollowUps] = {}
        for req, n in rows:
            plan = verifying.get(id(req)) if n == 0 else None
            reach = self._reach.pop(req.request_id, None) if plan is not None else None
            if reach is None or min(FOLLOW_UPS, budget) <= 0:
                continue
            depth = len(plan.draft_tokens)
            odds = [reach[k] - (reach[k + 1] if k < depth else 0.0) for k in range(depth + 1)]
            lengths = sorted(range(depth + 1), key=lambda k: -odds[k])[:min(FOLLOW_UPS, budget)]
            out[req.request_id] = FollowUps(lengths, depth)
            budget -= len(lengths)
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
        self.follow_ups = self.follow_hits = 0
        if self.gate is not None:
            self.gate.new_rollout()

    def metrics(self) -> dict[str, float]:
        """The gate's (engine/drafts_gate.py), and the follow-ups' queries and hits."""
        out = self.gate.metrics() if self.gate is not None else {}
        out.update({"rollout/ahead_follow_ups": float(self.follow_ups),
                    "rollout/ahead_follow_hits": float(self.follow_hits)})
        return out

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
        self._reach.pop(req.request_id, None)
