"""`tailrl simulate`: compare scheduling policies on a simulated cluster.

    tailrl simulate --workload qwen2vl-72b --instances 16 --policies static,divided,context,history,oracle

Prints the workload, a table per policy (makespan, speedup and tail vs the first policy,
throughput, idle fraction, preemptions, migrated KV), writes a timeline PNG and a
length-CDF PNG, and ends with one JSON line:
{"workload", "requests", "instances", "baseline", "policies": {name: {makespan_s,
throughput_tok_s, tail_s, idle_frac, preemptions, migrated_gb, prefill_mtok, chunks,
speedup_vs_<baseline>, tail_vs_<baseline>, wall_s, cpu_s}}, "plots": [paths]}.
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from tailrl.rollout.policies import POLICY_NAMES
from tailrl.sim.metrics import table
from tailrl.sim.scenario import Scenario, run_policies


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tailrl simulate", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--workload", default="qwen2vl-72b", help="preset (qwen2vl-72b, moonlight, kimi-k2) or a .jsonl trace")
    a("--requests", type=int, help="override the preset's number of requests (a multiple of its group size)")
    a("--instances", type=int, default=16)
    a("--policies", default="static,divided,context,history,oracle",
      help=f"comma-separated, of {', '.join(POLICY_NAMES)}; the first is the baseline")
    a("--model", help="model shape (default: the preset's deployment)")
    a("--accelerator", help="h800, h100, h20, a100, l40s")
    a("--gpus", type=int, help="accelerators per instance")
    a("--max-num-seqs", type=int, help="batch slots per instance")
    a("--kv-capacity", type=int, help="KV tokens per instance (default: from memory)")
    a("--step-times", help="JSON of measured steps -> calibrated step model instead of roofline")
    a("--chunk-tokens", type=int, default=2048, help="divided rollout chunk size")
    a("--link-gbps", type=float, default=1600.0, help="KV migration bandwidth per instance (Gb/s)")
    a("--rho", type=float, help="within-group correlation of log lengths")
    a("--rank-corr", type=float, help="across-epoch correlation of a prompt's length score")
    a("--sigma", type=float, help="spread of log lengths")
    a("--epoch", type=int, help="epoch of a JSONL trace to simulate (default: the last)")
    a("--draft-tokens", type=int, default=0, help="speculative tokens per request-step (0: off)")
    a("--accept-mean", type=float, default=1.0, help="mean tokens per step with speculation")
    a("--accept-std", type=float, default=0.0)
    a("--seed", type=int, default=0)
    a("--out", default="sim_out", help="directory for the PNGs")
    a("--no-plots", action="store_true")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    policies = [s.strip() for s in args.policies.split(",") if s.strip()]
    bad = [s for s in policies if s not in POLICY_NAMES]
    if not policies or bad:
        print(f"tailrl simulate: --policies must name some of {POLICY_NAMES}, got {bad or args.policies!r}")
        return 2
    try:
        sc = Scenario(workload=args.workload, requests=args.requests, instances=args.instances,
                      model=args.model, accelerator=args.accelerator, gpus=args.gpus,
                      max_num_seqs=args.max_num_seqs, kv_capacity=args.kv_capacity,
                      step_times=args.step_times, chunk_tokens=args.chunk_tokens, link_gbps=args.link_gbps,
                      rho=args.rho, rank_corr=args.rank_corr, sigma=args.sigma, epoch=args.epoch,
                      draft_tokens=args.draft_tokens, accept_mean=args.accept_mean,
                      accept_std=args.accept_std, seed=args.seed)
        trace = sc.trace()
        results = run_policies(sc, policies, trace)
    except ValueError as e:
        print(f"tailrl simulate: {e}")
        return 2
    L = trace.length
    print(f"workload {args.workload}: {len(L)} requests, {len(np.unique(trace.group_id))} groups, "
          f"mean {L.mean():.0f} tokens, p50 {np.median(L):.0f}, p90 {np.percentile(L, 90):.0f}, "
          f"max {L.max()}, at limit {np.mean(L >= trace.max_tokens):.1%}; {args.instances} instances")
    text, figures = table(results, baseline=policies[0])
    print(text)
    for r in results:
        figures[r.policy].update(wall_s=round(r.wall_s, 2), cpu_s=round(r.cpu_s, 2))
    plots = []
    if not args.no_plots:
        from tailrl.sim import plots as P
        out = Path(args.out)
        plots = [str(P.timeline(results, out / "timeline.png")),
                 str(P.length_cdf(results, out / "length_cdf.png", trace.prev_length))]
        print("wrote " + ", ".join(plots))
    print(json.dumps({"workload": args.workload, "requests": int(len(L)), "instances": args.instances,
                      "baseline": policies[0], "policies": figures, "plots": plots}))
    return 0
