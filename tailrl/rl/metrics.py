"""Per-step metrics: one JSONL line per step, a console line, tensorboard when installed.

Keys follow verl (``critic/score/mean``, ``actor/pg_loss``, ``timing_s/gen`` ...); the run's
``metrics.jsonl`` is what ``tailrl report`` and the benchmarks read.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"
# What the console line shows, in order: (key, label, format)
CONSOLE_KEYS = (("critic/score/mean", "score", ".3f"), ("actor/pg_loss", "pg", "+.4f"),
                ("actor/kl", "kl", ".4f"), ("actor/clip_frac", "clip", ".3f"),
                ("response_length/mean", "len", ".1f"), ("timing_s/gen", "gen", ".2f"),
                ("rollout/tail_s", "tail", ".2f"), ("rollout/spec_accept_length", "acc", ".2f"),
                ("timing_s/update", "upd", ".2f"), ("timing_s/step", "step", ".2f"))


def read_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_after(path: str | Path, step: int) -> None:
    """Drop lines of steps after ``step`` (a resumed run rewrites them)."""
    rows = [r for r in read_jsonl(path) if r.get("step", 0) <= step]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))


def console_line(step: int, total: int, m: dict[str, float]) -> str:
    parts = [f"step {step}/{total}"]
    parts += [f"{label} {m[key]:{fmt}}" for key, label, fmt in CONSOLE_KEYS if key in m]
    return " | ".join(parts)


class MetricsLogger:
    def __init__(self, output_dir: str | Path, tensorboard: bool = True, resume_step: int | None = None):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / METRICS_FILE
        self.rollouts = self.dir / ROLLOUTS_FILE
        for p in (self.path, self.rollouts):
            if resume_step is None:
                p.unlink(missing_ok=True)
            elif p.exists():
                truncate_after(p, resume_step)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(str(self.dir / "tensorboard"))
            except Exception:   # tensorboard is optional: any import failure means "not installed"
                log.info("tensorboard not importable; metrics go to %s only", self.path)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def log_rollouts(self, step: int, uids: list[str], responses: list[list[list[int]]],
                     rewards: list[float]) -> None:
        with self.rollouts.open("a") as f:
            f.write(json.dumps({"step": step, "uids": uids, "responses": responses, "rewards": rewards},
                               separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
