"""`tailrl train CONFIG.yaml` and `tailrl report RUN_DIR [RUN_DIR]`.

Both end their output with one line of JSON holding their figures:
- train: ``steps``, ``steps_per_s``, ``rollout_s_per_step``, ``step_s``, ``rollout_share``,
  ``tail_s_per_step``, ``score_first``, ``score_last``, ``score_mean``,
  ``spec_accept_length`` (when speculating), ``output_dir``;
- report: the same figures per run under its label, ``plots``, and with two runs
  ``rollout_ratio`` / ``step_ratio`` (first run / second run) and the ``equiv/*`` keys of
  ``compare_runs`` (share of identical responses, largest reward difference).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def train_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tailrl train", description="GRPO training with accelerated rollouts")
    p.add_argument("config", help="YAML file of training config keys (see docs/training.md)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable), e.g. --set total_steps=5 --set speculative=false")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    from tailrl.rl.config import load_config
    from tailrl.rl.report import summarize
    from tailrl.rl.trainer import Trainer

    try:
        cfg = load_config(args.config, args.overrides)
        trainer = Trainer(cfg, resume=args.resume)
    except ValueError as e:
        print(f"tailrl train: {e}", file=sys.stderr)
        return 2
    spec = trainer.llm.speculative              # with an online drafter: hybrid
    print(f"model {trainer.model_dir} | {len(trainer.prompts)} prompts | batch {cfg.batch_size} x {cfg.group_size} | "
          f"speculation {'on (' + spec.method + ', ' + spec.policy + ')' if spec else 'off'} | "
          f"update {cfg.train_dtype}{' in bfloat16 autocast' if trainer.autocast else ''} | out {cfg.output_dir}")
    trainer.train(log_fn=print)
    from tailrl.rl.report import load_metrics
    rows = load_metrics(cfg.output_dir)
    s = summarize(rows)
    acc = f", mean accepted length {s['spec_accept_length']:.2f} tokens/verify" if "spec_accept_length" in s else ""
    print(f"done: {int(s['steps'])} steps, {s['steps_per_s']:.3f} steps/s | rollout {s['rollout_s_per_step']:.2f} s/step "
          f"({s['rollout_share']:.0%} of step time), tail {s['tail_s_per_step']:.2f} s/step, speculation "
          f"{'on' + acc if spec else 'off'} | reward {s['score_first']:.3f} -> {s['score_last']:.3f}")
    print(f"plot it: tailrl report {cfg.output_dir}")
    print(json.dumps({**s, "speculation": bool(spec), "output_dir": cfg.output_dir}))
    return 0


def report_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tailrl report", description="plot reward, response length and rollout "
                                "time per step of one run, or of two runs (e.g. speculation on / off)")
    p.add_argument("runs", nargs="+", help="one or two run directories (output_dir of tailrl train)")
    p.add_argument("--out", default=None, help="where the PNGs go (default: the first run's directory)")
    args = p.parse_args(argv)
    if len(args.runs) > 2:
        p.error("give one or two run directories")
    from tailrl.rl.report import compare_runs, load_metrics, plot_runs, run_label, summarize

    try:
        runs = {d: load_metrics(d) for d in args.runs}
    except ValueError as e:
        print(f"tailrl report: {e}", file=sys.stderr)
        return 2
    labels = {d: f"{Path(d).name} ({run_label(rows)})" for d, rows in runs.items()}
    out_dir = args.out or args.runs[0]
    paths = plot_runs({labels[d]: rows for d, rows in runs.items()}, out_dir)
    figures: dict = {"plots": [str(x) for x in paths]}
    for d, rows in runs.items():
        s = summarize(rows)
        figures[labels[d]] = s
        print(f"{labels[d]}: {int(s['steps'])} steps, rollout {s['rollout_s_per_step']:.2f} s/step, step "
              f"{s['step_s']:.2f} s, reward {s['score_first']:.3f} -> {s['score_last']:.3f}")
    if len(args.runs) == 2:
        a, b = (summarize(rows) for rows in runs.values())
        figures["rollout_ratio"] = a["rollout_s_per_step"] / max(b["rollout_s_per_step"], 1e-9)
        figures["step_ratio"] = a["step_s"] / max(b["step_s"], 1e-9)
        print(f"rollout time ratio (first / second): {figures['rollout_ratio']:.3f}, "
              f"step time ratio {figures['step_ratio']:.3f}")
        try:
            eq = compare_runs(*args.runs)
            figures.update(eq)
            print(f"identical responses: {eq['equiv/identical_share']:.2%} of {int(eq['equiv/responses'])}, "
                  f"largest reward difference {eq['equiv/max_reward_diff']:g}")
        except ValueError as e:
            print(f"(no response comparison: {e})")
    print("plots: " + ", ".join(figures["plots"]))
    print(json.dumps(figures))
    return 0
