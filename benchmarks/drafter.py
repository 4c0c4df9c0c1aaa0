"""The learned drafter against the suffix sources and plain decoding, on one rollout.

Rollout: 64 held-out prompts x 8 samples at temperature 1 (``--quick``: 16 x 8), in the
engine's default dtype and policy (6-token chains). Suffix and hybrid draft from a previous
sampling round of the same prompts (other seeds), recorded as their history, as in RL.
The drafter is warm-started by ``tailrl train-drafter`` on training prompts (never the
held-out ones) unless ``--drafter DIR`` gives one.

Reports, per method (drafter / suffix / hybrid):
- accepted tokens per verify step (incl. the bonus token; also per source for hybrid), overall
  and in the tail (after 90% of the responses finished);
- rollout makespan ratio vs plain (plain makespan / method's): the methods and plain run in
  ABBA order ``--rounds`` times, each ratio is the mean of the rounds';
- whether every response equals plain's (it must: verification is lossless);
- drafting cost: the drafter rollout's drafting time over its target forward time, and one
  drafter step at batch 1 and 64 over one target decode forward at the same batch (both over
  a 128-token past), and the drafter K/V of one committed position per row (computed once
  per position, batched) over the same forward.
Ends with one JSON line: {"drafter": {...}, "suffix": {...}, "hybrid": {...}, "cost": {...},
"train": {...}}.
Usage: python benchmarks/drafter.py [--model models/small] [--drafter DIR] [--quick] [--train-steps N]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from speculation import load_prompts, rollout  # noqa: E402

from tailrl import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from tailrl.engine.batch import ModelRunner  # noqa: E402
from tailrl.engine.kv_cache import KVCache  # noqa: E402
from tailrl.engine.request import Request  # noqa: E402
from tailrl.model.drafter import Drafter  # noqa: E402
from tailrl.model.loader import DTYPES, load_model  # noqa: E402
from tailrl.rl.drafter_train import task_prompts, warm_start  # noqa: E402

METHODS = ("suffix", "drafter", "hybrid")


def step_cost(model_dir: str, drafter_dir: str, dtype: str, batch: int, repeat: int = 20) -> dict:
    """Median seconds of one target decode forward and one drafter step at ``batch`` rows, both
    over a 128-token past (the drafter's step: depth 3 of a chain, so 2 path positions)."""
    model = load_model(model_dir, dtype)
    drafter = Drafter.load(drafter_dir, model)
    kv = KVCache(model.args, DTYPES[dtype], "cpu", batch * 256, batch, 256)
    runner = ModelRunner(model, kv)
    reqs = [Request(f"r{i}", [(5 * i + j) % 200 + 3 for j in range(128)], SamplingParams(), 0) for i in range(batch)]
    kv.reserve(batch, 160)
    for i, r in enumerate(reqs):
        r.row = i
    runner.run(runner.build([(r, r.num_prompt_tokens - 1) for r in reqs], {}))
    for r in reqs:
        r.num_computed_tokens = r.num_prompt_tokens - 1
    decode = runner.build([(r, 1) for r in reqs], {})
    feats = torch.randn(batch, model.args.hidden_size)
    toks = torch.randint(0, model.args.vocab_size, (batch,))
    c = drafter.cfg
    past = (torch.randn(batch, c.num_heads, c.head_dim, 128), torch.randn(batch, c.num_heads, 128, c.head_dim),
            torch.zeros(batch, 128))
    path = tuple(torch.randn(batch, c.num_heads, 2, c.head_dim) for _ in range(2))
    pos = torch.full((batch,), 130)
    committed = torch.randn(batch, model.args.hidden_size), toks, pos

    def timed(fn) -> float:
        times = []
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return float(np.median(times))

    with torch.inference_mode():
        target = timed(lambda: runner.run(decode))
        draft = timed(lambda: drafter.step(feats, toks, pos, past, None, path))
        kv_s = timed(lambda: drafter.committed_kv(*committed))
    return {"target_s": target, "drafter_step_s": draft, "share": draft / target,
            "committed_kv_s": kv_s, "committed_kv_share": kv_s / target}


def same(a, b) -> bool:
    return all(x == y for ga, gb in zip(a, b, strict=True) for x, y in zip(ga, gb, strict=True))


def compare(model_dir: str, drafter_dir: str, prompts, n: int, max_tokens: int, dtype: str, rounds: int) -> dict:
    history, _ = rollout(LLM(model_dir, dtype=dtype, seed=1), prompts, n, 1000, max_tokens)
    llms = {"plain": LLM(model_dir, dtype=dtype)}
    for m in METHODS:
        cfg = SpeculativeConfig(method=m, drafter=None if m == "suffix" else drafter_dir)
        llms[m] = LLM(model_dir, dtype=dtype, speculative=cfg)
    runs: dict[str, list] = {k: [] for k in llms}
    order = ["plain", *METHODS]
    for r in range(rounds):
        for name in (order if r % 2 == 0 else order[::-1]):     # ABBA: the machine drifts
            for i, resp in enumerate(history):                  # every run drafts from the same previous round
                llms[name].history.record(f"p{i}", resp)
            runs[name].append(rollout(llms[name], prompts, n, 0, max_tokens))
            met = runs[name][-1][1]
            calls = (f" | drafter calls {met['rollout/spec_drafter_calls']:.0f} (exploring "
                     f"{met['rollout/spec_drafter_explore_calls']:.0f}, skipped by the gate "
                     f"{met['rollout/spec_drafter_gate_skips']:.0f}) {met['timing_s/drafter']:.2f} s"
                     if "rollout/spec_drafter_calls" in met else "")
            print(f"round {r} {name:8s} makespan {met['timing_s/gen']:.2f} s | forward {met['timing_s/forward']:.2f} s"
                  f"{calls}", flush=True)
    out = {}
    for m in METHODS:
        met = runs[m][0][1]
        ratios = [p[1]["timing_s/gen"] / s[1]["timing_s/gen"] for p, s in zip(runs["plain"], runs[m])]
        out[m] = {"accept_length": round(met["rollout/spec_accept_length"], 3),
                  "accept_length_tail": round(met.get("rollout/spec_accept_length_tail", 0.0), 3),
                  "tail_s": round(met.get("rollout/tail_s", 0.0), 2),
                  "speedup_vs_plain": round(float(np.mean(ratios)), 3), "round_ratios": [round(x, 3) for x in ratios],
                  "makespan_s": round(met["timing_s/gen"], 2), "identical_to_plain": same(runs["plain"][0][0], runs[m][0][0]),
                  "draft_over_forward": round(met["timing_s/draft"] / met["timing_s/forward"], 3)}
        for src in ("history", "group", "self", "drafter"):
            if met.get(f"rollout/spec_draft_tokens/{src}", 0) > 0:
                out[m][f"accept_length/{src}"] = round(met[f"rollout/spec_accept_length/{src}"], 3)
                out[m][f"draft_tokens/{src}"] = int(met[f"rollout/spec_draft_tokens/{src}"])
    out["plain_makespan_s"] = round(runs["plain"][0][1]["timing_s/gen"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: warm-start one now)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=960)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds of plain and every method")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--train-prompts", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=1000)
    ap.add_argument("--quick", action="store_true", help="16 prompts, one round")
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.rounds = 16, 1
    train = {}
    drafter_dir = a.drafter
    if drafter_dir is None:
        drafter_dir = tempfile.mkdtemp(prefix="tailrl_drafter_")
        train = warm_start(a.model, drafter_dir, task_prompts(a.model, a.train_prompts), n=4, max_tokens=512,
                           steps=a.train_steps)
        print(f"warm start: {json.dumps(train)}", flush=True)
    res = compare(a.model, drafter_dir, load_prompts(a.model, a.prompts), a.n, a.max_tokens, a.dtype, a.rounds)
    res["cost"] = {f"batch{b}": {k: round(v, 6) for k, v in step_cost(a.model, drafter_dir, a.dtype, b).items()}
                   for b in (1, 64)}
    res["train"] = {k: round(v, 3) for k, v in train.items()}
    res["config"] = {"prompts": a.prompts, "n": a.n, "max_tokens": a.max_tokens, "dtype": a.dtype,
                     "rounds": a.rounds, "drafter": drafter_dir}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
