"""One engine instance: requests in, tokens out, one step at a time.

    step = schedule -> propose drafts -> one batched forward -> sample -> verify/commit
           -> the speculator observes -> finish

each stage timed (``EngineMetrics.STAGES``). On a GPU, steps without prefill replay CUDA
graphs (graphs.py).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping

import torch

from tailrl.config import AHEAD_ABOVE, EngineConfig, SpeculativeConfig, device_scope, require_device
from tailrl.engine import top_logprobs
from tailrl.engine.ahead import HandOut, Launched, feed, placeholders, settle
from tailrl.engine.ahead_drafts import AheadDrafts
from tailrl.engine.batch import Batch, ModelRunner
from tailrl.engine.graph_pool import captures_made
from tailrl.engine.graphs import StepGraphs, engine_graphs, warm_up
from tailrl.engine.hand_out import hand_out_states, prefill_spans
from tailrl.engine.inputs import load_tokenizer
from tailrl.engine.metrics import EngineMetrics
from tailrl.engine.request import Request, RequestStatus
from tailrl.engine.scheduler import Scheduler, SchedulerOutput
from tailrl.engine.stop_strings import StopStrings
from tailrl.engine.tail_choice import DRAFTER_METHODS, TailChoice
from tailrl.engine.tensor_parallel import ParallelModel
from tailrl.engine.transfer import RequestState
from tailrl.engine.verify import commit
from tailrl.engine.weights import load
from tailrl.model.loader import DTYPES
from tailrl.speculative.history import HistoryStore
from tailrl.threads import use_threads

log = logging.getLogger(__name__)


class LLMEngine:
    """``speculative`` turns speculative decoding on (``history``: the store history drafts
    read); ``speculator`` injects a ready-made one instead (tests, ablations)."""

    def __init__(self, config: EngineConfig, speculative: SpeculativeConfig | None = None,
                 history: HistoryStore | None = None, *, speculator=None):
        self.config = config
        require_device(config.device)
        # a fixed thread count, or threads sized to the cores other processes leave free
        self.threads = use_threads(config.num_threads, config.dtype)
        dtype = DTYPES[config.dtype]
        self.model, self.kv, self.max_model_len = load(config, speculative)
        self.args = self.model.args
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        drafts = speculative is not None or speculator is not None
        graphs = engine_graphs(self.model, self.kv, config, dtype, grouped=drafts)
        self.runner = ModelRunner(self.model, self.kv, graphs)
        if graphs is not None and config.cuda_graph_warmup:
            warm_up(graphs, config, drafts)
        if speculator is None and speculative is not None:
            from tailrl.speculative.speculator import Speculator
            # its cost model learns from real steps; the drafter (if any) shares our embedding and head
            speculator = Speculator(speculative, history, target=self.model)
        self.speculator = speculator
        if speculator is not None and speculator.reads_hidden:
            self.kv.prefix = None               # a learned drafter's past needs every position's hidden state
        # plain decoding steps launched before the previous step's tokens are back (ahead.py)
        ahead = config.async_scheduling if config.async_scheduling is not None else graphs is not None
        self.ahead = ahead and speculator is None
        # a speculative engine's plain steps launched ahead while more than this many requests
        # run or wait (SpeculativeConfig.ahead_above; 0: every step one at a time; None: see _above)
        self.ahead_above = speculator.config.ahead_above if ahead and speculator is not None else 0
        self._measured_ways(speculator, ahead, history)
        self._launched: Launched | None = None
        self._settled_at = 0.0
        if speculator is not None and hasattr(speculator, "captures"):
            speculator.captures = captures_made
        if graphs is not None and speculator is not None:     # the drafter's chain steps too, in the same pool
            for source in getattr(speculator, "sources", ()):
                if hasattr(source, "use_graphs"):
                    source.use_graphs(graphs.pool)
        # run between steps with the step's batch size (the spot trainer: at most one unit of work)
        self.idle_work = None
        self.requests: dict[str, Request] = {}
        self.metrics = EngineMetrics()
        self._rollout_allocations = self.kv.allocations
        self._rollout_prefix = (0, 0)
        # set to a list to record every step as {"batch", "new_tokens", "kv_tokens", "seconds"}
        # (the simulator's calibration format: `tailrl simulate --step-times`, benchmarks/pool.py)
        self.step_log: list[dict] | None = None
        self._stops: StopStrings | None = None      # requests' stop strings (loaded on first use)
        self._processing: set[str] = set()          # requests whose logits are processed (logits_process.py)
        self._alternatives: set[str] = set()        # requests that ask for top logprobs (top_logprobs.py)
        self._rollout_start = self.metrics.snapshot()
        self._graphs_start = self._graph_stats()

    def _measured_ways(self, speculator, ahead: bool, history: HistoryStore | None) -> None:
        """In the tail, plain steps launched ahead wherever they measure faster (``tail``,
        tail_choice.py); where no step is launched ahead, each step speculating or plain, the
        way measured faster (``choice``: one_at_a_time); the rows expected to run longest
        drafting inside steps launched ahead (``ahead_drafts``, ahead_drafts.py). The last two
        not with a learned drafter (``DRAFTER_METHODS``); the tail's choice with any method, since
        plain steps launched ahead hand out their hidden states (``HandOut``) as other steps do."""
        cfg = getattr(speculator, "config", None)
        suffix = cfg is not None and getattr(cfg, "method", None) not in DRAFTER_METHODS
        self.tail = TailChoice() if ahead and getattr(cfg, "tail", None) == "measured" else None
        one = getattr(cfg, "one_at_a_time", None) == "measured"
        self.choice = TailChoice("steps") if not ahead and suffix and one else None
        rows = getattr(cfg, "ahead_drafts", 0)
        gate = getattr(cfg, "ahead_drafts_gate", "") == "measured"
        self.ahead_drafts = AheadDrafts(speculator, rows, history, gate) if ahead and rows > 0 and suffix else None

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in the engine")
        req.max_model_len = self.max_model_len
        if req.params.stop:
            req.stop_check = self._stop_strings()
        if req.params.processes:
            self._processing.add(req.request_id)
        if top_logprobs.wants(req.params):
            self._alternatives.add(req.request_id)
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        if self.speculator is not None:
            self.speculator.start(req)

    def _stop_strings(self) -> StopStrings:
        """The checker of requests' stop strings, over the model's tokenizer (loaded when the
        first such request comes; a model without one refuses it)."""
        if self._stops is None:
            tok = load_tokenizer(self.config.model)
            if tok is None:
                raise ValueError("stop: stop strings need the model's tokenizer files; pass stop_token_ids")
            self._stops = StopStrings(tok)
        return self._stops

    def abort(self, request_id: str) -> Request | None:
        self.drain()
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            return req
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def release(self, request_id: str) -> Request | None:
        """Forget a request (aborting it first if it is unfinished); returns it."""
        req = self.abort(request_id)
        self.requests.pop(request_id, None)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def free_cache(self) -> None:
        """Give back the memory of the K/V pool between rollouts (nothing queued, running or
        unreleased); it is allocated again at the next step."""
        self.drain()
        if self.has_unfinished() or any(r.row >= 0 for r in self.requests.values()):
            raise RuntimeError("free_cache: requests still hold the KV cache")
        self.kv.free_memory()

    # ---- metrics of one rollout (a generate call) --------------------------------------------
    def begin_rollout(self) -> None:
        """Start counting a rollout: ``rollout_counters`` and ``spec_metrics`` cover what follows."""
        self.drain()
        self.metrics.trace.clear()
        self._rollout_start = self.metrics.snapshot()
        self._rollout_allocations = self.kv.allocations
        self._rollout_prefix = self._prefix_counts()
        self.kv.reset_peaks()
        if self.speculator is not None:
            self.speculator.reset_metrics()
        for choice in (self.tail, self.choice):
            if choice is not None:
                choice.new_rollout()
        if self.ahead_drafts is not None:
            self.ahead_drafts.new_rollout()
        self._graphs_start = self._graph_stats()

    def rollout_counters(self) -> EngineMetrics:
        out = self.metrics.since(self._rollout_start)
        kv = self.kv
        out.kv_blocks, out.kv_blocks_peak, out.kv_shared_peak = kv.num_blocks, kv.peak_used, kv.peak_shared
        out.kv_allocations = kv.allocations - self._rollout_allocations
        out.prefix_query_tokens, out.prefix_hit_tokens = (a - b for a, b in zip(self._prefix_counts(),
                                                                                  self._rollout_prefix))
        return out

    def _prefix_counts(self) -> tuple[int, int]:
        p = self.kv.prefix
        return (p.query_tokens, p.hit_tokens) if p is not None else (0, 0)

    def spec_metrics(self) -> dict[str, float]:
        if self.speculator is None:
            return {}
        return {**self.speculator.metrics(), **(self.tail.metrics() if self._tail() else {}),
                **(self.choice.metrics() if self.choice is not None else {}),
                **(self.ahead_drafts.metrics() if self.ahead_drafts is not None else {})}

    def _graph_stats(self) -> dict[str, float]:
        if self.runner.graphs is None:
            return {}
        out = self.runner.graphs.stats()
        drafting = [s.graphs for s in getattr(self.speculator, "sources", ()) if getattr(s, "graphs", None)]
        if drafting:
            out["graphs/drafter_replayed_depths"] = sum(g.replays for g in drafting)
            out["graphs/drafter_eager_depths"] = sum(g.eager for g in drafting)
            out["graphs/drafter_whole_chains"] = sum(g.chains for g in drafting)
        return out

    def graph_metrics(self) -> dict[str, float]:
        """The CUDA graphs over this rollout (``graphs/...``: counts since ``begin_rollout``, the
        pool's bytes now); empty without graphs."""
        now, start = self._graph_stats(), self._graphs_start
        return {k: v if k in StepGraphs.LEVELS else v - start.get(k, 0) for k, v in now.items()}

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One step for every scheduled request. Returns the requests that finished."""
        with device_scope(self.config.device):
            return self._step()

    def _step(self) -> list[Request]:
        if self.threads is not None:
            self.threads.tick()
        # processed logits with rows drafting ahead, or top logprobs (read from a step's logits
        # after its commit): one step at a time
        if (self._processing and self.ahead_drafts is not None) or self._alternatives:
            if self._launched is not None:
                step, self._launched = self._launched, None
                return self._settle(step)
            return self._step_one()
        if self.ahead or self._bulk():
            return self._step_ahead()
        if self._tail() and self.tail.plain():
            return self._step_ahead(tail=True)
        if self._launched is not None:            # a speculative engine's tail: the bulk's last step settles first
            step, self._launched = self._launched, None
            return self._settle(step)
        return self._step_one()

    def _nothing_scheduled(self) -> list[Request]:
        """A step that scheduled nothing: done, or stuck (an error naming the knobs)."""
        if self.scheduler.has_work():
            raise RuntimeError("engine: no request could be scheduled (KV budget or max_num_seqs too small)")
        return []

    def _step_one(self) -> list[Request]:
        """A step the host waits for: scheduled, drafted, computed, sampled and committed."""
        clock = [time.perf_counter()]
        captures = captures_made()
        sched = self.scheduler.schedule()                                  # 1. schedule
        if sched.num_tokens == 0:
            return self._nothing_scheduled()
        clock.append(time.perf_counter())
        plain = self.choice is not None and self.choice.plain()           # the way measured faster
        drafts = {} if plain else self._propose(sched)                     # 2. propose drafts
        clock.append(time.perf_counter())
        # 3. one batched forward (sampled outside a graph where some row reads its logits after)
        batch = self.runner.build(sched.rows, drafts, processed=bool(self._processing or self._alternatives))
        clock.append(time.perf_counter())
        logits, hidden, computed = self._forward(batch, sched)
        clock.append(time.perf_counter())
        for req, n in sched.rows:                                          # the forward wrote their K/V
            req.num_computed_tokens += n
        tokens, logprobs = self.runner.sample(batch, logits).lists()                 # 4. sample
        clock.append(time.perf_counter())
        spans = prefill_spans(batch) if computed is not None else None   # before commit: a prefill
        if spans:                                                          # span ends where sampling starts
            self.speculator.observe_hidden(computed, spans)
        handed = time.perf_counter()
        finished, accepted, emitted = self._commit(batch, tokens, logprobs)   # 5. verify, commit
        if self._alternatives:
            top_logprobs.attach(batch, logits)
        committed = time.perf_counter()
        if self.speculator is not None:                                    # 6. what the speculator learns
            self._observe(batch, emitted, hidden)
        observed = time.perf_counter()
        # Only now free rows: compaction moves a row's committed K/V, and every plan above
        # had to commit (and move its accepted draft K/V) before any row moves.
        for req in finished:                                               # 7. finish
            self._finish(req, req.status)
        clock.append(time.perf_counter())
        stages = [b - a for a, b in zip(clock, clock[1:])]
        spec = (handed - clock[-2]) + (observed - committed)  # observe_s; postprocess_s: commit and finish
        stages[-1] -= spec
        if self.speculator is not None:
            # a step with prefill chunks is not a decode step's cost, nor one that captured a graph
            decode = len(batch.input_ids) - batch.num_draft_tokens == len(sched.rows)
            typical = decode and captures_made() == captures
            self.speculator.observe_step(len(batch.plans), len(batch.input_ids), clock[-1] - clock[0],
                                         batch.meta.work, prefill=not typical, reads=batch.meta.reads)
            spec += time.perf_counter() - clock[-1]             # what it learned from the step: observe_s too
        stages.append(spec)
        # what the step's way measured (tail_choice.py; a tail's ways are not what a processed step runs)
        ways = (None if batch.processed else self.tail) if self._tail() else self.choice
        if ways is not None:
            ways.record("plain" if plain else "speculate", clock[-1] - clock[0], [len(t) for t, _ in emitted if t])
        verify_rows = sum(1 for p in batch.plans if p.draft_tokens)
        self.metrics.record_step(len(sched.rows), len(batch.input_ids), batch.num_draft_tokens,
                                 len(sched.preempted), stages, verify_rows, accepted)
        self._log_step(len(sched.rows), batch, clock[-1] - clock[0])
        if self.idle_work is not None:                 # a step boundary: nothing is mid-step
            self.idle_work.after_step(len(sched.rows))
        return finished

    # ---- steps launched ahead (ahead.py) ------------------------------------------------------
    def _step_ahead(self, tail: bool = False) -> list[Request]:
        """Launch the next plain step, then settle the one launched before it. Returns the
        requests that finished (in the settled step). ``tail``: a speculative engine's tail step
        (its time goes to ``self.tail``)."""
        start = time.perf_counter()
        prev, self._launched = self._launched, None
        if prev is not None:
            hits = placeholders(prev, self.scheduler, self.kv)
            if self.ahead_drafts is not None:
                self.ahead_drafts.follow_hits += hits
        sched = self.scheduler.schedule()
        follow = self._follow_ups(prev, sched)
        scheduled = time.perf_counter()
        if sched.num_tokens == 0 and not follow:
            return self._settle(prev) if prev is not None else self._nothing_scheduled()
        drafts = self._drafts_ahead(sched, sched.token_budget_left - sum(len(f.lengths) for f in follow.values()))
        drafted = time.perf_counter()
        batch = self.runner.build(sched.rows, drafts, follow, processed=bool(self._processing))
        if prev is not None:
            feed(batch, prev)                         # its tokens, on the device, as this step's inputs
        built = time.perf_counter()
        hand_out = None                               # the hidden states, where the speculator reads them
        if self.speculator is not None and self.speculator.wants_hidden(len(sched.rows)):
            logits, hidden, computed = self.runner.run(batch, return_hidden=True)
            hand_out = HandOut(hidden, computed, prefill_spans(batch))
        else:
            logits = self.runner.run(batch)
        for req, n in sched.rows:
            req.num_computed_tokens += n
        launched = time.perf_counter()
        sampled = self.runner.sample(batch, logits)
        self._launched = step = Launched(batch, len(sched.rows), len(sched.preempted), sampled,
                                         [scheduled - start, drafted - scheduled, built - drafted,
                                          launched - built, time.perf_counter() - launched], start, tail,
                                         self.ahead_drafts is not None and self.ahead_drafts.drafting(), hand_out)
        if prev is None:
            return []
        finished = self._settle(prev)
        if not step.live():                           # every row it computes has stopped already
            self._launched = None
            self._settle(step)
        if self.idle_work is not None:                # a step boundary (the one in flight drafts nothing)
            self.idle_work.after_step(prev.rows)
        return finished

    def _drafts_ahead(self, sched: SchedulerOutput, budget: int) -> dict:
        """The chosen rows' drafts for a step launched ahead (ahead_drafts.py), with their blocks."""
        if self.ahead_drafts is None or budget <= 0:
            return {}
        drafts = self.ahead_drafts.propose(sched.rows, self.scheduler.running, budget)
        return drafts if not drafts or self._room_for(drafts) else {}

    def _follow_ups(self, prev: Launched | None, sched: SchedulerOutput) -> dict:
        """Follow-ups (batch.FollowUps) of the drafts ``prev`` verifies, for a step launched
        after it, with the blocks of their scratch positions (none where the pool lacks them or
        they would pass the cache's length)."""
        if self.ahead_drafts is None or prev is None or not prev.batch.num_draft_tokens or sched.token_budget_left <= 0:
            return {}
        follow = self.ahead_drafts.follow(prev.batch.plans, sched.rows, sched.token_budget_left)
        reqs, kv = self.requests, self.kv
        need = {rid: (reqs[rid].row, reqs[rid].num_tokens + f.depth + len(f.lengths)) for rid, f in follow.items()}
        follow = {rid: f for rid, f in follow.items() if need[rid][1] <= kv.max_len}
        if not follow or not kv.grow_rows([need[rid] for rid in follow]):
            return {}
        self.ahead_drafts.follow_ups += sum(len(f.lengths) for f in follow.values())
        return follow

    def _bulk(self) -> bool:
        """Whether this speculative engine's step is plain and launched ahead: more requests run
        or wait than ``_above``."""
        above = self._above()
        return above > 0 and len(self.scheduler.running) + len(self.scheduler.waiting) > above

    def _tail(self) -> bool:
        """Whether this engine measures its tail's two ways (``tail_choice.py``): a speculative
        engine that launches its bulk's steps ahead."""
        return self.tail is not None and self._above() > 0

    def _above(self) -> int:
        """The requests above which this speculative engine's steps are plain, launched ahead:
        ``ahead_above``, or by default ``AHEAD_ABOVE`` (an online drafter's collector too: those
        steps hand out their hidden states when they settle)."""
        return AHEAD_ABOVE if self.ahead_above is None else self.ahead_above

    def _settle(self, step: Launched) -> list[Request]:
        """Wait for a launched step's tokens, commit them, finish what stopped; its metrics."""
        t0 = time.perf_counter()
        tokens = step.sampled.lists()[0]
        t1 = time.perf_counter()
        h = step.hand_out
        if h is not None and h.prefill:           # positions before those it samples, first (as _step_one)
            live = [s for s in h.prefill if not s[0].status.finished]
            if live:
                self.speculator.observe_hidden(h.computed, live)
        handed = time.perf_counter()
        finished, verified = settle(step, self.kv, self.args.eos_token_ids)
        observed = time.perf_counter()
        accepted = sum(a for _, a in verified)
        if self.ahead_drafts is not None:         # the gate's count, before finished requests leave
            running, chosen = len(self.scheduler.running), self.ahead_drafts.tokens(step.batch.plans, step.drafting)
        if self.speculator is not None:           # its sources index every token (plan.rows: settled now)
            for plan, a in verified:
                req = plan.req
                self.speculator.record_verification(req, plan.draft, a)
                req.spec_draft_tokens += len(plan.draft_tokens)
                req.spec_accepted_tokens += a
                req.spec_verify_steps += 1
            sp = self.speculator                 # the rows' tokens only where some source reads them
            sp.observe_many([(p.req, [tokens[i] for i in p.rows]) for p in step.batch.plans if p.rows]
                            if sp.tokens_wanted else [])
            if h is not None:                     # the rows that sampled what each request emitted
                emitted = [(p.req, p.req.num_tokens - len(p.rows) - 1, p.rows) for p in step.batch.plans if p.rows]
                if emitted:
                    hand_out_states(self.speculator, h.sampled, emitted)
        spec = time.perf_counter() - observed + handed - t1
        for req in finished:
            self._finish(req, req.status)
        t2 = time.perf_counter()
        b, s = step.batch, step.stages
        self.metrics.record_step(step.rows, len(b.input_ids), b.num_draft_tokens, step.preempted,
                                 s[:4] + [s[4] + t1 - t0, t2 - t1 - spec, spec], len(verified), accepted)
        period = t2 - max(step.start, self._settled_at)     # a step's period: since the step settled before it
        if step.tail:
            self.tail.record("plain", period, [len(p.rows) for p in b.plans if p.rows])
        if self.ahead_drafts is not None:
            self.ahead_drafts.settled(step.drafting, period, running, chosen)
        self._log_step(step.rows, b, period)
        self._settled_at = t2
        return finished

    def _log_step(self, rows: int, batch: Batch, seconds: float) -> None:
        """The step in ``step_log`` (where it is kept), the simulator's calibration format."""
        if self.step_log is not None:
            self.step_log.append({"batch": rows, "new_tokens": len(batch.input_ids), "kv_tokens": batch.meta.reads,
                                  "seconds": seconds})

    def drain(self) -> list[Request]:
        """Settle the step in flight, if any (``async_scheduling``): afterwards every request's
        state is its own, with nothing computing. Returns the requests that finished."""
        if self._launched is None:
            return []
        step, self._launched = self._launched, None
        with device_scope(self.config.device):
            return self._settle(step)

    def _propose(self, sched: SchedulerOutput) -> dict:
        if self.speculator is None or sched.token_budget_left <= 0:
            return {}
        # rows sampling one token; which of them may take drafts is asked only where the step drafts
        sampling = [r for r, n in sched.rows if n == 1]
        if not sampling:
            return {}
        drafts = self.speculator.propose(sampling, len(sched.rows), max_total_tokens=sched.token_budget_left,
                                         eligible=Request.takes_drafts)
        for rid, d in list(drafts.items()):                 # never draft past max_tokens / context
            room = self.requests[rid].remaining_tokens - 1
            if len(d.tokens) > room:
                drafts[rid] = d.truncate(room)
        drafts = {rid: d for rid, d in drafts.items() if len(d.tokens) > 0}
        return drafts if self._room_for(drafts) else {}

    def _room_for(self, drafts: dict) -> bool:
        """Blocks for the drafts' nodes where the pool has them free (drafts never cost a
        preemption: without them, no drafts)."""
        reqs = self.requests
        return self.kv.grow_rows([(reqs[rid].row, reqs[rid].num_tokens + len(d.tokens)) for rid, d in drafts.items()])

    def _forward(self, batch: Batch, sched: SchedulerOutput):
        """A step's forward: (logits, hidden, computed), the hidden states only where a source
        or collector reads them at this batch size (None else); a prefill's states give the
        prompt logprobs asked for (no extra forward either way)."""
        keep = self.speculator is not None and self.speculator.wants_hidden(len(sched.rows))
        prompts = bool(self._alternatives) and any(r.prompt_logprobs_pending for r, _ in sched.rows)
        if not keep and not prompts:
            return self.runner.run(batch), None, None
        logits, hidden, computed = self.runner.run(batch, return_hidden=True)
        if prompts:
            self._prompt_logprobs(batch, sched, computed)
        return (logits, hidden, computed) if keep else (logits, None, None)

    def _prompt_logprobs(self, batch: Batch, sched: SchedulerOutput, computed: torch.Tensor) -> None:
        """Prompt logprobs from a step's prefill states (top_logprobs.py); a request whose prompt
        is given and that asks no output alternatives goes back to the fast path."""
        top_logprobs.attach_prompt(batch, computed, self.runner.logits_of)
        for r, _ in sched.rows:
            if not r.params.logprobs and not r.prompt_logprobs_pending:
                self._alternatives.discard(r.request_id)

    def _commit(self, batch: Batch, tokens: list[int], logprobs: list[float]
                ) -> tuple[list[Request], int, list[tuple[list[int], int]]]:
        """Verify and commit every sampling row. Returns (the requests that stopped, draft tokens
        accepted, (tokens emitted, draft tokens accepted) per plan)."""
        finished: list[Request] = []
        total_accepted = 0
        emitted_per_plan = []
        for plan in batch.plans:
            emitted, accepted, status = commit(plan, tokens, logprobs, self.kv, self.args.eos_token_ids)
            emitted_per_plan.append((emitted, accepted))
            if plan.draft_tokens:
                total_accepted += accepted
                plan.req.spec_draft_tokens += len(plan.draft_tokens)
                plan.req.spec_accepted_tokens += accepted
                plan.req.spec_verify_steps += 1
            if status is not None:
                plan.req.status = status
                finished.append(plan.req)
        if self.kv.states is not None:          # recurrent layers: the accepted nodes into the rows' states
            self.kv.states.accept(self.model, batch, [k for _, k in emitted_per_plan])
        return finished, total_accepted, emitted_per_plan

    def _observe(self, batch: Batch, emitted: list[tuple[list[int], int]], hidden: torch.Tensor | None) -> None:
        """The speculator's share of a step after sampling (its own stage, ``observe_s``): each
        verification's outcome, the emitted tokens, and with ``hidden`` [M, H] (the sampled
        positions' states) the rows that sampled the emitted tokens, in one call (``hand_out_states``)."""
        emitted_rows: list[tuple[Request, int, list[int]]] = []   # (request, first position, sampled rows)
        for plan, (toks, accepted) in zip(batch.plans, emitted):
            if plan.draft_tokens:
                self.speculator.record_verification(plan.req, plan.draft, accepted)
            if hidden is not None:                     # positions num_tokens - len(emitted) - 1 on
                emitted_rows.append((plan.req, plan.req.num_tokens - len(toks) - 1, plan.rows))
        sp = self.speculator
        sp.observe_many([(plan.req, toks) for plan, (toks, _) in zip(batch.plans, emitted)]
                        if sp.tokens_wanted else [])
        if emitted_rows:
            hand_out_states(self.speculator, hidden, emitted_rows)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finish_time = time.perf_counter()
        self._leave(req)

    def _leave(self, req: Request) -> None:
        """The request leaves the schedule and every per-request set (finished or moved away)."""
        self.scheduler.remove(req)
        self._processing.discard(req.request_id)
        self._alternatives.discard(req.request_id)
        if self.speculator is not None:
            self.speculator.finish(req)
        if self.ahead_drafts is not None:
            self.ahead_drafts.finish(req)

    def close(self) -> None:
        """Stop the other ranks' processes of a model split over devices (nothing otherwise)."""
        if isinstance(self.model, ParallelModel):
            self.model.close()

    # ---- moving requests between instances ------------------------------------------------
    def export_request(self, request_id: str) -> RequestState:
        """Take an unfinished request out of this engine with its tokens, K/V and drafting state."""
        self.drain()
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            raise ValueError(f"request_id {request_id!r} is not an unfinished request of this engine")
        kv = req.pending_kv
        # (recurrent layers' states are not exported: the request is computed again there)
        if req.row >= 0 and req.num_computed_tokens > 0 and self.kv.states is None:
            kv = self.kv.export_row(req.row, req.num_computed_tokens)
        spec = None if self.speculator is None else self.speculator.export_state(req)   # drafts continue there
        self._leave(req)
        del self.requests[request_id]
        return RequestState.from_request(req, kv, spec)

    def import_request(self, state: RequestState) -> Request:
        req = state.to_request()
        if req.pending_kv is not None:
            self.kv.check_shape(req.pending_kv)         # fail before the request is queued
        self.add_request(req)
        return req

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, weights) -> set[str]:
        """In-place weight update under Hugging Face names (e.g. after an RL step): a mapping of
        the whole model (names and shapes checked before anything is copied), or an iterable of
        (name, tensor) pairs holding any part (a trainer's bucket). Call it with no request
        running (between ``generate`` calls; the server's engine loop waits for them): a running
        request's K/V is the old weights'. Returns the checkpoint names written (model/hf_names.py)."""
        self.drain()
        try:
            return self.model.load_weights(weights, complete=isinstance(weights, Mapping))
        finally:                                # whatever was copied before an error counts
            self.kv.clear_prefixes()            # the cached prefixes' K/V were the old weights'
            if self.speculator is not None:
                self.speculator.target_updated(self.model)
