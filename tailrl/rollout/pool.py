"""The rollout pool: N engine instances run one rollout step under one scheduler policy.

`LLM(model, instances=2, scheduler="context")` routes its requests here; the pool answers
with the same tokens a single engine would produce (sampling noise is keyed by request and
position, so placement, chunking, migration and recomputation change nothing), plus the
`pool/...` metrics. Decisions come from the policy objects the simulator uses
(``tailrl.rollout.policies``); `driver.Rollout` executes them.

Per step the pool builds the request buffer (one entry per response), gives the policy what
it reads (``history``: the previous epoch's lengths per prompt from the LLM's history store;
``oracle``: true lengths from an earlier run with the same seeds, for evaluation only),
syncs every instance's history store (what its history drafts read), and runs the driver.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from tailrl.config import EngineConfig, PoolConfig, SpeculativeConfig
from tailrl.engine.metrics import EngineMetrics
from tailrl.engine.request import Request
from tailrl.model.hf_names import pairs_of
from tailrl.rollout.backends import InstanceDied, LocalBackend
from tailrl.rollout.buffer import BufferEntry, RequestBuffer
from tailrl.rollout.driver import PoolCounters, Rollout
from tailrl.rollout.policies import PolicyConfig, SchedulerPolicy, make_policy
from tailrl.rollout.worker import WorkerInfo, merge_counters
from tailrl.speculative.history import HistoryStore

log = logging.getLogger(__name__)


def _backend(cfg: PoolConfig):
    if cfg.backend == "ray":
        from tailrl.rollout.ray_backend import RayBackend
        return RayBackend(cfg.address)
    processes = cfg.instances > 1 if cfg.processes is None else cfg.processes
    return LocalBackend(processes)


def instance_configs(config: EngineConfig, cfg: PoolConfig, separate: bool) -> list[EngineConfig]:
    """One config per instance. Each instance in its own process gets its share of the cores
    (torch threads). On one machine (not Ray, whose actors each get GPUs of their own),
    ``device="cuda"`` spreads the instances over the visible GPUs (instance i on GPUs
    i * tensor_parallel_size onwards, mod their number); instances that share a GPU (more
    instances than GPUs, or ``cuda:N`` named) split its ``gpu_memory_utilization``, so together
    they take what one would."""
    threads = cfg.threads_per_instance or config.num_threads
    if threads is None and separate:
        threads = max(1, (os.cpu_count() or 1) // cfg.instances)
    devices, share = [config.device] * cfg.instances, {}
    if cfg.backend != "ray" and config.device.startswith("cuda"):
        import torch
        count, tp = torch.cuda.device_count() if torch.cuda.is_available() else 0, config.tensor_parallel_size
        if config.device == "cuda" and count >= 2 * tp:
            devices = [f"cuda:{i * tp % (count - count % tp)}" for i in range(cfg.instances)]
        share = {d: devices.count(d) for d in devices}
    return [EngineConfig(**{**vars(config), "num_threads": threads, "device": d,
                            "gpu_memory_utilization": config.gpu_memory_utilization / share.get(d, 1)})
            for d in devices]


def length_estimates(policy: SchedulerPolicy):
    """What an engine should take as a request's expected length (`Request.priority`) and the
    lengths its critical-path estimate conditions on (`Request.length_prior`)."""
    if hasattr(policy, "estimate"):
        expected = policy.estimate
    elif hasattr(policy, "true_lengths"):
        expected = lambda e: policy.true_lengths[e.request_id]   # noqa: E731
    else:
        expected = lambda e: 0.0                                  # noqa: E731
    return lambda e: (float(expected(e)), policy.known_lengths(e))


class RolloutPool:
    def __init__(self, config: EngineConfig, speculative: SpeculativeConfig | None, cfg: PoolConfig) -> None:
        self.cfg = cfg
        self.backend = _backend(cfg)
        separate = cfg.backend == "ray" or getattr(self.backend, "processes", False)
        self.instances = self.backend.start(instance_configs(config, cfg, separate), speculative)
        self.info: WorkerInfo = self.instances[0].call("info")
        self._synced: list[dict[str, int]] = [{} for _ in self.instances]   # prompt -> history version sent
        self.on_progress = None        # called with the driver after each report (tests, progress bars)
        self.idle_training = False     # instances with nothing to run train the drafter (after spot setup)
        self.last_counters = PoolCounters()

    @property
    def alive(self) -> list:
        return [h for h in self.instances if h.alive]

    def run(self, reqs: list[Request], history: HistoryStore,
            true_lengths: dict[str, int] | None = None) -> tuple[EngineMetrics, dict[str, float], dict[str, float]]:
        """Generate every request to the end (filling its tokens, logprobs, status, finish time).
        Returns (engine counters summed over instances, speculation metrics, pool metrics)."""
        buffer = self._buffer(reqs)
        lengths = {r.prompt_id: history.lengths(r.prompt_id) for r in reqs}
        oracle = None if true_lengths is None else {k: true_lengths[r.request_id] for k, r in enumerate(reqs)}
        # the longest a response may run in this call (its max_tokens, capped by the context)
        chunk = self.cfg.chunk_for(max((e.max_tokens for e in buffer), default=1))
        policy = make_policy(self.cfg.scheduler, PolicyConfig(chunk_tokens=chunk),
                             history={p: v for p, v in lengths.items() if v}, true_lengths=oracle)
        self._each("begin")
        self._sync_history(history, {r.prompt_id for r in reqs})
        rollout = Rollout(self.instances, self.backend, policy, buffer, reqs, self.info.max_num_seqs,
                          self.info.kv_capacity, self.cfg.steps_per_call, length_estimates(policy), self.on_progress)
        rollout.idle_training = self.idle_training
        counters = rollout.run()
        self.last_counters = counters
        parts = [h.call("counters") for h in self.alive]
        engine = merge_counters([p[0] for p in parts])
        extra = self._metrics(counters, chunk)
        for p in parts:                  # CUDA graphs: counts and bytes summed over the instances
            for k, v in p[2].items():
                extra[k] = extra.get(k, 0) + v
        return engine, _mean_spec([p[1] for p in parts]), extra

    def _buffer(self, reqs: list[Request]) -> RequestBuffer:
        groups: dict[str, int] = {}
        entries = []
        for k, r in enumerate(reqs):
            g = groups.setdefault(r.group_id, len(groups))
            limit = min(r.params.max_tokens, self.info.max_model_len - r.num_prompt_tokens)
            entries.append(BufferEntry(k, g, r.prompt_id, r.num_prompt_tokens, limit))
        return RequestBuffer(entries)

    def _sync_history(self, history: HistoryStore, prompt_ids: set[str]) -> None:
        """Send each instance the histories of this step's prompts that changed since it last
        heard (what `generate` recorded and what `history.record` set)."""
        for k, h in enumerate(self.instances):
            if not h.alive:
                continue
            seen = self._synced[k]
            delta = {p: history.get(p) for p in prompt_ids if seen.get(p, 0) != history.version(p)}
            if delta:
                self._call(h, "history", delta)
                seen.update({p: history.version(p) for p in delta})

    def step_log(self, record: bool) -> list[list[dict]]:
        """Per live instance, its engine steps recorded since the last call (the simulator's
        calibration format); ``record`` switches recording on (True) or off (False) from now."""
        return [self._call(h, "step_log", record) or [] for h in self.alive]

    def load_weights(self, weights) -> set[str]:
        """New policy weights to every live instance (``LLMEngine.load_weights``'s: a mapping of
        the whole model, or (name, tensor) pairs of any part), names and shapes checked by one
        instance before any tensor is sent. Returns the checkpoint names written."""
        complete = isinstance(weights, Mapping)
        pairs = list(pairs_of(weights))
        error, written = self._call(self.alive[0], "check_weights",
                                    ([(n, tuple(t.shape)) for n, t in pairs], complete))
        if error is not None:
            raise ValueError(error)
        self._each("load_weights", self.backend.put(dict(pairs) if complete else pairs))
        return written

    def weight_names(self) -> list[str]:
        """The Hugging Face names of a complete checkpoint of the model."""
        return self._call(self.alive[0], "weight_names")

    def reset_prefix_cache(self) -> None:
        """Every live instance forgets its cached prefixes."""
        self._each("reset_prefix_cache", None)

    def spot(self, method: str, *args) -> list:
        """Every live instance's drafter spot trainer: ``spot("setup", factory, *fargs)`` builds
        one per instance with ``factory(engine, *fargs)`` (then instances with nothing to run
        train it during rollouts, ``idle_training``); other methods are called by name
        (worker.SPOT_METHODS) on all, in parallel. Returns their answers."""
        if method == "setup":
            self.idle_training = True
        return self._each("spot", (method, *args))

    def spot_first(self, method: str, *args):
        """``spot`` on the first live instance only (a checkpoint needs one copy)."""
        return self._call(self.alive[0], "spot", (method, *args))

    def _each(self, op: str, payload=None) -> list:
        """The same message to every live instance, answered in parallel; the answers."""
        sent, out, last = [], [], None
        for h in self.alive:
            try:
                h.submit(op, payload)
                sent.append(h)
            except InstanceDied as e:
                log.warning("rollout pool: %s", e)
                last = e
        for h in sent:
            try:
                out.append(h.result())
            except InstanceDied as e:
                log.warning("rollout pool: %s", e)
                last = e
        if not self.alive:
            why = f" (last: {last})" if last is not None else ""
            raise RuntimeError(f"rollout pool: every instance has died{why}") from last
        return out

    def _call(self, h, op: str, payload=None):
        try:
            return h.call(op, payload)
        except InstanceDied as e:
            log.warning("rollout pool: %s", e)
            if not self.alive:
                raise RuntimeError(f"rollout pool: every instance has died (last: {e})") from e
            return None

    def _metrics(self, c: PoolCounters, chunk_tokens: int) -> dict[str, float]:
        m = {"pool/instances": float(len(self.instances)), "pool/instances_alive": float(len(self.alive)),
             "pool/chunk_tokens": float(chunk_tokens), "pool/chunks": float(c.chunks),
             "pool/local_resumes": float(c.local_resumes),
             "pool/migrations": float(c.migrations), "pool/kv_bytes_moved": float(c.kv_bytes_moved),
             "pool/recomputes": float(c.recomputes), "pool/recomputed_tokens": float(c.recomputed_tokens),
             "pool/banked_chunks": float(c.banked), "pool/faults": float(c.faults),
             "pool/idle_train_steps": float(c.idle_train_steps)}
        for i, s in enumerate(c.busy_s):
            m[f"pool/busy_s/{i}"] = s
        return m

    def close(self) -> None:
        for h in self.instances:
            h.close()


COUNT_WORDS = ("tokens", "rows", "steps", "drafts", "calls", "skips")   # counts: summed, not averaged


def _mean_spec(parts: list[dict[str, float]]) -> dict[str, float]:
    """Speculation metrics of the instances: counts summed, rates and lengths averaged over
    the instances that report them."""
    out = {}
    for k in sorted({k for p in parts for k in p}):
        vals = [p[k] for p in parts if k in p]
        out[k] = sum(vals) if any(w in k for w in COUNT_WORDS) else sum(vals) / len(vals)
    return out
