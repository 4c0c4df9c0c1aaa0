"""The learned drafter against the suffix sources and plain decoding, on one rollout.

Rollout: 64 held-out prompts x 8 samples at temperature 1 (``--quick``: 16 x 8), in the
engine's default dtype and policy (6-token chains). Suffix and hybrid draft from a previous
sampling round of the same prompts (other seeds), recorded as their history, as in RL.
The drafter is warm-started by ``tailrl train-drafter`` on training prompts (never the
held-out ones) unless ``--drafter DIR`` gives one.

Every engine first runs one rollout of its own (its first rollout: the KV cache grows, the
speculation policy and the drafter's prices start unmeasured; reported apart), then the
methods and plain run in ABBA order ``--rounds`` times (the machine's speed drifts over
minutes), suffix and hybrid next to each other and never right after the drafter alone
(measured: whichever rollout came right after it ran 4-25% slower, in 6 rounds of 6).

Reports, per method (drafter / suffix / hybrid), over the timed rounds:
- accepted tokens per verify step (incl. the bonus token; also per source for hybrid), overall
  and in the tail (after 90% of the responses finished); for hybrid also the drafter's calls
  and its shadow drafts (drafted to measure it, scored on the emitted tokens, never verified);
- rollout makespan ratio vs plain (plain makespan / method's) per round, with the mean, its
  standard error and the range; the makespan over the no-tail bound (total tokens / the plain
  engine's full-batch throughput, measured in the same run);
- hybrid against the faster of suffix and drafter alone, per round (the target: >= 1 within
  noise);
- the share of responses equal to plain's (1 in bfloat16 and float64: verification is
  lossless and the kernels are row-invariant; float32 may flip a rare near-tie);
- drafting cost: the drafter rollout's drafting time over its target forward time, and one
  drafter step at batch 1 and 64 over one target decode forward at the same batch (both over
  a 128-token past), and the drafter K/V of one committed position per row (computed once
  per position, batched) over the same forward.
Ends with a text summary and one JSON line: {"drafter": {...}, "suffix": {...}, "hybrid":
{...}, "hybrid_vs_best": {...}, "no_tail_bound_s", "bound_ratio": {...}, "cost": {...},
"train": {...}}.
On a GPU (``--device cuda``; #35's rollout: ``--model 0.5b --max-tokens 512``, the 0.5b
stand-in of `small` built into ``--standin-dir`` on first use), everything runs there: the
warm start (sampling, the teacher-forced states, training), the rollouts, the step costs
(synchronised). ``--model`` takes a directory, a preset or a stand-in name; ``--tree-paths``
sets every method's ``max_tree_paths`` (trees of drafts, where a flat step curve may pay for them).
Usage: python benchmarks/drafter.py [--model models/small] [--drafter DIR] [--quick] [--train-steps N]
       python benchmarks/drafter.py --device cuda --model 0.5b --max-tokens 512 --rounds 2
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from speculation import full_batch_throughput, load_prompts, rollout  # noqa: E402

from tailrl import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from tailrl.cli.train_drafter import task_prompts, warm_start  # noqa: E402
from tailrl.drafter.network import Drafter  # noqa: E402
from tailrl.engine.batch import ModelRunner  # noqa: E402
from tailrl.engine.kv import KVCache  # noqa: E402
from tailrl.engine.request import Request  # noqa: E402
from tailrl.model.loader import DTYPES, load_model  # noqa: E402

METHODS = ("suffix", "drafter", "hybrid")


def step_cost(model_dir: str, drafter_dir: str, dtype: str, batch: int, repeat: int = 20,
              device: str = "cpu") -> dict:
    """Median seconds of one target decode forward and one drafter step at ``batch`` rows, both
    over a 128-token past (the drafter's step: a chain depth as the engine drafts it, in the
    target's dtype: ``drafter_step.depth_runner``, from its CUDA graph on a GPU)."""
    from drafter_step import depth_runner
    model = load_model(model_dir, dtype, device)
    drafter = Drafter.load(drafter_dir, model)
    graphs = None
    if torch.device(device).type == "cuda":
        from tailrl.drafter.graphs import DrafterGraphs
        from tailrl.engine.graph_pool import GraphPool, cuda_capture
        graphs = DrafterGraphs(GraphPool(1 << 30, cuda_capture))
    mode = "kernels" if graphs is None else "graphs"
    depth = depth_runner(copy.deepcopy(drafter).to(DTYPES[dtype]), batch, 130, mode, graphs)
    kv = KVCache(model.args, DTYPES[dtype], device, batch * 256, batch, 256)
    runner = ModelRunner(model, kv)
    reqs = [Request(f"r{i}", [(5 * i + j) % 200 + 3 for j in range(128)], SamplingParams(), 0) for i in range(batch)]
    kv.grow_rows([(i, 160) for i in range(batch)])
    for i, r in enumerate(reqs):
        r.row = i
    runner.run(runner.build([(r, r.num_prompt_tokens - 1) for r in reqs], {}))
    for r in reqs:
        r.num_computed_tokens = r.num_prompt_tokens - 1
    decode = runner.build([(r, 1) for r in reqs], {})
    toks = torch.randint(0, model.args.vocab_size, (batch,), device=device)
    pos = torch.full((batch,), 130, device=device)
    committed = torch.randn(batch, model.args.hidden_size, device=device), toks, pos
    wait = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        times = []
        for _ in range(repeat):
            wait()
            t = time.perf_counter()
            fn()
            wait()
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    with torch.inference_mode():
        target = timed(lambda: runner.run(decode))
        depth()                                          # kernels built, graph captured
        draft = timed(depth)
        kv_s = timed(lambda: drafter.committed_kv(*committed))
    return {"target_s": target, "drafter_step_s": draft, "share": draft / target,
            "committed_kv_s": kv_s, "committed_kv_share": kv_s / target}


def identical_share(a, b) -> float:
    """The share of responses of rollout ``a`` equal to ``b``'s (prompt by prompt, sample by sample)."""
    pairs = [(x, y) for ga, gb in zip(a, b, strict=True) for x, y in zip(ga, gb, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def spread(xs: list[float]) -> dict:
    """Mean, standard error of the mean, min and max of per-round ratios."""
    a = np.asarray(xs, dtype=float)
    se = round(float(a.std(ddof=1) / np.sqrt(len(a))), 3) if len(a) > 1 else None
    return {"mean": round(float(a.mean()), 3), "se": se, "min": round(float(a.min()), 3),
            "max": round(float(a.max()), 3), "rounds": [round(float(x), 3) for x in a]}


def compare(model_dir: str, drafter_dir: str, prompts, n: int, max_tokens: int, dtype: str, rounds: int,
            device: str = "cpu", tree_paths: int = 1) -> dict:
    # four engines at once: on a GPU each takes a fifth of its memory
    kw = dict(dtype=dtype, device=device, **({"gpu_memory_utilization": 0.2} if device.startswith("cuda") else {}))
    history, _ = rollout(LLM(model_dir, seed=1, **kw), prompts, n, 1000, max_tokens)
    llms = {"plain": LLM(model_dir, **kw)}
    for m in METHODS:
        cfg = SpeculativeConfig(method=m, drafter=None if m == "suffix" else drafter_dir, max_tree_paths=tree_paths)
        llms[m] = LLM(model_dir, speculative=cfg, **kw)
    # suffix and hybrid side by side in every round (their comparison is the target), never right
    # after the drafter alone (see the module docstring)
    order = ["suffix", "hybrid", "plain", "drafter"]
    runs: dict[str, list] = {k: [] for k in llms}
    first: dict[str, float] = {}
    for r in range(-1, rounds):                                 # round -1: each engine's first rollout
        for name in (order if r % 2 == 0 else order[::-1]):     # ABBA: the machine drifts
            for i, resp in enumerate(history):                  # every run drafts from the same previous round
                llms[name].history.record(f"p{i}", resp)
            done = rollout(llms[name], prompts, n, 0, max_tokens)
            met = done[1]
            if r < 0:
                first[name] = met["timing_s/gen"]
            else:
                runs[name].append(done)
            calls = (f" | drafter calls {met['rollout/spec_drafter_calls']:.0f} (exploring "
                     f"{met['rollout/spec_drafter_explore_calls']:.0f}, skipped by the gate "
                     f"{met['rollout/spec_drafter_gate_skips']:.0f}) {met['timing_s/drafter']:.2f} s, a call "
                     f"priced {met['rollout/spec_drafter_price_call_s'] * 1e3:.2f} ms + "
                     f"{met['rollout/spec_drafter_price_request_s'] * 1e3:.3f} ms a request, accepting "
                     f"{met['rollout/spec_drafter_mean_accepted']:.2f}"
                     if "rollout/spec_drafter_calls" in met else "")
            print(f"{'first' if r < 0 else f'round {r}':8s} {name:8s} makespan {met['timing_s/gen']:.2f} s | "
                  f"forward {met['timing_s/forward']:.2f} s{calls}", flush=True)
    plain = [p[1]["timing_s/gen"] for p in runs["plain"]]
    span = {m: [x[1]["timing_s/gen"] for x in runs[m]] for m in METHODS}
    out: dict = {}
    for m in METHODS:
        mets = [x[1] for x in runs[m]]
        mean = lambda key: round(float(np.mean([x.get(key, 0.0) for x in mets])), 3)   # noqa: E731
        out[m] = {"accept_length": mean("rollout/spec_accept_length"),
                  "accept_length_tail": mean("rollout/spec_accept_length_tail"),
                  "tail_s": mean("rollout/tail_s"), "makespan_s": mean("timing_s/gen"),
                  "first_rollout_s": round(first[m], 2),
                  "speedup_vs_plain": spread([p / s for p, s in zip(plain, span[m])]),
                  # over every timed round (bfloat16: 1.0; float32 may flip a rare near-tie, see README)
                  "identical_to_plain": round(float(np.mean([identical_share(runs["plain"][0][0], x[0])
                                                             for x in runs[m]])), 4),
                  "draft_over_forward": round(float(np.mean([x["timing_s/draft"] / x["timing_s/forward"]
                                                             for x in mets])), 3)}
        for src in ("history", "group", "self", "drafter"):
            if mets[0].get(f"rollout/spec_draft_tokens/{src}", 0) > 0:
                out[m][f"accept_length/{src}"] = mean(f"rollout/spec_accept_length/{src}")
                out[m][f"draft_tokens/{src}"] = mean(f"rollout/spec_draft_tokens/{src}")
        if "graphs/drafter_replayed_depths" in mets[0]:      # a GPU engine: chain depths from CUDA graphs
            out[m]["drafter_graph_depths"] = mean("graphs/drafter_replayed_depths")
            out[m]["drafter_eager_depths"] = mean("graphs/drafter_eager_depths")
        if "rollout/spec_drafter_calls" in mets[0]:
            for key in ("calls", "explore_calls", "gate_skips", "shadow_drafts", "shadow_accept_length",
                        "price_call_s", "price_request_s", "mean_accepted"):
                out[m][f"drafter_{key}"] = mean(f"rollout/spec_drafter_{key}")
    # the target: hybrid at least as fast as the faster of suffix and drafter alone, round by round
    out["hybrid_vs_best"] = spread([min(a, b) / h for a, b, h in zip(span["suffix"], span["drafter"], span["hybrid"])])
    out["plain_makespan_s"] = round(float(np.mean(plain)), 2)
    out["plain_first_rollout_s"] = round(first["plain"], 2)
    out["total_tokens"] = int(sum(len(c) for g in runs["plain"][0][0] for c in g))
    return out


def summary(res: dict) -> str:
    """The table the README shows, as text."""
    lines = [f"{'method':8s} {'speedup vs plain (mean +- se)':30s} {'tokens/verify all, tail':24s} "
             f"{'makespan / no-tail bound':24s} first rollout  identical to plain"]
    for m in METHODS:
        r, s = res[m], res[m]["speedup_vs_plain"]
        lines.append(f"{m:8s} {s['mean']:.3f} +- {s['se'] or 0:.3f} [{s['min']:.2f}, {s['max']:.2f}]{'':7s} "
                     f"{r['accept_length']:.2f}, {r['accept_length_tail']:.2f}{'':14s} "
                     f"{res['bound_ratio'][m]:.2f}{'':20s} {r['first_rollout_s']:.2f} s{'':8s}"
                     f"{r['identical_to_plain']:.4f}")
    h = res["hybrid_vs_best"]
    lines.append(f"hybrid vs the faster of suffix and drafter, per round: {h['mean']:.3f} +- {h['se'] or 0:.3f} "
                 f"[{h['min']:.2f}, {h['max']:.2f}] (> 1: hybrid faster)")
    lines.append(f"no-tail bound {res['no_tail_bound_s']:.2f} s ({res['total_tokens']} tokens); plain "
                 f"{res['plain_makespan_s']:.2f} s ({res['bound_ratio']['plain']:.2f}x the bound)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: warm-start one now)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=960)
    ap.add_argument("--rounds", type=int, default=4, help="ABBA rounds of plain and every method")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--train-prompts", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="16 prompts, two rounds")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tree-paths", type=int, default=1, help="max_tree_paths of every method (1: chains)")
    ap.add_argument("--standin-dir", default="/tmp/tailrl-standins")
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.rounds = 16, 2
    from regime import model_dir  # here: regime imports this module's helpers
    a.model = model_dir(a.model, Path(a.standin_dir))
    train = {}
    prompts = load_prompts(a.model, a.prompts)
    drafter_dir = a.drafter
    if drafter_dir is None:
        drafter_dir = tempfile.mkdtemp(prefix="tailrl_drafter_")
        train = warm_start(a.model, drafter_dir, task_prompts(a.model, a.train_prompts), n=4, max_tokens=512,
                           steps=a.train_steps, device=a.device)
        print(f"warm start: {json.dumps(train)}", flush=True)
    res = compare(a.model, drafter_dir, prompts, a.n, a.max_tokens, a.dtype, a.rounds, a.device, a.tree_paths)
    full = full_batch_throughput(a.model, prompts, a.dtype, device=a.device)
    res["no_tail_bound_s"] = round(res["total_tokens"] / full, 2)
    res["bound_ratio"] = {m: round(res[m]["makespan_s"] / res["no_tail_bound_s"], 2) for m in METHODS}
    res["bound_ratio"]["plain"] = round(res["plain_makespan_s"] / res["no_tail_bound_s"], 2)
    res["cost"] = {f"batch{b}": {k: round(v, 6) for k, v in
                                 step_cost(a.model, drafter_dir, a.dtype, b, device=a.device).items()}
                   for b in (1, 64)}
    res["train"] = {k: round(v, 3) for k, v in train.items()}
    res["config"] = {"prompts": a.prompts, "n": a.n, "max_tokens": a.max_tokens, "dtype": a.dtype,
                     "rounds": a.rounds, "drafter": drafter_dir, "device": a.device, "model": a.model,
                     "tree_paths": a.tree_paths}
    print(summary(res))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
