"""Per request and step: its suffix draft, a learned-drafter draft, or none, chosen from the
measured acceptance of each source and the measured cost of drafting and verifying.

Prices at this step's batch size ``B``:

    tau  = seconds one emitted token is worth now: the realized seconds per emitted token of
           the recent steps of this batch size (step time / (rows + accepted draft tokens),
           drafting included, with forgetting; before any, the ``CostModel``'s plain step
           T(B, B) / B). A token drafted now saves producing it later at that rate: at small
           batch, where a suffix-drafted step emits ~4 tokens per row, a token is worth a
           quarter of a plain step, not a whole one.
    c    = slope(B)           seconds one more verified draft node costs (``CostModel``; read
                              again every ``SLOPE_EVERY`` uses per batch size: a refit per
                              step cost ~40 us, a few percent of a small batch's step)
    D(n, q) = d0 + d1 n + d2 q  seconds of one batched drafter call for n requests with q
                              positions queued for their drafter past (their K/V are computed
                              first: after a pause that is most of a call); least squares with
                              forgetting over the calls made: the drafter's own work, priced

A draft's expected accepted tokens are its score (the source's own estimate) times the
source's calibration (accepted / score over its verified drafts, with forgetting; 1 before
any). Its value over ``k`` verified nodes is ``v = e * tau - k * c``.

0. ``plan``: from the step's batch size and number of requests alone, whether anything may be
   asked (a call that could pay, an exploring call that is due); most steps nothing is, and
   the speculator does not look at the requests.
1. ``ask``: before drafting, the drafter is expected to accept ``A`` tokens per verify step
   (its measured mean, with forgetting) with drafts of ``k`` nodes (their measured mean size,
   at most the request's limit). Its gain for a request is ``A * tau - k * c`` over
   the value of what the request already has (a suffix draft, or nothing = 0), minus ``d2 q_r``
   for its own queued positions (``pending(req)``, set by the speculator). The drafter is
   called for the requests with a positive gain if their gains add up to more than
   ``d0 + d1 n``. A call the prices approve is then made or skipped by ``gate``
   (``CallGate``: a call/skip bandit per batch size over realized step throughput), which
   checks the model against what the calls bring.
2. *Exploring*: the drafter's acceptance changes as it trains online, so it is measured
   whether or not its drafts are worth verifying. Until its first draft is scored, and then
   after ``explore_every`` steps without a call (a call's verified drafts measure it too),
   while exploring calls took at most ``explore_share`` of the steps' time so far, the
   drafter drafts for ``explore_rows`` requests drawn at random (seeded) among those without
   a full-length draft, and nothing else is asked that step. Unless ``track``, only where
   measuring could change a decision: where a call for this step's requests would pay were
   the drafter perfect (all of its draft accepted), once calls have been priced. A drafter
   too costly for its target (as on the small CPU target) then costs only its readiness;
   ``track`` measures it throughout (to follow an online drafter's acceptance). These drafts
   are *shadow* drafts: never verified (each request verifies its suffix draft as usual),
   scored by the speculator once the request's tokens are known. Sampling is counter-based,
   so the tokens a request emits do not depend on its drafts, and a draft node is accepted
   iff it equals the token emitted at its position: a shadow draft's score is exactly the
   acceptance verification would have given it (``Draft.accepted_by``), at the cost of a
   few-row drafter call and no verify slot.
3. ``pick``: without a drafter draft, the suffix draft as the speculation policy chose it (as
   with suffix drafts alone); else the draft of higher value, none when the better value is
   not positive.

Readiness (``ready``): the engine hands out the hidden states that fill the requests' drafter
pasts and draft roots only at batch sizes up to twice the largest one where the prices
approved a call in the last ``READY_MEMORY`` steps (unless the gate measured calls there
worse than skipping them), once the drafter and ``PRICED_CALLS`` calls are measured: where
no call pays, keeping the drafter ready is pure cost. A call approved where the last step
handed nothing out (no request has a draft root) is not made; it extends readiness, so the
next steps can make it. Exploring keeps to the steps that have roots too.

``always`` (the drafter alone, ``method="drafter"``; tests of the drafter's verified path):
every request without a full-length draft gets the drafter's draft at every step the
speculation policy drafts, and it is verified, whatever the prices say.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np

from tailrl.speculative.call_gate import CallGate
from tailrl.speculative.draft import Draft
from tailrl.speculative.policies.cost_model import CostModel, batch_bucket

SLOPE_EVERY = 16
READY_MEMORY = 1024       # steps a call approved at a batch size keeps the drafter ready up to twice it
READY_EVERY = 64          # steps between two reads of that bound
PRICED_CALLS = 4          # measured calls before readiness follows approvals


class SourceChoice:
    def __init__(self, cost_model: CostModel, drafter: str = "drafter", decay: float = 0.98,
                 explore_every: int = 16, explore_share: float = 0.01, explore_rows: int = 4,
                 always: bool = False, track: bool = False, seed: int = 0) -> None:
        self.cost = cost_model
        self.drafter = drafter                   # the batched source's name
        self.decay = decay
        self.explore_every = explore_every
        self.explore_share = explore_share
        self.explore_rows = explore_rows         # requests per exploring (shadow) call
        self.always = always                     # the drafter drafts for every open request, verified
        self.track = track                       # explore even where no call could pay (follow acceptance)
        self._rng = random.Random(seed)          # which requests an exploring call samples
        self.explore_s = 0.0                     # seconds of exploring calls
        self.elapsed_s = 0.0                     # seconds of all steps (``observe_step``)
        self._acc: dict[str, float] = {}         # source -> forgotten sum of accepted tokens
        self._score: dict[str, float] = {}       # source -> forgotten sum of draft scores
        self._steps: dict[str, float] = {}       # source -> forgotten count of verify steps
        self._nodes: dict[str, float] = {}       # source -> forgotten sum of draft sizes (when given)
        self._xtx = np.zeros((3, 3))             # forgotten sums of x x^T, x = (1, n, q), over drafter calls
        self._xty = np.zeros(3)                  # ... and of x * seconds
        self._prices: np.ndarray | None = None   # call_prices() solved from them
        self._calls = 0                          # calls measured
        self._token_s: dict[int, float] = {}     # batch bucket -> realized seconds per emitted token
        self._slopes: dict[int, list] = {}        # batch bucket -> [c, uses left]
        self._step_accepted = 0                  # verified draft tokens accepted this step
        self.pending = None                      # req -> positions queued for its drafter past (0: none)
        self._asks = 0                           # asks since the last exploring call
        self.exploring = False                   # this step's call drafts shadow drafts (never verified)
        self._steps_total = 0                    # steps planned
        self._approved_at: dict[int, tuple[int, int]] = {}   # batch bucket -> (step, largest batch) of its approvals
        self._reach: tuple[int, int] | None = None   # (largest live approved batch size, step to read it again)
        self.handed = True                       # the last step handed out hidden states (set by the speculator)
        self.gate = CallGate()

    # ---- learning ------------------------------------------------------------------------
    def record(self, source: str, score: float, accepted: int, verified: bool = True,
               nodes: int | None = None) -> None:
        """One draft of ``source`` scored: its score and the tokens accepted (bonus excluded);
        ``verified=False`` for a shadow draft (its acceptance counts, not for this step's gate);
        ``nodes``: the draft's size (what verifying a draft of this source costs)."""
        d = self.decay
        self._acc[source] = self._acc.get(source, 0.0) * d + accepted
        self._score[source] = self._score.get(source, 0.0) * d + score
        self._steps[source] = self._steps.get(source, 0.0) * d + 1.0
        if nodes is not None:
            self._nodes[source] = self._nodes.get(source, 0.0) * d + nodes
        if verified:
            self.gate.record(accepted)
            self._step_accepted += accepted

    def observe_step(self, seconds: float, batch_size: int = 0, prefill: bool = False) -> None:
        """One engine step of ``batch_size`` rows (drafting included) took ``seconds``."""
        self.elapsed_s += seconds
        self.gate.observe_step(batch_size, seconds, prefill)
        accepted, self._step_accepted = self._step_accepted, 0
        if prefill or batch_size < 1 or not seconds > 0:
            return
        b, per_token = batch_bucket(batch_size), seconds / (batch_size + accepted)
        old = self._token_s.get(b)
        self._token_s[b] = per_token if old is None else self.decay * old + (1 - self.decay) * per_token

    def observe_call(self, seconds: float, requests: int, positions: int = 0) -> None:
        """One batched drafter call for ``requests`` requests with ``positions`` queued past
        positions took ``seconds`` (this step's: an exploring call if ``exploring``)."""
        if self.exploring:
            self.explore_s += seconds
        self._calls += 1
        x = np.array([1.0, float(requests), float(positions)])
        self._xtx = self._xtx * self.decay + np.outer(x, x)
        self._xty = self._xty * self.decay + x * seconds
        self._prices = None

    # ---- prices ------------------------------------------------------------------------------
    def calibration(self, source: str) -> float:
        s = self._score.get(source, 0.0)
        return self._acc[source] / s if s > 0 else 1.0

    def drafter_nodes(self, limit: int) -> float:
        """The nodes a drafter draft is expected to have: its drafts' mean size (it drafts only
        as deep as pays under the priced policy), at most ``limit``; ``limit`` before any."""
        st = self._steps.get(self.drafter, 0.0)
        n = self._nodes.get(self.drafter)
        return min(limit, n / st) if n is not None and st > 0 else float(limit)

    def drafter_mean(self) -> float | None:
        """The drafter's accepted tokens per draft, bonus excluded (None before any was scored)."""
        st = self._steps.get(self.drafter, 0.0)
        return self._acc[self.drafter] / st if st > 0 else None

    def call_prices(self) -> np.ndarray:
        """(d0, d1, d2) of the calls measured so far (each >= 0; zeros before any); solved
        again only after a new call was measured."""
        if self._prices is None:
            self._prices = self._solve_prices()
        return self._prices

    def _solve_prices(self) -> np.ndarray:
        if self._xtx[0, 0] <= 0:
            return np.zeros(3)
        ridge = 1e-9 * np.trace(self._xtx) * np.eye(3)       # a feature that never varied gets 0
        coef = np.linalg.solve(self._xtx + ridge, self._xty)
        if coef.min() < 0:                                   # refit the others without the negative ones
            keep = coef > 0
            coef = np.zeros(3)
            if keep.any():
                sub = np.ix_(keep, keep)
                coef[keep] = np.linalg.solve(self._xtx[sub] + ridge[sub], self._xty[keep])
        return np.maximum(coef, 0.0)

    def call_cost(self, requests: int, positions: int = 0) -> float:
        d0, d1, d2 = self.call_prices()
        return d0 + d1 * requests + d2 * positions

    def token_seconds(self, batch_size: int) -> float:
        """tau: what one emitted token is worth at this batch size, in seconds."""
        tau = self._token_s.get(batch_bucket(batch_size))
        return tau if tau is not None else self.cost.predict(batch_size, batch_size) / batch_size

    def slope(self, batch_size: int) -> float:
        """c: seconds one more verified node costs at this batch size."""
        b = batch_bucket(batch_size)
        cached = self._slopes.get(b)
        if cached is None or cached[1] <= 0:
            cached = self._slopes[b] = [self.cost.slope(batch_size), SLOPE_EVERY]
        cached[1] -= 1
        return cached[0]

    def prices(self, batch_size: int) -> tuple[float, float]:
        """(tau, c): seconds per emitted token, seconds per verified node at this batch size."""
        return self.token_seconds(batch_size), self.slope(batch_size)

    def value(self, draft: Draft | None, limit: int, tau: float, c: float) -> float:
        if draft is None:
            return 0.0
        k = min(len(draft), limit)
        e = self.calibration(draft.source) * (draft.truncate(k).score if k < len(draft) else draft.score)
        return e * tau - k * c

    # ---- decisions -----------------------------------------------------------------------------
    def plan(self, batch_size: int, n: int) -> str | None:
        """What this step may ask of the drafter, from its batch size and its ``n`` requests'
        count alone (counts the step): "all" (``always``), "explore" (a shadow-draft call is
        due), "call" (a call could pay) or None: nothing, and the caller need not look at the
        requests (most steps: a per-request look is a few percent of a small batch's step)."""
        self.exploring = False
        if self.always:
            return "all"
        self._steps_total += 1
        self._asks += 1                            # since the last exploring call
        mean = self.drafter_mean()
        if (mean is None or self._asks >= self.explore_every) and self.explore_s <= self.explore_share * self.elapsed_s:
            return "explore"
        return "call" if self._may_call(mean, batch_size, n) else None

    def _may_call(self, mean: float | None, batch_size: int, n: int) -> bool:
        """Whether ``n`` requests could gain enough for a call, each its most (the drafter's
        mean acceptance at this batch size's token value, nothing to beat)."""
        if mean is None:                           # nothing measured yet: nothing to value
            return False
        d0, d1, _ = self.call_prices()
        most = mean * self.token_seconds(batch_size)
        return most > d1 and n * (most - d1) > d0

    def ask(self, requests: list[Any], have: dict[str, Draft | None], limits: dict[str, int],
            batch_size: int, plan: str | None = "auto") -> list[Any]:
        """The requests to call the drafter for this step (for shadow drafts if ``exploring``);
        ``plan``: this step's ``plan`` (default: made now)."""
        if plan == "auto":
            plan = self.plan(batch_size, len(requests))
        if plan is None:
            return []
        if plan == "all":
            return self._open(requests, have, limits)
        if plan == "explore":
            open_ = self._open(requests, have, limits) if self.handed else []
            if open_ and (self.track or self._paying(open_, have, limits, batch_size, None)):
                self._asks, self.exploring = 0, True
                picked = sorted(self._rng.sample(range(len(open_)), min(self.explore_rows, len(open_))))
                return [open_[i] for i in picked]
            self._asks = 0                         # nothing to learn here now: look again later
            if not self._may_call(self.drafter_mean(), batch_size, len(requests)):
                return []
        worth = self._paying(self._open(requests, have, limits), have, limits, batch_size, self.drafter_mean())
        if not worth or not self._approved(batch_size) or not self.gate.allow(batch_size):
            return []
        self._asks = 0                             # this call's verified drafts measure the drafter
        return worth

    def ready(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` rows should hand out its hidden states to the
        drafter (the requests' pasts and draft roots come from hand-outs): up to twice the
        largest batch size at which the prices approved a call within the last
        ``READY_MEMORY`` steps, unless the gate measured calls there worse than skipping them;
        everywhere with ``always`` or ``track``, and until the drafter and its calls are
        measured. Where no call pays, being ready is pure cost."""
        if self.always or self.track or self.drafter_mean() is None or not self._priced():
            return True
        if self._reach is None or self._steps_total >= self._reach[1]:
            live = [size for at, size in self._approved_at.values()
                    if self._steps_total - at <= READY_MEMORY and not self.gate.rejects(size)]
            self._reach = (max(live, default=0), self._steps_total + READY_EVERY)
        return batch_size <= 2 * self._reach[0]

    def _priced(self) -> bool:
        """Whether enough calls were measured to price one (three prices to fit)."""
        return self._calls >= PRICED_CALLS

    def _approved(self, batch_size: int) -> bool:
        """The prices approved a call at this batch size: it keeps the drafter ready up to twice
        it; the call is made only if this step's requests have draft roots (the last step
        handed out)."""
        if not self._priced():                     # ready everywhere: an approval means little yet
            return self.handed
        b = batch_bucket(batch_size)
        at, size = self._approved_at.get(b, (0, 0))
        self._approved_at[b] = (self._steps_total, batch_size if self._steps_total - at > READY_MEMORY
                                else max(size, batch_size))
        if self._reach is not None and batch_size > self._reach[0]:
            self._reach = None                     # read the bound again at the next step
        return self.handed

    def _paying(self, open_: list[Any], have: dict[str, Draft | None], limits: dict[str, int],
                batch_size: int, accepts: float | None) -> list[Any]:
        """The requests of ``open_`` whose gain from a drafter draft is positive, if their gains
        add up to more than the call's price; else []. ``accepts``: the drafter's expected
        accepted tokens per draft (None: all of each request's ``limit``, a perfect drafter;
        before any call was priced, then every open request)."""
        d0, d1, d2 = self.call_prices()
        if accepts is None and not (d0 or d1 or d2):
            return open_
        tau, c = self.prices(batch_size)
        queued = self.pending or (lambda r: 0)
        worth = []
        total = 0.0
        for r in open_:
            limit = limits[r.request_id]
            a = limit if accepts is None else accepts
            k = limit if accepts is None else self.drafter_nodes(limit)
            g = a * tau - k * c - d2 * queued(r) - max(self.value(have[r.request_id], limit, tau, c), 0.0)
            if g > 0:
                worth.append(r)
                total += g
        return worth if worth and total > d0 + d1 * len(worth) else []

    @staticmethod
    def _open(requests: list[Any], have: dict[str, Draft | None], limits: dict[str, int]) -> list[Any]:
        """The requests without a draft certain to be accepted in full."""
        return [r for r in requests if have[r.request_id] is None or have[r.request_id].score < limits[r.request_id]]

    def pick(self, current: Draft | None, drafted: Draft | None, limit: int, batch_size: int) -> Draft | None:
        if drafted is None:               # the drafter was not asked: what suffix drafting alone does
            return current
        if self.always:
            return drafted
        options = [d for d in (current, drafted) if d is not None]
        tau, c = self.prices(batch_size)
        values = [self.value(d, limit, tau, c) for d in options]
        i = max(range(len(options)), key=values.__getitem__)     # ties: the first (the suffix draft)
        return options[i] if values[i] > 0 else None
