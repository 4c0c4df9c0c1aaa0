"""Length traces: synthetic generators with the papers' statistics, and recorded JSONL.

A trace is one rollout step: for every response its group, prompt, prompt length, max
length, true length, the previous epoch's length of the same prompt slot (for `history`),
and optionally its accepted tokens per speculative step.

Synthetic lengths are log-normal and clipped at the max length (responses that hit the
limit are the real tail):

    log L = mu + sigma * (sqrt(rho) z_group + sqrt(1 - rho) z_request)

`rho` is the within-group correlation of log lengths. `mu` is solved so that the clipped
mean equals the target mean. The previous epoch redraws with the group score
z'_group = c z_group + sqrt(1 - c^2) e: `c` (`rank_corr`) is the across-epoch rank
stability of a prompt (RhymeRL: ranks are stable; c = 1 is no churn).

Presets follow Seer's Table 3 (requests / group size / max length / mean length).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Trace:
    group_id: np.ndarray      # [M] int
    prompt_id: np.ndarray     # [M] int
    prompt_len: np.ndarray    # [M] int
    max_tokens: np.ndarray    # [M] int
    length: np.ndarray        # [M] int, true generated tokens (1..max_tokens)
    prev_length: np.ndarray | None = None   # [M] int, previous epoch (history); None = no history
    accept_len: np.ndarray | None = None    # [M] float, tokens per speculative step (>= 1)

    def __post_init__(self) -> None:
        m = len(self.length)
        for name in ("group_id", "prompt_id", "prompt_len", "max_tokens"):
            if len(getattr(self, name)) != m:
                raise ValueError(f"{name} must have {m} entries like length, got {len(getattr(self, name))}")
        if m == 0:
            raise ValueError("length must not be empty")
        if (self.length < 1).any() or (self.length > self.max_tokens).any():
            raise ValueError("length must be in [1, max_tokens] for every request")

    def __len__(self) -> int:
        return len(self.length)

    def history(self) -> dict[int, list[int]]:
        """prompt id -> previous epoch's lengths (what the history policy reads)."""
        if self.prev_length is None:
            return {}
        out: dict[int, list[int]] = {}
        for p, n in zip(self.prompt_id.tolist(), self.prev_length.tolist()):
            if n > 0:   # 0 marks a response without history
                out.setdefault(p, []).append(int(n))
        return out


