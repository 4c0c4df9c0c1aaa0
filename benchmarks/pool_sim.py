"""The simulator, calibrated on this machine, against the real pool (used by benchmarks/pool.py).

Calibration: real engine steps, measured by as many processes at once as the pool has
instances (one thread each, as the pool's instances run):
for a grid of batch sizes and contexts, requests whose first `context` output tokens are
given: the prefill step is timed when it is as short as the workload's prompts (after a
warm-up request: an engine's first steps pay its set-up), then decode steps (the mean of
`repeats` after a warm-up: a rollout's time is a sum of steps, spikes included). The simulator's `CalibratedStepModel`
(t = c0 + c1 B + c2 N + c3 K) is fitted to those samples. Then the benchmark's workload trace
(its true lengths, the history round's lengths) is simulated with the same policy objects,
instance count, batch size and chunk length as the real pool, and the predicted makespans
are reported next to the measured ones.
"""
from __future__ import annotations

import multiprocessing
import time

import numpy as np

from tailrl.config import EngineConfig, SamplingParams
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request
from tailrl.model.loader import read_args
from tailrl.rollout.policies import PolicyConfig, make_policy
from tailrl.sim.simulator import SimConfig, simulate
from tailrl.sim.step_model import CalibratedStepModel
from tailrl.sim.workload import Trace

PROMPT = [1, 5, 9, 4]
STEP_TOKENS = 16384                                # the calibration engine's token budget per step


def _timed_step(eng: LLMEngine) -> float:
    t = time.perf_counter()
    eng.step()
    return time.perf_counter() - t


def _measure(model: str, threads: int, batch: int, context: int, repeats: int) -> list[dict]:
    """A decode step's time at (batch, context), and the prefill's when it is short and fits one step."""
    eng = LLMEngine(EngineConfig(model=model, num_threads=threads, max_num_seqs=batch,
                                 max_num_batched_tokens=STEP_TOKENS))
    vocab = read_args(model).vocab_size
    eng.add_request(Request("warm-up", list(PROMPT), SamplingParams(max_tokens=2), 1))
    while eng.has_unfinished():                        # the first steps of an engine pay its set-up
        eng.step()
    sp = SamplingParams(max_tokens=context + repeats + 8, ignore_eos=True)
    for i in range(batch):
        out = [3 + (i * 7 + j) % (vocab - 3) for j in range(context)]
        eng.add_request(Request(f"c{i}", list(PROMPT), sp, 1000 + i, output_token_ids=out,
                                output_logprobs=[0.0] * context))
    n = len(PROMPT) + context
    samples = []
    first = _timed_step(eng)
    if batch * n <= STEP_TOKENS and context <= 64:     # prefills as short as the workload's prompts
        samples.append({"batch": batch, "new_tokens": batch * n, "kv_tokens": batch * n, "seconds": first})
    while any(not r.is_decoding for r in eng.requests.values()):
        eng.step()
    for _ in range(2):                                 # warm-up: the cache's first touches
        eng.step()
    ts = [_timed_step(eng) for _ in range(repeats)]
    samples.append({"batch": batch, "new_tokens": batch, "kv_tokens": batch * (n + 3), "seconds": float(np.mean(ts))})
    return samples


def _grid(model: str, threads: int, batches, contexts, repeats: int) -> list[dict]:
    return [s for b in batches for k in contexts for s in _measure(model, threads, b, k, repeats)]


def calibrate(model: str, threads: int = 1, instances: int = 1, batches=(1, 4, 16, 64, 256),
              contexts=(64, 256, 640), repeats: int = 5) -> tuple[CalibratedStepModel, list[dict]]:
    """Fit the step model to measured engine steps. With ``instances`` > 1 that many processes
    measure the same grid at the same time, as the pool's instances step side by side (they
    share the memory bandwidth and the last-level cache); every process's samples count."""
    if instances == 1:
        samples = _grid(model, threads, batches, contexts, repeats)
    else:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(instances) as pool:
            runs = pool.starmap(_grid, [(model, threads, batches, contexts, repeats)] * instances)
        samples = [s for run in runs for s in run]
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
