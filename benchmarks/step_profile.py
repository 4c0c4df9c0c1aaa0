"""Where a rollout step's time goes: plain with and without steps launched ahead, and speculation.

``benchmarks/gpu.py`` measures the rollouts' makespans; this says why they are what they are.
The 0.5b stand-in's rollout (``--prompts`` x ``--n``, T=1, ``--max-tokens``; round 1 warms each
engine up and is the history), then, per engine (``ahead``: plain, steps launched ahead, the
default with CUDA graphs; ``sync``: plain, each step waiting for the last; ``default``: the
default speculation, whose tail's steps wait for the last, as drafts need the tokens, and whose
bulk's plain steps are launched ahead, ``SpeculativeConfig.ahead_above``):

1. timed rounds, rotating the engines (A B C, then C B A, ...), no profiler attached: makespan,
   step count, the stages per step (``benchmarks/gpu.py``'s ``step_figures``), and the CUDA
   caching allocator's device allocations and retries (a retry frees the cache and waits for
   the GPU); each engine's outputs against the others' (tokens and log-probabilities);
   ``default_speedup``: the fastest plain round over the default's first (its later rounds
   also draft from its earlier timed rounds, the same responses: optimistic);
2. on a GPU, one round of ``ahead`` and of ``default`` under ``torch.cuda.set_sync_debug_mode``:
   every operation that makes the host wait for the device, counted by the Python line that
   asked for it (the sampler's ``Fetched.lists`` wait is the one a step needs);
3. on a GPU, one round of ``ahead`` and of ``default`` under ``torch.profiler``: the operators
   by host time and by device time (``--profile-rows`` rows of each table), last (a profiler
   session slows the process's later CUDA calls).

Usage: python benchmarks/step_profile.py [--device cuda] [--prompts 64 --n 8 --max-tokens 512]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_round import HISTORY_SEED, TIMED_SEED, allocator, rollout, rollout_args, step_figures, sync_sites  # noqa: E402
from regime import model_dir  # noqa: E402

from tailrl import LLM, SpeculativeConfig  # noqa: E402
from tailrl.tasks import mixture  # noqa: E402

REPO = HERE.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    rollout_args(ap)
    ap.add_argument("--rounds", type=int, default=2, help="timed rounds per engine (A B C, C B A, ...)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25)
    ap.add_argument("--profile-rows", type=int, default=18)
    ap.add_argument("--quick", action="store_true", help="4 prompts x 2, max 32: checks the script")
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.n, a.max_tokens = 4, 2, 32
    t_start = time.perf_counter()
    cuda = torch.device(a.device).type == "cuda"
    mdir = model_dir(a.model, Path(a.standin_dir))
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(mdir)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(a.prompts)]
    mem = {"gpu_memory_utilization": a.gpu_memory_utilization} if cuda else {}
    engines = {"ahead": LLM(mdir, device=a.device, seed=0, async_scheduling=True, **mem),
               "sync": LLM(mdir, device=a.device, seed=0, async_scheduling=False, **mem),
               "default": LLM(mdir, device=a.device, seed=0, speculative=SpeculativeConfig(), **mem)}
    out: dict = {"device": torch.cuda.get_device_name() if cuda else a.device, "model": a.model,
                 "rollout": f"{a.prompts}x{a.n} T=1 max {a.max_tokens}"}
    outputs = {}
    for name, llm in engines.items():
        rollout(llm, prompts, a, HISTORY_SEED)                  # warm-up (kernels, graphs) and history
    runs: dict = {name: [] for name in engines}
    names = list(engines)
    order = [n for r in range(a.rounds) for n in (names if r % 2 == 0 else names[::-1])]
    for name in order:
        before = allocator() if cuda else {}
        got, secs = rollout(engines[name], prompts, a, TIMED_SEED)
        outputs[name] = got
        after = allocator() if cuda else {}
        m = engines[name].last_metrics
        runs[name].append({"s": round(secs, 3), **step_figures(m), **{k: after[k] - before[k] for k in after},
                           **({"accept_length": round(m["rollout/spec_accept_length"], 2)}
                              if "rollout/spec_accept_length" in m else {})})
        print(f"{name}: {secs:.3f} s {json.dumps(runs[name][-1])}", flush=True)
    out["runs"] = runs
    out["best_s"] = {name: min(r["s"] for r in rs) for name, rs in runs.items()}
    out["ahead_speedup"] = round(out["best_s"]["sync"] / out["best_s"]["ahead"], 3)
    # the default's later rounds draft from its earlier timed rounds too (the same responses): its
    # first timed round alone is the fair one (history from another seed's round)
    out["default_speedup"] = round(out["best_s"]["ahead"] / runs["default"][0]["s"], 3)
    out["identical"] = outputs["ahead"] == outputs["sync"] == outputs["default"]
    if cuda:
        out["sync_sites"] = {}
        profiled = {name: engines[name] for name in ("ahead", "default")}
        for name, llm in profiled.items():
            try:
                out["sync_sites"][name] = sync_sites(llm, prompts, a)
            except Exception as exc:                    # the profiler tables still run
                traceback.print_exc()
                out["sync_sites"][name] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"synchronising operations, {name}: {json.dumps(out['sync_sites'][name], indent=1)}", flush=True)
        from torch.profiler import ProfilerActivity, profile
        for name, llm in profiled.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                rollout(llm, prompts, a, TIMED_SEED)
            steps = int(llm.last_metrics["rollout/num_forward"])
            table = prof.key_averages()
            for key in ("self_cpu_time_total", "self_device_time_total"):
                print(f"{name} rollout ({steps} steps, profiled), by {key}:\n"
                      + table.table(sort_by=key, row_limit=a.profile_rows, max_name_column_width=60), flush=True)
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
