"""One GRPO step of the main job, phase by phase: the update as it was and as it is now, its
training quality, and TRL's GRPOTrainer on the same workload.

Settings (same config, seed and data; ``--config``, default configs/demo.yaml):
- ``reference``: the update as it was: a float32 Hugging Face forward and backward with SDPA
  attention, pi_old recomputed by the trainer (``exact_logprobs=false``, ``autocast=false``,
  ``old_logprobs=recompute``);
- ``lean``: the defaults: eager attention, the forward and backward in bfloat16 autocast,
  log-probability values from the engine's kernels (equal to the rollout's), pi_old the
  rollout's.
``profile``: the two trainers' steps alternate (reference, lean, lean, reference, ...) for
``--steps`` steps each; per phase the median over steps 2.. (the first builds kernels):
rollout, reward, drafter training, pi_old pass, update forward (of which the exact values),
backward, optimizer, weight sync, the whole step; the update's ratio lean / reference (median
of the per-step ratios) and the rollout's share of the step.
``quality`` (``--quality-steps N``, ``--seeds``): each setting trains N steps per seed; the
mean score over the run and over its second half, per seed, and the paired difference
lean - reference with its standard error over seeds (bfloat16 gradients change the
trajectory, so curves are compared as distributions, not step by step).
``trl`` (``--trl``): TRL's GRPOTrainer with its own Hugging Face generation on the same
workload (the config's prompts, group size, batch, max tokens, temperature, learning rate;
float32, CPU), ``--trl-steps`` steps, median step time, against the lean trainer's median step
in this invocation.
Ends with one line of JSON: {"profile": {setting: {phase: s}}, "update_ratio", "rollout_share",
"quality": {...}, "trl": {...}}.

    python benchmarks/train_profile.py --steps 8 [--quality-steps 20 --seeds 0,1,2] [--trl]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time

import torch

from tailrl.rl.config import load_config
from tailrl.rl.policy import load_policy
from tailrl.rl.trainer import Trainer

PHASES = ["timing_s/gen", "timing_s/reward", "timing_s/drafter_train", "timing_s/old_log_prob",
          "timing_s/update_forward", "timing_s/update_exact", "timing_s/update_backward",
          "timing_s/update_optimizer", "timing_s/update", "timing_s/sync_weights", "timing_s/step"]
REFERENCE = ["exact_logprobs=false", "autocast=false", "old_logprobs=recompute"]


def trainer(config: str, setting: str, out: str, extra: list[str]) -> Trainer:
    over = [f"output_dir={out}", "progress=false", "checkpoint_every=0", "save_rollouts=false",
            "log_tensorboard=false"] + extra + (REFERENCE if setting == "reference" else [])
    tr = Trainer(load_config(config, over))
    if setting == "reference":                       # the policy as the update loaded it: SDPA attention
        tr.policy = load_policy(tr.model_dir, tr.cfg.train_dtype, attn_implementation="sdpa")
        tr.optimizer = torch.optim.AdamW(tr.policy.parameters(), lr=tr.cfg.lr, weight_decay=tr.cfg.weight_decay)
    return tr


def profile(config: str, steps: int, extra: list[str]) -> dict:
    rows: dict[str, list[dict]] = {"reference": [], "lean": []}
    with tempfile.TemporaryDirectory() as tmp:
        trs = {s: trainer(config, s, f"{tmp}/{s}", extra + [f"total_steps={steps}"]) for s in rows}
        for i in range(steps):
            for s in (["reference", "lean"] if i % 2 == 0 else ["lean", "reference"]):
                rows[s].append(trs[s].train_step())
                print(f"step {i + 1} {s:9s} update {rows[s][-1]['timing_s/update']:.3f} s  "
                      f"step {rows[s][-1]['timing_s/step']:.3f} s", flush=True)
        for tr in trs.values():
            tr.llm.close()
    out = {s: {k: round(statistics.median(r.get(k, 0.0) for r in rs[1:]), 4) for k in PHASES}
           for s, rs in rows.items()}
    ratios = [b["timing_s/update"] / a["timing_s/update"] for a, b in zip(rows["reference"][1:], rows["lean"][1:])]
    out["update_ratio"] = round(statistics.median(ratios), 3)
    out["logprob_diff"] = {s: max(r["actor/rollout_logprob_diff"] for r in rs) for s, rs in rows.items()}
    out["first_ratio_dev"] = {s: max(r["actor/first_ratio_dev"] for r in rs) for s, rs in rows.items()}
    out["rollout_share"] = {s: round(v["timing_s/gen"] / v["timing_s/step"], 3) for s, v in out.items()
                            if s in rows}
    return out


def quality(config: str, steps: int, seeds: list[int], extra: list[str]) -> dict:
    res: dict[str, dict[int, list[float]]] = {"reference": {}, "lean": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for s in res:
                tr = trainer(config, s, f"{tmp}/{s}{seed}", extra + [f"total_steps={steps}", f"seed={seed}"])
                res[s][seed] = [m["critic/score/mean"] for m in tr.train()]
                tr.llm.close()
                print(f"seed {seed} {s:9s} mean score {statistics.mean(res[s][seed]):.4f}", flush=True)
    half = steps // 2
    diffs = [statistics.mean(res["lean"][k][half:]) - statistics.mean(res["reference"][k][half:]) for k in seeds]
    se = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None
    return {"steps": steps, "seeds": seeds, "scores": res,
            "mean": {s: round(statistics.mean(v for c in r.values() for v in c), 4) for s, r in res.items()},
            "second_half_mean": {s: round(statistics.mean(v for c in r.values() for v in c[half:]), 4)
                                 for s, r in res.items()},
            "second_half_diff": round(statistics.mean(diffs), 4), "second_half_diff_se": se}


def trl_steps(config: str, steps: int, extra: list[str]) -> dict:
    """TRL's GRPOTrainer, its own generation, on the config's workload; seconds per step."""
    import os
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tailrl.rl.data import load_dataset, resolve_reward
    from tailrl.rl.trainer import resolve_model

    cfg = load_config(config, extra)
    model_dir = resolve_model(cfg.model)
    prompts = load_dataset(cfg)
    data = Dataset.from_list([{"prompt": p.text, "answer": p.answer, **p.columns} for p in prompts])
    reward = resolve_reward(cfg)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=cfg.batch_size * cfg.group_size,
                          num_generations=cfg.group_size, max_completion_length=cfg.max_tokens,
                          learning_rate=cfg.lr, beta=0.0, temperature=cfg.temperature, top_k=0,
                          report_to="none", use_cpu=True, bf16=False, save_strategy="no", logging_steps=1,
                          seed=cfg.seed, dataloader_num_workers=0)
        tr = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"),
                         processing_class=AutoTokenizer.from_pretrained(model_dir),
                         reward_funcs=lambda prompts, completions, **kw: reward(prompts, completions, **kw),
                         args=args, train_dataset=data, callbacks=[Clock()])
        start = time.perf_counter()
        tr.train()
    spans = [b - a for a, b in zip([start] + stamps, stamps)]
    return {"steps": steps, "step_s": [round(x, 3) for x in spans],
            "median_step_s": round(statistics.median(spans[1:] or spans), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--quality-steps", type=int, default=0)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--trl", action="store_true")
    ap.add_argument("--trl-steps", type=int, default=4)
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    out: dict = {"profile": profile(a.config, a.steps, a.overrides)}
    p = out["profile"]
    print(f"\n{'phase':26s} {'reference s':>12s} {'lean s':>8s}")
    for k in PHASES:
        print(f"{k:26s} {p['reference'][k]:12.3f} {p['lean'][k]:8.3f}")
    print(f"update lean / reference: {p['update_ratio']:.3f} (median of per-step ratios); rollout share of the "
          f"step {p['rollout_share']}; rollout_logprob_diff max {p['logprob_diff']}; first-minibatch "
          f"|ratio - 1| max {p['first_ratio_dev']}", flush=True)
    if a.quality_steps:
        q = out["quality"] = quality(a.config, a.quality_steps, [int(s) for s in a.seeds.split(",")], a.overrides)
        print(f"quality over {q['steps']} steps, seeds {q['seeds']}: mean score {q['mean']}, second half "
              f"{q['second_half_mean']}; lean - reference (second half, paired by seed) "
              f"{q['second_half_diff']:+.4f} +- {q['second_half_diff_se'] or float('nan'):.4f}", flush=True)
    if a.trl:
        t = out["trl"] = trl_steps(a.config, a.trl_steps, a.overrides)
        t["ratio_to_tailrl"] = round(t["median_step_s"] / p["lean"]["timing_s/step"], 2)
        print(f"TRL GRPOTrainer (its own generation): {t['median_step_s']:.2f} s per step, "
              f"{t['ratio_to_tailrl']:.2f}x tailrl train's {p['lean']['timing_s/step']:.2f} s", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
