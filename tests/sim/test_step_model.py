import json

import numpy as np
import pytest

from tailrl.sim.hardware import get_accelerator, get_model
from tailrl.sim.step_model import CalibratedStepModel, RooflineStepModel, run_time, steps_within


def roofline(**kw):
    return RooflineStepModel(get_accelerator("h800"), get_model("qwen2-72b"), gpus=8, **kw)


def brute(lines, kv0, rate, n):
    return sum(max(a + b * (kv0 + rate * j) for a, b in lines) for j in range(n))


@pytest.mark.parametrize("batch,kv0,rate,n", [(1, 100, 1, 50), (64, 1e5, 64, 3000), (256, 2e6, 256, 500),
                                              (8, 0, 8 * 4.0, 777)])
def test_run_time_matches_step_by_step_sum(batch, kv0, rate, n):
    lines = roofline().lines(batch, int(rate))
    assert run_time(lines, kv0, rate, n) == pytest.approx(brute(lines, kv0, rate, n), rel=1e-9)


def test_run_time_across_a_crossover():
    lines = [(1.0, 0.0), (0.0, 0.1)]          # flat until K = 10, then K-bound
    assert run_time(lines, 0.0, 1.0, 30) == pytest.approx(brute(lines, 0.0, 1.0, 30))
    assert run_time(lines, 0.0, 1.0, 0) == 0.0


def test_steps_within_is_the_largest_n_that_fits():
    lines = roofline().lines(32, 32)
    t = run_time(lines, 5e4, 32, 400)
    assert steps_within(lines, 5e4, 32, t, 1000) == 400
    assert steps_within(lines, 5e4, 32, t - 1e-6, 1000) == 399
    assert steps_within(lines, 5e4, 32, 1e9, 1000) == 1000


def test_roofline_decode_is_memory_bound_and_prefill_compute_bound():
    m = roofline(overhead_s=0.0)
    weights = 72.7e9 * 2 / (8 * 3.35e12 * 0.8)
    step = max(a + b * 0 for a, b in m.lines(1, 1))
    assert step == pytest.approx(weights)                # batch 1, no KV: read the weights once
    flops = 2 * 72.7e9 * 8192 + 2 * 80 * 8192 * 8192 ** 2
    assert m.prefill_time([8192], 0) == pytest.approx(flops / (8 * 989e12 * 0.5))


def test_kv_capacity_from_memory():
    m = roofline()
    assert m.kv_capacity() == int((8 * 80e9 * 0.9 - 72.7e9 * 2) // (2 * 80 * 8 * 128 * 2))
    with pytest.raises(ValueError, match="does not fit"):
        RooflineStepModel(get_accelerator("l40s"), get_model("kimi-k2"), gpus=1).kv_capacity()


def test_calibrated_fit_recovers_coefficients(tmp_path):
    rng = np.random.default_rng(0)
    steps = [{"batch": int(b), "new_tokens": int(b * k), "kv_tokens": int(kv),
              "seconds": 0.004 + 1e-4 * b + 2e-5 * b * k + 3e-8 * kv}
             for b, k, kv in zip(rng.integers(1, 64, 40), rng.integers(1, 5, 40), rng.integers(0, 10**5, 40))]
    path = tmp_path / "steps.json"
    path.write_text(json.dumps({"steps": steps}))
    m = CalibratedStepModel.from_json(path)
    assert (m.c0, m.c1, m.c2, m.c3) == pytest.approx((0.004, 1e-4, 2e-5, 3e-8), rel=1e-6)
    assert m.lines(10, 20) == [pytest.approx((0.004 + 1e-3 + 4e-4, 3e-8))]
    with pytest.raises(ValueError, match="lacks"):
        CalibratedStepModel.fit([{"batch": 1}] * 4)
    with pytest.raises(ValueError, match=">= 4"):
        CalibratedStepModel.fit(steps[:2])


def test_roofline_config_errors():
    with pytest.raises(ValueError, match="mfu"):
        roofline(mfu=0)
    with pytest.raises(ValueError, match="accelerator"):
        get_accelerator("tpu9")
