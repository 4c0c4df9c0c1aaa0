"""The mixed workload: deterministic, held-out prompts unseen in training, a long tail."""
import itertools

import numpy as np

from tailrl.tasks import mixture


def test_mixture_is_deterministic_and_mixes_every_family():
    a = [mixture.mixed_example(s) for s in range(300)]
    assert a == [mixture.mixed_example(s) for s in range(300)]
    assert {ex.family for ex in a} == set(mixture.FAMILIES)


def test_heldout_prompts_never_appear_in_training():
    held = {ex.prompt for ex in mixture.heldout_examples(256)}
    assert len(held) == 256
    train = [ex.prompt for ex in itertools.islice(mixture.training_examples(heldout=256), 20000)]
    assert held.isdisjoint(train)


def test_reference_lengths_have_a_long_tail():
    lines = np.array([ex.solution.count("\n") for ex in
                      (mixture.mixed_example(s) for s in range(4000))])
    median = np.median(lines)
    assert np.percentile(lines, 99) >= 4 * median
    assert lines.max() >= 8 * median


def test_reward_dispatch_is_robust():
    ex = mixture.mixed_example(1)
    assert mixture.reward(ex.family, ex.prompt, ex.solution, ex.answer) == 1.0
    assert mixture.reward("nope", ex.prompt, ex.solution, ex.answer) == 0.0
    assert mixture.reward(ex.family, ex.prompt, None, ex.answer) == 0.0
