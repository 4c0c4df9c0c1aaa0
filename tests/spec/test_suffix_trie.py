"""SuffixTrie against a brute-force reference on random token strings."""
import random
from collections import Counter

import pytest

from tailrl.spec.suffix_trie import SuffixTrie


def occurrences(seqs, s):
    """(seq index, start) of every occurrence of s."""
    m = len(s)
    return [(i, j) for i, q in enumerate(seqs) for j in range(len(q) - m + 1) if q[j:j + m] == s]


def ref_continuations(seqs, s):
    return dict(Counter(seqs[i][j + len(s)] for i, j in occurrences(seqs, s) if j + len(s) < len(seqs[i])))


def ref_match(seqs, ctx, lo, hi, depth):
    best = 0
    for m in range(lo, min(hi, len(ctx), depth - 1) + 1):
        if ref_continuations(seqs, ctx[len(ctx) - m:]):
            best = m
    return best


def build(rng, depth, n_seqs, length, vocab, interleave):
    trie = SuffixTrie(depth)
    seqs = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n_seqs)]
    if interleave:        # grow all sequences live, token by token (the group source's case)
        ids = [trie.add() for _ in seqs]
        for pos in range(length):
            for sid, q in zip(ids, seqs):
                trie.extend(sid, [q[pos]])
    else:
        for q in seqs:
            trie.close(trie.add(q))
    return trie, seqs


@pytest.mark.parametrize("seed,vocab,interleave", [(0, 3, False), (1, 4, True), (2, 8, True), (3, 2, False)])
def test_counts_and_continuations_match_brute_force(seed, vocab, interleave):
    rng = random.Random(seed)
    depth = 6
    trie, seqs = build(rng, depth, 3, 60, vocab, interleave)
    for _ in range(300):
        q = seqs[rng.randrange(len(seqs))]
        m = rng.randint(1, depth)
        j = rng.randrange(len(q) - m + 1)
        s = q[j:j + m] if rng.random() < 0.8 else [rng.randrange(vocab) for _ in range(m)]
        assert trie.count(s) == len(occurrences(seqs, s)), s
        if m < depth:
            assert trie.continuations(s) == ref_continuations(seqs, s), s
    assert trie.count([]) == sum(map(len, seqs))


@pytest.mark.parametrize("seed", range(4))
def test_match_is_longest_continued_suffix(seed):
    rng = random.Random(seed)
    trie, seqs = build(rng, 10, 2, 80, 3, interleave=seed % 2 == 1)
    for _ in range(100):
        ctx = [rng.randrange(3) for _ in range(rng.randint(1, 12))]
        assert trie.match(ctx, 2, 8) == ref_match(seqs, ctx, 2, 8, 10), ctx


def test_proposal_follows_real_occurrences():
    rng = random.Random(7)
    trie, seqs = build(rng, 12, 4, 120, 4, interleave=True)
    for _ in range(100):
        ctx = [rng.randrange(4) for _ in range(8)]
        d = trie.propose(ctx, 8, 3, min_match_len=2, max_match_len=6, min_token_prob=0.05)
        m = trie.match(ctx, 2, 6)
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
            parent_ctx = path[:-1]
            conts = ref_continuations(seqs, parent_ctx)
            assert d.probs[i] == pytest.approx(conts[d.tokens[i]] / sum(conts.values()))
        assert all(p >= 0.05 - 1e-12 for p in d.path_probs)
        # the first node is the most frequent continuation of the matched suffix
        conts = ref_continuations(seqs, suffix)
        assert conts[d.tokens[0]] == max(conts.values())


def test_one_token_match_proposes_nothing():
    trie = SuffixTrie(8)
    trie.add([5, 1, 2, 3, 4])
    assert trie.propose([9, 5], 4, min_match_len=2) is None        # only "5" matches
    d = trie.propose([9, 5], 4, min_match_len=1)
    assert d is not None and d.tokens[0] == 1
    d = trie.propose([5, 1], 4, min_match_len=2)
    assert d.tokens == [2, 3, 4] and d.is_chain and d.score == pytest.approx(3.0)


def test_min_token_prob_stops_the_draft():
    trie = SuffixTrie(8)
    for nxt in range(10):                  # "1 2" followed by ten different tokens
        trie.close(trie.add([1, 2, 100 + nxt, 7]))
    assert trie.propose([1, 2], 4, min_token_prob=0.11) is None
    d = trie.propose([1, 2], 4, max_paths=1, min_token_prob=0.1)
    assert len(d) == 2 and d.probs[0] == pytest.approx(0.1)


def test_exclude_subtracts_own_occurrences():
    group, own = SuffixTrie(8), SuffixTrie(8)
    a = group.add([1, 2, 3, 1, 2, 3])       # this request's own tokens
    own.add([1, 2, 3, 1, 2, 3])
    assert group.propose([3, 1, 2], 4) is not None
    assert group.propose([3, 1, 2], 4, exclude=own) is None        # only itself repeats
    group.add([1, 2, 9])                    # a sibling
    d = group.propose([3, 1, 2], 4, exclude=own)
    assert d.tokens == [9] and d.match_len == 2
    assert group.continuations([1, 2], exclude=own) == {9: 1}
    group.extend(a, [4])
    own.extend(0, [4])
    assert group.continuations([1, 2], exclude=own) == {9: 1}


def test_memory_stays_bounded_on_random_text():
    rng = random.Random(0)
    trie = SuffixTrie(32)
    trie.add(rng.randrange(50_000) for _ in range(5000))
    # a plain depth-32 trie would hold ~32 nodes per token; implicit paths keep ~1
    assert trie.num_nodes < 3 * trie.num_tokens
