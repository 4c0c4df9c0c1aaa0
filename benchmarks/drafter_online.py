"""The online drafter over a GRPO run: its acceptance per step as the policy moves, what spot
training costs the rollout, and the rollout time against plain decoding and suffix drafts.

Runs, same config and seed, one after another in this process (``--steps`` each):
  plain    speculation off
  suffix   the config's suffix speculation
  hybrid   hybrid with the drafter from ``--drafter`` (or fresh), never trained, default
           settings: the rollout time against suffix
  frozen   the same with ``drafter_tracking`` (the drafter's acceptance measured by shadow
           drafts at every step, within 1% of the steps' time, even where it cannot pay): the
           baseline for spot training's cost, the same run without training
  online   frozen's drafter and tracking, trained by the spot trainer inside the rollout's tail
           (below ``drafter_spot_batch`` requests) and between rollout and update
All must sample identical responses (drafts are verified).

Prints per step the drafter's accepted tokens per verify step (incl. the bonus token, over
its verified and its shadow drafts) in ``frozen`` and ``online``, the rollout times, and the
spot training time inside the online rollout. Ends with one JSON line:
  steps, rollout_s_per_step (per run), rollout_ratio_vs_plain (plain / run, per run),
  drafter_accept_length_per_step (frozen, online: lists), drafter_accept_length (means over
  the steps that scored drafter drafts), drafter_accept_length_halves (the same over the
  first and the second half of the steps),
  spot_train_s_per_step, spot_share_of_rollout (spot training time / online rollout time),
  online_vs_frozen_rollout (online rollout time / frozen's; > 1 = slower),
  hybrid_vs_suffix_rollout (total: rollout time ratio; step_mean, step_se: over the steps'
  ratios, > 1 = hybrid slower),
  drafter_train_s_per_step (between rollout and update), identical_share (per run vs plain).

    PYTHONPATH=. python benchmarks/drafter_online.py --steps 8 --drafter DIR
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from tailrl.rl.config import load_config
from tailrl.rl.report import compare_runs, load_metrics, summarize
from tailrl.rl.trainer import Trainer

FROZEN = ["drafter=true", "drafter_spot_batch=0", "drafter_train_steps=0"]
RUNS = {"plain": ["speculative=false"], "suffix": [], "hybrid": FROZEN, "frozen": FROZEN, "online": ["drafter=true"]}
TRACKED = ("frozen", "online")


def run(config: str, overrides: list[str], out: Path, name: str) -> list[dict]:
    cfg = load_config(config, overrides + RUNS[name] + [f"output_dir={out / name}", "checkpoint_every=0",
                                                         "save_rollouts=true"])
    if name in TRACKED:
        spec = cfg.speculative if isinstance(cfg.speculative, dict) else {}
        cfg.speculative = {**spec, "drafter_tracking": True}
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    print(f"[{name}] setup {time.perf_counter() - t0:.1f} s", flush=True)
    trainer.train(log_fn=lambda line: print(f"[{name}] {line}", flush=True))
    return load_metrics(out / name)


def col(rows: list[dict], key: str) -> list[float]:
    return [float(r.get(key, 0.0)) for r in rows]


def drafter_acceptance(row: dict) -> float:
    """The drafter's tokens per verify step (incl. the bonus token) in one step's rollout, over
    its verified drafts and its shadow drafts (scored on the emitted tokens: what verification
    would give) together; 0 when it drafted nothing."""
    steps = float(row.get("rollout/spec_verify_steps/drafter", 0.0))
    tokens = steps * float(row.get("rollout/spec_accept_length/drafter", 0.0))
    shadow = float(row.get("rollout/spec_drafter_shadow_drafts", 0.0))
    tokens += shadow * float(row.get("rollout/spec_drafter_shadow_accept_length", 0.0))
    return tokens / (steps + shadow) if steps + shadow else 0.0


def mean_scored(values: list[float]) -> float:
    """Mean over the steps where the drafter's drafts were scored (0: none were)."""
    scored = [v for v in values if v > 0]
    return sum(scored) / len(scored) if scored else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--drafter", default=None, help="starting drafter (`tailrl train-drafter`); default: fresh")
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ",".join(RUNS))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="runs/drafter_online")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    overrides = args.overrides + [f"total_steps={args.steps}", "progress=false"]
    if args.drafter:
        overrides.append(f"drafter_init={args.drafter}")
    names = [n for n in args.runs.split(",") if n]
    rows = {n: run(args.config, overrides, out, n) for n in names}
    s = {n: summarize(r) for n, r in rows.items()}
    acc = {n: [drafter_acceptance(r) for r in rows[n]] for n in ("frozen", "online") if n in rows}

    print(f"\n{'step':>4} | " + " ".join(f"{n + ' s':>9}" for n in names) + " | drafter tokens/verify "
          + " ".join(f"{n:>7}" for n in acc) + " | spot s")
    for i in range(args.steps):
        line = f"{i + 1:>4} | " + " ".join(f"{rows[n][i]['timing_s/gen']:>9.2f}" for n in names)
        line += " | " + " " * 22 + " ".join(f"{acc[n][i]:>7.2f}" for n in acc)
        if "online" in rows:
            line += f" | {rows['online'][i].get('timing_s/spot_train', 0.0):.2f}"
        print(line)
    figures: dict = {"steps": args.steps, "drafter": args.drafter or "fresh",
                     "rollout_s_per_step": {n: s[n]["rollout_s_per_step"] for n in names},
                     "drafter_accept_length_per_step": acc,
                     # steps where no drafter draft was scored (0) are left out
                     "drafter_accept_length": {n: mean_scored(a) for n, a in acc.items()},
                     "drafter_accept_length_halves": {n: [mean_scored(a[:len(a) // 2]), mean_scored(a[len(a) // 2:])]
                                                      for n, a in acc.items()}}
    if "plain" in rows:
        base = s["plain"]["rollout_s_per_step"]
        figures["rollout_ratio_vs_plain"] = {n: base / s[n]["rollout_s_per_step"] for n in names}
        figures["identical_share"] = {n: compare_runs(out / n, out / "plain")["equiv/identical_share"]
                                      for n in names if n != "plain"}
    if "online" in rows:
        spot = sum(col(rows["online"], "timing_s/spot_train")) / args.steps
        figures["spot_train_s_per_step"] = spot
        figures["spot_share_of_rollout"] = spot / s["online"]["rollout_s_per_step"]
        figures["drafter_train_s_per_step"] = sum(col(rows["online"], "timing_s/drafter_train")) / args.steps
        if "frozen" in rows:
            figures["online_vs_frozen_rollout"] = s["online"]["rollout_s_per_step"] / s["frozen"]["rollout_s_per_step"]
    if "hybrid" in rows and "suffix" in rows:       # the same responses step by step: per-step ratios
        r = [h["timing_s/gen"] / x["timing_s/gen"] for h, x in zip(rows["hybrid"], rows["suffix"])]
        mean = sum(r) / len(r)
        se = (sum((x - mean) ** 2 for x in r) / (len(r) - 1)) ** 0.5 / len(r) ** 0.5 if len(r) > 1 else None
        figures["hybrid_vs_suffix_rollout"] = {"total": s["hybrid"]["rollout_s_per_step"] / s["suffix"]["rollout_s_per_step"],
                                               "step_mean": mean, "step_se": se}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
