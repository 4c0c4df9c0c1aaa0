"""The simulator, calibrated on this machine, against the real pool (used by benchmarks/pool.py).

Calibration: time engine steps of one instance (one thread, as the pool's instances run) at
a grid of batch sizes and contexts with the engine's own synthetic step (batch building,
forward, sampling), and fit the simulator's `CalibratedStepModel` (t = c0 + c1 B + c2 N +
c3 K). Then simulate the benchmark's workload trace (its true lengths, the history round's
lengths) with the same policy objects, instance count, batch size and chunk length as the
real pool, and report predicted vs measured makespans.
"""
from __future__ import annotations

import time

import numpy as np

from tailrl.config import EngineConfig
from tailrl.engine.engine import LLMEngine
from tailrl.rollout.policies import PolicyConfig, make_policy
from tailrl.sim.simulator import SimConfig, simulate
from tailrl.sim.step_model import CalibratedStepModel
from tailrl.sim.workload import Trace


def calibrate(model: str, threads: int = 1, batches=(1, 4, 16, 64, 128, 256), contexts=(64, 256, 640),
              repeats: int = 5) -> tuple[CalibratedStepModel, list[dict]]:
    """Fit the step model to measured engine steps (median of `repeats` after a warm-up)."""
    eng = LLMEngine(EngineConfig(model=model, num_threads=threads))
    samples = []
    for b in batches:
        for k in contexts:
            eng.runner.synthetic_step(b, b, k)            # warm-up (allocates the scratch K/V)
            ts = []
            for _ in range(repeats):
                t = time.perf_counter()
                eng.runner.synthetic_step(b, b, k)
                ts.append(time.perf_counter() - t)
            samples.append({"batch": b, "new_tokens": b, "kv_tokens": b * k, "seconds": float(np.median(ts))})
    return CalibratedStepModel.fit(samples), samples


def trace_of(prompts: list[list[int]], lengths: list[list[int]], history: list[list[int]],
             max_tokens: int) -> Trace:
    """The benchmark's workload as a simulator trace (request order = the pool's buffer order)."""
    g, p, pl, mt, ln, prev = [], [], [], [], [], []
    for i, (prompt, group, past) in enumerate(zip(prompts, lengths, history)):
        for j, n in enumerate(group):
            g.append(i), p.append(i), pl.append(len(prompt)), mt.append(max_tokens)
            ln.append(max(1, n)), prev.append(max(1, past[j]) if j < len(past) else 0)
    arr = lambda xs: np.asarray(xs, dtype=np.int64)   # noqa: E731
    return Trace(arr(g), arr(p), arr(pl), arr(mt), arr(ln), prev_length=arr(prev))


def predict(trace: Trace, step_model: CalibratedStepModel, policies, instances: int, max_num_seqs: int,
            chunk_tokens: int, kv_bytes_per_token: int) -> dict[str, float]:
    """Simulated makespan per policy (K/V moves over host memory: about 5 GB/s)."""
    cfg = SimConfig(instances=instances, max_num_seqs=max_num_seqs, kv_capacity=1_000_000,
                    kv_bytes_per_token=kv_bytes_per_token, link_bw=5e9)
    true = {i: int(n) for i, n in enumerate(trace.length.tolist())}
    out = {}
    for name in policies:
        policy = make_policy(name, PolicyConfig(chunk_tokens=chunk_tokens), history=trace.history(), true_lengths=true)
        out[name] = simulate(trace, policy, cfg, step_model).makespan_s
    return out
