"""The scheduling-policy ladder on the Qwen2-VL-72B-like workload at Seer's scale.

    PYTHONPATH=. python benchmarks/simulate_ladder.py [--quick]

1. The ladder: static, divided, context, history, oracle on 9,600 requests (groups of 16,
   max 40,960, mean ~7,615 tokens) on 16 instances of 8 x H800, next to Seer's published
   ablation (divided 1.42x, +context 1.56x, oracle 1.63x over veRL; tail time 0.79 / 0.11
   / 0.00 of veRL's).
2. Sensitivity of `context` to the within-group length correlation `rho`.
3. `history` under across-epoch rank churn (`rank_corr` 1.0 = the previous epoch ranks
   prompts exactly as this one; 0 = history is noise).

    PYTHONPATH=. python benchmarks/simulate_ladder.py --measure-rho [--rollouts RUN/rollouts.jsonl ...]

measures instead the within-group correlation of log response lengths (`tailrl.sim.fit`)
on our own rollouts: it samples `--prompts` x `--n` responses of held-out task prompts
from the shipped `small` model (temperature 1, one torch thread), writes them as a JSONL
trace (`sim_out/small_rollouts.jsonl`, the simulator's trace format) and prints rho
overall and per task family; `--rollouts` adds the rollouts that `tailrl train` recorded
(`rollouts.jsonl`: every step's groups, during RL training).

Prints tables; the last line is one JSON object with every figure. Ratios only: wall time
is reported, never asserted.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tailrl.sim.fit import group_correlation
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


def _print_fit(name: str, lengths: list[int], groups: list) -> dict:
    fit = group_correlation(lengths, groups)
    print(f"{name:<34} rho {fit.rho:.2f}  sd within {fit.sd_within:.2f}  between {fit.sd_between:.2f}  "
          f"({fit.groups} groups, {fit.responses} responses)")
    return {"rho": round(fit.rho, 3), "sd_within": round(fit.sd_within, 3),
            "sd_between": round(fit.sd_between, 3), "groups": fit.groups, "responses": fit.responses}


def measure_rho(prompts: int, n: int, seed: int, rollouts: list[str]) -> dict:
    """rho of our own rollouts: fresh samples of the small model, and recorded RL runs."""
    import torch
    from transformers import AutoTokenizer

    from tailrl.tasks import mixture
    from tailrl.tasks.models import get_model
    from tailrl.tasks.sampling import sample

    torch.set_num_threads(1)
    model_dir = get_model("small")
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = mixture.heldout_examples(prompts)
    ids = [tok.encode(ex.prompt) for ex in examples]
    responses = sample("tailrl", model_dir, ids, n, 1.0, 960, seed)
    rows = [dict(prompt_id=k, group_id=k, family=ex.family, prompt_len=len(p), max_tokens=960,
                 response_len=max(1, len(r))) for k, (ex, p, group) in enumerate(zip(examples, ids, responses))
            for r, _ in group]
    out_path = Path("sim_out/small_rollouts.jsonl")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out_path} ({len(rows)} responses of {prompts} prompts)")
    out = {"small": _print_fit(f"small model, {prompts} x {n}", [r["response_len"] for r in rows],
                               [r["group_id"] for r in rows])}
    for fam in sorted({r["family"] for r in rows}):
        sel = [r for r in rows if r["family"] == fam]
        if len({r["group_id"] for r in sel}) >= 2:
            out[f"small/{fam}"] = _print_fit(f"  {fam}", [r["response_len"] for r in sel],
                                             [r["group_id"] for r in sel])
    for path in rollouts:   # tailrl train's rollouts.jsonl: {"step", "uids", "responses": [[ids...]...]}
        lengths, groups = [], []
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            for uid, group in zip(row["uids"], row["responses"]):
                lengths += [max(1, len(r)) for r in group]
                groups += [f"{row['step']}/{uid}"] * len(group)
        out[path] = _print_fit(f"RL run {path}", lengths, groups)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/4 of the requests and instances")
    ap.add_argument("--measure-rho", action="store_true", help="measure rho on our rollouts instead")
    ap.add_argument("--prompts", type=int, default=128, help="--measure-rho: held-out prompts")
    ap.add_argument("--n", type=int, default=16, help="--measure-rho: responses per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rollouts", nargs="*", default=[], help="--measure-rho: recorded RL rollouts.jsonl")
    args = ap.parse_args(argv)
    if args.measure_rho:
        print(json.dumps({"rho_measured": measure_rho(args.prompts, args.n, args.seed, args.rollouts)}))
        return 0
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
