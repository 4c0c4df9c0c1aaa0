"""The scheduling-policy ladder on the Qwen2-VL-72B-like workload at Seer's scale.

    PYTHONPATH=. python benchmarks/simulate_ladder.py [--quick]

1. The ladder: static, divided, context, history, oracle on 9,600 requests (groups of 16,
   max 40,960, mean ~7,615 tokens) on 16 instances of 8 x H800, next to Seer's published
   ablation (divided 1.42x, +context 1.56x, oracle 1.63x over veRL; tail time 0.79 / 0.11
   / 0.00 of veRL's).
2. Sensitivity of `context` to the within-group length correlation `rho`.
3. `history` under across-epoch rank churn (`rank_corr` 1.0 = the previous epoch ranks
   prompts exactly as this one; 0 = history is noise).

Prints tables; the last line is one JSON object with every figure. Ratios only: wall time
is reported, never asserted.
"""
from __future__ import annotations

import argparse
import json
import sys

from tailrl.sim.metrics import table
from tailrl.sim.scenario import Scenario, run_policies

SEER = {"divided": (1.42, 0.79), "context": (1.56, 0.11), "oracle": (1.63, 0.00)}  # speedup, tail vs veRL


def ladder(sc: Scenario) -> dict:
    res = run_policies(sc, ["static", "divided", "context", "history", "oracle"])
    text, fig = table(res)
    print(text)
    print(f"\n{'policy':<9} {'speedup':>8} {'Seer':>6} {'tail/static':>12} {'Seer':>6}")
    for name, (sp, tail) in SEER.items():
        f = fig[name]
        print(f"{name:<9} {f['speedup_vs_static']:>7.2f}x {sp:>5.2f}x {f['tail_vs_static']:>12.2f} {tail:>6.2f}")
    ctx, orc = fig["context"]["makespan_s"], fig["oracle"]["makespan_s"]
    print(f"context / oracle throughput: {orc / ctx:.1%} (Seer: ~95%)")
    return fig


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/4 of the requests and instances")
    args = ap.parse_args(argv)
    scale = dict(requests=2400, instances=4) if args.quick else dict(requests=9600, instances=16)
    out: dict = {"scale": scale}

    print(f"== ladder: qwen2vl-72b, {scale['requests']} requests, {scale['instances']} instances")
    out["ladder"] = ladder(Scenario(**scale))

    print("\n== context vs within-group correlation rho")
    out["rho"] = {}
    for rho in (0.6, 0.8, 0.9):
        res = run_policies(Scenario(rho=rho, **scale), ["static", "context", "oracle"])
        _, fig = table(res)
        out["rho"][str(rho)] = {n: {k: fig[n][k] for k in ("speedup_vs_static", "tail_vs_static")} for n in fig}
        c, o = fig["context"], fig["oracle"]
        print(f"rho {rho}: context {c['speedup_vs_static']:.2f}x tail {c['tail_vs_static']:.2f} | "
              f"oracle {o['speedup_vs_static']:.2f}x tail {o['tail_vs_static']:.2f} | "
              f"context/oracle {o['makespan_s'] / c['makespan_s']:.1%}")

    print("\n== history vs across-epoch rank churn")
    out["rank_corr"] = {}
    for rc in (1.0, 0.9, 0.7, 0.0):
        res = run_policies(Scenario(rank_corr=rc, **scale), ["static", "history"])
        _, fig = table(res)
        h = fig["history"]
        out["rank_corr"][str(rc)] = {k: h[k] for k in ("speedup_vs_static", "tail_vs_static", "migrated_gb")}
        print(f"rank_corr {rc}: history {h['speedup_vs_static']:.2f}x tail {h['tail_vs_static']:.2f}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
