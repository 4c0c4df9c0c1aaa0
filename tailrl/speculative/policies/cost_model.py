"""Forward-pass time as a function of batch size, tokens and attention work, learned online.

Speculation pays only while verifying extra tokens is cheap (FACTS: at batch 1 a 16-token
forward costs 1.3x a 1-token one; at batch 64, 6x). The policies need two numbers per step:
the plain step time ``predict(B, B)`` and the marginal cost of one more verified token
``slope(B)``.

Model, per batch-size bucket (powers of two):

    t = a + b * tokens + c * reads + d * work
    reads = rows x key positions / 1000         (K/V read once per row, whatever its queries)
    work  = query slots x key positions / 1000  (scores computed)

Decode attention reads every row's K/V once for all of the row's query slots, so its cost
grows with ``reads`` and only a little with the number of queries; the ``work`` term prices
the extra queries of a verify step. A model with ``work`` alone cannot fit both (measured
at batch 256: 46 ms for a plain step at 128 positions and 110 ms at 512, but 155 ms and 244
ms with 4 draft tokens per row; its fit predicted the plain step at 69 ms, the verify
steps too cheap, and the policy speculated where it lost 10-25%). Without any attention term
the model is confounded worse: verify steps run late in a rollout, over long contexts.
Predictions use the context of the current step (``context``, set by the speculator: a
plain step reads and scores ``B x context`` positions, a verify step reads as many and
scores ``B x (1 + g) x context``).

Each bucket is fitted by exponentially-forgotten least squares (recent steps weigh more:
contexts grow during a rollout); the slopes are ridge-regularised toward prior slopes, so
a bucket that has only seen plain decode steps still has a sane model: its intercept comes
from data, its slopes from the priors. Between buckets, coefficients interpolate linearly in
log2(batch size); outside the observed range the nearest bucket's are used. Before any data,
the prior applies (``prior_base`` + ``prior_per_token`` * tokens).

``calibrate(forward_fn)`` times a few synthetic shapes up front so the slopes are measured,
not assumed, before the first real step.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, Sequence

import numpy as np

logger = logging.getLogger(__name__)


def batch_bucket(batch_size: int) -> int:
    """The one batch-size bucketing of speculation control: the nearest power of two's exponent
    (1 -> 0, 2 -> 1, 3-5 -> 2, 6-11 -> 3, ...). Step cost and acceptance change smoothly with
    the batch size, so neighbouring sizes share what was learned."""
    return max(round(math.log2(max(batch_size, 1))), 0)


class _Line:
    """Weighted least squares of y on k regressors with forgetting; slopes ridge-regularised."""

    __slots__ = ("w", "sx", "sy", "sxx", "sxy")

    def __init__(self, k: int) -> None:
        self.w = 0.0
        self.sx, self.sy = np.zeros(k), 0.0
        self.sxx, self.sxy = np.zeros((k, k)), np.zeros(k)

    def add(self, x: np.ndarray, y: float, decay: float) -> None:
        self.w = self.w * decay + 1.0
        self.sx = self.sx * decay + x
        self.sy = self.sy * decay + y
        self.sxx = self.sxx * decay + np.outer(x, x)
        self.sxy = self.sxy * decay + x * y

    def fit(self, prior: np.ndarray, ridge: np.ndarray) -> tuple[float, ...]:
        """(intercept, slope_1, ..., slope_k); slopes shrink toward ``prior`` with weights
        ``ridge`` and are clipped at 0 (time never falls with more work)."""
        m, my = self.sx / self.w, self.sy / self.w
        cov = self.sxx - self.w * np.outer(m, m) + np.diag(ridge)      # centred sums
        rhs = self.sxy - self.w * m * my + ridge * prior
        beta = np.maximum(np.linalg.solve(cov, rhs), 0.0)
        return (float(my - beta @ m), *map(float, beta))


class CostModel:
    def __init__(self, prior_base: float = 5e-3, prior_per_token: float = 5e-5,
                 decay: float = 0.995, prior_weight: float = 4.0, max_bucket: int = 12,
                 prior_per_kread: float = 0.0, prior_per_kpair: float = 0.0, context: int = 128) -> None:
        self.prior_base = prior_base            # seconds per forward before any data
        self.prior_per_token = prior_per_token  # seconds per token before any data
        self.prior_per_kread = prior_per_kread  # seconds per 1000 (row, key position) reads
        self.prior_per_kpair = prior_per_kpair  # seconds per 1000 (query slot, key position) pairs
        self.context = context                  # key positions of the current step (the longest context)
        self.decay = decay
        self.prior_weight = prior_weight        # pseudo-observations behind the prior slope
        self.max_bucket = max_bucket            # buckets 2**0 .. 2**max_bucket
        self._lines: dict[int, _Line] = {}
        self._cache: dict[int, tuple[float, ...]] = {}     # per batch size, interpolated
        self._fits: dict[int, tuple[float, ...]] = {}      # per bucket: a step refits only its own
        self.num_observations = 0

    def _bucket(self, batch_size: int) -> int:
        return min(batch_bucket(batch_size), self.max_bucket)

    def observe(self, batch_size: int, num_tokens: int, seconds: float, attention: float = 0.0,
                reads: float = 0.0) -> None:
        """One forward: ``attention`` = query slots x key positions of its attention calls,
        ``reads`` = rows x key positions (0, 0: unknown, the slopes' priors price them)."""
        if batch_size < 1 or num_tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        k = self._bucket(batch_size)
        line = self._lines.get(k)
        if line is None:
            line = self._lines[k] = _Line(3)
        line.add(np.array([float(num_tokens), reads / 1000.0, attention / 1000.0]), float(seconds), self.decay)
        self.num_observations += 1
        self._fits.pop(k, None)
        self._cache.clear()

    def _line(self, k: int) -> tuple[float, ...]:
        fit = self._fits.get(k)
        if fit is None:
            fit = self._fits[k] = self._fit_line(k)
        return fit

    def _fit_line(self, k: int) -> tuple[float, ...]:
        # ridge: prior_weight observations spread one batch width apart (tokens), and one
        # batch width times a 128-position context (reads, attention)
        width = float(2 ** k)
        ridge = self.prior_weight * np.array([width ** 2, (width * 0.128) ** 2, (width * 0.128) ** 2])
        prior = np.array([self.prior_per_token, self.prior_per_kread, self.prior_per_kpair])
        return self._lines[k].fit(prior, ridge)

    def _coeffs(self, batch_size: int) -> tuple[float, ...]:
        c = self._cache.get(batch_size)            # policies ask many times between two steps
        if c is None:
            c = self._cache[batch_size] = self._fit_coeffs(batch_size)
        return c

    def _fit_coeffs(self, batch_size: int) -> tuple[float, ...]:
        if not self._lines:
            return self.prior_base, self.prior_per_token, self.prior_per_kread, self.prior_per_kpair
        x = math.log2(max(batch_size, 1))
        below = [k for k in self._lines if k <= x]
        above = [k for k in self._lines if k >= x]
        if not below or not above:
            return self._line(max(below) if below else min(above))
        lo, hi = max(below), min(above)
        c0 = self._line(lo)
        if lo == hi:
            return c0
        c1 = self._line(hi)
        f = (x - lo) / (hi - lo)
        return tuple(u + f * (v - u) for u, v in zip(c0, c1))

    def predict(self, batch_size: int, num_tokens: int) -> float:
        """Expected seconds of one forward over ``num_tokens`` tokens of ``batch_size`` requests
        (``ceil(num_tokens / batch_size)`` query slots per row) at the current ``context``."""
        return self.predict_many(batch_size, (num_tokens,))[0]

    def predict_many(self, batch_size: int, num_tokens: Sequence[int]) -> list[float]:
        """``predict`` for several token counts at once (the policies scan draft depths)."""
        a, b, c, d = self._coeffs(batch_size)
        bs, kpos = max(batch_size, 1), self.context / 1000.0
        base = a + c * batch_size * kpos
        return [max(base + b * n + d * bs * -(-n // bs) * kpos, 1e-9) for n in num_tokens]

    def slope(self, batch_size: int) -> float:
        """Seconds per additional verified token in a forward of ``batch_size`` requests."""
        _, b, _, d = self._coeffs(batch_size)
        return b + d * self.context / 1000.0

    def calibrate(self, forward_fn: Callable[..., object],
                  batch_sizes: tuple[int, ...] = (1, 4, 16, 64),
                  extra_per_request: tuple[int, ...] = (0, 2, 8), repeats: int = 2,
                  contexts: tuple[int, ...] | None = None) -> None:
        """Time ``forward_fn(batch_size, num_tokens[, context])`` on a grid of shapes and learn.

        ``num_tokens = batch_size * (1 + extra)``: a plain decode step plus ``extra`` draft
        tokens per request, over ``context`` cached positions (``contexts=None``: the
        function takes two arguments and its context is ``self.context``). The first call of
        each shape is a warm-up and is not recorded.
        """
        for ctx in contexts or (None,):
            for bs in batch_sizes:
                for extra in extra_per_request:
                    n = bs * (1 + extra)
                    args = (bs, n) if ctx is None else (bs, n, ctx)
                    keys = (self.context if ctx is None else ctx) + 1 + extra
                    forward_fn(*args)
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        forward_fn(*args)
                        self.observe(bs, n, time.perf_counter() - t0, attention=float(n * keys),
                                     reads=float(bs * keys))
        logger.info("cost model calibrated: %s", {bs: (round(self.predict(bs, bs) * 1e3, 2),
                                                       round(self.slope(bs) * 1e3, 3)) for bs in batch_sizes})
