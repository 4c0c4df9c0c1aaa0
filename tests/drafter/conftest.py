"""Fixtures of the spot-trainer tests: a fresh drafter for the sharp random target (tests/conftest.py)."""
import pytest

from tailrl.drafter.network import Drafter
from tailrl.model.loader import load_model


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    """A freshly initialised drafter (MLP width 64) saved for ``model``."""
    out = str(tmp_path_factory.mktemp("fresh_drafter"))
    Drafter.for_target(load_model(model, "float32"), intermediate_size=64).save(out)
    return out
