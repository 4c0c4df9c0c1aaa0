"""The call gate: approved drafter calls are made or skipped by a per-batch-size bandit over
realized step throughput, so a value model that over-rates calls is corrected by measurement."""
import pytest

from tailrl.speculative.call_gate import CallGate


def play(gate, batch, rewards, steps):
    """``steps`` approved calls at ``batch``; a step's throughput is rewards[arm] (tokens / s)."""
    arms = []
    for _ in range(steps):
        arm = int(gate.allow(batch))
        arms.append(arm)
        gate.record(int(rewards[arm] - batch))        # accepted tokens of a 1 s step
        gate.observe_step(batch, 1.0)
    return arms


def test_both_arms_are_tried_in_turn_then_the_faster_one_is_kept():
    gate = CallGate(epsilon=0.0, warmup=3)
    arms = play(gate, 8, rewards=(12, 9), steps=12)              # calls slow the steps down
    assert arms[:6] == [1, 0, 1, 0, 1, 0] and arms[6:] == [0] * 6
    assert gate.skipped == 9 and gate.mean(8) == pytest.approx((12.0, 9.0))
    helps = CallGate(epsilon=0.0, warmup=3)
    assert play(helps, 8, rewards=(9, 12), steps=12)[6:] == [1] * 6


def test_batch_sizes_learn_separately_and_prefill_steps_teach_nothing():
    gate = CallGate(epsilon=0.0, warmup=2)
    play(gate, 2, rewards=(5, 8), steps=6)                       # the tail: calls pay
    play(gate, 64, rewards=(90, 70), steps=6)                    # the bulk: they do not
    assert gate.allow(2) and not gate.allow(64)
    gate.observe_step(64, 1.0)
    before = gate.mean(40)
    gate.allow(40)
    gate.record(500)
    gate.observe_step(40, 1.0, prefill=True)
    assert gate.mean(40) == before


def test_epsilon_keeps_sampling_the_other_arm_deterministically():
    a, b = CallGate(epsilon=0.3, warmup=2, seed=5), CallGate(epsilon=0.3, warmup=2, seed=5)
    ra, rb = play(a, 16, (10, 8), 200), play(b, 16, (10, 8), 200)
    assert ra == rb and 0 < sum(ra[4:]) < 0.3 * 196


def test_rejects_once_both_arms_measured_calls_worse():
    gate = CallGate(warmup=2, epsilon=0.0)
    assert not gate.rejects(8)
    for _ in range(4):                          # calls: 8 rows in 2 s; skips: 8 rows in 1 s
        call = gate.allow(8)
        gate.observe_step(8, 2.0 if call else 1.0)
    assert gate.rejects(8) and not gate.rejects(64)
