"""PNG figures of simulated rollouts: an instance timeline and length / completion CDFs.

matplotlib is optional for the package (``pip install 'tailrl[plot]'``); it is imported
lazily, with a clear error when missing.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tailrl.sim.metrics import SimResult


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:   # pragma: no cover - depends on the environment
        raise ImportError("plots need matplotlib: pip install 'tailrl[plot]' (or pass --no-plots)") from e
    return plt


def occupancy(busy: list[tuple[float, float, int]], edges: np.ndarray) -> np.ndarray:
    """Mean running requests of one instance in each bin between `edges` (0 = idle)."""
    if not busy:
        return np.zeros(len(edges) - 1)
    seg = np.asarray(busy, dtype=float)                     # [S, 3]: start, end, batch
    area = np.cumsum((seg[:, 1] - seg[:, 0]) * seg[:, 2])   # batch-seconds at each end
    times = np.column_stack([seg[:, 0], seg[:, 1]]).ravel()
    cum = np.column_stack([np.concatenate([[0.0], area[:-1]]), area]).ravel()
    # segments are sequential per instance, so `times` is sorted and `cum` piecewise linear
    at_edges = np.interp(edges, times, cum, left=0.0, right=float(area[-1]))
    return np.diff(at_edges) / np.diff(edges)


def timeline(results: list[SimResult], path: str | Path, bins: int = 600) -> Path:
    """One panel per policy, one row per instance; colour = running requests, white = idle."""
    plt = _pyplot()
    horizon = max(r.makespan_s for r in results)
    edges = np.linspace(0.0, horizon, bins + 1)
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 1.2 + 1.6 * len(results)), sharex=True,
                             squeeze=False)
    vmax = max(max((b for inst in r.busy for _, _, b in inst), default=1) for r in results)
    for ax, r in zip(axes[:, 0], results):
        grid = np.array([occupancy(inst, edges) for inst in r.busy])   # [instances, bins]
        grid = np.ma.masked_less_equal(grid, 0.0)
        cmap = plt.get_cmap("viridis").with_extremes(bad="white")
        im = ax.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=vmax, interpolation="nearest",
                       extent=(0, horizon, len(r.busy) - 0.5, -0.5))
        ax.axvline(r.makespan_s - r.tail_s, color="red", lw=0.8, ls="--")
        ax.set_ylabel(f"{r.policy}\ninstance")
        ax.set_title(f"{r.policy}: makespan {r.makespan_s:.0f} s, tail {r.tail_s:.0f} s, "
                     f"idle {r.idle_frac:.0%}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (s); red dashed: 90% of responses done")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="running requests", shrink=0.8)
    return _save(fig, plt, path)


def length_cdf(results: list[SimResult], path: str | Path, prev_lengths: np.ndarray | None = None) -> Path:
    """Left: CDF of response lengths (and the previous epoch's). Right: completion times."""
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    lengths = np.sort(results[0].lengths)
    y = np.arange(1, len(lengths) + 1) / len(lengths)
    a.plot(lengths, y, label="this epoch")
    if prev_lengths is not None:
        a.plot(np.sort(prev_lengths), y, ls="--", label="previous epoch")
    a.set_xlabel("response length (tokens)")
    a.set_ylabel("fraction of responses")
    a.legend()
    for r in results:
        b.plot(np.sort(r.finish_time), y, label=r.policy)
    b.axhline(0.9, color="grey", lw=0.6, ls=":")
    b.set_xlabel("completion time (s)")
    b.legend()
    return _save(fig, plt, path)


def _save(fig, plt, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
