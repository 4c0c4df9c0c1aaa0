"""Both SuffixIndex implementations (Python reference, native) against a brute-force reference."""
import random
from collections import Counter

import pytest

from tailrl.speculative.sources.suffix_index import NATIVE, NativeSuffixIndex, PySuffixIndex, key_lengths

IMPLS = [PySuffixIndex] + ([NativeSuffixIndex] if NATIVE else [])


@pytest.fixture(params=IMPLS, ids=lambda c: c.__name__)
def SuffixIndex(request):
    return request.param


def occurrences(seqs, s):
    """(seq index, start) of every occurrence of s."""
    m = len(s)
    return [(i, j) for i, q in enumerate(seqs) for j in range(len(q) - m + 1) if q[j:j + m] == s]


def ref_continuations(seqs, s, exclude=None):
    return dict(Counter(seqs[i][j + len(s)] for i, j in occurrences(seqs, s)
                        if j + len(s) < len(seqs[i]) and i != exclude))


def ref_match(seqs, ctx, lo, hi, exclude=None):
    best = 0
    for m in range(lo, min(hi, len(ctx)) + 1):
        if ref_continuations(seqs, ctx[len(ctx) - m:], exclude):
            best = m
    return best


def build(SuffixIndex, rng, lo, hi, n_seqs, length, vocab, interleave):
    index = SuffixIndex(lo, hi, max_occurrences=10**9)       # exact counts: no cap
    seqs = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n_seqs)]
    if interleave:        # grow all sequences live, token by token (the group source's case)
        ids = [index.add() for _ in seqs]
        for pos in range(length):
            for sid, q in zip(ids, seqs):
                index.extend(sid, [q[pos]])
    else:
        for q in seqs:
            index.add(q)
    return index, seqs


def test_key_lengths_grow_fourfold_up_to_the_longest_match():
    assert key_lengths(2, 16) == (2, 8, 16)
    assert key_lengths(2, 64) == (2, 8, 32, 64)
    assert key_lengths(3, 10) == (3, 10)
    assert key_lengths(1, 1) == (1,)
    with pytest.raises(ValueError, match="min_match_len"):
        key_lengths(5, 4)


@pytest.mark.parametrize("seed,vocab,interleave,lo,hi", [(0, 3, False, 2, 8), (1, 4, True, 1, 6),
                                                         (2, 8, True, 2, 16), (3, 2, False, 3, 5)])
