"""One engine instance of the rollout pool: runs the chunks the pool's driver hands it.

The worker is the same object in every backend (in this process, in a local worker process,
in a Ray actor); backends only carry its messages. It never decides anything: the scheduler
policy, in the driver, says which request runs where and for how many tokens.

A chunk ends when a request has ``target`` output tokens. The engine keeps generating with
the request's real ``max_tokens``, so a speculative step may overshoot the target by a few
accepted draft tokens: those are kept ("banked") and reported; they are exactly the tokens
the request would produce next anyway (sampling noise is keyed by position), and the driver
accounts for them when the request's next chunk starts. The engine never finishes a request
at a chunk boundary, which is what lets its K/V survive the boundary.

After a chunk ends the request stays in the engine until the next command says what to do
with it: continue here (a new target, K/V untouched), export it (tokens + K/V, to another
instance), or, by default, park it: take it out of the engine with its K/V into this
worker's host memory (Seer's global KV pool, local part), from which it resumes without
re-prefill, here or elsewhere.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from tailrl.config import EngineConfig, SpeculativeConfig
from tailrl.engine.engine import LLMEngine
from tailrl.engine.heap import held_collections
from tailrl.engine.metrics import EngineMetrics
from tailrl.engine.transfer import RequestState
from tailrl.speculative.history import HistoryStore

log = logging.getLogger(__name__)
# what the pool may ask of an instance's spot trainer (tailrl.drafter.spot_trainer.SpotTrainer)
SPOT_METHODS = ("train", "weights", "set_weights", "metrics", "reset_metrics", "save")


@dataclass
class Chunk:
    """Run `request_id` until it has `target` output tokens (or finishes)."""

    request_id: str
    target: int                       # total output tokens at which this chunk ends
    priority: float = 0.0             # expected length: engine admission and drafting order
    prior: tuple = ()                 # lengths its length is drawn from: the critical path's estimate
    state: RequestState | None = None  # None: this worker already holds the request


@dataclass
class Command:
    """What the driver wants from one worker before its next steps."""

    chunks: list[Chunk] = field(default_factory=list)
    exports: list[str] = field(default_factory=list)   # held requests to hand over (tokens + K/V)
    max_steps: int = 8                                  # engine steps at most, stopping at the first event


@dataclass
class Delta:
    """New tokens of one running request since the last report."""

    request_id: str
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None = None   # set when the engine finished it ("stop", "length")
    top_logprobs: list[dict] | None = None   # where the request asks for them (engine/top_logprobs.py)
    prompt_top_logprobs: list[dict] | None = None   # its prompt's, once its prefill gave them all


@dataclass
class Report:
    deltas: list[Delta]
    exported: list[RequestState]
    ended: list[str]        # chunks that reached their target (request held here, unfinished)
    busy_s: float           # wall time spent in engine steps
    steps: int


@dataclass
class WorkerInfo:
    vocab_size: int
    max_model_len: int
    kv_capacity: int        # KV token slots
    max_num_seqs: int
    kv_bytes_per_token: int


class EngineWorker:
    """An `LLMEngine` plus the chunk bookkeeping of divided rollout."""

    def __init__(self, config: EngineConfig, speculative: SpeculativeConfig | None = None) -> None:
        self.history = HistoryStore()   # what this instance's history drafts read (synced by the pool)
        # a chunk ends at its target exactly: no step launched ahead past it (engine/ahead.py)
        config = replace(config, async_scheduling=False)
        self.engine = LLMEngine(config, speculative, self.history)
        self.targets: dict[str, int] = {}            # live chunks: request -> target
        self.reported: dict[str, int] = {}           # output tokens already reported
        self.ended: set[str] = set()                 # chunk ended, still in the engine
        self.parked: dict[str, RequestState] = {}    # chunk ended, out of the engine with its K/V
        self.prompt_sent: set[str] = set()           # prompt logprobs already reported
        self.spot = None                             # the drafter's spot trainer ("spot" op), if set up

    def handle(self, op: str, payload=None):
        """The one entry point every backend calls."""
        if op == "run":
            return self.run(payload)
        if op == "info":
            return self.info()
        if op == "begin":
            return self.begin()
        if op == "counters":
            return self.engine.rollout_counters(), self.engine.spec_metrics(), self.engine.graph_metrics()
        if op == "history":
            for prompt_id, responses in payload.items():
                self.history.record(prompt_id, responses)
            return None
        if op == "step_log":        # payload True: record from now on; False: stop. Returns the records so far
            log, self.engine.step_log = self.engine.step_log or [], [] if payload else None
            return log
        if op == "load_weights":
            return self.engine.load_weights(payload)
        if op == "weight_names":
            return self.engine.model.weight_names()
        if op == "check_weights":       # payload ((name, shape) pairs, complete): (error, names written)
            try:
                return None, self.engine.model.check_weights(*payload)
            except ValueError as e:
                return str(e), None
        if op == "reset_prefix_cache":
            self.engine.kv.clear_prefixes()
            return None
        if op == "spot":
            return self._spot(*payload)
        raise ValueError(f"unknown worker op {op!r}")

    def _spot(self, method: str, *args):
        """The drafter's spot trainer on this instance: ``("setup", factory, *fargs)`` builds it
        with ``factory(engine, *fargs)`` (the caller's: this layer never imports the trainer),
        then its methods by name."""
        if method == "setup":
            factory, *fargs = args
            self.spot = factory(self.engine, *fargs)
            return None
        if self.spot is None:
            raise ValueError("worker: spot trainer op before ('setup', factory, ...)")
        if method not in SPOT_METHODS:
            raise ValueError(f"worker: spot method must be one of {SPOT_METHODS}, got {method!r}")
        return getattr(self.spot, method)(*args)

    def info(self) -> WorkerInfo:
        e = self.engine
        per_token = e.args.kv_bytes_per_token * e.kv.dtype.itemsize      # args count elements
        return WorkerInfo(e.args.vocab_size, e.max_model_len, e.kv.budget_tokens, e.config.max_num_seqs, per_token)

    def begin(self) -> None:
        """Start a rollout: forget the previous one's leftovers (an aborted run leaves some)."""
        for rid in list(self.engine.requests):
            self.engine.release(rid)
        self.targets.clear()
        self.reported.clear()
        self.ended.clear()
        self.parked.clear()
        self.prompt_sent.clear()
        self.engine.begin_rollout()

    def run(self, cmd: Command) -> Report:
        exported = [self._export(rid) for rid in cmd.exports]
        for c in cmd.chunks:
            self._start(c)
        for rid in list(self.ended):                  # nobody continued them here: park
            self.parked[rid] = self.engine.export_request(rid)
            self.ended.discard(rid)
        deltas: dict[str, Delta] = {}
        ended: list[str] = []
        busy, steps = 0.0, 0
        with held_collections():                      # no full collection mid-chunk
            while self.targets and steps < cmd.max_steps:
                t0 = time.perf_counter()
                self.engine.step()
                busy += time.perf_counter() - t0
                steps += 1
                if self._collect(deltas, ended):
                    break
        return Report(list(deltas.values()), exported, ended, busy, steps)

    def _start(self, c: Chunk) -> None:
        rid = c.request_id
        if c.state is not None:
            self._add(c.state, c)
        elif rid in self.parked:
            self._add(self.parked.pop(rid), c)
        elif rid in self.ended:
            self.ended.discard(rid)                   # continues in place, K/V untouched
            req = self.engine.requests[rid]
            req.priority, req.length_prior = c.priority, tuple(c.prior)
        else:
            raise ValueError(f"worker does not hold request {rid!r}")
        self.targets[rid] = c.target
        self.reported.setdefault(rid, len(self.engine.requests[rid].output_token_ids))

    def _add(self, state: RequestState, c: Chunk) -> None:
        req = state.to_request()
        req.priority, req.length_prior = c.priority, tuple(c.prior)     # before it queues
        if req.pending_kv is not None:
            self.engine.kv.check_shape(req.pending_kv)
        self.engine.add_request(req)
        self.reported[req.request_id] = req.num_output_tokens

    def _export(self, rid: str) -> RequestState:
        if rid in self.parked:
            return self.parked.pop(rid)
        if rid not in self.ended:
            raise ValueError(f"worker holds no ended chunk of request {rid!r}")
        self.ended.discard(rid)
        self.reported.pop(rid, None)
        return self.engine.export_request(rid)

    def _collect(self, deltas: dict[str, Delta], ended: list[str]) -> bool:
        """Gather new tokens of live chunks; end chunks at their target. True on any event."""
        event = False
        for rid, target in list(self.targets.items()):
            req = self.engine.requests[rid]
            out, seen = req.output_token_ids, self.reported[rid]
            if len(out) > seen:
                d = deltas.setdefault(rid, Delta(rid, [], []))
                d.tokens.extend(out[seen:])
                d.logprobs.extend(req.output_logprobs[seen:])
                if req.output_top_logprobs is not None:
                    d.top_logprobs = (d.top_logprobs or []) + req.output_top_logprobs[seen:]   # one report's
                self.reported[rid] = len(out)
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_pending \
                    and rid not in self.prompt_sent:
                deltas.setdefault(rid, Delta(rid, [], [])).prompt_top_logprobs = list(req.prompt_top_logprobs or [])
                self.prompt_sent.add(rid)
            if req.status.finished:
                deltas.setdefault(rid, Delta(rid, [], [])).finish_reason = req.finish_reason
                del self.targets[rid], self.reported[rid]
                self.engine.release(rid)
                event = True
            elif len(out) >= target:
                del self.targets[rid]
                self.ended.add(rid)
                ended.append(rid)
                event = True
        return event


def merge_counters(parts: list[EngineMetrics]) -> EngineMetrics:
    """Sum the per-instance counters of one rollout (traces interleaved by time)."""
    total = EngineMetrics()
    for m in parts:
        for name, value in vars(m).items():
            if name != "trace":
                setattr(total, name, getattr(total, name) + value)
        total.trace.extend(m.trace)
    total.trace.sort(key=lambda s: s[0])
    return total
