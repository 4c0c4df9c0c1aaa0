"""Speculation that prices itself: each step verifies the draft tokens that save the most time.

Per step with ``B`` requests sampling (the default policy, ``SpeculativeConfig(policy="priced")``):

1. *Prices.* ``T(N)``: the measured time of a step computing ``N`` tokens (``StepCurve``,
   learned online from this engine's own decode and verify steps; no start-up calibration).
   A token the batch emits is worth ``tau = T(B) / B`` seconds (what a plain step spends per
   token now). A draft node at depth ``j`` of request ``i`` is accepted with probability
   ``p_ij = path_prob_j * a_i^j``: its draft's own path probability times the geometric
   acceptance model of Seer's cost formula (``a_i``: the request's running acceptance once it
   has ``min_request_steps`` verifications, else its draft source's). A source whose path
   probabilities are a model's own next-token probabilities (``model_sources``: the learned
   drafter) already prices depth in them: its nodes are valued ``path_prob_j * c``, ``c``
   being the source's calibration (accepted nodes over the path probabilities of the nodes
   verified, with forgetting; 1 before any), not discounted by ``a^j`` a second time.
2. *Depth by value.* Nodes are taken best-first (a node after its parent; among equal gains
   the request expected to run longest first: ``priority_fn``, its expected length), and the
   step verifies the first ``k`` nodes for the ``k`` that maximises the expected time saved,
   ``tau * sum(p) - (T(B + k) - T(B))`` (``k = 0``: plain decode). So depth follows the
   curve: in the tail, where ``T`` is flat (a step reads the weights once whatever its rows),
   requests draft deep; in the bulk, where a token costs a row's arithmetic, only drafts
   nearly certain to be accepted pay, and usually none do. Seer's ``T_SD`` with measured
   ``a``, ``D`` and ``T``, solved per step instead of per batch size; TLT's threshold falls
   out of it.
3. *Gate.* Before any drafting (which costs CPU time per request asked), the best saving any
   drafts could bring this step (every request drafting at the best source's rate) must
   exceed ``min_saving`` of the step, or nobody drafts (then the speculator's critical rows
   still may, `SpeculativeConfig.critical_rows`).
4. *Exploring.* The curve is known up to the largest step measured. A step that would pay only
   if the next stretch (up to twice that) were as cheap as the last measured point, while the
   last measured stretch is still cheap enough, runs that way: at once for a stretch not yet
   tried twice (the first step of a shape is not measured), else once per ``explore_every``
   such steps. So a fresh engine at batch 1 learns its
   flat curve in a few steps, and a compute-bound curve is not explored past where it turned
   steep.
5. *Probing the rate.* A gate shut by the acceptance rate alone (drafts at the highest rate,
   ``MAX_RATE``, would pass it) stays shut on what the rate was when drafts were last
   verified: a rollout whose batch never gets small (longest-first admission with a good
   history keeps it full to the end) never drafts, and never learns that its drafts are now
   right. So on every ``explore_every``-th step the gate shuts, if drafts at ``MAX_RATE``
   would open it, ``PROBE_ROWS`` requests draft (``probe_rows``; which ones:
   ``critical.probe_requests``, successive probes walking the batch), at the critical rows'
   depth: their verifications measure the rate afresh, and a few rows' drafts cost a step
   little where they do not pay.
Outputs never depend on drafts.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable

from tailrl.speculative.draft import Draft
from tailrl.speculative.policies.acceptance import MAX_RATE, AcceptanceStats
from tailrl.speculative.policies.step_curve import StepCurve

CRITICAL_DEPTH = 6     # the critical rows' depth where the prices switch drafting off (docs/pool.md's figures)
PROBE_ROWS = 4         # requests a rate probe drafts for (rule 5)


def _output_length(req: Any) -> float:
    return float(len(req.output_token_ids))


def _remaining(expected: float, generated: int) -> float:
    return expected - generated if expected > generated else float(generated)


class PricedPolicy:
    def __init__(self, curve: StepCurve | None = None, *, max_draft_tokens: int = 16, max_tree_paths: int = 1,
                 max_spec_batch: int = 0, min_saving: float = 0.02, explore_every: int = 32,
                 min_request_steps: int = 3, model_sources: frozenset[str] = frozenset({"drafter"}),
                 priority_fn: Callable[[Any], float] | None = None) -> None:
        if max_draft_tokens < 1 or max_tree_paths < 1:
            raise ValueError(f"PricedPolicy needs max_draft_tokens >= 1 and max_tree_paths >= 1, got "
                             f"{max_draft_tokens}, {max_tree_paths}")
        self.curve = curve or StepCurve()
        self.max_draft_tokens = max_draft_tokens
        self.max_tree_paths = max_tree_paths
        self.max_spec_batch = max_spec_batch
        self.min_saving = min_saving
        self.explore_every = explore_every
        self.min_request_steps = min_request_steps
        self.priority_fn = priority_fn or _output_length
        self.model_sources = model_sources
        self._calib: dict[str, list[float]] = {}   # model source -> [accepted, score] with forgetting
        self.overall = AcceptanceStats()
        self.by_source: dict[str, AcceptanceStats] = {}
        self._by_request: dict[str, AcceptanceStats] = {}
        self.draft_seconds = 0.0          # EMA of drafting CPU time per request asked
        self._draft_obs = 0
        self._step_draft_s = 0.0          # this step's drafting time (taken out of its step time)
        self._explore_streak = 0
        self._tries: dict[float, int] = {}   # exploring steps made from each measured range's top
        self._exploring = False
        self._open = False                # this step may draft (max_paths said so)
        self._probe_streak = 0
        self._probing = False             # this step probes the rate (rule 5)
        self.explore_steps = 0            # steps run on the optimistic curve (a metric)
        self.last_tokens = 0              # draft tokens of the last allocation

    # ---- prices ---------------------------------------------------------------------------
    def _t(self, tokens: float) -> float:
        return self.curve.predict_flat(tokens) if self._exploring else self.curve.predict(tokens)

    def _best_rate(self) -> float:
        return max([self.overall.rate, AcceptanceStats().rate] + [s.rate for s in self.by_source.values()])

    def _layer_saving(self, batch_size: int, rate: float, predict: Callable[[float], float]) -> float:
        """The most time drafts could save this step: every request drafting at ``rate``,
        the best number of whole depth layers (seconds; drafting time counted). The layers stop
        where no deeper one can do better: ``predict`` never falls with more tokens, so a deeper
        layer's saving is at most all the gain left (a geometric tail) less this layer's cost."""
        B = batch_size
        base = predict(B)
        tau, gain, best = base / B, 0.0, 0.0
        drafting = self.draft_seconds * B
        for j in range(1, self.max_draft_tokens + 1):
            gain += B * rate ** j
            cost = predict(B + B * j) - base + drafting
            best = max(best, tau * gain - cost)
            if tau * (gain + B * rate ** (j + 1) / (1.0 - rate)) - cost <= best:
                break
        return best / base

    def max_paths(self, batch_size: int) -> int:
        self._exploring = self._open = self._probing = False
        if self.curve.empty or (self.max_spec_batch and batch_size > self.max_spec_batch):
            return 0
        rate = self._best_rate()
        known = self._layer_saving(batch_size, rate, self.curve.predict)
        if self.explore_every > 0 and self._worth_exploring(batch_size, rate, known):
            self._explore_streak += 1
            top = self.curve.max_tokens()
            fresh = self._tries.get(top, 0) < 2          # a stretch tried at most twice at once
            if fresh or self._explore_streak >= self.explore_every:
                self._explore_streak = 0
                self._tries[top] = self._tries.get(top, 0) + 1
                self._exploring = self._open = True
                self.explore_steps += 1
                return self.max_tree_paths
        if known > self.min_saving:
            self._open = True
            self._probe_streak = 0
            return self.max_tree_paths
        self._probing = self._worth_probing(batch_size)
        return 0

    def _worth_probing(self, batch_size: int) -> bool:
        """Rule 5: every ``explore_every``-th step with the gate shut, whether it would open at
        ``MAX_RATE`` (asked only then: a shut step costs no second pricing)."""
        self._probe_streak += 1
        if self.explore_every <= 0 or self._probe_streak < self.explore_every:
            return False
        self._probe_streak = 0
        return self._layer_saving(batch_size, MAX_RATE, self.curve.predict) > self.min_saving

    def probe_rows(self) -> int:
        """Requests that draft this step although ``max_paths`` said 0: a rate probe's (rule 5)."""
        return PROBE_ROWS if self._probing else 0

    def _worth_exploring(self, batch_size: int, rate: float, known: float) -> bool:
        """Drafts would save more than the measured curve lets them (``known``) were the
        stretch above the measured range as cheap as its last point, and the last measured
        stretch does not already say tokens cost too much there (its slope per token under
        what a token at ``rate`` is worth now): so a flat curve is followed up doubling by
        doubling (a fresh engine at batch 1 learns it in a few steps), and a compute-bound
        one is not explored past where it turned steep."""
        if self._layer_saving(batch_size, rate, self.curve.predict_flat) <= max(known, 0.0) + self.min_saving:
            return False
        slope = self.curve.last_slope()
        return slope is None or slope < rate * self.curve.predict(batch_size) / batch_size

    def draft_limit(self, req: Any) -> int:
        """The cap sources draft to: the full depth where this step may draft; where it may not,
        the speculator's critical rows (`SpeculativeConfig.critical_rows`) still draft, at the
        depth their measured figures used (``CRITICAL_DEPTH``)."""
        return self.max_draft_tokens if self._open else min(CRITICAL_DEPTH, self.max_draft_tokens)

    def _rate(self, req: Any, source: str) -> float:
        st = self._by_request.get(req.request_id)
        if st is None or st.steps < self.min_request_steps:
            st = self.by_source.get(source)
        return st.rate if st is not None else AcceptanceStats().rate

    def allocate(self, proposals: list[tuple[Any, Draft]], batch_size: int,
                 max_tokens: int | None = None) -> list[int]:
        """Draft nodes per proposal (rule 2); ``max_tokens`` caps their sum."""
        n = len(proposals)
        alloc = [0] * n
        self.last_tokens = 0
        if n == 0 or self.curve.empty:
            return alloc
        B = max(batch_size, n)
        base = self._t(B)
        tau = base / B
        cap = self.max_draft_tokens * n if max_tokens is None else min(max_tokens, self.max_draft_tokens * n)
        if self._exploring:                       # no further than the stretch being explored
            cap = min(cap, max(0, int(2 * self.curve.max_tokens()) - B))
        # expected tokens still to come (a request past every estimate: as many as it has, the
        # lengths are long-tailed); among nodes of equal gain the long-tail requests' go first
        left = [_remaining(self.priority_fn(req), len(req.output_token_ids)) for req, _ in proposals]
        heap: list[tuple[float, float, int, int]] = []
        # per proposal: (path probabilities, the factor on them, whether depth discounts them,
        # children per node of a tree / None for a chain); a node's gain is computed when it is
        # pushed (a chain's nodes one after another), not for every node of every draft
        nodes: list[tuple[list[float], float, bool, list[list[int]] | None, list[int] | None]] = []
        for i, (req, d) in enumerate(proposals):
            model = d.source in self.model_sources
            factor = self.calibration(d.source) if model else self._rate(req, d.source)
            kids: list[list[int]] | None = None
            if not d.is_chain:
                kids = [[] for _ in range(len(d) + 1)]                    # slot len(d) = the root
                for j, p in enumerate(d.parents):
                    kids[p if p >= 0 else len(d)].append(j)
            nodes.append((d.path_probs, factor, model, kids, None if model or kids is None else d.depths))
            for j in (kids[len(d)] if kids is not None else (0,)):
                heapq.heappush(heap, (-self._gain(nodes[i], j), -left[i], i, j))
        taken: list[int] = []
        gained = best = 0.0
        best_k = 0
        while heap and len(taken) < cap:
            g, _, i, j = heapq.heappop(heap)
            if alloc[i] >= self.max_draft_tokens:
                continue
            alloc[i] += 1
            taken.append(i)
            gained += -g
            saving = tau * gained - (self._t(B + len(taken)) - base)
            if saving > best:
                best, best_k = saving, len(taken)
            elif len(taken) - best_k > 2 * self.max_draft_tokens:
                break                              # gains fall and costs rise from here: no later k wins
            node = nodes[i]
            for c in (node[3][j] if node[3] is not None else (j + 1,) if j + 1 < len(node[0]) else ()):
                heapq.heappush(heap, (-self._gain(node, c), -left[i], i, c))
        if best <= self.min_saving * base:
            best_k = 0
        alloc = [0] * n
        for i in taken[:best_k]:
            alloc[i] += 1
        self.last_tokens = best_k
        return alloc

    @staticmethod
    def _gain(node: tuple, j: int) -> float:
        """Node ``j``'s expected acceptance: its path probability times the source's calibration
        (a model source) or times the acceptance rate to the power of its depth."""
        probs, factor, model, _, depths = node
        if model:
            return min(1.0, probs[j] * factor)
        return min(1.0, probs[j] * factor ** (depths[j] if depths is not None else j + 1))

    # ---- feedback ------------------------------------------------------------------------
    def observe_draft(self, seconds: float, requests: int = 1) -> None:
        per_request = seconds / max(requests, 1)
        self.draft_seconds = per_request if self._draft_obs == 0 else 0.9 * self.draft_seconds + 0.1 * per_request
        self._draft_obs += 1
        self._step_draft_s = seconds

    def calibration(self, source: str) -> float:
        acc, score = self._calib.get(source, (0.0, 0.0))
        return acc / score if score > 0 else 1.0

    def update(self, req: Any, draft_nodes: int, accepted: int, source: str, *,
               max_depth: int | None = None, score: float | None = None) -> None:
        if draft_nodes <= 0:
            return
        if score is not None and source in self.model_sources:
            st = self._calib.setdefault(source, [0.0, 0.0])
            st[0] = 0.98 * st[0] + accepted
            st[1] = 0.98 * st[1] + score
        full = accepted >= (draft_nodes if max_depth is None else max_depth)
        for st in (self.overall, self.by_source.setdefault(source, AcceptanceStats()),
                   self._by_request.setdefault(req.request_id, AcceptanceStats())):
            st.add(draft_nodes, accepted, full)

    def observe_step(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        """A decode or verify step: its time without drafting teaches the curve."""
        draft_s, self._step_draft_s = self._step_draft_s, 0.0
        self.curve.observe(num_tokens, seconds - draft_s)

    def finish(self, req: Any) -> None:
        self._by_request.pop(req.request_id, None)
