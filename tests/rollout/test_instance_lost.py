"""A lost instance (a real pool's dead process or actor): its work goes to the survivors."""
import pytest
from test_policies import ask, buffer, ids

from tailrl.rollout.policies import DividedPolicy, StaticPolicy


def test_static_deals_a_lost_share_to_the_survivors():
    p = StaticPolicy()
    p.reset(buffer(9), 3)
    assert ids(ask(p, 2, 1)) == [6]                      # instance 2 runs one of its share
    p.on_instance_lost(2)
    p.on_preempt(6, 3, 1.0)                              # its running request comes back
    assert sorted(p.share(0) + p.share(1)) == list(range(9)) and p.share(2) == []
    got = ids(ask(p, 0, 10)) + ids(ask(p, 1, 10))
    assert sorted(got) == list(range(9))


def test_fair_share_counts_survivors_only():
    p = DividedPolicy()
    p.reset(buffer(8), 2)
    p.on_instance_lost(1)
    assert len(ask(p, 0, 100)) == 8                      # not half: the other instance is gone


def test_losing_every_instance_is_an_error():
    p = DividedPolicy()
    p.reset(buffer(2), 2)
    p.on_instance_lost(0)
    with pytest.raises(RuntimeError, match="every instance"):
        p.on_instance_lost(1)
    with pytest.raises(ValueError, match="instance"):
        p.on_instance_lost(5)
