"""One thread owns the engine; HTTP handlers hand requests in and get tokens out through queues.

The engine is not thread-safe, and continuous batching needs a single loop anyway: requests of
every connection join the running batch between two ``step`` calls and leave it when they
finish or are aborted, so 200 concurrent HTTP requests cost one batched forward per step,
not 200 ``generate`` calls. Handlers never touch the engine: they ``submit`` a group and get
``Update`` lists through a callback (the server turns it into an asyncio queue), and ``abort``
puts an abort on the same FIFO inbox, so an abort can never overtake its own submission.

New weights (``update_weights``, whole or a trainer's buckets) come through the same inbox: from
the first bucket on, requests submitted wait outside the engine, requests running finish on the
old weights, then every bucket is loaded between two steps, and the waiting requests join once
the last one is in. No request runs on a mix of weights or on K/V computed by others.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

from tailrl.engine.heap import held_collections
from tailrl.engine.request import Request

log = logging.getLogger(__name__)

# Engine counters exported as monotonic counters (cumulative since the server started), by
# their verl-style names; everything else in ``stats`` is a gauge.
COUNTER_KEYS = {
    "num_forward": "rollout/num_forward", "num_batched_tokens": "rollout/batched_tokens",
    "num_draft_tokens": "rollout/draft_tokens", "num_preemptions": "rollout/preemptions",
    "num_verify_rows": "rollout/spec_verify_rows", "num_accepted_tokens": "rollout/spec_accepted_tokens",
    "forward_s": "timing_s/forward", "schedule_s": "timing_s/schedule", "postprocess_s": "timing_s/postprocess",
    "observe_s": "timing_s/observe",
}
TRACE_LIMIT = 4096          # engine step trace entries kept before a new metrics window starts
HEAP_STEPS = 4096           # engine steps a busy stretch holds off full collections (engine/heap.py)


@dataclass
class Update:
    """What one sequence gained since its last update (copies: the engine keeps mutating its lists)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None        # set once, on the sequence's last update
    error: str | None = None                # the engine failed; the sequence was aborted
    top_logprobs: list[dict] | None = None  # per token, its alternatives (SamplingParams.logprobs >= 1)
    prompt_top_logprobs: list[dict] | None = None   # on the last update: its prompt's (prompt_logprobs)


Sink = Callable[[list[Update]], None]


def _prompt_entries(group: list[Request]) -> list[dict] | None:
    """The group's prompt logprobs: those of the sample that prefilled its prompt (None if none asked)."""
    return next((r.prompt_top_logprobs for r in group if r.params.prompt_logprobs is not None
                 and not r.prompt_logprobs_pending), None)


@dataclass(eq=False)
class _Group:
    requests: list[Request]
    sink: Sink
    final_only: bool = False                            # report each request once, when it finished
    on_retire: Callable[[list[Request]], None] | None = None    # None: the loop's own
    sent: list[int] = field(default_factory=list)       # tokens already reported, per request
    reported: list[bool] = field(default_factory=list)  # finish already reported, per request


