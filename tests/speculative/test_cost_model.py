import time

import pytest

from tailrl.speculative.policies.cost_model import CostModel


def feed(cm, bs, a, b, extras=(0, 1, 3, 7), reps=20):
    for _ in range(reps):
        for e in extras:
            x = bs * (1 + e)
            cm.observe(bs, x, a + b * x)


def test_prior_before_data():
    cm = CostModel(prior_base=0.004, prior_per_token=1e-4)
    assert cm.predict(8, 10) == pytest.approx(0.005)
    assert cm.slope(64) == pytest.approx(1e-4)


def test_fits_lines_per_bucket_and_interpolates():
    cm = CostModel()
    feed(cm, 1, 0.004, 8e-5)
    feed(cm, 64, 0.008, 7e-4)
    assert cm.predict(1, 16) == pytest.approx(0.004 + 16 * 8e-5, rel=2e-2)
    assert cm.predict(64, 512) == pytest.approx(0.008 + 512 * 7e-4, rel=2e-2)
    assert cm.slope(64) == pytest.approx(7e-4, rel=2e-2)
    mid = cm.slope(8)                                     # log2(8) is halfway between 0 and 6
    assert mid == pytest.approx((8e-5 + 7e-4) / 2, rel=2e-2)
    assert cm.predict(256, 256) == pytest.approx(0.008 + 256 * 7e-4, rel=2e-2)   # nearest bucket


def test_single_token_count_takes_the_prior_slope():
    cm = CostModel(prior_per_token=2e-4)
    for _ in range(10):
        cm.observe(16, 16, 0.02)                           # plain decode only
    assert cm.slope(16) == pytest.approx(2e-4)
    assert cm.predict(16, 16) == pytest.approx(0.02)
    cm.observe(16, 32, 0.2)                                # one wild timing barely moves it
    assert cm.slope(16) < 3e-3


def test_ignores_garbage():
    cm = CostModel()
    cm.observe(0, 5, 1.0)
    cm.observe(4, 4, float("nan"))
    cm.observe(4, 4, -1.0)
    assert cm.num_observations == 0


def test_calibrate_measures_forward_time():
    calls = []

    def forward(bs, n):
        calls.append((bs, n))
        time.sleep(1e-3 * n)

    cm = CostModel(prior_per_token=0.0)
    cm.calibrate(forward, batch_sizes=(1, 4), extra_per_request=(0, 8), repeats=1)
    assert sorted(set(calls)) == [(1, 1), (1, 9), (4, 4), (4, 36)]
    assert cm.num_observations == 4
    assert cm.slope(4) > 5e-4                                # measured, not the zero prior


def test_separates_kv_reads_from_query_work():
    """Decode attention reads each row's K/V once whatever its query slots: a model in query
    work alone mispriced plain steps against verify steps (see the module docstring)."""
    a, b, c, d = 0.002, 1e-4, 6e-4, 1e-4            # per token; per 1000 reads; per 1000 pairs
    cm = CostModel()
    for ctx in (64, 128, 256, 512):
        for e in (0, 1, 4):
            n, keys = 256 * (1 + e), ctx + 1 + e
            for _ in range(10):
                cm.observe(256, n, a + b * n + (c * 256 * keys + d * n * keys) / 1000, attention=n * keys,
                           reads=256 * keys)
    for ctx in (100, 400):
        cm.context = ctx
        assert cm.predict(256, 256) == pytest.approx(a + b * 256 + (c + d) * 256 * ctx / 1000, rel=0.08)
        assert cm.predict(256, 1280) == pytest.approx(a + b * 1280 + (c * 256 + d * 1280) * ctx / 1000, rel=0.08)
        assert cm.slope(256) == pytest.approx(b + d * ctx / 1000, rel=0.08)
