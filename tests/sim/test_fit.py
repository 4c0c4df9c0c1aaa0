import math

import pytest

from tailrl.sim.fit import group_correlation, tail_clustering
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


def test_tail_clustering_counts_top_responses_with_a_top_sibling():
    # top 25% (q 0.75) of 8 lengths = the two >= 70: 80 and 90; both in group 1 -> 1.0
    lengths, groups = [1, 2, 3, 4, 50, 60, 80, 90], [0, 0, 0, 0, 1, 1, 1, 1]
    assert tail_clustering(lengths, groups, q=0.75) == 1.0
    assert tail_clustering(lengths, [0, 0, 0, 1, 1, 1, 0, 1], q=0.75) == 0.0   # split across groups
    with pytest.raises(ValueError, match="q"):
        tail_clustering(lengths, groups, q=1.0)
