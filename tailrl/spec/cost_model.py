"""Forward-pass time as a function of (batch size, tokens in the forward), learned online.

Speculation pays only while verifying extra tokens is nearly free (FACTS: at batch 1 a
16-token forward costs 1.3x a 1-token one; at batch 64, 6x). The policies need two numbers
per step: the plain step time ``predict(B, B)`` and the marginal cost of one more verified
token ``slope(B)``.

Model: one line ``t = a + b * tokens`` per batch-size bucket (powers of two), fitted by
exponentially-forgotten least squares (recent steps weigh more: contexts grow during a
rollout). The slope is ridge-regularised toward a prior slope, so a bucket that has only
seen plain decode steps (a single ``tokens`` value) still has a sane line: its intercept
comes from data, its slope from the prior. Between buckets, predictions interpolate linearly
in log2(batch size); outside the observed range the nearest bucket's line is used. Before
any data, the prior line applies (``prior_base`` + ``prior_per_token`` * tokens).

``calibrate(forward_fn)`` times a few synthetic shapes up front so the slope is measured,
not assumed, before the first real step.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

logger = logging.getLogger(__name__)


class _Line:
    """Weighted least-squares sufficient statistics with forgetting."""

    __slots__ = ("w", "sx", "sy", "sxx", "sxy")

    def __init__(self) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.sx = self.sx * decay + x
        self.sy = self.sy * decay + y
        self.sxx = self.sxx * decay + x * x
        self.sxy = self.sxy * decay + x * y

    def fit(self, prior_slope: float, ridge: float) -> tuple[float, float]:
        """(intercept, slope); the slope shrinks toward ``prior_slope`` with weight ``ridge``."""
        mx, my = self.sx / self.w, self.sy / self.w
        vxx = max(self.sxx - self.w * mx * mx, 0.0)      # centred sums
        vxy = self.sxy - self.w * mx * my
        b = max((vxy + ridge * prior_slope) / (vxx + ridge), 0.0)
        return my - b * mx, b


class CostModel:
    def __init__(self, prior_base: float = 5e-3, prior_per_token: float = 5e-5,
                 decay: float = 0.995, prior_weight: float = 4.0, max_bucket: int = 12) -> None:
        self.prior_base = prior_base            # seconds per forward before any data
        self.prior_per_token = prior_per_token  # seconds per token before any data
        self.decay = decay
        self.prior_weight = prior_weight        # pseudo-observations behind the prior slope
        self.max_bucket = max_bucket            # buckets 2**0 .. 2**max_bucket
        self._lines: dict[int, _Line] = {}
        self.num_observations = 0

    def _bucket(self, batch_size: int) -> int:
        return min(max(round(math.log2(max(batch_size, 1))), 0), self.max_bucket)

    def observe(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        if batch_size < 1 or num_tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        k = self._bucket(batch_size)
        line = self._lines.get(k)
        if line is None:
            line = self._lines[k] = _Line()
        line.add(float(num_tokens), float(seconds), self.decay)
        self.num_observations += 1

    def _line(self, k: int) -> tuple[float, float]:
        # ridge in token^2 units: prior_weight observations spread one batch width apart
        ridge = self.prior_weight * float(2 ** k) ** 2
        return self._lines[k].fit(self.prior_per_token, ridge)

    def _coeffs(self, batch_size: int) -> tuple[float, float]:
        if not self._lines:
            return self.prior_base, self.prior_per_token
        x = math.log2(max(batch_size, 1))
        below = [k for k in self._lines if k <= x]
        above = [k for k in self._lines if k >= x]
        if not below or not above:
            return self._line(max(below) if below else min(above))
        lo, hi = max(below), min(above)
        a0, b0 = self._line(lo)
        if lo == hi:
            return a0, b0
        a1, b1 = self._line(hi)
        f = (x - lo) / (hi - lo)
        return a0 + f * (a1 - a0), b0 + f * (b1 - b0)

    def predict(self, batch_size: int, num_tokens: int) -> float:
        """Expected seconds of one forward over ``num_tokens`` tokens of ``batch_size`` requests."""
        a, b = self._coeffs(batch_size)
        return max(a + b * num_tokens, 1e-9)

    def slope(self, batch_size: int) -> float:
        """Seconds per additional token in a forward of ``batch_size`` requests."""
        return self._coeffs(batch_size)[1]

    def calibrate(self, forward_fn: Callable[[int, int], object],
                  batch_sizes: tuple[int, ...] = (1, 4, 16, 64),
                  extra_per_request: tuple[int, ...] = (0, 2, 8), repeats: int = 2) -> None:
        """Time ``forward_fn(batch_size, num_tokens)`` on a grid of shapes and learn from it.

        ``num_tokens = batch_size * (1 + extra)``: a plain decode step plus ``extra`` draft
        tokens per request. The first call of each shape is a warm-up and is not recorded.
        """
        for bs in batch_sizes:
            for extra in extra_per_request:
                n = bs * (1 + extra)
                forward_fn(bs, n)
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    forward_fn(bs, n)
                    self.observe(bs, n, time.perf_counter() - t0)
        logger.info("cost model calibrated: %s", {bs: (round(self.predict(bs, bs) * 1e3, 2),
                                                       round(self.slope(bs) * 1e3, 3)) for bs in batch_sizes})
