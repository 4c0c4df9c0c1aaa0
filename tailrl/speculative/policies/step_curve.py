"""A decode step's time as a function of the tokens it computes, learned from the steps run.

Why tokens alone: a step's matmuls read every weight once whatever their row count, and their
arithmetic grows with the rows (tokens: decode rows plus draft tokens). So below the ridge
(~10-16 rows for a model whose weights stream from memory on this CPU) a step costs its weight
bytes and extra tokens are nearly free; above it each token costs about a row's arithmetic.
A verify step of ``b`` rows and ``k`` draft tokens runs the matmuls of a plain step of
``b + k`` rows, and a rollout's bulk runs plain steps at every batch size on its way down, so
the curve the tail's verify steps need has mostly been measured before the tail begins.

The first step at each token count is not counted (it builds the matmul kernels for its
shape). Points are bucketed by tokens (exact up to 16, then four buckets per doubling); each keeps an
exponential average of the tokens and seconds it saw (recent steps weigh more: contexts grow
during a rollout and attention with them). ``predict`` interpolates linearly between
points, holds the first point's time below it, and extrapolates above the last point
proportionally to its tokens (as if compute-bound: the most a token can cost, so an
unmeasured depth is never thought cheap). Points that fall with more tokens (noise) are pooled
into their mean (isotonic regression). ``predict_flat`` is the optimistic reading above the
measured range, which a policy may try now and then to learn the curve's next stretch.
"""
from __future__ import annotations

import bisect
import math


def token_bucket(tokens: int) -> int:
    """Bucket id of a step's token count: the count itself up to 16, then quarter-octaves."""
    if tokens <= 16:
        return max(tokens, 1)
    return 16 + max(1, round(4 * math.log2(tokens / 16)))


class StepCurve:
    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha                           # weight of a new step in its bucket's average
        self._points: dict[int, list[float]] = {}    # bucket -> [mean tokens, mean seconds, steps]
        self._sorted: tuple[list[float], list[float]] | None = None
        self._seen: set[int] = set()                 # token counts stepped at least once

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens < 1 or not seconds > 0 or not math.isfinite(seconds):
            return
        if tokens not in self._seen:       # the first step of a shape builds its kernels (oneDNN
            self._seen.add(tokens)         # primitives, allocations): several times its cost
            return
        p = self._points.get(token_bucket(tokens))
        if p is None:
            self._points[token_bucket(tokens)] = [float(tokens), seconds, 1.0]
        else:
            w = max(self.alpha, 1.0 / (p[2] + 1))          # a plain mean until 1/alpha steps
            p[0] += w * (tokens - p[0])
            p[1] += w * (seconds - p[1])
            p[2] += 1
        self._sorted = None

    @property
    def empty(self) -> bool:
        return not self._points

    def _xy(self) -> tuple[list[float], list[float]]:
        if self._sorted is None:
            pts = sorted(self._points.values())
            # time never falls with more tokens: pool adjacent points that say otherwise into
            # their weighted mean (isotonic regression), so one noisy bucket moves the curve by
            # its share instead of raising every point above it
            blocks: list[list[float]] = []                   # [sum w*y, sum w, first index, last index]
            for k, (_, y, steps) in enumerate(pts):
                w = min(steps, 1.0 / self.alpha)
                blocks.append([w * y, w, k, k])
                while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
                    top = blocks.pop()
                    blocks[-1][0] += top[0]
                    blocks[-1][1] += top[1]
                    blocks[-1][3] = top[3]
            ys = [0.0] * len(pts)
            for sy, sw, a, b in blocks:
                for k in range(a, b + 1):
                    ys[k] = sy / sw
            self._sorted = ([p[0] for p in pts], ys)
        return self._sorted

    def max_tokens(self) -> float:
        """The largest token count measured (0 before any step)."""
        return self._xy()[0][-1] if self._points else 0.0

    def predict(self, tokens: float) -> float:
        """Seconds of a step computing ``tokens`` tokens (needs at least one observation)."""
        xs, ys = self._xy()
        if tokens >= xs[-1]:
            return ys[-1] * tokens / xs[-1]
        i = bisect.bisect_right(xs, tokens)
        if i == 0:
            return ys[0]
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def last_slope(self) -> float | None:
        """Seconds per token over the last measured stretch (None below two points)."""
        xs, ys = self._xy()
        if len(xs) < 2:
            return None
        return (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

    def predict_flat(self, tokens: float) -> float:
        """The optimistic reading for exploring: above the measured range a step costs what
        the largest measured one did (memory-bound), up to twice its tokens."""
        top = self.max_tokens()
        return self.predict(min(tokens, top)) if tokens <= 2 * top else self.predict(tokens / 2)
