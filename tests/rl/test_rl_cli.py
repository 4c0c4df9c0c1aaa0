"""`tailrl train` and `tailrl report` end to end on the `test` model."""
import json
from pathlib import Path

import pytest

from tailrl.rl.cli import report_main, train_main
from tailrl.rl.trainer import resolve_model

TINY = """model: test
task_family: sort
train_size: 2
batch_size: 2
group_size: 2
max_tokens: 24
total_steps: 2
num_threads: 1
checkpoint_every: 1
progress: false
log_tensorboard: false
"""


def last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


@pytest.mark.slow   # ~85 s on a loaded 2-core machine (three short runs, matplotlib)
def test_train_then_report_one_and_two_runs(tmp_path, capsys):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY)
    a, b = tmp_path / "a", tmp_path / "b"
    assert train_main([str(cfg), "--set", f"output_dir={a}", "--set", "speculative=false"]) == 0
    out = capsys.readouterr().out
    figures = last_json(out)
    assert figures["steps"] == 2 and figures["speculation"] is False and "rollout" in out
    assert (a / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    assert train_main([str(cfg), "--resume", "--set", f"output_dir={a}", "--set", "speculative=false"]) == 0
    assert last_json(capsys.readouterr().out)["steps"] == 2          # already at total_steps: nothing to do
    assert report_main([str(a)]) == 0
    rep = last_json(capsys.readouterr().out)
    assert all(Path(p).is_file() for p in rep["plots"]) and len(rep["plots"]) == 3
    # a second run with the same seed: same responses, so the report finds them identical
    assert train_main([str(cfg), "--set", f"output_dir={b}", "--set", "speculative=false"]) == 0
    capsys.readouterr()
    assert report_main([str(a), str(b), "--out", str(tmp_path / "plots")]) == 0
    rep = last_json(capsys.readouterr().out)
    assert rep["equiv/identical_share"] == 1.0 and rep["equiv/max_reward_diff"] == 0.0
    assert rep["rollout_ratio"] > 0


def test_report_of_a_directory_without_metrics_fails_clearly(tmp_path, capsys):
    assert report_main([str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_small_model_missing_is_a_clear_error(tmp_path, monkeypatch):
    from tailrl.tasks import models
    monkeypatch.setattr(models, "shipped_model", lambda name: None)
    monkeypatch.setattr(models, "cached_model_path", lambda preset: tmp_path / "not-built")
    with pytest.raises(ValueError, match="'small' model is not available"):
        resolve_model("small")
    with pytest.raises(ValueError, match="'model'"):
        resolve_model("medium")
