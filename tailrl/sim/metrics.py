"""What a simulated rollout step measured, and the table the CLI prints.

- makespan_s: time until the last response finished.
- throughput_tok_s: generated tokens / makespan.
- tail_s: time spent after 90% of the responses had finished (Seer's "last 10%").
- idle_frac: fraction of instance-time with nothing running.
- preemptions, migrated_gb (KV moved between instances), prefill_mtok (tokens prefilled,
  including recomputation after preemption), chunks (chunk runs started).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tailrl.sim.simulator import _Run


@dataclass
class SimResult:
    policy: str
    makespan_s: float
    throughput_tok_s: float
    tail_s: float
    idle_frac: float
    preemptions: int
    migrated_gb: float
    prefill_mtok: float
    chunks: int
    events: int
    finish_time: np.ndarray = field(repr=False)                          # [M] seconds
    busy: list[list[tuple[float, float, int]]] = field(repr=False)       # per instance
    lengths: np.ndarray = field(repr=False)                              # [M] tokens
    wall_s: float = 0.0     # simulator run time (set by the caller that timed it)
    cpu_s: float = 0.0

    @classmethod
    def collect(cls, run: "_Run") -> "SimResult":
        ft = run.finish_time
        makespan = float(ft.max())
        k = max(1, math.ceil(0.9 * len(ft)))
        t90 = float(np.partition(ft, k - 1)[k - 1])
        busy_s = sum(e - s for inst in run.insts for s, e, _ in inst.busy)
        reqs = list(run.buffer)
        return cls(policy=run.policy.name, makespan_s=makespan,
                   throughput_tok_s=float(run.trace.length.sum()) / makespan if makespan > 0 else 0.0,
                   tail_s=makespan - t90,
                   idle_frac=1.0 - busy_s / (len(run.insts) * makespan) if makespan > 0 else 0.0,
                   preemptions=sum(r.preemptions for r in reqs),
                   migrated_gb=run.migrated_bytes / 1e9, prefill_mtok=run.prefill_tokens / 1e6,
                   chunks=sum(r.chunks for r in reqs), events=run.events,
                   finish_time=ft, busy=[inst.busy for inst in run.insts], lengths=run.trace.length)

    def figures(self) -> dict[str, float | int]:
        """The scalar figures (what the JSON line holds)."""
        return {"makespan_s": round(self.makespan_s, 2), "throughput_tok_s": round(self.throughput_tok_s, 1),
                "tail_s": round(self.tail_s, 2), "idle_frac": round(self.idle_frac, 4),
                "preemptions": self.preemptions, "migrated_gb": round(self.migrated_gb, 3),
                "prefill_mtok": round(self.prefill_mtok, 3), "chunks": self.chunks}


def table(results: list[SimResult], baseline: str = "static") -> tuple[str, dict[str, dict]]:
    """A text table of `results` and the per-policy figures with ratios vs `baseline`."""
    base = next((r for r in results if r.policy == baseline), results[0])
    rows, out = [], {}
    head = (f"{'policy':<12} {'makespan_s':>10} {'speedup':>8} {'tok/s':>10} {'tail_s':>8} "
            f"{'tail/base':>9} {'idle':>6} {'preempt':>8} {'migr_GB':>8}")
    for r in results:
        f = r.figures()
        f["speedup_vs_" + base.policy] = round(base.makespan_s / r.makespan_s, 3)
        f["tail_vs_" + base.policy] = round(r.tail_s / base.tail_s, 3) if base.tail_s > 0 else 0.0
        out[r.policy] = f
        rows.append(f"{r.policy:<12} {r.makespan_s:>10.1f} {f['speedup_vs_' + base.policy]:>7.2f}x "
                    f"{r.throughput_tok_s:>10.0f} {r.tail_s:>8.1f} {f['tail_vs_' + base.policy]:>9.2f} "
                    f"{r.idle_frac:>6.1%} {r.preemptions:>8d} {r.migrated_gb:>8.1f}")
    return "\n".join([head] + rows), out
