"""Broken configs and datasets give clear errors naming the key or the file."""
import json

import pytest

from tailrl.rl.cli import train_main
from tailrl.rl.config import TrainConfig, load_config
from tailrl.rl.data import compute_rewards, file_prompts, load_dataset, resolve_reward, task_prompts


def write(path, text):
    path.write_text(text)
    return path


def test_unknown_yaml_key_is_named(tmp_path):
    cfg = write(tmp_path / "c.yaml", "model: test\nbatch_sise: 4\n")
    with pytest.raises(ValueError, match="unknown config key 'batch_sise'"):
        load_config(cfg)


@pytest.mark.parametrize("key,value", [("group_size", 1), ("batch_size", 0), ("lr", 2.0), ("clip_ratio_low", 1.5),
                                       ("loss_agg_mode", "sum"), ("temperature", 0), ("dtype", "int8"),
                                       ("train_size", 2), ("ppo_minibatches", 3), ("task_family", "chess"),
                                       ("dataset", "data.csv"), ("reward", "nope"), ("gpu_memory_utilization", 0),
                                       ("gpu_memory_utilization", 1.5), ("drafter_spot_stream", "beside"),
                                       ("repetition_penalty", 0), ("min_p", 2), ("autocast", "maybe")])
def test_bad_value_names_the_key(tmp_path, key, value):
    cfg = write(tmp_path / "c.yaml", f"batch_size: 4\n{key}: {json.dumps(value)}\n")
    with pytest.raises(ValueError, match=f"'{key}'"):
        load_config(cfg)


def test_a_side_stream_for_the_spot_trainer_needs_a_gpu(tmp_path):
    cfg = write(tmp_path / "c.yaml", "batch_size: 4\ndrafter: true\ndrafter_spot_stream: side\n")
    with pytest.raises(ValueError, match="'drafter_spot_stream'.*needs device cuda"):
        load_config(cfg)


def test_bad_speculative_section_is_named():
    with pytest.raises(ValueError, match="'speculative'.*max_draft_tokens"):
        TrainConfig(speculative={"max_draft_tokens": 0})
    with pytest.raises(ValueError, match="'speculative'"):
        TrainConfig(speculative={"metod": "suffix"})
    assert TrainConfig(speculative=False).speculative_config() is None
    assert TrainConfig(speculative={"policy": "fixed"}).speculative_config().policy == "fixed"


def test_missing_and_malformed_config_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="nowhere.yaml: no such file"):
        load_config(tmp_path / "nowhere.yaml")
    with pytest.raises(ValueError, match="invalid YAML"):
        load_config(write(tmp_path / "bad.yaml", "model: [test\n"))
    with pytest.raises(ValueError, match="expected a mapping"):
        load_config(write(tmp_path / "list.yaml", "- model\n"))


def test_overrides_are_parsed_as_yaml(tmp_path):
    cfg = load_config(write(tmp_path / "c.yaml", "model: test\n"), ["total_steps=5", "speculative=false"])
    assert cfg.total_steps == 5 and cfg.speculative is False


def test_broken_dataset_file_names_file_and_row(tmp_path):
    data = write(tmp_path / "prompts.jsonl", '{"prompt": "1+1?", "answer": "2"}\n{"prompt": "no answer"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl: row 2"):
        load_dataset(TrainConfig(dataset=str(data), batch_size=1, train_size=1))
    with pytest.raises(ValueError, match="missing.jsonl: no such file"):
        load_dataset(TrainConfig(dataset=str(tmp_path / "missing.jsonl")))


def test_file_dataset_with_math_reward(tmp_path):
    data = write(tmp_path / "gsm.jsonl", '{"question": "2+2?", "answer": "work #### 4", "level": 1}\n')
    cfg = TrainConfig(dataset=str(data), batch_size=1, train_size=1)
    prompts = file_prompts(cfg.dataset)
    assert prompts[0].uid == "gsm-0" and prompts[0].answer == "4"
    rewards = compute_rewards(resolve_reward(cfg), prompts, [["so \\boxed{4}", "it is 5"]])
    assert rewards == [1.0, 0.0]


def test_task_rewards_and_prompts_are_distinct():
    cfg = TrainConfig(task_family="add", task_difficulty=3, train_size=8, batch_size=8)
    prompts = task_prompts(cfg)
    assert len({p.text for p in prompts}) == 8 and len({p.uid for p in prompts}) == 8
    p = prompts[0]
    right = f"answer {p.answer}\n"
    assert compute_rewards(resolve_reward(cfg), [p], [[right, "answer -1\n"]]) == [1.0, 0.0]


def test_reward_by_import_path():
    cfg = TrainConfig(reward="tests_rl_nowhere:fn")
    with pytest.raises(ValueError, match="'reward': cannot import"):
        resolve_reward(cfg)
    assert resolve_reward(TrainConfig(reward="tailrl.rl.data:task_reward")).__name__ == "task_reward"


def test_cli_reports_config_errors_without_a_traceback(tmp_path, capsys):
    cfg = write(tmp_path / "c.yaml", "model: test\nsteps: 3\n")
    assert train_main([str(cfg)]) == 2
    assert "unknown config key 'steps'" in capsys.readouterr().err
    cfg = write(tmp_path / "d.yaml", f"model: test\ndataset: {tmp_path / 'x.parquet'}\n")
    assert train_main([str(cfg)]) == 2
    assert "x.parquet: no such file" in capsys.readouterr().err


def test_demo_config_is_valid():
    from pathlib import Path
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    assert cfg.model == "small" and cfg.dataset == "tasks"
    assert cfg.speculative_config().sources == ("history", "group", "self")
    assert cfg.train_size % cfg.batch_size == 0       # whole epochs: every prompt recurs with a history
