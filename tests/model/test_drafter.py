"""The learned drafter: checkpoint round trip, shapes, and that a few training steps teach it."""
import pytest
import torch

from tailrl.model.drafter import Drafter
from tailrl.model.loader import load_model
from tailrl.rl.drafter_train import drafter_loss, teacher_forced, train


@pytest.fixture(scope="module")
def target(ckpt_dir):
    path = ckpt_dir("qwen2", init_std=3.0, max_pos=1024)
    return path, load_model(path)


def test_save_load_round_trip(target, tmp_path):
    path, model = target
    d = Drafter.for_target(model)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))             # not the initial weights
    d.save(str(tmp_path / "dr"))
    e = Drafter.load(str(tmp_path / "dr"), model)
    assert e.cfg == d.cfg
    for (na, a), (nb, b) in zip(d.state_dict().items(), e.state_dict().items(), strict=True):
        assert na == nb and torch.equal(a, b)
    feat, tok = torch.randn(3, model.args.hidden_size), torch.tensor([1, 2, 3])
    for x, y in zip(d.step(feat, tok), e.step(feat, tok)):
        assert torch.equal(x, y)
    assert e.step(feat, tok)[1].shape == (3, model.args.vocab_size)


def test_load_rejects_a_missing_file_or_another_target(target, ckpt_dir, tmp_path):
    path, model = target
    with pytest.raises(ValueError, match="drafter.json"):
        Drafter.load(str(tmp_path), model)
    Drafter.for_target(model).save(str(tmp_path / "dr"))
    other = load_model(ckpt_dir("qwen2", hidden_size=32, num_heads=2, num_kv_heads=1))
    with pytest.raises(ValueError, match="hidden_size"):
        Drafter.load(str(tmp_path / "dr"), other)


def test_shared_weights_are_frozen_and_not_saved(target):
    _, model = target
    d = Drafter.for_target(model)
    names = {n for n, _ in d.named_parameters()}
    assert not any("embed" == n or "head" == n for n in names)
    assert "embed" not in d.state_dict() and "head" not in d.state_dict()
    assert torch.equal(d.head, model.embed.weight.float() if model.lm_head is None else model.lm_head.weight.float())


def test_training_lowers_the_loss(target):
    path, _ = target
    gen = torch.Generator().manual_seed(0)
    seqs = [([5, 6, 7], torch.randint(0, 97, (40,), generator=gen).tolist()) for _ in range(4)]
    data = teacher_forced(path, seqs, unroll=2)
    d = Drafter.for_target(load_model(path))
    idx = data.starts
    before = drafter_loss(d, data, idx, 2)[0].item()
    train(d, data, steps=60, batch=64, lr=3e-3, unroll=2)
    with torch.no_grad():
        after = drafter_loss(d, data, idx, 2)[0].item()
    assert after < 0.8 * before
