"""The training prompt order: a pure function of (seed, step), epochs are permutations, and
no batch holds a prompt twice, also when the batch size does not divide the prompt count."""
import pytest

from tailrl.rl.data import batch_indices


@pytest.mark.parametrize("num_prompts,batch_size", [(5, 3), (4, 3), (7, 4), (10, 4), (6, 6), (9, 1)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_batches_never_repeat_a_prompt_and_epochs_are_permutations(num_prompts, batch_size, shuffle):
    for seed in range(8):
        batches = [batch_indices(s, batch_size, num_prompts, seed, shuffle) for s in range(30)]
        for b in batches:
            assert len(b) == batch_size and len(set(b)) == batch_size, (seed, b)
        flat = [i for b in batches for i in b]
        for e in range(len(flat) // num_prompts):
            assert sorted(flat[e * num_prompts:(e + 1) * num_prompts]) == list(range(num_prompts))


def test_batch_larger_than_the_prompt_set_is_refused():
    with pytest.raises(ValueError, match="batch_size"):
        batch_indices(0, 6, 5, seed=0, shuffle=True)
