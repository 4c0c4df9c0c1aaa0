"""The object the engine holds for speculative decoding: sources + policy + metrics.

Per engine step:

1. ``propose(requests, batch_size)`` -> ``{request_id: Draft}``: asks the policy whether to
   speculate at this batch size (``max_paths == 0`` skips drafting entirely), asks every
   source for every request (trees: at most ``policy.draft_limit(req)`` nodes; chains: up to
   ``max_draft_tokens``, cheap to draft), keeps the draft with the best ``score`` (expected
   accepted length; ties go to the earlier source in the list, and a draft scoring the
   policy's full limit stops the search), lets the policy allocate node counts, truncates
   (``Draft.truncate``) and drops empty drafts. ``max_total_tokens`` optionally caps the
   step's total draft nodes (the engine's token budget). Sources with a ``prepare(requests,
   max_tokens, max_paths)`` method (the learned drafter) draft in one batched call for the
   requests that ``SourceChoice`` (source_choice.py) finds worth it, from measured acceptance
   and the measured price of the drafter's forward; it also picks per request the suffix
   draft, the drafter's or none. Without suffix sources (``method="drafter"``) the drafter
   drafts for every request. To keep the drafter measured, some steps' calls draft *shadow*
   drafts for a few requests: never verified, each is scored (``record(..., verified=False)``)
   by ``observe`` once the request has emitted the tokens at the draft's positions, with
   ``Draft.accepted_by``: the count verification would have given, since a request's tokens
   do not depend on its drafts. *Carry*: when a chain was accepted in full, its unverified
   rest is the request's next draft if the bonus token sampled after it equals the rest's
   first token; the sources are not asked (measured: drafting was ~15% of a speculative
   rollout's time).
2. the engine verifies, then calls ``record_verification(req, draft, accepted)`` for each
   verified draft (``accepted`` excludes the bonus token) and ``observe(req, new_tokens)``
   for every request that gained tokens (drafted or not: the group and self indexes need
   all tokens). When ``needs_hidden``, ``observe_hidden(hidden, spans)`` hands the target's
   normed hidden states of the step's committed positions (prompt positions from the
   prefill, and those that sampled the new tokens), one tensor with one span per request,
   to the sources that read them (the drafter's past) and to the ``collector`` (the spot
   trainer's buffer);
3. ``observe_step(batch_size, num_tokens, seconds, attention, reads=...)`` after every step
   (``seconds``: the whole step, drafting included; ``attention``: the step's (query slot,
   key position) pairs; ``reads``: its (row, key position) pairs; see ``CostModel``).

``calibrate(forward_fn)`` (optional, once at start-up) times synthetic forwards so the cost
model is measured before the first step. ``start(req)`` / ``finish(req)`` bracket a request's
stay in the engine; ``export_state(req)`` before ``finish`` packs what its drafts depend on for
another instance's ``start``. ``metrics()``: ``SpecCounters``'s keys (metrics.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from tailrl.config import SpeculativeConfig
from tailrl.speculative.critical import critical_requests, probe_requests
from tailrl.speculative.draft import Draft
from tailrl.speculative.factory import make_sources, make_spec_policy
from tailrl.speculative.history import HistoryStore
from tailrl.speculative.metrics import SpecCounters
from tailrl.speculative.policies.base import SpecPolicy
from tailrl.speculative.policies.cost_model import CostModel
from tailrl.speculative.source_choice import SourceChoice
from tailrl.speculative.sources.base import DraftSource, context_tail

log = logging.getLogger(__name__)


class Speculator:
    """``Speculator(config, history_store)`` builds sources and policy from the config;
    ``sources=`` / ``policy=`` override them (tests, ablations, a learned-drafter source)."""

    def __init__(self, config: SpeculativeConfig | None = None, history_store: HistoryStore | None = None, *,
                 sources: list[DraftSource] | None = None, policy: SpecPolicy | None = None,
                 cost_model: CostModel | None = None, seed: int = 0, target: Any = None) -> None:
        self.config = config if config is not None else SpeculativeConfig()
        if cost_model is None:                 # a given policy's own cost model is the one to feed
            own = getattr(policy, "cost", None)
            cost_model = own if isinstance(own, CostModel) else CostModel()
        self.cost_model = cost_model
        self.sources = list(sources) if sources is not None else make_sources(self.config, history_store, target=target)
        self.policy = policy if policy is not None else make_spec_policy(self.config, self.cost_model,
                                                                    history_store, seed)
        self.max_draft_tokens = self.config.max_draft_tokens
        # sources whose observe does something (the others index lazily, or need nothing)
        self._observers = [s for s in self.sources if getattr(s, "observes", True)]
        self._step_observers = [s for s in self.sources if hasattr(s, "observe_step")]
        # the context a source's ``propose_many`` reads (``_ask``): its longest match
        self._context_len = max((s.params.max_match_len for s in self.sources if hasattr(s, "params")), default=0)
        # sources that read the target's hidden states (the drafter's past); called every step
        self._hidden_takers = [s.observe_hidden for s in self.sources if hasattr(s, "observe_hidden")]
        # a source drafts from hidden states (the drafter): read once, not per engine step
        self._drafts_from_hidden = any(getattr(s, "needs_hidden", False) for s in self.sources)
        # per request: suffix draft, drafter draft or none (only with a batched source: the drafter)
        batched = [s for s in self.sources if hasattr(s, "prepare")]
        # the drafter alone (no suffix source) drafts for every request, verified
        always = len(batched) == len(self.sources)
        self.choice = SourceChoice(self.cost_model, batched[0].name, always=always,
                                   track=self.config.drafter_tracking, seed=seed) if batched else None
        if batched and hasattr(batched[0], "pending"):
            self.choice.pending = batched[0].pending        # positions a call must catch up on
        # the cost model is fed only where it is read: the source choice (a drafter) and the
        # adaptive policy (the default priced policy has its own curve; a fit per step is ~20 us)
        self._cost_read = self.choice is not None or getattr(self.policy, "cost", None) is self.cost_model
        self.max_tree_paths = self.config.max_tree_paths
        self._step_draft_s = 0.0
        self._full: dict[str, Draft] = {}      # this step's untruncated chains, by request
        self._carry: dict[str, Draft] = {}     # unverified rests of fully accepted chains
        self._shadow: dict[str, tuple[Draft, int, int]] = {}   # id -> (shadow draft, first, end position)
        self._probed = 0                       # requests rate probes drafted for (where the next starts)
        # where the rollout's (hidden state, token) pairs go (the spot trainer's DrafterBuffer)
        self.collector: Any = None
        self._drafter_warm = False             # a batched drafter call was made (and timed) before
        self._atypical_s = 0.0                 # this step's drafter calls that priced nothing (seconds)
        self._step_typical = True              # this step made no such call
        # graph captures so far (the engine sets its pools' count): a call that captured is not timed
        self.captures: Callable[[], int] = lambda: 0
        self.reset_metrics()

    @property
    def needs_hidden(self) -> bool:
        """Whether the engine must hand out hidden states (a source drafts from them, or a
        collector keeps them)."""
        return self.collector is not None or self._drafts_from_hidden

    @property
    def reads_hidden(self) -> bool:
        """Whether any step may hand it hidden states (a learned drafter's source or collector)."""
        return self._drafts_from_hidden or self.collector is not None

    def wants_hidden(self, batch_size: int) -> bool:
        """Whether a step of ``batch_size`` rows hands out its hidden states: always for a
        collector (the spot trainer learns from every position); for a drafter up to twice
        ``max_spec_batch`` rows, and where its calls can pay (``SourceChoice.ready``).
        Drafting happens below half the bound; the steps between fill the requests' pasts
        before it starts (the drafter needs its recent positions: see drafter_past.MAX_WAIT).
        The choice learns whether the next step's requests have draft roots."""
        bound = 2 * self.config.max_spec_batch
        drafting = self._drafts_from_hidden and (bound <= 0 or batch_size <= bound)
        out = self.collector is not None or (drafting and (self.choice is None or self.choice.ready(batch_size)))
        if self.choice is not None:
            self.choice.handed = out
        return out

    def calibrate(self, forward_fn: Callable[[int, int], object], **kw) -> None:
        """Time synthetic forwards up front (see ``CostModel.calibrate``)."""
        self.cost_model.calibrate(forward_fn, **kw)

    # ---- request lifecycle ------------------------------------------------------------
    def start(self, req: Any) -> None:
        """``req`` entered the engine; one imported from another instance brings what its
        drafts there depended on (``req.pending_spec``: ``export_state`` of that instance)."""
        t0 = time.perf_counter()
        for s in self.sources:
            s.start(req)
        imported = getattr(req, "pending_spec", None)
        if imported is not None:
            req.pending_spec = None
            self._adopt(req, imported)
        self.counts.index_s += time.perf_counter() - t0

    def export_state(self, req: Any) -> dict[str, Any] | None:
        """What ``req``'s next drafts depend on here beyond its tokens, to travel with it to
        another instance (``RequestState.speculation``; call before ``finish``): per source
        its own state (``export``: the drafter's past), and the unverified rest of a fully
        accepted chain (the carry). None when there is none. Shadow drafts (measurement only)
        and the policy's per-request statistics stay here."""
        own = {}
        for s in self.sources:
            state = s.export(req) if hasattr(s, "export") else None
            if state is not None:
                own[s.name] = state
        carry = self._carry.get(req.request_id)
        return {"sources": own, "carry": carry} if own or carry is not None else None

    def _adopt(self, req: Any, state: dict[str, Any]) -> None:
        """Continue ``export_state``'s state on this instance. A source's state that does not
        fit here (another drafter's shapes) is dropped with a warning: the request then
        drafts from what this instance computes, and drafts never change outputs."""
        for s in self.sources:
            own = state["sources"].get(s.name)
            if own is not None and hasattr(s, "adopt"):
                try:
                    s.adopt(req, own)
                except ValueError as e:
                    log.warning("imported request %r: its %s state is dropped (%s)", req.request_id, s.name, e)
        if state["carry"] is not None:
            self._carry[req.request_id] = state["carry"]

    def observe(self, req: Any, new_tokens: list[int]) -> None:
        self.observe_many([(req, new_tokens)])

    @property
    def tokens_wanted(self) -> bool:
        """Whether ``observe_many`` reads a step's (request, new tokens): some source observes
        rows, or a shadow draft waits for its tokens. Where not, the engine passes none."""
        return bool(self._observers or self._shadow)

    def observe_many(self, items: list[tuple[Any, list[int]]]) -> None:
        """A step's tokens are settled: ``observe_step`` for each source that has it, then
        ``observe`` for each (request, its new tokens), in one pass: each source whose
        ``observe`` does something (not marked ``observes = False``) sees every item in order
        (a step launched ahead settles hundreds of rows, each with one token). ``items`` may be
        empty where ``tokens_wanted`` is false."""
        t0 = time.perf_counter()
        for s in self._step_observers:
            s.observe_step()
        for s in self._observers:
            for req, new_tokens in items:
                s.observe(req, new_tokens)
        if self._shadow:
            for req, _ in items:
                if req.request_id in self._shadow:
                    self._score_shadow(req)
        self.counts.index_s += time.perf_counter() - t0

    def _score_shadow(self, req: Any) -> None:
        """Score the request's shadow draft once its tokens at the draft's positions are known:
        the nodes verification would have accepted (``Draft.accepted_by``)."""
        draft, first, end = self._shadow[req.request_id]
        if req.num_tokens < end:
            return
        del self._shadow[req.request_id]
        accepted = draft.accepted_by(req.tokens(first, end))
        self.choice.record(draft.source, draft.score, accepted, verified=False, nodes=len(draft))
        self.counts.shadow_n += 1
        self.counts.shadow_accepted += accepted

    def observe_hidden(self, hidden: Any, spans: list[tuple[Any, int, int, int]]) -> None:
        """One step's hand-out: ``hidden`` [P, H] in the target's dtype (fresh, never modified
        after); span (req, start, row, n): rows row .. row + n - 1 are the target's states at
        the committed positions start .. start + n - 1 of ``req`` (each one's next token is held)."""
        t0 = time.perf_counter()
        for take in self._hidden_takers:
            take(hidden, spans)
        if self.collector is not None:
            self.collector.add_spans(hidden, spans)
        self.counts.index_s += time.perf_counter() - t0

    def target_updated(self, model: Any) -> None:
        """The target's weights changed (``LLM.load_weights``): sources that share them refresh."""
        for s in self.sources:
            refresh = getattr(s, "target_updated", None)
            if refresh is not None:
                refresh(model)

    def finish(self, req: Any) -> None:
        self._carry.pop(req.request_id, None)
        self._shadow.pop(req.request_id, None)           # ended before its shadow draft's positions
        if self.collector is not None:
            self.collector.finish(req)
        for s in self.sources:
            s.finish(req)
        self.policy.finish(req)

    # ---- per step ---------------------------------------------------------------------
    def best_draft(self, req: Any, max_paths: int, sources: list[DraftSource] | None = None,
                   limit: int | None = None) -> Draft | None:
        """The draft the policy sees for ``req``: at most its ``draft_limit`` nodes, or ``limit``
        (a longer chain's untruncated form is kept in ``_full`` for the carry). ``sources``
        (default: all) are asked unless the carry applies. ``_best_drafts`` for one request,
        asking each source directly (``chain_from`` drafts row by row inside steps launched
        ahead: the lists of the many-request form cost it ~1 us a row)."""
        limit = min(self.max_draft_tokens, self.policy.draft_limit(req) if limit is None else limit)
        if limit <= 0:
            return None
        carry = self._carry.pop(req.request_id, None)
        if self._carry_applies(req, carry, max_paths):
            return self._kept(req, carry.rest(1), limit)
        ask = self.max_draft_tokens if max_paths == 1 else limit   # a chain's rest is cheap and may be carried
        best: Draft | None = None
        for s in self.sources if sources is None else sources:
            if _certain(best, limit):
                break
            best = _better(best, s.propose(req, ask, max_paths))
        if best is not None:
            self._full.pop(req.request_id, None)
        return self._kept(req, best, limit)

    def chain_from(self, req: Any, skip: int, room: int) -> tuple[Draft | None, float]:
        """A chain continuing ``req``'s context (its tokens as they are now) with its first
        ``skip`` nodes dropped (they guess tokens the caller does not know yet: if a guess is
        wrong, the rest is rejected as any wrong draft is), at most ``room`` nodes; and the
        expected accepted nodes of what is left (their path probabilities, the dropped nodes'
        included). (None, 0) where no source has one that long. Counted as drafting; no carry
        is kept for it (``record_verification`` finds no untruncated chain). Up to
        ``max_draft_tokens`` deep whatever the policy's ``draft_limit``: that prices the
        speculator's own steps (a priced policy cuts drafts to ``CRITICAL_DEPTH`` where its
        last step drafted nothing), not the caller's."""
        t0 = time.perf_counter()
        d = self.best_draft(req, 1, limit=self.max_draft_tokens)
        self._full.pop(req.request_id, None)
        self.counts.asked += 1
        out, expected = None, 0.0
        if d is not None and d.is_chain and len(d) > skip and room > 0:
            k = min(len(d) - skip, room)
            out = d.rest(skip).truncate(k) if skip else d.truncate(k)
            expected = float(sum(d.path_probs[skip:skip + k]))
            self.counts.found += 1
        self.counts.draft_s += time.perf_counter() - t0
        return out, expected

    @staticmethod
    def _carry_applies(req: Any, carry: Draft | None, max_paths: int) -> bool:
        out = req.output_token_ids
        return carry is not None and max_paths == 1 and bool(out) and out[-1] == carry.tokens[0]

    def propose(self, requests: list[Any], batch_size: int, max_total_tokens: int | None = None,
                eligible: Callable[[Any], bool] | None = None) -> dict[str, Draft]:
        """This step's drafts for ``requests`` (those ``eligible`` says may take one, asked only
        of the requests the step would draft for: where the policy drafts nothing, of the
        critical rows' candidates alone)."""
        if not requests or not self.sources:
            return {}
        t0 = time.perf_counter()
        paths = min(self.policy.max_paths(batch_size), self.max_tree_paths)
        critical, everyone = paths <= 0, requests
        if critical:                     # drafting is off at this batch size: the critical path only
            # (the critical_rows requests with the most expected tokens still to generate)
            requests, paths = critical_requests(requests, self.config.critical_rows, eligible), 1
            if not requests:             # else a rate probe's few (policies/priced.py, rule 5)
                requests = probe_requests(everyone, getattr(self.policy, "probe_rows", lambda: 0)(),
                                          self._probed, eligible)
                self._probed += len(requests)
                self.counts.probe_steps += bool(requests)
            if not requests:
                self.counts.off_steps += 1
                return {}
        elif eligible is not None:
            requests = everyone = [r for r in requests if eligible(r)]
            if not requests:
                return {}
        # the step's key positions: its longest context (what the cost model prices; only where it drafts)
        self.cost_model.context = max(len(r.prompt_token_ids) + len(r.output_token_ids) for r in everyone)
        self._full = {}
        found = self._search(requests, paths, batch_size)
        proposals = [(req, found[req.request_id]) for req in requests if found[req.request_id] is not None]
        self.counts.asked += len(requests)
        self.counts.found += len(proposals)
        if critical:
            alloc = [min(self.max_draft_tokens, self.policy.draft_limit(req), len(d)) for req, d in proposals]
        else:
            alloc = self.policy.allocate(proposals, batch_size, max_total_tokens)
        left = max_total_tokens if max_total_tokens is not None else float("inf")
        out: dict[str, Draft] = {}
        for (req, d), k in zip(proposals, alloc):
            k = int(min(k, left))
            if k > 0:
                out[req.request_id] = d.truncate(k)
                left -= k
                if d.is_chain and len(d) > k + 1:
                    self._full.setdefault(req.request_id, d)
        dt = time.perf_counter() - t0
        self.counts.draft_s += dt
        self._step_draft_s = dt
        # a drafter call that built kernels or captured a graph prices neither drafting nor the step
        atypical, self._atypical_s = self._atypical_s, 0.0
        self._step_typical = atypical == 0.0
        self.policy.observe_draft(dt - atypical, len(requests))
        return out

    def _search(self, requests: list[Any], paths: int, batch_size: int) -> dict[str, Draft | None]:
        """Every request's draft for this step. Per-request sources first (the best score
        wins); with a batched source (the drafter, ``prepare``), ``choice`` then decides which
        requests it drafts for, in one batched call, and whether each request verifies its
        suffix draft, the drafter's or none. A request served from the carry asks no source."""
        single = [s for s in self.sources if not hasattr(s, "prepare")]
        batched = [s for s in self.sources if hasattr(s, "prepare")]
        carried = {r.request_id for r in requests if self._carry_applies(r, self._carry.get(r.request_id), paths)}
        found = self._best_drafts(requests, paths, single)
        if not batched:
            return found
        rest = [r for r in requests if r.request_id not in carried]
        plan = self.choice.plan(batch_size, len(rest))
        if plan is None:                               # most steps: no call could pay, none is due
            return found
        limits = {r.request_id: min(self.max_draft_tokens, self.policy.draft_limit(r)) for r in rest}
        asked = self.choice.ask(rest, found, limits, batch_size, plan)
        drafted = self._draft_batched(asked, paths, batched, batch_size)
        if self.choice.exploring:                      # shadow drafts, scored as the tokens come
            for req in asked:
                if req.request_id in drafted:
                    d = drafted[req.request_id][0]
                    self._shadow[req.request_id] = (d, req.num_tokens, req.num_tokens + d.max_depth)
            return found
        if not drafted:                                # every request keeps its suffix draft (``pick``)
            return found
        for req in rest:
            rid = req.request_id
            own, full = drafted.get(rid, (None, None))
            pick = self.choice.pick(found[rid], own, limits[rid], batch_size)
            if pick is not found[rid]:                 # the carry follows the verified chain
                self._full.pop(rid, None)
                if pick is not None and full is not None:
                    self._full[rid] = full
            found[rid] = pick
        return found

    def _best_drafts(self, requests: list[Any], paths: int, sources: list[DraftSource],
                     limit: int | None = None) -> dict[str, Draft | None]:
        """``best_draft`` of each of ``requests``: at most its ``draft_limit`` nodes (or ``limit``);
        a request whose carry applies takes it and asks no source; for the others each source is
        asked once, for those still without a draft certain to be accepted in full, in the
        sources' order (``_ask``); the best score wins, ties to the earlier source. A longer
        chain's untruncated form is kept in ``_full`` for the carry."""
        maxd = self.max_draft_tokens
        out: dict[str, Draft | None] = {}
        asked, limits = [], []
        for req in requests:
            lim = min(maxd, self.policy.draft_limit(req) if limit is None else limit)
            if lim <= 0:
                out[req.request_id] = None
                continue
            carry = self._carry.pop(req.request_id, None)
            if self._carry_applies(req, carry, paths):
                out[req.request_id] = self._kept(req, carry.rest(1), lim)
            else:
                asked.append(req)
                limits.append(lim)
        if asked:
            for req, d, lim in zip(asked, self._ask(asked, limits, paths, sources), limits):
                if d is not None:
                    self._full.pop(req.request_id, None)
                out[req.request_id] = self._kept(req, d, lim)
        return out

    def _ask(self, requests: list[Any], limits: list[int], paths: int,
             sources: list[DraftSource]) -> list[Draft | None]:
        """Each request's best draft from ``sources``, each source asked once for the requests
        still without one scoring their full ``limits``: in one call where it has
        ``propose_many`` (the suffix sources: one native call for a step's rows; the draft
        stage of `small`'s rollout 0.81x, docs/speculation.md) and more than one request is
        asked, else request by request (a lone request's ``propose`` costs less)."""
        asks = [self.max_draft_tokens] * len(requests) if paths == 1 else limits   # a chain's rest may be carried
        contexts = None
        best: list[Draft | None] = [None] * len(requests)
        todo = range(len(requests))
        for s in sources:
            todo = [i for i in todo if not _certain(best[i], limits[i])]
            if not todo:                                             # every one certain: unbeatable
                break
            many = getattr(s, "propose_many", None) if len(todo) > 1 else None   # one request: its own call
            if many is None:
                drafts = [s.propose(requests[i], asks[i], paths) for i in todo]
            else:
                if contexts is None:
                    contexts = [context_tail(r, self._context_len) for r in requests]
                drafts = many([requests[i] for i in todo], [asks[i] for i in todo], paths, [contexts[i] for i in todo])
            for i, d in zip(todo, drafts):
                best[i] = _better(best[i], d)
        return best

    def _kept(self, req: Any, d: Draft | None, limit: int) -> Draft | None:
        """``d`` cut to ``limit`` nodes; a longer chain's whole form kept in ``_full``."""
        if d is not None and len(d) > limit and d.is_chain:
            self._full[req.request_id] = d
            return d.truncate(limit)
        return d

    def _draft_batched(self, requests: list[Any], paths: int, sources: list[DraftSource],
                       batch_size: int) -> dict[str, tuple[Draft, Draft | None]]:
        """The batched sources' drafts for ``requests``: {id: (draft, its untruncated chain)};
        the call's time teaches ``choice`` the drafter's cost. Under the priced policy each
        source is told what an expected accepted token is worth and what a verified node costs
        at this batch size (``pricing``), so it drafts only as deep as pays."""
        if not requests:
            return {}
        queued = sum(map(self.choice.pending, requests)) if self.choice.pending is not None else 0
        t0, captures = time.perf_counter(), self.captures()
        if self.config.policy == "priced":          # the other policies set depths themselves
            tau, c = self.choice.prices(batch_size)
            for s in sources:
                s.pricing = (tau * self.choice.calibration(s.name), c)
        self._prepare(requests, paths, sources)
        out = {}
        for req in requests:
            kept = self._full.pop(req.request_id, None)
            d = self.best_draft(req, paths, sources)
            full = self._full.pop(req.request_id, None)
            if kept is not None:
                self._full[req.request_id] = kept
            if d is not None:
                out[req.request_id] = (d, full)
        dt = time.perf_counter() - t0
        # an engine's first call (copies, tables, kernels built) and a call that captured a graph
        # teach no prices
        if self._drafter_warm and self.captures() == captures:
            self.choice.observe_call(dt, len(requests), queued)
        else:
            self._atypical_s += dt
        self._drafter_warm = True
        self.counts.calls += 1
        self.counts.explore_calls += self.choice.exploring
        self.counts.call_s += dt
        return out

    def _prepare(self, requests: list[Any], paths: int, sources: list[DraftSource]) -> None:
        """Let batched ``sources`` (the drafter) draft for all ``requests`` at once, asked for
        what ``best_draft`` asks each request."""
        ask = self.max_draft_tokens if paths == 1 else max(
            min(self.max_draft_tokens, self.policy.draft_limit(r)) for r in requests)
        for s in sources:
            s.prepare(requests, ask, paths)

    def record_verification(self, req: Any, draft: Draft, accepted: int) -> None:
        n = len(draft)
        if not 0 <= accepted <= draft.max_depth:
            raise ValueError(f"accepted={accepted} outside [0, {draft.max_depth}] for a draft of depth "
                             f"{draft.max_depth}")
        self.counts.drafted[draft.source] += n
        self.counts.accepted[draft.source] += accepted
        self.counts.steps[draft.source] += 1
        full = self._full.pop(req.request_id, None)
        if full is not None and accepted == n and draft.is_chain and len(full) > n + 1:
            # all verified: the chain's unverified rest is next step's draft if the bonus token
            # the engine samples now equals its first token (checked in ``best_draft``)
            self._carry[req.request_id] = full.rest(n)
        if self.choice is not None:
            self.choice.record(draft.source, draft.score, accepted, nodes=n)
        self.policy.update(req, n, accepted, draft.source, max_depth=draft.max_depth, score=draft.score)

    def observe_step(self, batch_size: int, num_tokens: int, seconds: float, attention: float = 0.0,
                     prefill: bool = False, reads: float = 0.0) -> None:
        """``seconds``: the whole step; this step's drafting time is taken out (the policy
        prices drafting per request asked, separately). Steps with prefill chunks do not
        teach the cost model, which prices decode and verify steps."""
        draft_s, self._step_draft_s = self._step_draft_s, 0.0
        prefill, self._step_typical = prefill or not self._step_typical, True
        if self.choice is not None:
            self.choice.observe_step(seconds, batch_size, prefill)
        if not prefill:
            if self._cost_read:
                self.cost_model.observe(batch_size, num_tokens, seconds - draft_s, attention, reads)
            self.policy.observe_step(batch_size, num_tokens, seconds)

    # ---- metrics ------------------------------------------------------------------------
    def reset_metrics(self) -> None:
        choice = getattr(self, "choice", None)
        self.counts = SpecCounters(choice.gate.skipped if choice is not None else 0)

    def metrics(self) -> dict[str, float]:
        return self.counts.metrics([s.name for s in self.sources], self.choice)


def _certain(best: Draft | None, limit: int) -> bool:
    """A draft scoring its full ``limit``: no other source's can beat it."""
    return best is not None and best.score >= limit - 1e-9


def _better(best: Draft | None, d: Draft | None) -> Draft | None:
    """The draft of the higher score, ``best`` on a tie (the earlier source's)."""
    return d if d is not None and len(d) > 0 and (best is None or d.score > best.score) else best