class EngineLoop:
    """Runs ``llm.engine`` in a daemon thread; ``submit``/``abort``/``call`` are safe from any
    thread. ``on_retire(requests)`` (default: the group's responses become its prompt's history,
    as after ``LLM.generate``) runs in the loop thread when a group that was not aborted ends."""

    def __init__(self, llm, stats_every_s: float = 0.5,
                 on_retire: Callable[[list[Request]], None] | None = None) -> None:
        self.llm = llm
        self.engine = llm.engine
        self._on_retire = on_retire or self._record_history
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: list[_Group] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tailrl-engine-loop", daemon=True)
        self._stats_every_s = stats_every_s
        self._stats: dict[str, float] = {}
        self._stats_time = 0.0
        self._live = 0                       # sequences submitted and not yet reported finished
        self.aborted_sequences = 0           # sequences that ended aborted (client left, stop string, error)
        self._live_lock = threading.Lock()
        self._weights: list[tuple[object, bool, Future]] = []   # buckets waiting for running requests
        self._updating = False               # between an update's first bucket and its last
        self._parked: list[_Group] = []      # groups submitted during an update

    # ---- any thread -------------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def live_sequences(self) -> int:
        return self._live

    def submit(self, group: list[Request], sink: Sink, final_only: bool = False,
               on_retire: Callable[[list[Request]], None] | None = None) -> None:
        """Queue one prompt's requests (a group: group drafts see the siblings); ``sink`` gets
        lists of ``Update`` from the loop thread and must not block. ``final_only``: a caller
        that neither streams nor watches stop strings gets one update per request, at its end
        (per-step updates of 200 requests would cost the engine thread the GIL for nothing).
        ``on_retire``: this group's own, in place of the loop's (the per-sample front's groups)."""
        with self._live_lock:
            self._live += len(group)
        self._inbox.put(("add", _Group(group, sink, final_only, on_retire, [0] * len(group), [False] * len(group))))

    def abort(self, request_ids: list[str]) -> None:
        """Abort unfinished requests (a client left, or a stop string matched): their KV is freed."""
        if request_ids:
            self._inbox.put(("abort", list(request_ids)))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run ``fn()`` in the loop thread between two steps (new weights, for one); the future
        gets its result or exception."""
        done: Future = Future()
        self._inbox.put(("call", (fn, done)))
        return done

    def update_weights(self, weights, done: bool = True) -> Future:
        """Load ``weights`` (``LLM.load_weights``'s: a mapping of the whole model, or a bucket of
        (name, tensor) pairs, ``done`` on an update's last) once no request runs; requests
        submitted from now on wait until the update's last bucket is in (or one failed). The
        future gets the checkpoint names written, or the exception."""
        done_future: Future = Future()
        self._inbox.put(("weights", (weights, done, done_future)))
        return done_future

    def stats(self) -> dict[str, float]:
        """The latest metrics snapshot (replaced whole by the loop thread, so reading it is safe)."""
        return self._stats

    # ---- the loop thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._load_weights()
            self._drain(block=not self.engine.has_unfinished())
            self._load_weights()
            # a busy stretch: no full collection inside it
            with held_collections() if self.engine.has_unfinished() else nullcontext():
                self._rounds()
        self._fail_all("server shutting down")
        for g in self._parked:
            self._report_error(g, "server shutting down")
        for *_, future in self._weights:
            future.set_exception(RuntimeError("the engine loop stopped"))
        while True:                          # calls queued behind the stop fail, not hang
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind in ("call", "weights"):
                payload[-1].set_exception(RuntimeError("the engine loop stopped"))

    def _rounds(self) -> None:
        """The loop's round (take what came in, step if there is work, publish), repeated while
        there is work, for at most ``HEAP_STEPS`` rounds: a server busy for hours still makes
        its full collections between two stretches. The first round's inbox
        was taken by the caller."""
        for i in range(HEAP_STEPS):
            if i:
                self._drain(block=False)
            if self.engine.has_unfinished():
                try:
                    self.engine.step()
                except Exception as e:      # the server must stay up: fail what was running
                    log.exception("engine step failed; aborting %d live groups", len(self._groups))
                    self._fail_all(f"engine error: {e}")
            self._publish()
            self._refresh_stats()
            if self._stop.is_set() or not self.engine.has_unfinished():
                return

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "add" and self._updating:
                self._parked.append(payload)
            elif kind == "add":
                self._add(payload)
            elif kind == "weights":
                self._weights.append(payload)
                self._updating = True
            elif kind == "call":
                fn, done = payload
                try:
                    done.set_result(fn())
                except Exception as e:                    # the caller gets it; the loop goes on
                    done.set_exception(e)
            else:
                for rid in payload:
                    self.engine.abort(rid)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _load_weights(self) -> None:
        """The buckets waiting, once no request runs; after an update's last (or a failed one),
        the groups that waited join."""
        if not self._weights or self._groups:
            return
        for weights, done, future in self._weights:
            try:
                future.set_result(self.llm.load_weights(weights))
            except Exception as e:                      # the caller gets it; the update ends
                future.set_exception(e)
                done = True
            if done:
                self._updating = False
        self._weights = []
        if not self._updating:
            parked, self._parked = self._parked, []
            for g in parked:
                self._add(g)

    def _add(self, group: _Group) -> None:
        added = []
        try:
            for r in group.requests:
                self.engine.add_request(r)
                added.append(r)
        except Exception as e:
            log.exception("could not add a request group")
            for r in added:
                self.engine.release(r.request_id)
            self._report_error(group, f"engine rejected the request: {e}")
            return
        self._groups.append(group)

    def _publish(self) -> None:
        """Send each group its new tokens; retire groups whose requests all finished."""
        still = []
        for g in self._groups:
            updates = []
            for j, r in enumerate(g.requests):
                n, done = len(r.output_token_ids), r.status.finished
                if g.final_only and not done:
                    continue
                if n > g.sent[j] or (done and not g.reported[j]):
                    top = r.output_top_logprobs
                    updates.append(Update(r.request_id, r.output_token_ids[g.sent[j]:n],
                                          r.output_logprobs[g.sent[j]:n], r.finish_reason if done else None,
                                          top_logprobs=None if top is None else top[g.sent[j]:n],
                                          prompt_top_logprobs=_prompt_entries(g.requests) if done else None))
                    g.sent[j], g.reported[j] = n, done
            if all(g.reported):              # before the sink: a caller that got its last update
                self._retire(g)              # finds the history recorded and the KV released
            else:
                still.append(g)
            if updates:
                g.sink(updates)
        self._groups = still

    def _retire(self, g: _Group) -> None:
        for r in g.requests:
            self.engine.release(r.request_id)
        aborted = sum(r.finish_reason == "abort" for r in g.requests)
        self.aborted_sequences += aborted
        if not aborted:
            (g.on_retire or self._on_retire)(g.requests)
        with self._live_lock:
            self._live -= len(g.requests)

    def _record_history(self, requests: list[Request]) -> None:
        """The responses become the prompt's history (previous epoch), as after LLM.generate."""
        self.llm.history.record(requests[0].prompt_id, [list(r.output_token_ids) for r in requests])

    def _report_error(self, g: _Group, message: str) -> None:
        g.sink([Update(r.request_id, [], [], "abort", message) for r in g.requests])
        with self._live_lock:
            self._live -= len(g.requests)

    def _fail_all(self, message: str) -> None:
        for g in self._groups:
            for r in g.requests:
                self.engine.release(r.request_id)
            self._report_error(g, message)
        self._groups = []

    def _refresh_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_time < self._stats_every_s:
            return
        self._stats_time = now
        m = self.engine.metrics
        stats = {key: float(getattr(m, name)) for name, key in COUNTER_KEYS.items()}
        stats["rollout/mean_batch_size"] = m.sum_batch_size / max(m.num_forward, 1)
        stats.update({k: float(v) for k, v in self.engine.spec_metrics().items()})
        stats["serve/live_sequences"] = float(self._live)
        stats["serve/running_groups"] = float(len(self._groups))
        stats["serve/aborted_sequences"] = float(self.aborted_sequences)
        self._stats = stats
        if len(m.trace) > TRACE_LIMIT:           # the per-step trace would grow without bound
            self.engine.begin_rollout()
