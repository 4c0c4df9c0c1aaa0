import math

import numpy as np
import pytest

from tailrl.sim.fit import group_correlation
from tailrl.sim.workload import WorkloadConfig, generate


def test_hand_checked_icc():
    # log lengths: group a = (0, 2), group b = (4, 6): m_a 1, m_b 5, grand 3
    # MSB = 2 (1-3)^2 + 2 (5-3)^2 = 16 over k-1 = 1; MSW = (1+1+1+1) / (4-2) = 2; n0 = 2
    # rho = (16 - 2) / (16 + 2) = 7/9
    e = math.e
    fit = group_correlation([1, e ** 2, e ** 4, e ** 6], ["a", "a", "b", "b"])
    assert fit.rho == pytest.approx(7 / 9)
    assert fit.sd_within == pytest.approx(2 ** 0.5) and fit.sd_between == pytest.approx(7 ** 0.5)


def test_identical_siblings_give_one_and_singletons_are_skipped():
    fit = group_correlation([5, 5, 80, 80, 999], [0, 0, 1, 1, 2])
    assert fit.rho == pytest.approx(1.0) and fit.groups == 2 and fit.responses == 4


@pytest.mark.parametrize("rho", [0.3, 0.8])
def test_recovers_the_generators_rho(rho):
    tr = generate(WorkloadConfig(requests=16_000, group_size=16, rho=rho, max_tokens=10 ** 7, mean_tokens=5000))
    assert group_correlation(tr.length, tr.group_id).rho == pytest.approx(rho, abs=0.04)


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="lengths and groups"):
        group_correlation([1, 2, 3], [0, 0])
    with pytest.raises(ValueError, match="groups"):
        group_correlation([1, 2, 3], [0, 0, 1])
