"""Fixtures shared by the engine's tests of steps launched ahead."""
import pytest

from tailrl.engine import engine as engine_mod


@pytest.fixture
def fed(monkeypatch):
    """Counts the steps whose inputs came from a step still in flight."""
    count = [0]
    feed = engine_mod.feed

    def counting(batch, step):
        count[0] += bool(batch.ahead)
        return feed(batch, step)
    monkeypatch.setattr(engine_mod, "feed", counting)
    return count
