"""Workload knobs measured from real lengths: how alike are the responses of one group?

The synthetic workload (`workload.py`) draws log lengths as
``mu + sigma (sqrt(rho) z_group + sqrt(1 - rho) z_request)``, so `rho` is the intraclass
correlation of log lengths within a group: the share of their variance that the prompt
explains. `group_correlation` estimates it from measured responses with the one-way
ANOVA estimator (groups may differ in size; Shrout & Fleiss ICC(1)):

    MSB = sum_g n_g (m_g - m)^2 / (k - 1)      MSW = sum_g sum_i (x_gi - m_g)^2 / (N - k)
    n0  = (N - sum_g n_g^2 / N) / (k - 1)
    rho = (MSB - MSW) / (MSB + (n0 - 1) MSW)

with x = log length, k groups, N responses. The within-group and between-group standard
deviations it reports are sqrt(MSW) and sqrt(max(0, (MSB - MSW) / n0)). Lengths cut at the
length limit are used as they are (censored values pull rho slightly towards 1 when whole
groups hit the limit, towards 0 otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class GroupFit:
    rho: float          # intraclass correlation of log lengths
    sd_within: float    # sd of log length inside a group
    sd_between: float   # sd of the groups' mean log length (its true part)
    sd_total: float     # sd of all log lengths (the workload's sigma)
    groups: int
    responses: int


def group_correlation(lengths: Sequence[int] | np.ndarray, groups: Sequence | np.ndarray) -> GroupFit:
    """ICC(1) of log lengths within groups; groups of one response are skipped."""
    x = np.log(np.maximum(np.asarray(lengths, dtype=float), 1.0))
    g = np.asarray(groups)
    if x.shape != g.shape or x.ndim != 1:
        raise ValueError(f"lengths and groups must be 1-D of equal length, got {x.shape} and {g.shape}")
    _, inv, counts = np.unique(g, return_inverse=True, return_counts=True)
    keep = counts[inv] > 1
    x, inv = x[keep], np.unique(inv[keep], return_inverse=True)[1]
    n = np.bincount(inv).astype(float)
    k, N = len(n), float(len(x))
    if k < 2:
        raise ValueError(f"groups must hold at least 2 groups of >= 2 responses, got {k}")
    means = np.bincount(inv, weights=x) / n
    grand = x.mean()
    msb = float((n * (means - grand) ** 2).sum() / (k - 1))
    msw = float(((x - means[inv]) ** 2).sum() / (N - k))
    n0 = (N - (n ** 2).sum() / N) / (k - 1)
    denom = msb + (n0 - 1) * msw
    rho = (msb - msw) / denom if denom > 0 else 0.0
    return GroupFit(rho=float(rho), sd_within=msw ** 0.5, sd_between=max(0.0, (msb - msw) / n0) ** 0.5,
                    sd_total=float(x.std()), groups=k, responses=int(N))


def tail_clustering(lengths: Sequence[int] | np.ndarray, groups: Sequence | np.ndarray, q: float = 0.9) -> float:
    """Share of the responses in the top (1 - q) of lengths that have a sibling there too.

    A check of the tail's group structure that rho alone does not pin down: context-aware
    scheduling finds a long response early only if its siblings are long as well.
    """
    x, g = np.asarray(lengths, dtype=float), np.asarray(groups)
    if x.shape != g.shape or x.ndim != 1 or len(x) == 0:
        raise ValueError(f"lengths and groups must be 1-D of equal, nonzero length, got {x.shape} and {g.shape}")
    if not 0 < q < 1:
        raise ValueError(f"q must be in (0, 1), got {q!r}")
    top = x >= np.quantile(x, q)
    _, inv = np.unique(g, return_inverse=True)
    per_group = np.bincount(inv, weights=top.astype(float))
    return float((top & (per_group[inv] >= 2)).sum() / top.sum())
