"""The online drafter over a GRPO run: its acceptance per step as the policy moves, what spot
training costs the rollout, and the rollout time against plain decoding and suffix drafts.

Runs, same config and seed, in this process, stepped in turn (ABBA: the machine's speed
drifts over minutes, so the runs see the same drift and their step times compare):
  plain    speculation off
  suffix   the config's suffix speculation
  frozen   hybrid with the drafter from ``--drafter`` (or fresh), never trained: the rollout
           time against suffix, and the baseline for spot training's cost (the same run
           without training)
  online   the same drafter, trained by the spot trainer inside the rollout's tail (below
           ``drafter_spot_batch`` requests) and between rollout and update
  online_side  (``--runs ...,online_side``; a GPU) the same with the spot steps queued on a
           CUDA stream of their own beside the rollout's (``drafter_spot_stream=side``)
           instead of between its steps
All must sample identical responses (drafts are verified), and so all train the same policy.

The drafter's acceptance per step is measured exactly on the step's responses (the
``drafter_eval`` config key, ``tailrl.drafter.evaluate``): the drafter the rollout started
with, on the target's hidden states of the policy that sampled them (a teacher-forced
forward), its greedy chains of the config's draft length at every position, walked as the
drafter alone would verify them: hundreds of verify steps per GRPO step, where the rollout
itself verifies or shadows only the few drafts it makes. It is computed after the rollout,
outside its timing. ``--track`` also sets ``drafter_tracking`` in frozen and online (shadow
drafts: the rollout's own measure, within 1% of its time).

Prints per step the rollout times, the drafter's tokens per verify step in frozen and online,
and the spot training time inside the online rollout. Ends with one JSON line:
  steps, rollout_s_per_step (per run), rollout_ratio_vs_plain (plain / run, per run),
  drafter_accept_length_per_step (frozen, online: lists, exact), drafter_accept_length (means),
  drafter_accept_length_halves (first and second half of the steps),
  online_minus_frozen (per-step differences on the same responses: mean, se, per half),
  drafter_verify_steps_per_step (how many verify steps each figure rests on),
  spot_train_s_per_step, spot_share_of_rollout (spot training time / online rollout time),
  spot_step_max_s (the longest spot step: the most a rollout step waited for training),
  online_vs_frozen_rollout (online rollout time / frozen's; > 1 = slower),
  hybrid_vs_suffix_rollout (frozen against suffix; total: rollout time ratio; step_mean,
  step_se: over the steps' ratios, > 1 = hybrid slower),
  drafter_train_s_per_step (between rollout and update), identical_share (per run vs plain);
  with online_side, the same spot figures and pairings for it (``side_*``) and
  online_side_vs_online_rollout.

    PYTHONPATH=. python benchmarks/drafter_online.py --steps 20 --drafter DIR
"""
from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tailrl.rl.config import load_config
from tailrl.rl.metrics import console_line
from tailrl.rl.report import compare_runs, load_metrics, summarize
from tailrl.rl.trainer import Trainer

FROZEN = ["drafter=true", "drafter_spot_batch=0", "drafter_train_steps=0"]
RUNS = {"plain": ["speculative=false"], "suffix": [], "frozen": FROZEN, "online": ["drafter=true"],
        "online_side": ["drafter=true", "drafter_spot_stream=side"]}
DEFAULT_RUNS = ("plain", "suffix", "frozen", "online")
MEASURED = ("frozen", "online", "online_side")
TRAINED = ("online", "online_side")


class Run:
    """One training run, stepped from outside (frozen and online with ``drafter_eval``)."""

    def __init__(self, config: str, overrides: list[str], out: Path, name: str, track: bool) -> None:
        extra = ["drafter_eval=true"] if name in MEASURED else []
        cfg = load_config(config, overrides + RUNS[name] + extra + [f"output_dir={out / name}",
                                                                     "checkpoint_every=0", "save_rollouts=true"])
        if track and name in MEASURED:
            spec = cfg.speculative if isinstance(cfg.speculative, dict) else {}
            cfg.speculative = {**spec, "drafter_tracking": True}
        self.name, self.cfg, self.out = name, cfg, out / name
        self.trainer = Trainer(cfg)
        self.rows: list[dict] = []

    def step(self) -> None:
        m = self.trainer.train_step()
        print(f"[{self.name}] {console_line(self.trainer.step, self.cfg.total_steps, m)}", flush=True)

    def exact(self) -> list[tuple[float, int]]:
        """Per step: (the drafter's tokens per verify step, the verify steps it rests on)."""
        return [(r["drafter/eval_accept_length"], int(r["drafter/eval_verify_steps"]))
                for r in self.rows if "drafter/eval_accept_length" in r]


def run_all(config: str, overrides: list[str], out: Path, names: list[str], steps: int,
            track: bool) -> dict[str, Run]:
    """The runs stepped in turn, ABBA (the machine's speed drifts over minutes: every run
    sees the same drift, and the per-step ratios compare steps run side by side)."""
    runs = {n: Run(config, overrides, out, n, track) for n in names}
    try:
        for i in range(steps):
            for n in (names if i % 2 == 0 else names[::-1]):
                runs[n].step()
    finally:
        for r in runs.values():
            r.trainer.logger.close()
            r.trainer.llm.close()                 # a pool's workers
    for r in runs.values():
        r.rows = load_metrics(r.out)
    return runs


def col(rows: list[dict], key: str) -> list[float]:
    return [float(r.get(key, 0.0)) for r in rows]


