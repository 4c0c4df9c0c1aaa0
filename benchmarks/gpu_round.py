"""One timed rollout round on a device, and the figures it reports: shared by benchmarks/gpu.py
and benchmarks/step_profile.py. The round (``rollout``: ``--prompts`` held-out task prompts x
``--n``, T=1, ``--max-tokens``, seeded per prompt), its step figures (``step_figures``: stages,
garbage collection, graphs, the measured tail's ways), and what else a round on a GPU can be
asked: the caching allocator's allocations and retries (``allocator``), the Triton kernels
compiled so far (``compiled_kernels``), and the operations that made the host wait for the
device (``sync_sites``); ``settle_heap`` between the parts of a run.
"""
from __future__ import annotations

import argparse
import collections
import gc
import traceback
import warnings
from pathlib import Path

import torch

from tailrl import LLM, SamplingParams

HISTORY_SEED, TIMED_SEED = 10_000, 20_000


def settle_heap(device: str) -> None:
    """Collect the garbage of the parts before (a dropped engine's reference cycles, with its
    graphs and K/V pool) and give its device memory back, outside any timed round: otherwise the
    collection, and the device's frees it makes, land in the next rollout's steps."""
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def allocator() -> dict:
    """The CUDA caching allocator's device allocations, frees and retries so far (a retry frees
    the cache and waits for the GPU)."""
    s = torch.cuda.memory_stats()
    return {"device_allocs": s.get("num_device_alloc", 0), "alloc_retries": s.get("num_alloc_retries", 0),
            "device_frees": s.get("num_device_free", 0)}


def compiled_kernels() -> int:
    """Binaries Triton holds for tailrl's GPU kernels so far, every specialisation of each (a
    round that adds some compiled inside it: the H200 runs of stop 46 found rollouts slowed after
    an engine's kernels compiled). Counts ``JITFunction.device_caches``' kernel caches."""
    import importlib
    import pkgutil

    import triton

    import tailrl.kernels.gpu as gpu_kernels
    total = 0
    for info in pkgutil.iter_modules(gpu_kernels.__path__):
        module = importlib.import_module(f"tailrl.kernels.gpu.{info.name}")
        for fn in vars(module).values():
            if isinstance(fn, triton.runtime.JITFunction):
                total += sum(len(entry[0]) for entry in getattr(fn, "device_caches", {}).values())
    return total


def sync_sites(llm: LLM, prompts, a) -> dict:
    """One round with every synchronising CUDA operation reported: counts by the innermost
    lines of tailrl (or of the benchmarks) that led to it."""
    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        if "debug mode is a prototype" in str(message):  # PyTorch's notice on turning the mode on
            return
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/tailrl/" in f.filename or "/benchmarks/" in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[::-1][:3])
        sites[f"{str(message)[:60]} @ {where}"] += 1

    with warnings.catch_warnings():                   # restores the filters and showwarning after
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rollout(llm, prompts, a, TIMED_SEED)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    steps = llm.last_metrics["rollout/num_forward"]
    return {"steps": int(steps), "sites": dict(sites.most_common(12))}


def rollout(llm: LLM, prompts: list[list[int]], a: argparse.Namespace, seed: int) -> tuple[list, float]:
    params = [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, prompt_ids=[f"p{i}" for i in range(len(prompts))])
    return [[(list(c.token_ids), list(c.logprobs)) for c in o.outputs] for o in outs], llm.last_metrics["timing_s/gen"]


def step_figures(m: dict) -> dict:
    """A rollout's steps: count, wall ms per step, the speculator's host ms per step, the
    cyclic garbage collector's ms in the whole rollout and its full collections, the
    engine's own stages per step (``stage_ms``: schedule, build, forward, sample, postprocess:
    on a GPU all but the forward's kernels are host work, and ``sample`` also waits for the
    forward), a speculative engine's rate probes (``probe_steps``), and the CUDA graphs (share
    of steps replayed, captures, pool MB, budget MB, and the engine's start-up captures: count,
    seconds)."""
    steps = max(m["rollout/num_forward"], 1)
    out = {"steps": int(steps), "step_ms": round(m["timing_s/gen"] / steps * 1e3, 3),
           "spec_host_ms": round((m["timing_s/draft"] + m["timing_s/observe"]) / steps * 1e3, 3),
           "gc_ms": round(m.get("timing_s/gc", 0.0) * 1e3, 1), "gc_full": int(m.get("rollout/gc_full_collections", 0)),
           "stage_ms": {k: round(m[f"timing_s/{k}"] / steps * 1e3, 3)
                        for k in ("schedule", "build", "forward", "sample", "postprocess") if f"timing_s/{k}" in m}}
    if "rollout/spec_probe_steps" in m:         # the priced policy's rate probes (policies/priced.py, rule 5)
        out["probe_steps"] = int(m["rollout/spec_probe_steps"])
    if "rollout/tail_plain_steps" in m:         # the measured tail's ways (engine/tail_choice.py)
        out["tail_steps"] = {w: int(m[f"rollout/tail_{w}_steps"]) for w in ("speculate", "plain")}
    if "graphs/replayed_steps" in m:
        out.update(graph_share=round(m["graphs/replayed_steps"] / steps, 3), graph_captures=m["graphs/captures"],
                   graph_mb=round(m["graphs/peak_bytes"] / 2**20, 1),
                   graph_budget_mb=round(m["graphs/budget_bytes"] / 2**20, 1),
                   graph_warmup=(int(m.get("graphs/warmup_captures", 0)), round(m.get("graphs/warmup_s", 0.0), 2)))
    return out


def rollout_args(ap: argparse.ArgumentParser) -> None:
    """The GPU rollout's options (device, model, its stand-ins' folder, prompts x n, max tokens)."""
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--standin-dir", default="/tmp/tailrl-standins")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
