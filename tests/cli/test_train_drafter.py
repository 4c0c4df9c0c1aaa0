"""`tailrl train-drafter`: registered, and refuses bad arguments before any work."""
import pytest

from tailrl import cli


def test_registered_and_checks_its_arguments(ckpt_dir, tmp_path):
    assert cli.COMMANDS["train-drafter"][0] == "tailrl.cli.train_drafter"
    with pytest.raises(SystemExit) as e:
        cli.main(["train-drafter", "--model", ckpt_dir("qwen2"), "--out", str(tmp_path), "--steps", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["train-drafter", "--model", ckpt_dir("qwen2"), "--out", str(tmp_path), "--size", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["train-drafter", "--model", ckpt_dir("qwen2"), "--out", str(tmp_path), "--max-seconds", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        cli.main(["train-drafter", "--model", ckpt_dir("qwen2"), "--out", str(tmp_path), "--draft-vocab", "-1"])
    assert e.value.code == 2
    for device in ("gpu", "cuda:9"):                         # malformed; not on this machine
        with pytest.raises(SystemExit) as e:
            cli.main(["train-drafter", "--model", ckpt_dir("qwen2"), "--out", str(tmp_path), "--device", device])
        assert e.value.code == 2
    with pytest.raises(ValueError, match="tokenizer"):      # task prompts need the model's tokenizer
        cli.main(["train-drafter", "--model", ckpt_dir("qwen2"), "--out", str(tmp_path), "--steps", "1"])
    assert not (tmp_path / "drafter.json").exists()
