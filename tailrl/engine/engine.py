"""One engine instance: requests in, tokens out, one step at a time.

    step = schedule -> propose drafts -> one batched forward -> sample/verify -> postprocess
"""
from __future__ import annotations

import logging
import time

import torch

from tailrl.config import EngineConfig, SpeculativeConfig
from tailrl.engine.batch import Batch, ModelRunner
from tailrl.engine.kv_cache import KVCache
from tailrl.engine.metrics import EngineMetrics
from tailrl.engine.request import Request, RequestStatus
from tailrl.engine.sampler import sample
from tailrl.engine.scheduler import Scheduler, SchedulerOutput
from tailrl.engine.transfer import RequestState
from tailrl.engine.verify import accept_draft
from tailrl.model.loader import DTYPES, load_model, read_args
from tailrl.spec.history import HistoryStore

log = logging.getLogger(__name__)


class LLMEngine:
    """``speculative`` turns speculative decoding on (``history``: the store history drafts
    read); ``speculator`` injects a ready-made one instead (tests, ablations)."""

    def __init__(self, config: EngineConfig, speculative: SpeculativeConfig | None = None,
                 history: HistoryStore | None = None, *, speculator=None):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        args = read_args(config.model)
        self.max_model_len = min(config.max_model_len or args.max_position_embeddings, args.max_position_embeddings)
        self.model = load_model(config.model, config.dtype, config.device, self.max_model_len)
        self.args = self.model.args
        dtype = DTYPES[config.dtype]
        budget = config.kv_cache_tokens or int(config.kv_cache_gib * 2**30 // (
            self.args.kv_bytes_per_token * torch.tensor([], dtype=dtype).element_size()))
        self.kv = KVCache(self.args, dtype, config.device, budget, config.max_num_seqs, self.max_model_len)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.kv)
        if speculator is None and speculative is not None:
            if speculative.method != "suffix":
                raise ValueError(f"speculative.method {speculative.method!r} is not available yet "
                                 "(the learned drafter has not landed); use method='suffix'")
            from tailrl.spec.speculator import Speculator
            speculator = Speculator(speculative, history)     # its cost model learns from real steps
        self.speculator = speculator
        self.requests: dict[str, Request] = {}
        self.metrics = EngineMetrics()
        self._rollout_start = self.metrics.snapshot()

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in the engine")
        req.max_model_len = self.max_model_len
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        if self.speculator is not None:
            self.speculator.start(req)

    def abort(self, request_id: str) -> Request | None:
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

    # ---- metrics of one rollout (a generate call) --------------------------------------------
    def begin_rollout(self) -> None:
        """Start counting a rollout: ``rollout_counters`` and ``spec_metrics`` cover what follows."""
        self.metrics.trace.clear()
        self._rollout_start = self.metrics.snapshot()
        if self.speculator is not None:
            self.speculator.reset_metrics()

    def rollout_counters(self) -> EngineMetrics:
        return self.metrics.since(self._rollout_start)

    def spec_metrics(self) -> dict[str, float]:
        return self.speculator.metrics() if self.speculator is not None else {}

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one forward for the scheduled requests. Returns the requests that finished."""
        t0 = time.perf_counter()
        kv_before = self.kv.data
        sched = self.scheduler.schedule()
        if sched.num_tokens == 0:
            if self.scheduler.has_work():
                raise RuntimeError("engine: no request could be scheduled (KV budget or max_num_seqs too small)")
            return []
        drafts = self._propose(sched)
        batch = self.runner.build(sched.rows, drafts)
        t1 = time.perf_counter()
        logits = self.runner.run(batch)
        t2 = time.perf_counter()
        finished, verify_rows, accepted = self._postprocess(batch, sched, logits)
        t3 = time.perf_counter()
        self.metrics.record_step(len(sched.rows), len(batch.input_ids), batch.num_draft_tokens,
                                 len(sched.preempted), t1 - t0, t2 - t1, t3 - t2, verify_rows, accepted)
        if self.speculator is not None:
            # the whole step (batch building, sampling, verification included): what a step costs;
            # steps with prefill chunks are priced differently (big matmuls, per-row attention)
            # (and a step that grew the KV cache paid a one-time copy)
            unusual = len(batch.input_ids) - batch.num_draft_tokens > len(sched.rows) or self.kv.data is not kv_before
            self.speculator.observe_step(len(batch.plans), len(batch.input_ids), t3 - t0, batch.meta.work,
                                         prefill=unusual, reads=batch.meta.reads)
        return finished

    def _propose(self, sched: SchedulerOutput) -> dict:
        if self.speculator is None or sched.token_budget_left <= 0:
            return {}
        decoding = [r for r, n in sched.rows if n == 1 and r.is_decoding and r.remaining_tokens > 1]
        if not decoding:
            return {}
        drafts = self.speculator.propose(decoding, len(sched.rows), max_total_tokens=sched.token_budget_left)
        for rid, d in list(drafts.items()):                 # never draft past max_tokens / context
            room = self.requests[rid].remaining_tokens - 1
            if len(d.tokens) > room:
                drafts[rid] = d.truncate(room)
        drafts = {rid: d for rid, d in drafts.items() if len(d.tokens) > 0}
        longest = max((self.requests[rid].num_tokens + len(d.tokens) for rid, d in drafts.items()), default=0)
        if not self.kv.reserve(len(sched.rows), longest):
            return {}                                   # drafts never cost a preemption
        return drafts

    def _postprocess(self, batch: Batch, sched: SchedulerOutput,
                     logits: torch.Tensor) -> tuple[list[Request], int, int]:
        """Sample, verify drafts, append tokens. Returns (finished, verify rows, accepted drafts)."""
        for req, n in sched.rows:
            req.num_computed_tokens += n
        tokens, logprobs = sample(logits, batch.temperature, batch.top_k, batch.top_p, batch.u)
        finished: list[Request] = []
        verify_rows = total_accepted = 0
        for plan in batch.plans:
            req, e = plan.req, plan.entry
            targets = tokens[e:e + 1 + len(plan.draft_tokens)]
            emitted, accepted = accept_draft(plan.parents, plan.draft_tokens, targets)
            if plan.draft_tokens:
                verify_rows += 1
                total_accepted += len(accepted)
                self._keep_accepted_kv(req, plan, accepted)
                self.speculator.record_verification(req, plan.draft, len(accepted))
            entries = [e] + [e + 1 + j for j in accepted]
            for tok, k in zip(emitted, entries):
                status = self._append(req, tok, logprobs[k])
                if status is not None:
                    req.status = status
                    finished.append(req)
                    break
            if self.speculator is not None:
                self.speculator.observe(req, emitted)
        # Only now free rows: compaction moves a row's committed K/V, and every plan above
        # had to commit (and move its accepted draft K/V) before any row moves.
        for req in finished:
            self._finish(req, req.status)
        return finished, verify_rows, total_accepted

    def _keep_accepted_kv(self, req: Request, plan, accepted: list[int]) -> None:
        """Accepted node j sits at cache position base + j; it belongs at base + depth - 1."""
        base = req.num_computed_tokens
        src = [base + j for j in accepted]
        dst = list(range(base, base + len(accepted)))
        if src != dst:
            self.kv.move_positions(req.row, src, dst)
        req.num_computed_tokens += len(accepted)

    def _append(self, req: Request, tok: int, logprob: float) -> RequestStatus | None:
        req.output_token_ids.append(tok)
        req.output_logprobs.append(logprob)
        p = req.params
        if (not p.ignore_eos and tok in self.args.eos_token_ids) or (p.stop_token_ids and tok in p.stop_token_ids):
            return RequestStatus.FINISHED_STOPPED
        if req.remaining_tokens <= 0:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.remove(req)
        req.status = status
        req.finish_time = time.perf_counter()
        if self.speculator is not None:
            self.speculator.finish(req)

    # ---- moving requests between instances ------------------------------------------------
    def export_request(self, request_id: str) -> RequestState:
        """Take an unfinished request out of this engine with its tokens and K/V."""
        req = self.requests.get(request_id)
        if req is None or req.status.finished:
            raise ValueError(f"request_id {request_id!r} is not an unfinished request of this engine")
        kv = req.pending_kv
        if req.row >= 0 and req.num_computed_tokens > 0:
            kv = self.kv.export_row(req.row, req.num_computed_tokens)
        self.scheduler.remove(req)
        if self.speculator is not None:
            self.speculator.finish(req)
        del self.requests[request_id]
        return RequestState.from_request(req, kv)

    def import_request(self, state: RequestState) -> Request:
        req = state.to_request()
        if req.pending_kv is not None:
            self.kv.check_shape(req.pending_kv)         # fail before the request is queued
        self.add_request(req)
        return req

    # ---- weights ----------------------------------------------------------------------------
    def load_weights(self, hf_state_dict: dict[str, torch.Tensor]) -> None:
        """In-place weight update from Hugging Face parameter names (e.g. after an RL step).
        Cached K/V of running requests is stale afterwards; call between generate calls."""
        self.model.load_hf_state_dict(hf_state_dict)
