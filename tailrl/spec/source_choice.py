"""Per request and step: its suffix draft, a learned-drafter draft, or none, chosen from the
measured acceptance of each source and the measured cost of drafting and verifying.

Prices at this step's batch size ``B``, from the speculator's ``CostModel``:

    tau  = T(B, B) / B        seconds one emitted token is worth now (the batch's time per token)
    c    = slope(B)           seconds one more verified draft node costs
    D(n, q) = d0 + d1 n + d2 q  seconds of one batched drafter call for n requests with q
                              positions queued for their drafter past (their K/V are computed
                              first: after a pause that is most of a call); least squares with
                              forgetting over the calls made: the drafter's own work, priced

A draft's expected accepted tokens are its score (the source's own estimate) times the
source's calibration (accepted / score over its verified drafts, with forgetting; 1 before
any). Its value over ``k`` verified nodes is ``v = e * tau - k * c``.

1. ``ask``: before drafting, the drafter is expected to accept ``A`` tokens per verify step
   (its measured mean, with forgetting). Its gain for a request is ``A * tau - k * c`` over
   the value of what the request already has (a suffix draft, or nothing = 0), minus ``d2 q_r``
   for its own queued positions (``pending(req)``, set by the speculator). The drafter is
   called for the requests with a positive gain if their gains add up to more than
   ``d0 + d1 n``. Before the drafter has been verified, and then one step in ``explore_every``
   while exploring calls took at most ``explore_share`` of the steps' time so far, it is
   called for every request without a full-length draft, and its drafts are verified
   whatever their value, so its acceptance (which changes as it trains online) and its cost
   stay measured; the share bounds what measuring a drafter that is rarely worth it costs.
   A call the prices approve is then made or skipped by ``gate`` (``CallGate``: a call/skip
   bandit per batch size over realized step throughput), which checks the model against
   what the calls bring.
2. ``pick``: without a drafter draft, the suffix draft as the speculation policy chose it (as
   with suffix drafts alone); else the draft of higher value, none when the better value is
   not positive.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tailrl.spec.call_gate import CallGate
from tailrl.spec.cost_model import CostModel
from tailrl.spec.draft import Draft


class SourceChoice:
    def __init__(self, cost_model: CostModel, drafter: str = "drafter", decay: float = 0.98,
                 explore_every: int = 16, explore_share: float = 0.02) -> None:
        self.cost = cost_model
        self.drafter = drafter                   # the batched source's name
        self.decay = decay
        self.explore_every = explore_every
        self.explore_share = explore_share
        self.explore_s = 0.0                     # seconds of exploring calls
        self.elapsed_s = 0.0                     # seconds of all steps (``observe_step``)
        self._acc: dict[str, float] = {}         # source -> forgotten sum of accepted tokens
        self._score: dict[str, float] = {}       # source -> forgotten sum of draft scores
        self._steps: dict[str, float] = {}       # source -> forgotten count of verify steps
        self._xtx = np.zeros((3, 3))             # forgotten sums of x x^T, x = (1, n, q), over drafter calls
        self._xty = np.zeros(3)                  # ... and of x * seconds
        self._prices: np.ndarray | None = None   # call_prices() solved from them
        self.pending = None                      # req -> positions queued for its drafter past (0: none)
        self._asks = 0
        self.exploring = False                   # this step verifies the drafter's drafts whatever their value
        self.gate = CallGate()

    # ---- learning ------------------------------------------------------------------------
    def record(self, source: str, score: float, accepted: int) -> None:
        """One verified draft of ``source``: its score and the tokens accepted (bonus excluded)."""
        d = self.decay
        self._acc[source] = self._acc.get(source, 0.0) * d + accepted
        self._score[source] = self._score.get(source, 0.0) * d + score
        self._steps[source] = self._steps.get(source, 0.0) * d + 1.0
        self.gate.record(accepted)

    def observe_step(self, seconds: float, batch_size: int = 0, prefill: bool = False) -> None:
        """One engine step of ``batch_size`` rows (drafting included) took ``seconds``."""
        self.elapsed_s += seconds
        self.gate.observe_step(batch_size, seconds, prefill)

    def observe_call(self, seconds: float, requests: int, positions: int = 0) -> None:
        """One batched drafter call for ``requests`` requests with ``positions`` queued past
        positions took ``seconds`` (this step's: an exploring call if ``exploring``)."""
        if self.exploring:
            self.explore_s += seconds
        x = np.array([1.0, float(requests), float(positions)])
        self._xtx = self._xtx * self.decay + np.outer(x, x)
        self._xty = self._xty * self.decay + x * seconds
        self._prices = None

    # ---- prices ------------------------------------------------------------------------------
    def calibration(self, source: str) -> float:
        s = self._score.get(source, 0.0)
        return self._acc[source] / s if s > 0 else 1.0

    def drafter_mean(self) -> float | None:
        """The drafter's accepted tokens per verify step (None before it was verified)."""
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

    def prices(self, batch_size: int) -> tuple[float, float]:
        """(tau, c): seconds per emitted token, seconds per verified node at this batch size."""
        return self.cost.predict(batch_size, batch_size) / batch_size, self.cost.slope(batch_size)

    def value(self, draft: Draft | None, limit: int, tau: float, c: float) -> float:
        if draft is None:
            return 0.0
        k = min(len(draft), limit)
        e = self.calibration(draft.source) * (draft.truncate(k).score if k < len(draft) else draft.score)
        return e * tau - k * c

    # ---- decisions -----------------------------------------------------------------------------
    def ask(self, requests: list[Any], have: dict[str, Draft | None], limits: dict[str, int],
            batch_size: int) -> list[Any]:
        """The requests to call the drafter for this step."""
        self._asks += 1                            # since the last exploring call
        mean = self.drafter_mean()
        self.exploring = mean is None or (self._asks >= self.explore_every
                                          and self.explore_s <= self.explore_share * self.elapsed_s)
        if self.exploring:
            self._asks = 0
        if not self.exploring:
            tau, c = self.prices(batch_size)
            d0, d1, d2 = self.call_prices()
            most = mean * tau - min(limits.values(), default=0) * c   # no request gains more: often nothing can pay
            if most <= d1 or len(requests) * (most - d1) <= d0:
                return []
        # requests without a draft certain to be accepted in full
        open_ = [r for r in requests if have[r.request_id] is None or have[r.request_id].score < limits[r.request_id]]
        if self.exploring or not open_:
            return open_
        queued = self.pending or (lambda r: 0)
        gains = [(r, mean * tau - limits[r.request_id] * c - d2 * queued(r)
                  - max(self.value(have[r.request_id], limits[r.request_id], tau, c), 0.0)) for r in open_]
        worth = [(r, g) for r, g in gains if g > 0]
        if not worth or sum(g for _, g in worth) <= d0 + d1 * len(worth) or not self.gate.allow(batch_size):
            return []
        return [r for r, _ in worth]

    def pick(self, current: Draft | None, drafted: Draft | None, limit: int, batch_size: int) -> Draft | None:
        if drafted is None:               # the drafter was not asked: what suffix drafting alone does
            return current
        if self.exploring:
            return drafted
        options = [d for d in (current, drafted) if d is not None]
        tau, c = self.prices(batch_size)
        values = [self.value(d, limit, tau, c) for d in options]
        i = max(range(len(options)), key=values.__getitem__)     # ties: the first (the suffix draft)
        return options[i] if values[i] > 0 else None
