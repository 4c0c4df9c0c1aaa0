import json

import numpy as np
import pytest

from tailrl.sim.workload import PRESETS, WorkloadConfig, clipped_lognormal_mean, generate, preset, read_jsonl

SEER_TABLE3 = {"moonlight": (3200, 8, 65536, 22386), "qwen2vl-72b": (9600, 16, 40960, 7615),
               "kimi-k2": (6400, 8, 98304, 38959)}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_seer_table3_statistics(name):
    n, g, mx, mean = SEER_TABLE3[name]
    tr = generate(preset(name))
    assert len(tr) == n and np.bincount(tr.group_id).tolist() == [g] * (n // g)
    assert tr.length.max() <= mx and (tr.max_tokens == mx).all()
    assert tr.length.mean() == pytest.approx(mean, rel=0.05)


def test_clipped_mean_formula_matches_sampling():
    rng = np.random.default_rng(1)
    x = np.minimum(np.exp(8.0 + 1.2 * rng.standard_normal(400_000)), 20_000)
    assert clipped_lognormal_mean(8.0, 1.2, 20_000) == pytest.approx(x.mean(), rel=0.01)


def test_full_correlation_knobs():
    tr = generate(WorkloadConfig(requests=64, group_size=8, rho=1.0, rank_corr=1.0))
    for g in range(8):
        assert len(set(tr.length[tr.group_id == g].tolist())) == 1   # identical siblings
    assert (tr.prev_length == tr.length).all()                      # no churn across epochs
    churn = generate(WorkloadConfig(requests=4096, group_size=8, rank_corr=0.0))
    stable = generate(WorkloadConfig(requests=4096, group_size=8, rank_corr=0.95))
    corr = lambda t: np.corrcoef(np.log(t.length), np.log(t.prev_length))[0, 1]
    assert corr(stable) > corr(churn) + 0.3
    assert tr.history()[0] == tr.prev_length[:8].tolist()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="group_size"):
        WorkloadConfig(requests=10, group_size=4)
    with pytest.raises(ValueError, match="rho"):
        WorkloadConfig(rho=1.5)
    with pytest.raises(ValueError, match="workload"):
        preset("gpt5")


def test_read_jsonl_with_epochs(tmp_path):
    rows = [dict(epoch=0, prompt_id="a", prompt_len=5, max_tokens=100, response_len=n) for n in (10, 20)]
    rows += [dict(epoch=1, prompt_id="a", prompt_len=5, max_tokens=100, response_len=n) for n in (30, 40)]
    rows += [dict(epoch=1, prompt_id="b", prompt_len=7, max_tokens=100, response_len=50, accept_len=2.5)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    tr = read_jsonl(path)
    assert tr.length.tolist() == [30, 40, 50] and tr.prev_length.tolist() == [10, 20, 0]
    assert tr.history() == {0: [10, 20]}                    # prompt "b" has none
    assert tr.group_id.tolist() == [0, 0, 1] and tr.accept_len.tolist() == [1.0, 1.0, 2.5]
    assert read_jsonl(path, epoch=0).prev_length is None
    path.write_text(json.dumps({"prompt_id": 1}) + "\n")
    with pytest.raises(ValueError, match="lacks"):
        read_jsonl(path)