def shadow_acceptance(row: dict) -> float:
    """The rollout's own measure: the drafter's tokens per verify step (incl. the bonus token)
    over its verified drafts and its shadow drafts together; 0 when it drafted nothing."""
    steps = float(row.get("rollout/spec_verify_steps/drafter", 0.0))
    tokens = steps * float(row.get("rollout/spec_accept_length/drafter", 0.0))
    shadow = float(row.get("rollout/spec_drafter_shadow_drafts", 0.0))
    tokens += shadow * float(row.get("rollout/spec_drafter_shadow_accept_length", 0.0))
    return tokens / (steps + shadow) if steps + shadow else 0.0


def mean_se(values: list[float]) -> tuple[float, float | None]:
    n = len(values)
    if n == 0:
        return 0.0, None
    mean = sum(values) / n
    se = (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 / n ** 0.5 if n > 1 else None
    return mean, se


def print_table(args, names: list[str], rows: dict, acc: dict, own: dict) -> None:
    print(f"\n{'step':>4} | " + " ".join(f"{n + ' s':>9}" for n in names) + " | drafter tokens/verify (exact) "
          + " ".join(f"{n:>7}" for n in acc) + (" | rollout's own " + " ".join(f"{n:>7}" for n in own) if own else "")
          + " | spot s")
    for i in range(args.steps):
        line = f"{i + 1:>4} | " + " ".join(f"{rows[n][i]['timing_s/gen']:>9.2f}" for n in names)
        line += " | " + " " * 30 + " ".join(f"{acc[n][i]:>7.2f}" for n in acc)
        if own:
            line += " | " + " " * 14 + " ".join(f"{own[n][i]:>7.2f}" for n in own)
        for n in TRAINED:
            if n in rows:
                line += f" | {rows[n][i].get('timing_s/spot_train', 0.0):.2f}"
        print(line)


def acceptance_figures(acc: dict, steps: dict) -> dict:
    half = lambda a: [mean_se(a[:len(a) // 2])[0], mean_se(a[len(a) // 2:])[0]]   # noqa: E731
    figures: dict = {"drafter_accept_length_per_step": acc,
                     "drafter_verify_steps_per_step": steps,
                     "drafter_accept_length": {n: mean_se(a)[0] for n, a in acc.items()},
                     "drafter_accept_length_halves": {n: half(a) for n, a in acc.items()}}
    for n in TRAINED:            # the same responses in both runs: paired per step
        if n in acc and "frozen" in acc:
            diff = [o - f for f, o in zip(acc["frozen"], acc[n])]
            mean, se = mean_se(diff)
            figures[f"{n}_minus_frozen"] = {"mean": mean, "se": se, "halves": half(diff)}
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--drafter", default=None, help="starting drafter (`tailrl train-drafter`); default: fresh")
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help="comma-separated subset of " + ",".join(RUNS))
    p.add_argument("--track", action="store_true", help="drafter_tracking in frozen and online")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="runs/drafter_online")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    overrides = args.overrides + [f"total_steps={args.steps}", "progress=false"]
    if args.drafter:
        overrides.append(f"drafter_init={args.drafter}")
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        p.error(f"--runs: unknown {unknown}; choose from {list(RUNS)}")
    done = run_all(args.config, overrides, out, names, args.steps, args.track)
    rows = {n: r.rows for n, r in done.items()}
    exact = {n: r.exact() for n, r in done.items() if r.exact()}
    s = {n: summarize(r) for n, r in rows.items()}
    acc = {n: [a for a, _ in e] for n, e in exact.items()}
    own = {n: [shadow_acceptance(r) for r in rows[n]] for n in MEASURED if n in rows and args.track}
    print_table(args, names, rows, acc, own)
    figures: dict = {"steps": args.steps, "drafter": args.drafter or "fresh",
                     "rollout_s_per_step": {n: s[n]["rollout_s_per_step"] for n in names},
                     **acceptance_figures(acc, {n: [k for _, k in e] for n, e in exact.items()})}
    if own:
        figures["rollout_own_accept_length_per_step"] = own
    if "plain" in rows:
        base = s["plain"]["rollout_s_per_step"]
        figures["rollout_ratio_vs_plain"] = {n: base / s[n]["rollout_s_per_step"] for n in names}
        figures["identical_share"] = {n: compare_runs(out / n, out / "plain")["equiv/identical_share"]
                                      for n in names if n != "plain"}
    for n, pre in (("online", ""), ("online_side", "side_")):
        if n not in rows:
            continue
        spot = sum(col(rows[n], "timing_s/spot_train")) / args.steps
        figures[f"{pre}spot_train_s_per_step"] = spot
        figures[f"{pre}spot_share_of_rollout"] = spot / s[n]["rollout_s_per_step"]
        figures[f"{pre}spot_step_max_s"] = max(col(rows[n], "timing_s/spot_step_max"), default=0.0)
        figures[f"{pre}spot_steps_per_step"] = sum(col(rows[n], "drafter/spot_steps")) / args.steps
        figures[f"{pre}drafter_train_s_per_step"] = sum(col(rows[n], "timing_s/drafter_train")) / args.steps
        if "frozen" in rows:
            figures[f"{n}_vs_frozen_rollout"] = s[n]["rollout_s_per_step"] / s["frozen"]["rollout_s_per_step"]
    if "online" in rows and "online_side" in rows:
        figures["online_side_vs_online_rollout"] = (s["online_side"]["rollout_s_per_step"]
                                                    / s["online"]["rollout_s_per_step"])
    if "frozen" in rows and "suffix" in rows:       # the same responses step by step: per-step ratios
        mean, se = mean_se([h["timing_s/gen"] / x["timing_s/gen"] for h, x in zip(rows["frozen"], rows["suffix"])])
        figures["hybrid_vs_suffix_rollout"] = {"total": s["frozen"]["rollout_s_per_step"] / s["suffix"]["rollout_s_per_step"],
                                               "step_mean": mean, "step_se": se}
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
