import itertools
import random

import pytest

from tailrl.speculative.draft import Draft


def random_tree(rng, n):
    parents = [-1] + [rng.randrange(-1, i) for i in range(1, n)]
    return Draft([rng.randrange(100) for _ in range(n)], parents, [rng.random() for _ in range(n)], "self")


def test_chain_properties():
    d = Draft.chain([5, 6, 7], [0.5, 0.5, 1.0])
    assert d.is_chain and d.depths == [1, 2, 3] and d.max_depth == 3
    assert d.score == pytest.approx(0.5 + 0.25 + 0.25)
    assert d.path_to(2) == [5, 6, 7]
    t = Draft([1, 2, 3], [-1, 0, 0], [1.0, 0.5, 0.5], "group")
    assert not t.is_chain and t.depths == [1, 2, 2] and t.score == pytest.approx(2.0)


def test_validation():
    with pytest.raises(ValueError):
        Draft([1, 2], [-1, 1], [1.0, 1.0], "self")          # parent after child
    with pytest.raises(ValueError):
        Draft([1], [-1], [1.5], "self")
    with pytest.raises(ValueError):
        Draft([1, 2], [-1], [1.0, 1.0], "self")


def best_closed_subset_score(d, k):
    """Brute force: the best sum of path probabilities over ancestor-closed k-subsets."""
    best = 0.0
    for subset in itertools.combinations(range(len(d)), k):
        s = set(subset)
        if all(d.parents[i] < 0 or d.parents[i] in s for i in subset):
            best = max(best, sum(d.path_probs[i] for i in subset))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_truncate_keeps_ancestors_topological_and_best(seed):
    rng = random.Random(seed)
    d = random_tree(rng, rng.randint(1, 9))
    for k in range(0, len(d) + 1):
        t = d.truncate(k)
        assert len(t) == k
        assert all(-1 <= p < i for i, p in enumerate(t.parents))      # topological, re-indexed
        paths = {tuple(t.path_to(i)) for i in range(k)}
        originals = {tuple(d.path_to(i)) for i in range(len(d))}
        assert paths <= originals                                       # same root paths
        assert t.score == pytest.approx(best_closed_subset_score(d, k))
    assert d.truncate(len(d) + 3) is d


def test_truncate_prefers_likely_branch():
    d = Draft([1, 2, 3, 4], [-1, 0, -1, 2], [0.3, 1.0, 0.7, 0.9], "group")
    t = d.truncate(2)
    assert t.tokens == [3, 4] and t.parents == [-1, 0]


def test_accepted_by_follows_the_emitted_tokens_down_a_chain_or_a_tree():
    c = Draft.chain([5, 6, 7])
    assert [c.accepted_by(e) for e in ([5, 6, 7, 1], [5, 6, 1], [1, 6, 7], [5, 6], [])] == [3, 2, 0, 2, 0]
    #        root -> 5 -> 6 -> 8 ; root -> 9 -> 6 ; root -> 5 (duplicate sibling: the first one wins)
    t = Draft([5, 9, 6, 6, 8, 5], [-1, -1, 0, 1, 2, -1], [0.5] * 6, "drafter")
    assert not t.is_chain
    assert [t.accepted_by(e) for e in ([5, 6, 8, 0], [9, 6, 8], [9, 7], [4], [5, 6, 7])] == [3, 2, 1, 0, 2]


def test_a_known_chains_path_probabilities_are_the_general_walks_bit_for_bit():
    rng = random.Random(5)
    for _ in range(200):
        k = rng.randint(1, 16)
        probs = [rng.random() for _ in range(k)]
        known = Draft.unchecked(list(range(k)), list(range(-1, k - 1)), probs, "x", chain=True)
        walked = Draft.unchecked(list(range(k)), list(range(-1, k - 1)), probs, "x")   # chain unknown: the walk
        assert known.path_probs == walked.path_probs and known.score == walked.score
        assert walked.is_chain
