"""What a finished run (or a pair of runs) shows: plots per step, rollout-time figures, and
whether two runs with the same seed sampled the same responses.

``compare_runs(a, b)`` reads both runs' ``rollouts.jsonl`` and counts, step by step, the
responses that are identical token for token, and the largest reward difference. With
speculation on in one run and off in the other this is the losslessness check of a whole
training run, not of one generate call.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from tailrl.rl.metrics import METRICS_FILE, ROLLOUTS_FILE, read_jsonl

log = logging.getLogger(__name__)

PLOTS = (("critic/score/mean", "reward (mean score)", "reward.png"),
         ("response_length/mean", "response length (tokens, mean)", "response_length.png"),
         ("timing_s/gen", "rollout time per step (s)", "rollout_time.png"))


def load_metrics(run_dir: str | Path) -> list[dict]:
    rows = read_jsonl(Path(run_dir) / METRICS_FILE)
    if not rows:
        raise ValueError(f"{run_dir}: no {METRICS_FILE} (not a training run directory?)")
    return rows


def run_label(rows: list[dict]) -> str:
    return "speculation on" if any("rollout/spec_accept_length" in r for r in rows) else "speculation off"


def summarize(rows: list[dict]) -> dict[str, float]:
    """Per-run figures: means over steps, and totals."""
    def col(k: str) -> np.ndarray:
        return np.array([r[k] for r in rows if k in r], dtype=np.float64)

    out = {"steps": float(len(rows)),
           "rollout_s_per_step": float(col("timing_s/gen").mean()),
           "step_s": float(col("timing_s/step").mean()),
           "update_s_per_step": float(col("timing_s/update").mean()),
           "rollout_s_total": float(col("timing_s/gen").sum()),
           "rollout_share": float(col("timing_s/gen").sum() / max(col("timing_s/step").sum(), 1e-9)),
           "tail_s_per_step": float(col("rollout/tail_s").mean()) if col("rollout/tail_s").size else 0.0,
           "steps_per_s": float(len(rows) / max(col("timing_s/step").sum(), 1e-9)),
           "score_first": float(col("critic/score/mean")[0]),
           "score_last": float(col("critic/score/mean")[-1]),
           "score_mean": float(col("critic/score/mean").mean())}
    acc = col("rollout/spec_accept_length")
    if acc.size:
        out["spec_accept_length"] = float(acc.mean())
    return out


def compare_runs(dir_a: str | Path, dir_b: str | Path) -> dict[str, float]:
    """Share of identical responses and largest reward difference over the common steps."""
    a = {r["step"]: r for r in read_jsonl(Path(dir_a) / ROLLOUTS_FILE)}
    b = {r["step"]: r for r in read_jsonl(Path(dir_b) / ROLLOUTS_FILE)}
    steps = sorted(set(a) & set(b))
    if not steps:
        raise ValueError(f"{dir_a} and {dir_b} have no common steps in {ROLLOUTS_FILE} (save_rollouts: true)")
    same = total = 0
    max_diff = 0.0
    first_diff = 0
    for s in steps:
        if a[s]["uids"] != b[s]["uids"]:
            raise ValueError(f"step {s}: the runs trained on different prompts (not the same config and seed?)")
        ra = [x for g in a[s]["responses"] for x in g]
        rb = [x for g in b[s]["responses"] for x in g]
        eq = sum(x == y for x, y in zip(ra, rb))
        same, total = same + eq, total + len(ra)
        if eq < len(ra) and not first_diff:
            first_diff = s
        max_diff = max(max_diff, float(np.max(np.abs(np.subtract(a[s]["rewards"], b[s]["rewards"])))))
    return {"equiv/steps": float(len(steps)), "equiv/identical_share": same / max(total, 1),
            "equiv/responses": float(total), "equiv/max_reward_diff": max_diff,
            "equiv/first_differing_step": float(first_diff)}


def plot_runs(runs: dict[str, list[dict]], out_dir: str | Path) -> list[Path]:
    """One PNG per quantity, every run a line."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError("plots need matplotlib: pip install 'tailrl[plot]'") from e
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, title, name in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for label, rows in runs.items():
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=label)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths
