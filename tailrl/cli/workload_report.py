"""`tailrl workload-report --model DIR`: is this a long-tail reasoning workload?

Samples ``--n`` responses for each of ``--prompts`` held-out prompts of the task mixture at
temperature 1 (top-k and top-p off) and reports accuracy (overall, per family, pass@n, the
share of groups with both right and wrong answers: the groups GRPO learns from), the
response-length distribution in tokens (median, p90, p99, max; PNG histogram) and group
similarity (see tailrl/tasks/similarity.py). The last output line is one JSON object:

    accuracy, accuracy/<family>, pass_at_n, mixed_groups, length/{median,p90,p99,max,mean},
    length/p99_over_median, length/max_over_median, length/capped (share cut at max-tokens),
    length/stopped/{median,p99,max} (responses that ended with <eos>), group_similarity,
    group_similarity/{matched,precision}, sample_seconds, tokens_per_s, prompts, n, backend
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from tailrl.cli.workload_sampling import Responses, sample
from tailrl.tasks import mixture
from tailrl.tasks.base import Example
from tailrl.tasks.similarity import group_similarity

log = logging.getLogger(__name__)


def summarize(examples: list[Example], prompt_ids: list[list[int]], responses: Responses,
              texts: list[list[str]]) -> dict[str, float]:
    """The report's figures from sampled responses (pure: no model needed)."""
    rewards = [[mixture.reward(ex.family, ex.prompt, t, ex.answer) for t in group]
               for ex, group in zip(examples, texts)]
    lengths = np.array([len(ids) for group in responses for ids, _ in group], dtype=float)
    capped = sum(reason == "length" for group in responses for _, reason in group)
    flat = [r for group in rewards for r in group]
    figures: dict[str, float] = {
        "accuracy": float(np.mean(flat)),
        "pass_at_n": float(np.mean([max(g) for g in rewards])),
        "mixed_groups": float(np.mean([0 < sum(g) < len(g) for g in rewards])),
    }
    by_family: dict[str, list[float]] = defaultdict(list)
    len_family: dict[str, list[int]] = defaultdict(list)
    for ex, group, rs in zip(examples, responses, rewards):
        by_family[ex.family] += rs
        len_family[ex.family] += [len(ids) for ids, _ in group]
    for fam in sorted(by_family):
        figures[f"accuracy/{fam}"] = float(np.mean(by_family[fam]))
        figures[f"length/median/{fam}"] = float(np.median(len_family[fam]))
    median = float(np.median(lengths))
    figures.update({
        "length/median": median, "length/p90": float(np.percentile(lengths, 90)),
        "length/p99": float(np.percentile(lengths, 99)), "length/max": float(lengths.max()),
        "length/mean": float(lengths.mean()), "length/capped": capped / len(lengths),
    })
    figures["length/p99_over_median"] = figures["length/p99"] / max(median, 1.0)
    figures["length/max_over_median"] = figures["length/max"] / max(median, 1.0)
    # the tail without responses cut at max_tokens (a looping response is not reasoning)
    stopped = np.array([len(ids) for group in responses for ids, reason in group if reason == "stop"], dtype=float)
    if len(stopped):
        figures["length/stopped/median"] = float(np.median(stopped))
        figures["length/stopped/p99"] = float(np.percentile(stopped, 99))
        figures["length/stopped/max"] = float(stopped.max())
    sim = group_similarity(prompt_ids, [[ids for ids, _ in g] for g in responses])
    figures.update({"group_similarity": sim["predicted"], "group_similarity/matched": sim["matched"],
                    "group_similarity/precision": sim["precision"]})
    return figures


def plot_lengths(responses: Responses, figures: dict[str, float], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = [len(ids) for group in responses for ids, _ in group]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(lengths, bins=60, color="#4477aa")
    ax.set_yscale("log")
    for key, style in (("length/median", "-"), ("length/p90", "--"), ("length/p99", ":")):
        ax.axvline(figures[key], color="k", linestyle=style, label=f"{key.split('/')[1]} {figures[key]:.0f}")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("responses (log scale)")
    ax.set_title(f"{len(lengths)} responses, accuracy {figures['accuracy']:.0%}")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tailrl workload-report", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small", help="checkpoint directory, or a preset name (test, small)")
    p.add_argument("--prompts", type=int, default=128)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=960)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("tailrl", "hf"), default="tailrl")
    p.add_argument("--plot", default="workload_lengths.png", help="PNG histogram path ('' = none)")
    args = p.parse_args(argv)
    for name in ("prompts", "n", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = args.model
    if not Path(model_dir).is_dir():
        from tailrl.tasks.models import get_model
        model_dir = get_model(args.model)

    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = mixture.heldout_examples(args.prompts)
    prompt_ids = [tok.encode(ex.prompt) for ex in examples]   # <bos> + prompt, as in training
    t0 = time.time()
    responses = sample(args.backend, model_dir, prompt_ids, args.n, args.temperature, args.max_tokens, args.seed)
    seconds = time.time() - t0
    texts = [[tok.decode(ids, skip_special_tokens=True) for ids, _ in group] for group in responses]
    figures = summarize(examples, prompt_ids, responses, texts)
    n_tokens = sum(len(ids) for group in responses for ids, _ in group)
    figures.update(sample_seconds=seconds, tokens_per_s=n_tokens / max(seconds, 1e-9),
                   prompts=float(args.prompts), n=float(args.n))
    if args.plot:
        plot_lengths(responses, figures, Path(args.plot))
        print(f"histogram: {args.plot}")
    print(f"model {model_dir}: accuracy {figures['accuracy']:.1%} (pass@{args.n} {figures['pass_at_n']:.1%}), "
          + ", ".join(f"{k.split('/')[1]} {v:.1%}" for k, v in figures.items() if k.startswith("accuracy/")))
    print(f"lengths: median {figures['length/median']:.0f}, p90 {figures['length/p90']:.0f}, "
          f"p99 {figures['length/p99']:.0f} ({figures['length/p99_over_median']:.1f}x), "
          f"max {figures['length/max']:.0f} ({figures['length/max_over_median']:.1f}x), "
          f"capped {figures['length/capped']:.1%}; ended with <eos>: median "
          f"{figures.get('length/stopped/median', 0):.0f}, p99 {figures.get('length/stopped/p99', 0):.0f}, "
          f"max {figures.get('length/stopped/max', 0):.0f}")
    print(f"group similarity: {figures['group_similarity']:.1%} of tokens predicted by siblings "
          f"(matched {figures['group_similarity/matched']:.1%}, precision {figures['group_similarity/precision']:.1%})")
    print(json.dumps({"model": model_dir, "backend": args.backend, **figures}))
    return 0
