"""Seer's marginal-benefit speculation budget with RhymeRL's per-request draft window.

Per step, with ``B`` requests sampling and ``n`` of them holding a draft:

1. *Is speculation worth anything at this batch size?* The cost model gives the plain step
   time ``T0 = T(B, B)`` and the marginal cost ``c`` of one more verified token. One extra
   accepted token is worth ``tau = T0 / B`` seconds (what the batch spends per token now).
   A draft node with expected gain ``e`` (accepted tokens it brings) pays iff
   ``e * tau >= c``. If even ``e = 1`` does not pay, or rule 2 gives ``g* = 0`` at the gate
   rate (``_gate_rate``: the best source's where verifying is cheap, the overall one
   elsewhere), ``max_paths`` returns 0 and nobody drafts (typically at batch 256, where
   verifying a token costs about as much as decoding one).
2. *Budget (Seer).* With per-token acceptance ``a`` (the mean running estimate over this
   step's proposals: each request's own once measured, else its source's), draft depth ``g``
   gives ``E_g = (1 - a^(g+1)) / (1 - a)`` tokens per drafting request per step, and the time
   per token is ``T_SD(g) = (D + T(B, B + g*n)) / (B - n + n*E_g)`` (Seer's
   ``(1-a)(D+T)/(1-a^(g+1))`` generalised to a batch where only ``n`` requests draft;
   ``D`` = measured drafting time per request asked, times ``B``: drafting is paid for every
   request asked, whatever the budget). ``g* = argmin_g T_SD(g)``, ``g = 0`` being plain
   decoding; the step's budget is ``g* * n`` draft nodes.
3. *Greedy by marginal gain.* A node at depth ``j`` is accepted with probability
   ``a^j * path_prob``: the geometric model of rule 2 (``a`` measured per request once it
   has ``min_request_steps`` verifications, else per source) times the draft's own
   count-based path probability (< 1 where the references disagree). Suffix drafts are
   certain of a path their single reference took; acceptance still decays with depth, so
   a flat accepted/predicted calibration over-values deep nodes and under-values shallow
   ones (measured: 16-node drafts at batch 17-64 cost more than they gained). Nodes are handed out
   best-first (a node only after its parent) by ``gain * priority`` until the budget is
   spent, skipping nodes whose gain does not pay (rule 1) and requests at their window or at
   ``2 g*`` nodes: attention pads every row to the longest draft of the step, so one request
   given 13 nodes makes a batch of 128 pay for 14 query slots per row (measured); the
   factor 2 leaves priority room to give the long requests more.
4. *Priority.* ``priority_fn(req)`` estimates how long the request will run (default: its
   output length so far; the factory uses the prompt's longest previous response when a
   history store is given). Rank ``r`` in [0, 1] among this step's drafting requests gives
   weight ``1 + priority_weight * r``: long-tail requests win ties for the budget. The
   weight orders the handout only; rule 1 never takes priority into account, so speculation
   is not slower than plain decoding in expectation.
5. *Window (RhymeRL).* Each request may verify at most ``window`` nodes; the window doubles
   on full acceptance (up to ``max_draft_tokens``) and halves otherwise (down to
   ``min_draft_tokens``), like TCP congestion control.

6. *Exploration.* Where rules 1-2 say no, one step in ``explore_every`` (per batch-size
   bucket) still verifies ``min_draft_tokens`` for a few of the best drafts, so the cost model and the
   acceptance statistics stay measured (see ``max_paths``).

7. *Checked against the clock.* After each speculative step its real time per emitted token
   (drafting included) is divided by the predicted one (the cost model's time over the
   allocated nodes' expected gain); the per-bucket average of that ratio scales the
   speculative side of rule 2; plain decode steps get the same check against the plain
   prediction (one step in ``plain_every`` is plain where speculation runs, so both sides
   stay measured on the same batch sizes and contexts). Where the models are optimistic
   (measured at batch 128-256: the mean acceptance rate over-predicts what deep chains yield
   there), ``g*`` falls to 0; an off bucket's ratio drifts back toward 1 (1% per step), so
   speculation is retried.

Departures from Seer: their "SD off when the budget is below the number of high-priority
requests" rule is replaced by rule 1, which switches off from measured costs instead.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable

from tailrl.speculative.draft import Draft
from tailrl.speculative.policies.acceptance import AcceptanceStats
from tailrl.speculative.policies.cost_model import CostModel, batch_bucket


def _output_length(req: Any) -> float:
    return float(len(req.output_token_ids))


class AdaptivePolicy:
    def __init__(self, cost: CostModel | None = None, *, max_draft_tokens: int = 16,
                 min_draft_tokens: int = 2, max_tree_paths: int = 4, max_spec_batch: int = 0,
                 initial_window: int = 4, priority_weight: float = 2.0,
                 priority_fn: Callable[[Any], float] | None = None, min_request_steps: int = 3,
                 explore_every: int = 32, min_gain: float = 0.1, plain_every: int = 16) -> None:
        if not 1 <= min_draft_tokens <= max_draft_tokens:
            raise ValueError(f"need 1 <= min_draft_tokens <= max_draft_tokens, got "
                             f"{min_draft_tokens}, {max_draft_tokens}")
        self.cost = cost or CostModel()
        self.max_draft_tokens = max_draft_tokens
        self.min_draft_tokens = min_draft_tokens
        self.max_tree_paths = max_tree_paths
        self.max_spec_batch = max_spec_batch
        self.initial_window = min(max(initial_window, min_draft_tokens), max_draft_tokens)
        self.priority_weight = priority_weight
        self.priority_fn = priority_fn or _output_length
        self.min_request_steps = min_request_steps
        self.explore_every = explore_every   # 0 = never speculate where the estimates say no
        self.min_gain = min_gain             # predicted time saving a draft depth must reach
        self.plain_every = plain_every       # where speculating, one step in this many is plain (0: never)
        self._off_streak: dict[int, int] = {}
        self._exploring = False
        self._step_depth = max_draft_tokens   # this step's cap on nodes per request (set by max_paths)
        self.overall = AcceptanceStats()
        self.by_source: dict[str, AcceptanceStats] = {}
        self._by_request: dict[str, AcceptanceStats] = {}
        self._windows: dict[str, int] = {}
        self.draft_seconds = 0.0      # EMA of drafting CPU time per request asked
        self._draft_obs = 0
        self._pending: tuple[int, float, float] | None = None   # (bucket, seconds, tokens) predicted
        self._step_accepted = 0               # draft tokens accepted in this step
        self._expected_gain = 0.0
        self._error: dict[int, float] = {}    # per batch bucket: EMA of real / predicted speculative step
        self._plain_error: dict[int, float] = {}   # the same for plain decode steps
        self._spec_streak: dict[int, int] = {}
        self.last_depth = 0           # g* of the last allocation
        self.last_budget = 0          # g* * n of the last allocation

    # ---- decisions ----------------------------------------------------------------
    def window(self, req: Any) -> int:
        return self._windows.get(req.request_id, self.initial_window)

    def draft_limit(self, req: Any) -> int:
        """Its window, and at most this step's ``g*`` at the best measured rate: nodes past it
        would be cut by ``allocate`` anyway, and drafting them costs CPU time."""
        return min(self.window(req), self._step_depth)

    def _gain_threshold(self, batch_size: int) -> float:
        """Expected accepted tokens a draft node must bring to pay for its verification."""
        tau = self.cost.predict(batch_size, batch_size) / batch_size
        return self.cost.slope(batch_size) / tau

    def _gate_depth(self, batch_size: int) -> int:
        """Seer's g* with every request drafting at the gate rate; 0 = no draft can pay here.

        0 when a certain token does not pay (rule 1) or when g* is 0 at the gate rate
        (``_gate_rate``; rule 2 with every request drafting: the ratio of gained tokens to
        verification cost does not depend on how many draft).
        """
        if self._gain_threshold(batch_size) >= 1.0:
            return 0
        return self.best_depth(batch_size, batch_size, self._gate_rate(batch_size))

    def _gate_rate(self, batch_size: int) -> float:
        """The acceptance rate that decides whether to draft at all. Where a verified token
        costs under 15% of a decoded one (small batches), the best rate of any source (an
        unmeasured one counts at the prior): trying is cheap, and a poor source must not
        silence a good one. Elsewhere the rate over all sources: drafting is paid for every
        request asked, and a step whose drafts then get ``g* = 0`` wasted it (measured: most
        bulk steps at batch 256 when the gate used the best source's rate)."""
        if self._gain_threshold(batch_size) < 0.15:
            return max([self.overall.rate, AcceptanceStats().rate] + [s.rate for s in self.by_source.values()])
        return self.overall.rate

    def max_paths(self, batch_size: int) -> int:
        """The tree width sources may draft this step; 0 = nobody drafts.

        When the estimates say speculation cannot pay, every ``explore_every``-th such step
        per batch bucket is an exploration step anyway (``min_draft_tokens`` for each of the
        ``max(4, n // 8)`` best-scoring drafts, a small cost: at batch 256, about 1% of the
        time when verifying costs as much as decoding): without it a few noisy timings or an unlucky acceptance streak would switch
        speculation off for good, since an off policy measures neither.
        """
        self._exploring = False
        self._pending = None
        self._step_depth = self.max_draft_tokens
        if self.max_spec_batch and batch_size > self.max_spec_batch:
            return 0
        depth = self._gate_depth(batch_size)
        if depth > 0:
            if self.plain_every:
                bucket = batch_bucket(batch_size)
                streak = self._spec_streak.get(bucket, 0) + 1
                self._spec_streak[bucket] = streak % self.plain_every
                if streak >= self.plain_every:
                    return 0               # a plain step now and then keeps rule 7's baseline measured
            self._step_depth = max(depth, self.min_draft_tokens)
            # side branches hold the less likely tokens: worth verifying only where a verified
            # token costs under a tenth of a decoded one (small batches); chains elsewhere
            return self.max_tree_paths if self._gain_threshold(batch_size) < 0.1 else 1
        if self.explore_every <= 0:
            return 0
        bucket = batch_bucket(batch_size)
        if bucket in self._error:          # an off bucket forgets its error slowly (no new evidence)
            self._error[bucket] = 0.99 * self._error[bucket] + 0.01
        streak = self._off_streak.get(bucket, 0) + 1
        self._off_streak[bucket] = streak % self.explore_every
        self._exploring = streak >= self.explore_every
        return self.max_tree_paths if self._exploring else 0

    def best_depth(self, batch_size: int, n: int, a: float, max_depth: int | None = None) -> int:
        """Seer's g* (at most ``max_depth``) for ``n`` drafting requests out of ``batch_size``
        at acceptance ``a``; a depth must beat plain decoding by ``min_gain`` (the models'
        error: measured at batch 64-256, predicted gains under ~10% turned into losses)."""
        B = batch_size
        plain_err = self._plain_error.get(batch_bucket(B), 1.0)
        best_g, best_t = 0, plain_err * self.cost.predict(B, B) / B * (1.0 - self.min_gain)
        err = self._error.get(batch_bucket(B), 1.0)
        depths = range(1, (max_depth or self.max_draft_tokens) + 1)
        for g, step in zip(depths, self.cost.predict_many(B, [B + g * n for g in depths])):
            tokens = (1 - a ** (g + 1)) / (1 - a)
            t = err * (self.draft_seconds * B + step) / (B - n + n * tokens)
            if t < best_t:
                best_g, best_t = g, t
        return best_g

    def _stats(self, req: Any, source: str) -> AcceptanceStats | None:
        """The request's own statistics once it has enough, else its draft source's."""
        st = self._by_request.get(req.request_id)
        if st is None or st.steps < self.min_request_steps:
            st = self.by_source.get(source)
        return st

    def _rate(self, req: Any, source: str) -> float:
        st = self._stats(req, source)
        return st.rate if st is not None else AcceptanceStats().rate

    def allocate(self, proposals: list[tuple[Any, Draft]], batch_size: int,
                 max_tokens: int | None = None) -> list[int]:
        """Draft nodes per proposal; ``max_tokens`` caps their sum (the step's token budget):
        depth, budget, prediction and clock check are all for the step that really runs."""
        exploring = self._exploring
        alloc = self._allocate(proposals, batch_size, max_tokens)
        nodes = sum(alloc)
        if nodes and not exploring:        # what this step should cost and yield, for the clock check
            B = batch_size
            self._pending = (batch_bucket(B), self.draft_seconds * B + self.cost.predict(B, B + nodes),
                             B + self._expected_gain)
        return alloc

    def _allocate(self, proposals: list[tuple[Any, Draft]], batch_size: int, max_tokens: int | None) -> list[int]:
        self._expected_gain = 0.0
        n = len(proposals)
        alloc = [0] * n
        self.last_depth = self.last_budget = 0
        if self._exploring:               # a probe: the best few drafts, min_draft_tokens each
            self._exploring = False
            probe = sorted(range(n), key=lambda i: -proposals[i][1].score)[:max(4, n // 8)]
            for i in probe:
                alloc[i] = min(self.min_draft_tokens, len(proposals[i][1]))
            return alloc
        if n == 0 or (self.max_spec_batch and batch_size > self.max_spec_batch) or not self._gate_depth(batch_size):
            return alloc
        a = sum(self._rate(req, d.source) for req, d in proposals) / n   # the drafts at hand
        cap = self.max_draft_tokens if max_tokens is None else max(min(max_tokens // n, self.max_draft_tokens), 1)
        g = self.best_depth(max(batch_size, n), n, a, cap)
        budget = g * n if max_tokens is None else min(g * n, max_tokens)
        self.last_depth, self.last_budget = g, budget
        if budget <= 0:
            return alloc
        threshold = self._gain_threshold(batch_size)
        ranks = sorted(range(n), key=lambda i: self.priority_fn(proposals[i][0]))
        weight = [0.0] * n
        for r, i in enumerate(ranks):
            weight[i] = 1.0 + self.priority_weight * (r / (n - 1) if n > 1 else 1.0)
        heap: list[tuple[float, float, int, int]] = []
        children: list[list[list[int]]] = []
        gains: list[list[float]] = []
        for i, (req, d) in enumerate(proposals):
            kids: list[list[int]] = [[] for _ in range(len(d) + 1)]      # slot len(d) = root
            for j, p in enumerate(d.parents):
                kids[p if p >= 0 else len(d)].append(j)
            children.append(kids)
            rate = self._rate(req, d.source)
            gains.append([min(1.0, p * rate ** k) for p, k in zip(d.path_probs, d.depths)])
            if min(self.window(req), len(d)) > 0:
                for j in kids[len(d)]:
                    self._push(heap, i, j, gains[i][j], d.path_probs[j], weight[i])
        done = [False] * n
        while heap and budget > 0:
            _, _, i, j = heapq.heappop(heap)
            req, d = proposals[i]
            if done[i]:
                continue
            gain = gains[i][j]
            if gain < threshold or alloc[i] >= min(self.window(req), len(d), 2 * g):
                done[i] = True            # its remaining nodes are worth no more than this one
                continue
            alloc[i] += 1
            budget -= 1
            self._expected_gain += gain
            for c in children[i][j]:
                self._push(heap, i, c, gains[i][c], d.path_probs[c], weight[i])
        return alloc

    @staticmethod
    def _push(heap: list, i: int, j: int, gain: float, path: float, weight: float) -> None:
        heapq.heappush(heap, (-gain * weight, -path, i, j))

    # ---- feedback ------------------------------------------------------------------
    def observe_draft(self, seconds: float, requests: int = 1) -> None:
        per_request = seconds / max(requests, 1)
        # the first measurement is taken whole: starting the average at 0 would call drafting
        # free for the first ten steps (a whole short rollout at batch 256)
        self.draft_seconds = per_request if self._draft_obs == 0 else 0.9 * self.draft_seconds + 0.1 * per_request
        self._draft_obs += 1

    def update(self, req: Any, draft_nodes: int, accepted: int, source: str, *,
               max_depth: int | None = None, score: float | None = None) -> None:
        if draft_nodes <= 0:
            return
        full = accepted >= (draft_nodes if max_depth is None else max_depth)
        rid = req.request_id
        w = self._windows.get(rid, self.initial_window)
        self._windows[rid] = min(2 * w, self.max_draft_tokens) if full else max(w // 2, self.min_draft_tokens)
        for st in (self.overall, self.by_source.setdefault(source, AcceptanceStats()),
                   self._by_request.setdefault(rid, AcceptanceStats())):
            st.add(draft_nodes, accepted, full)
        self._step_accepted += accepted

    def observe_step(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        """``seconds``: the whole step, drafting included. The speculator feeds the shared cost
        model; here a speculative step's real time is checked against its prediction, per
        batch bucket (rule 7)."""
        accepted, self._step_accepted = self._step_accepted, 0
        if self._pending is not None:
            bucket, predicted, expected = self._pending
            self._pending = None
            # real seconds per emitted token over predicted: cost and acceptance errors alike
            ratio = (seconds / (batch_size + accepted)) / (predicted / expected)
            self._error[bucket] = 0.8 * self._error.get(bucket, 1.0) + 0.2 * min(max(ratio, 0.25), 4.0)
        elif num_tokens == batch_size:     # a plain decode step: the baseline's own error
            bucket = batch_bucket(batch_size)
            ratio = seconds / self.cost.predict(batch_size, num_tokens)
            self._plain_error[bucket] = 0.8 * self._plain_error.get(bucket, 1.0) + 0.2 * min(max(ratio, 0.25), 4.0)


    def finish(self, req: Any) -> None:
        self._windows.pop(req.request_id, None)
        self._by_request.pop(req.request_id, None)
