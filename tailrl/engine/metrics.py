"""Engine counters, summed over steps, and the verl-style metrics of one generate call."""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import numpy as np


@dataclass
class EngineMetrics:
    num_forward: int = 0
    num_batched_tokens: int = 0
    num_draft_tokens: int = 0
    num_preemptions: int = 0
    sum_batch_size: int = 0
    schedule_s: float = 0.0              # the step's stages (see LLMEngine.step)
    draft_s: float = 0.0
    build_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    postprocess_s: float = 0.0           # verification, commit, finishing
    observe_s: float = 0.0               # the speculator after sampling: outcomes, emitted tokens, hidden states
    num_verify_rows: int = 0             # rows that verified a draft
    num_accepted_tokens: int = 0         # draft tokens accepted (bonus tokens excluded)
    # the K/V pool over a rollout (set by LLMEngine.rollout_counters; summed over a pool's instances)
    kv_blocks: int = 0                   # blocks in the pool
    kv_blocks_peak: int = 0              # most blocks in use at once
    kv_shared_peak: int = 0              # most blocks held by more than one request at once
    kv_allocations: int = 0              # times the pool was allocated (0: it was there already)
    prefix_query_tokens: int = 0         # positions admitted requests looked up in the prefix cache
    prefix_hit_tokens: int = 0           # of them found there (their K/V not computed again)
    # per step (perf_counter at its end, batch size, verify rows, accepted tokens); the caller
    # clears it per rollout, so tail metrics can be computed after the fact
    trace: list[tuple[float, int, int, int]] = field(default_factory=list, repr=False)

    STAGES = ("schedule_s", "draft_s", "build_s", "forward_s", "sample_s", "postprocess_s", "observe_s")

    def record_step(self, batch_size: int, tokens: int, draft_tokens: int, preemptions: int,
                    stages: list[float], verify_rows: int = 0, accepted: int = 0) -> None:
        """``stages``: seconds of each of ``STAGES``, in order."""
        self.trace.append((time.perf_counter(), batch_size, verify_rows, accepted))
        self.num_verify_rows += verify_rows
        self.num_accepted_tokens += accepted
        self.num_forward += 1
        self.num_batched_tokens += tokens
        self.num_draft_tokens += draft_tokens
        self.num_preemptions += preemptions
        self.sum_batch_size += batch_size
        for name, seconds in zip(self.STAGES, stages):
            setattr(self, name, getattr(self, name) + seconds)

    def snapshot(self) -> "EngineMetrics":
        return EngineMetrics(**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"})

    def since(self, before: "EngineMetrics") -> "EngineMetrics":
        """Counters accumulated after `before`; the trace is the steps after it."""
        out = EngineMetrics(**{f.name: getattr(self, f.name) - getattr(before, f.name)
                               for f in fields(self) if f.name != "trace"})
        out.trace = self.trace[len(self.trace) - out.num_forward:] if out.num_forward else []
        return out


def rollout_metrics(lengths: list[int], prompt_lengths: list[int], finish_times: list[float],
                    start: float, end: float, engine: EngineMetrics) -> dict[str, float]:
    """Flat verl-style keys; the README documents each one."""
    wall = max(end - start, 1e-9)
    lens = np.asarray(lengths, dtype=np.float64)
    gen = float(lens.sum())
    m: dict[str, float] = {
        "timing_s/gen": wall,
        "perf/tokens_per_s": gen / wall,
        "perf/throughput": (gen + float(np.sum(prompt_lengths))) / wall,
        "response_length/mean": float(lens.mean()) if lens.size else 0.0,
        "response_length/max": float(lens.max()) if lens.size else 0.0,
        "response_length/min": float(lens.min()) if lens.size else 0.0,
        "prompt_length/mean": float(np.mean(prompt_lengths)) if prompt_lengths else 0.0,
        "rollout/num_requests": float(lens.size),
        "rollout/num_forward": float(engine.num_forward),
        "rollout/batched_tokens": float(engine.num_batched_tokens),
        "rollout/mean_batch_size": engine.sum_batch_size / max(engine.num_forward, 1),
        "rollout/preemptions": float(engine.num_preemptions),
        "kv/blocks": float(engine.kv_blocks),
        "kv/blocks_used_peak": float(engine.kv_blocks_peak),
        "kv/blocks_shared_peak": float(engine.kv_shared_peak),
        "kv/allocations": float(engine.kv_allocations),
        "kv/prefix_query_tokens": float(engine.prefix_query_tokens),
        "kv/prefix_hit_tokens": float(engine.prefix_hit_tokens),
        **{f"timing_s/{name[:-2]}": getattr(engine, name) for name in EngineMetrics.STAGES},
    }
    for q in (50, 90, 99):
        m[f"response_length/p{q}"] = float(np.percentile(lens, q)) if lens.size else 0.0
    if finish_times:
        done = np.sort(np.asarray(finish_times) - start)
        t90 = done[max(int(np.ceil(0.9 * done.size)) - 1, 0)]
        m["rollout/t90_s"] = float(t90)
        m["rollout/tail_s"] = float(done[-1] - t90)   # time spent after 90% of requests finished
        tail = [s for s in engine.trace if s[0] - start > t90]
        m["rollout/tail_forward"] = float(len(tail))
        m["rollout/tail_mean_batch_size"] = float(np.mean([s[1] for s in tail])) if tail else 0.0
        if engine.num_verify_rows:
            rows, acc = sum(s[2] for s in tail), sum(s[3] for s in tail)
            m["rollout/spec_accept_length_tail"] = (acc + rows) / rows if rows else 0.0
    if engine.num_verify_rows:
        m["rollout/spec_verify_rows"] = float(engine.num_verify_rows)
    return m
