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


def test_the_draft_vocabulary_keeps_the_end_of_sequence_ids_however_rare(monkeypatch, ckpt_dir, tmp_path):
    """Responses that never end with EOS (their EOS ids taken out of the count): the drafter's
    8 tokens still hold the model's EOS ids, or it could never draft a response's last token."""
    import torch

    from tailrl.cli import train_drafter
    from tailrl.drafter.network import Drafter
    from tailrl.model.loader import load_model
    model = ckpt_dir("qwen2", init_std=3.0, eos_token_id=60)
    target = load_model(model)
    eos = torch.tensor(target.args.eos_token_ids)
    assert eos.tolist() == [60]
    counted = train_drafter.response_tokens
    monkeypatch.setattr(train_drafter, "response_tokens", lambda data: (t := counted(data))[~torch.isin(t, eos)])
    train_drafter.warm_start(model, str(tmp_path), [[1, 2, 3], [9, 8, 7, 6, 5]], n=2, max_tokens=24, steps=2,
                             batch=64, draft_vocab=8)
    d = Drafter.load(str(tmp_path), target)
    assert len(d.vocab) == 8 and set(eos.tolist()) <= set(d.vocab.tolist())
