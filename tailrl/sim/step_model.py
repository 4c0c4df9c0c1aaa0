"""Step-time models: how long one engine step of an instance takes.

A decode step of an instance with batch ``B`` (running requests), ``N`` new tokens (B, or
B x (1 + draft tokens) with speculation) and ``K`` KV tokens (the sum of the running
requests' contexts) takes, in both models, a *convex piecewise-linear* time in K:

    step(B, N, K) = max_l (a_l(B, N) + b_l(B, N) * K)

`lines(B, N)` returns the (a_l, b_l) pairs. Between two events B and N are fixed and K grows
by R tokens a step (R = the sum of the requests' tokens per step), so the time of n steps
has a closed form (`run_time`) and the simulator never steps token by token.

Roofline (`RooflineStepModel`), per instance of `gpus` accelerators:

    F  = gpus x peak FLOP/s x mfu            BW = gpus x HBM bytes/s x bw_eff
    compute(K) = (2 P_active N + 4 L d (N / B) K) / F        # matmuls + attention over K
    memory(K)  = (W + K kv_bytes) / BW                        # weights once + the whole KV
    step = overhead + max(compute, memory)

with P_active the active parameters, L layers, d the model width, kv_bytes the KV bytes per
token and W the weight bytes (MoE: min(all experts, active x N tokens)). `overhead` holds
kernel launches, sampling and the tensor-parallel all-reduces. A prefill of contexts p_i
costs overhead + max((2 P_active sum p + 2 L d sum p_i^2) / F, (W + kv_bytes sum p) / BW).

Calibrated (`CalibratedStepModel`): a least-squares fit t = c0 + c1 B + c2 N + c3 K to
measured steps from a JSON list of {"batch", "new_tokens", "kv_tokens", "seconds"}
(coefficients clamped at >= 0); a prefill is one step with N = sum p, K = sum p.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from tailrl.sim.hardware import Accelerator, ModelShape

Line = tuple[float, float]   # (a, b): a + b * K seconds


class StepModel(Protocol):
    def lines(self, batch: int, new_tokens: int) -> list[Line]: ...
    def prefill_time(self, lengths: Sequence[int], kv_tokens: int) -> float: ...


@dataclass(frozen=True)
class RooflineStepModel:
    accelerator: Accelerator
    model: ModelShape
    gpus: int = 8                   # accelerators per instance (tensor parallel)
    mfu: float = 0.5                # achieved fraction of peak FLOP/s
    bw_eff: float = 0.8             # achieved fraction of HBM bandwidth
    overhead_s: float = 0.008       # fixed cost per step

    def __post_init__(self) -> None:
        for name in ("gpus", "mfu", "bw_eff"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.mfu > 1 or self.bw_eff > 1:
            raise ValueError("mfu and bw_eff must be <= 1")
        if self.overhead_s < 0:
            raise ValueError(f"overhead_s must be >= 0, got {self.overhead_s!r}")

    @property
    def _flops(self) -> float:
        return self.gpus * self.accelerator.flops * self.mfu

    @property
    def _bw(self) -> float:
        return self.gpus * self.accelerator.mem_bw * self.bw_eff

    def _weight_bytes(self, tokens: int) -> float:
        m = self.model
        return min(m.params_total, m.params_active * max(tokens, 1)) * m.weight_bytes_per_param

    def kv_capacity(self, mem_util: float = 0.9) -> int:
        """KV token slots left after the weights in `mem_util` of the instance's memory."""
        free = self.gpus * self.accelerator.mem_bytes * mem_util - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.gpus} x {self.accelerator.name}")
        return int(free // self.model.kv_bytes_per_token)

    def lines(self, batch: int, new_tokens: int) -> list[Line]:
        m, F, BW = self.model, self._flops, self._bw
        compute = (self.overhead_s + 2 * m.params_active * new_tokens / F,
                   4 * m.n_layers * m.d_model * (new_tokens / max(batch, 1)) / F)
        memory = (self.overhead_s + self._weight_bytes(new_tokens) / BW, m.kv_bytes_per_token / BW)
        return [compute, memory]

    def prefill_time(self, lengths: Sequence[int], kv_tokens: int) -> float:
        if not lengths:
            return 0.0
        m, total = self.model, float(sum(lengths))
        sq = float(sum(p * p for p in lengths))
        compute = (2 * m.params_active * total + 2 * m.n_layers * m.d_model * sq) / self._flops
        memory = (self._weight_bytes(int(total)) + m.kv_bytes_per_token * (total + kv_tokens)) / self._bw
        return self.overhead_s + max(compute, memory)


@dataclass(frozen=True)
class CalibratedStepModel:
    c0: float   # seconds per step
    c1: float   # seconds per running request
    c2: float   # seconds per new token
    c3: float   # seconds per KV token

    @classmethod
    def fit(cls, samples: list[dict]) -> "CalibratedStepModel":
        if len(samples) < 4:
            raise ValueError(f"samples must hold >= 4 measured steps, got {len(samples)}")
        keys = ("batch", "new_tokens", "kv_tokens", "seconds")
        for s in samples:
            missing = [k for k in keys if k not in s]
            if missing:
                raise ValueError(f"samples: a step lacks {missing}: {s!r}")
        X = np.array([[1.0, s["batch"], s["new_tokens"], s["kv_tokens"]] for s in samples])
        y = np.array([float(s["seconds"]) for s in samples])
        # least squares on relative errors (step times span orders of magnitude: a 3 ms decode
        # step must not be drowned by a 1 s prefill), then scaled so the samples' predicted total
        # time is their measured total (relative fits run low on noisy steps; a makespan is a sum)
        w = 1.0 / np.maximum(y, 1e-9)
        coef = np.maximum(np.linalg.lstsq(X * w[:, None], y * w, rcond=None)[0], 0.0)
        pred = float((X @ coef).sum())
        coef = coef * (float(y.sum()) / pred if pred > 0 else 1.0)
        return cls(*(float(c) for c in coef))

    @classmethod
    def from_json(cls, path: str | Path) -> "CalibratedStepModel":
        data = json.loads(Path(path).read_text())
        return cls.fit(data["steps"] if isinstance(data, dict) else data)

    def lines(self, batch: int, new_tokens: int) -> list[Line]:
        return [(self.c0 + self.c1 * batch + self.c2 * new_tokens, self.c3)]

    def prefill_time(self, lengths: Sequence[int], kv_tokens: int) -> float:
        if not lengths:
            return 0.0
        total = float(sum(lengths))
        return self.c0 + self.c1 * len(lengths) + self.c2 * total + self.c3 * (total + kv_tokens)


def _series(p: float, q: float, s: int, e: int) -> float:
    """sum_{j=s}^{e-1} (p + q j)."""
    n = e - s
    return n * p + q * (s + e - 1) * n / 2


def run_time(lines: list[Line], kv0: float, rate: float, n: int) -> float:
    """Seconds for `n` steps starting at `kv0` KV tokens growing by `rate` a step."""
    if n <= 0:
        return 0.0
    pq = [(a + b * kv0, b * rate) for a, b in lines]   # step j costs max(p + q j)
    cuts = [0, n]   # where the costliest line may change: the lines' crossings
    for i in range(len(pq)):
        for k in range(i + 1, len(pq)):
            dq = pq[k][1] - pq[i][1]
            if dq != 0:
                j = (pq[i][0] - pq[k][0]) / dq
                if 0 < j < n:
                    cuts.append(math.ceil(j))
    if len(cuts) > 2:
        cuts = sorted(set(cuts))
    total = 0.0
    for s, e in zip(cuts, cuts[1:]):
        if e > s:
            mid = (s + e - 1) / 2
            p, q = pq[0]
            for pk, qk in pq[1:]:          # the costliest line inside [s, e) (first on ties)
                if pk + qk * mid > p + q * mid:
                    p, q = pk, qk
            total += _series(p, q, s, e)
    return total


def steps_within(lines: list[Line], kv0: float, rate: float, seconds: float, limit: int) -> int:
    """The most steps (<= limit) that complete within `seconds`."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if run_time(lines, kv0, rate, mid) <= seconds:
            lo = mid
        else:
            hi = mid - 1
    return lo
