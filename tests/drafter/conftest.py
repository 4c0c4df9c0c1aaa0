"""Fixtures of the spot-trainer tests: a fresh drafter for the sharp random target (tests/conftest.py)."""
import pytest
import torch

from tailrl.drafter.network import Drafter
from tailrl.model.loader import load_model


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    """A freshly initialised drafter (MLP width 64) saved for ``model``."""
    out = str(tmp_path_factory.mktemp("fresh_drafter"))
    Drafter.for_target(load_model(model, "float32"), intermediate_size=64).save(out)
    return out


@pytest.fixture(scope="module")
def vocab_drafter_dir(model, tmp_path_factory):
    """A fresh drafter (MLP width 64) whose head covers every other token of ``model``'s."""
    out = str(tmp_path_factory.mktemp("vocab_drafter"))
    target = load_model(model, "float32")
    Drafter.for_target(target, intermediate_size=64, vocab=torch.arange(0, target.args.vocab_size, 2)).save(out)
    return out