def test_match_and_continuations_match_brute_force(seed, vocab, interleave, lo, hi, SuffixIndex):
    rng = random.Random(seed)
    index, seqs = build(SuffixIndex, rng, lo, hi, 3, 60, vocab, interleave)
    for _ in range(200):
        q = seqs[rng.randrange(len(seqs))]
        j = rng.randrange(len(q))
        ctx = q[max(0, j - 12):j + 1] if rng.random() < 0.7 else [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        exclude = rng.choice([None, 0, 2])
        m = ref_match(seqs, ctx, lo, hi, exclude)
        assert index.match(ctx, exclude)[0] == m, ctx
        want = ref_continuations(seqs, ctx[len(ctx) - m:], exclude) if m else {}
        assert index.continuations(ctx, exclude) == want, ctx


def test_proposal_follows_real_occurrences(SuffixIndex):
    rng = random.Random(7)
    index, seqs = build(SuffixIndex, rng, 2, 6, 4, 120, 4, interleave=True)
    for _ in range(100):
        ctx = [rng.randrange(4) for _ in range(8)]
        d = index.propose(ctx, 8, 3, min_token_prob=0.05)
        m = index.match(ctx)[0]
        if m == 0:
            assert d is None
            continue
        assert d.match_len == m and len(d) <= 8
        leaves = sum(1 for i in range(len(d)) if i not in d.parents)
        assert leaves <= 3
        suffix = ctx[len(ctx) - m:]
        for i in range(len(d)):
            path = suffix + d.path_to(i)
            assert occurrences(seqs, path), path          # every draft path really occurs
            conts = ref_continuations(seqs, path[:-1])
            assert d.probs[i] == pytest.approx(conts[d.tokens[i]] / sum(conts.values()))
        assert all(p >= 0.05 - 1e-12 for p in d.path_probs)
        # the first node is the most frequent continuation of the matched suffix
        conts = ref_continuations(seqs, suffix)
        assert conts[d.tokens[0]] == max(conts.values())


def test_one_token_match_proposes_nothing(SuffixIndex):
    index = SuffixIndex(2, 8)
    index.add([5, 1, 2, 3, 4])
    assert index.propose([9, 5], 4) is None        # only "5" matches
    d = SuffixIndex(1, 8)
    d.add([5, 1, 2, 3, 4])
    assert d.propose([9, 5], 4).tokens[0] == 1
    d = index.propose([5, 1], 4)
    assert d.tokens == [2, 3, 4] and d.is_chain and d.score == pytest.approx(3.0)


def test_tokens_per_match_caps_short_matches(SuffixIndex):
    index = SuffixIndex(2, 8)
    index.add([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert index.propose([1, 2], 8, tokens_per_match=1.0).tokens == [3, 4]
    assert index.propose([1, 2, 3], 8, tokens_per_match=1.0).tokens == [4, 5, 6]
    assert index.propose([1, 2, 3], 8).tokens == [4, 5, 6, 7, 8, 9]


def test_min_token_prob_stops_the_draft(SuffixIndex):
    index = SuffixIndex(2, 8)
    for nxt in range(10):                  # "1 2" followed by ten different tokens
        index.add([1, 2, 100 + nxt, 7])
    assert index.propose([1, 2], 4, min_token_prob=0.11) is None
    d = index.propose([1, 2], 4, max_paths=1, min_token_prob=0.1)
    assert len(d) == 2 and d.probs[0] == pytest.approx(0.1)


def test_tree_takes_the_likeliest_branches(SuffixIndex):
    index = SuffixIndex(2, 8)
    for tail in ([3, 4], [3, 4], [3, 5], [6, 7]):
        index.add([1, 2] + tail)
    d = index.propose([1, 2], 8, max_paths=2, min_token_prob=0.0)
    # best-first by path probability: 3 (.75), 4 (.5), then 6 (.25) opens the second and last
    # path, so 5 (.25, a third leaf) is refused and 7 extends 6
    assert d.tokens == [3, 4, 6, 7] and d.parents == [-1, 0, -1, 2]
    assert d.path_probs == pytest.approx([0.75, 0.5, 0.25, 0.25])
    chain = index.propose([1, 2], 8, max_paths=1, min_token_prob=0.0)
    assert chain.tokens == [3, 4] and chain.path_probs == pytest.approx([0.75, 0.5])


def test_exclude_ignores_one_sequence(SuffixIndex):
    index = SuffixIndex(2, 8)
    a = index.add([1, 2, 3, 1, 2, 3])       # this request's own tokens
    assert index.propose([3, 1, 2], 4) is not None
    assert index.propose([3, 1, 2], 4, exclude=a) is None        # only itself repeats
    index.add([1, 2, 9])                    # a sibling
    d = index.propose([3, 1, 2], 4, exclude=a)
    assert d.tokens == [9] and d.match_len == 2
    index.extend(a, [4])
    assert index.continuations([1, 2], exclude=a) == {9: 1}


def test_counts_come_from_the_most_recent_occurrences(SuffixIndex):
    index = SuffixIndex(2, 8, max_occurrences=4)
    index.add([1, 2, 3] * 10 + [1, 2, 9] * 4)   # "1 2" is followed by 3 ten times, then 9 four times
    assert index.continuations([1, 2]) == {9: 4}
    assert SuffixIndex(2, 8, max_occurrences=100).add([1, 2, 3] * 10 + [1, 2, 9] * 4) == 0
    full = SuffixIndex(2, 8, max_occurrences=100)
    full.add([1, 2, 3] * 10 + [1, 2, 9] * 4)
    assert full.continuations([1, 2]) == {3: 10, 9: 4}