@dataclass
class WorkloadConfig:
    requests: int = 9600
    group_size: int = 16
    max_tokens: int = 40960
    mean_tokens: float = 7615.0
    sigma: float = 1.0           # spread of log lengths
    rho: float = 0.6             # within-group correlation of log lengths (0.49-0.66 measured on
                                 # our own RL rollouts; see docs/scheduling.md "Where rho comes from")
    rank_corr: float = 0.8       # across-epoch correlation of a prompt's length score
    prompt_mean: int = 1000      # mean prompt tokens (log-normal, sigma 0.5)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.group_size < 1 or self.requests < self.group_size or self.requests % self.group_size:
            raise ValueError(f"requests must be a positive multiple of group_size, got "
                             f"{self.requests} and {self.group_size}")
        if not 1 <= self.mean_tokens < self.max_tokens:
            raise ValueError(f"mean_tokens must be in [1, max_tokens), got {self.mean_tokens!r}")
        if self.sigma <= 0:
            raise ValueError(f"sigma must be > 0, got {self.sigma!r}")
        for name in ("rho", "rank_corr"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.prompt_mean < 1:
            raise ValueError(f"prompt_mean must be >= 1, got {self.prompt_mean!r}")


PRESETS: dict[str, dict] = {   # Seer Table 3
    "moonlight": dict(requests=3200, group_size=8, max_tokens=65536, mean_tokens=22386, prompt_mean=600),
    "qwen2vl-72b": dict(requests=9600, group_size=16, max_tokens=40960, mean_tokens=7615, prompt_mean=1500),
    "kimi-k2": dict(requests=6400, group_size=8, max_tokens=98304, mean_tokens=38959, prompt_mean=2000),
}


def preset(name: str, **overrides) -> WorkloadConfig:
    if name not in PRESETS:
        raise ValueError(f"workload must be one of {sorted(PRESETS)} or a .jsonl trace, got {name!r}")
    return WorkloadConfig(**{**PRESETS[name], **overrides})


def clipped_lognormal_mean(mu: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for log X ~ N(mu, sigma^2)."""
    phi = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma * sigma / 2) * phi(z - sigma) + cap * (1 - phi(z))


def _solve_mu(mean: float, sigma: float, cap: float) -> float:
    lo, hi = -10.0, math.log(cap) + 10 * sigma
    for _ in range(100):   # the clipped mean increases with mu
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_lognormal_mean(mid, sigma, cap) < mean else (lo, mid)
    return (lo + hi) / 2


def generate(cfg: WorkloadConfig) -> Trace:
    rng = np.random.default_rng(cfg.seed)
    m, g = cfg.requests, cfg.requests // cfg.group_size
    mu = _solve_mu(cfg.mean_tokens, cfg.sigma, cfg.max_tokens)
    group = np.repeat(np.arange(g), cfg.group_size)
    zg, zr, e, zr_prev = (rng.standard_normal(n) for n in (g, m, g, m))
    zg_prev = cfg.rank_corr * zg + math.sqrt(1 - cfg.rank_corr ** 2) * e

    def lengths(zgroup: np.ndarray, zreq: np.ndarray) -> np.ndarray:
        z = math.sqrt(cfg.rho) * zgroup[group] + math.sqrt(1 - cfg.rho) * zreq
        return np.clip(np.round(np.exp(mu + cfg.sigma * z)), 1, cfg.max_tokens).astype(np.int64)

    p_sigma = 0.5
    plen = np.exp(math.log(cfg.prompt_mean) - p_sigma ** 2 / 2 + p_sigma * rng.standard_normal(g))
    return Trace(group_id=group, prompt_id=group.copy(),
                 prompt_len=np.maximum(1, np.round(plen)).astype(np.int64)[group],
                 max_tokens=np.full(m, cfg.max_tokens, dtype=np.int64),
                 length=lengths(zg, zr), prev_length=lengths(zg_prev, zr_prev))


def read_jsonl(path: str | Path, epoch: int | None = None) -> Trace:
    """A recorded trace: one JSON object per line and response.

    Keys: ``prompt_id``, ``prompt_len``, ``max_tokens``, ``response_len``; optional
    ``group_id`` (default: the prompt id), ``epoch`` (lines of `epoch` are simulated, and
    those of epoch - 1 become the history; default: the last epoch), ``prev_response_len``
    (history given inline) and ``accept_len`` (tokens per speculative step).
    """
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"trace {path} holds no requests")
    for k, row in enumerate(rows):
        missing = [key for key in ("prompt_id", "prompt_len", "max_tokens", "response_len") if key not in row]
        if missing:
            raise ValueError(f"trace {path} line {k + 1} lacks {missing}")
    epochs = sorted({row.get("epoch", 0) for row in rows})
    cur = epochs[-1] if epoch is None else epoch
    if cur not in epochs:
        raise ValueError(f"epoch {cur} is not in trace {path} (epochs: {epochs})")
    now = [row for row in rows if row.get("epoch", 0) == cur]
    past: dict = {}
    for row in rows:
        if row.get("epoch", 0) == cur - 1:
            past.setdefault(row["prompt_id"], []).append(int(row["response_len"]))
    pids = {p: i for i, p in enumerate(dict.fromkeys(row["prompt_id"] for row in now))}
    gids = {gid: i for i, gid in enumerate(dict.fromkeys(row.get("group_id", row["prompt_id"]) for row in now))}
    slot: dict = {}
    prev = []
    for row in now:   # the k-th response of a prompt gets the k-th previous one (if any)
        k = slot[row["prompt_id"]] = slot.get(row["prompt_id"], -1) + 1
        hist = past.get(row["prompt_id"])
        prev.append(row.get("prev_response_len", hist[k % len(hist)] if hist else 0))
    has_prev = any(p > 0 for p in prev)
    arr = lambda key: np.array([int(row[key]) for row in now], dtype=np.int64)
    return Trace(group_id=np.array([gids[row.get("group_id", row["prompt_id"])] for row in now]),
                 prompt_id=np.array([pids[row["prompt_id"]] for row in now]),
                 prompt_len=arr("prompt_len"), max_tokens=arr("max_tokens"),
                 length=np.clip(arr("response_len"), 1, None),
                 prev_length=np.array(prev, dtype=np.int64) if has_prev else None,
                 accept_len=(np.array([float(row.get("accept_len", 1.0)) for row in now])
                             if any("accept_len" in row for row in now) else None))
