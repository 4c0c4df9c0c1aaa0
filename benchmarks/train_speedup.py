"""One GRPO run of N steps with speculation on and one with it off, same config and seed.

Prints the rollout time per step and the end-to-end step time of each run, the ratios
accelerated / plain, the reward curves side by side, and whether the two runs sampled the
same responses at every step (in bfloat16, the default, and float64 they should be
identical; the share of identical responses and the largest reward difference are reported).
Ends with one line of JSON:
  steps, rollout_s_per_step_spec, rollout_s_per_step_plain, rollout_ratio (spec / plain),
  step_s_spec, step_s_plain, step_ratio, tail_s_per_step_spec, tail_s_per_step_plain,
  steps_per_s_spec, steps_per_s_plain, spec_accept_length, score_spec, score_plain (lists),
  equiv/identical_share, equiv/max_reward_diff, equiv/responses, equiv/first_differing_step.

    PYTHONPATH=. python benchmarks/train_speedup.py --config configs/demo.yaml --steps 8 \
        --set model=test --out /tmp/speedup
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from tailrl.rl.config import load_config
from tailrl.rl.report import compare_runs, load_metrics, plot_runs, summarize
from tailrl.rl.trainer import Trainer


def run(config: str, overrides: list[str], out: Path, speculative: bool) -> list[dict]:
    name = "spec" if speculative else "plain"
    extra = [f"output_dir={out / name}", "checkpoint_every=0", "save_rollouts=true"]
    if not speculative:
        extra.append("speculative=false")
    cfg = load_config(config, overrides + extra)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    print(f"[{name}] setup {time.perf_counter() - t0:.1f} s (model load, engine start)", flush=True)
    trainer.train(log_fn=lambda line: print(f"[{name}] {line}", flush=True))
    return load_metrics(out / name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo.yaml")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dtype", choices=("bfloat16", "float32", "float64"), default="bfloat16")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--out", default="runs/train_speedup")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    out = Path(args.out)
    overrides = args.overrides + [f"total_steps={args.steps}", f"dtype={args.dtype}", "progress=false"]
    plain = run(args.config, overrides, out, speculative=False)
    spec = run(args.config, overrides, out, speculative=True)
    s, b = summarize(spec), summarize(plain)
    eq = compare_runs(out / "spec", out / "plain")
    plot_runs({"speculation on": spec, "speculation off": plain}, out)

    print(f"\n{'step':>4} | {'rollout s on':>12} {'off':>7} | {'step s on':>9} {'off':>7} | {'reward on':>9} {'off':>7}")
    for a, c in zip(spec, plain):
        print(f"{a['step']:>4} | {a['timing_s/gen']:>12.2f} {c['timing_s/gen']:>7.2f} | {a['timing_s/step']:>9.2f} "
              f"{c['timing_s/step']:>7.2f} | {a['critic/score/mean']:>9.4f} {c['critic/score/mean']:>7.4f}")
    figures = {
        "steps": args.steps, "dtype": args.dtype,
        "rollout_s_per_step_spec": s["rollout_s_per_step"], "rollout_s_per_step_plain": b["rollout_s_per_step"],
        "rollout_ratio": s["rollout_s_per_step"] / b["rollout_s_per_step"],
        "step_s_spec": s["step_s"], "step_s_plain": b["step_s"], "step_ratio": s["step_s"] / b["step_s"],
        "tail_s_per_step_spec": s["tail_s_per_step"], "tail_s_per_step_plain": b["tail_s_per_step"],
        "steps_per_s_spec": s["steps_per_s"], "steps_per_s_plain": b["steps_per_s"],
        "spec_accept_length": s.get("spec_accept_length", 0.0),
        "score_spec": [r["critic/score/mean"] for r in spec], "score_plain": [r["critic/score/mean"] for r in plain],
        **eq}
    print(f"rollout time per step: {s['rollout_s_per_step']:.2f} s with speculation, {b['rollout_s_per_step']:.2f} s "
          f"without (ratio {figures['rollout_ratio']:.3f}); step time ratio {figures['step_ratio']:.3f}")
    print(f"identical responses: {eq['equiv/identical_share']:.2%} of {int(eq['equiv/responses'])}; largest reward "
          f"difference {eq['equiv/max_reward_diff']:g}; plots in {out}")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
