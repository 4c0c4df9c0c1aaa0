"""The native suffix index gives exactly the reference's answers (and is built by install)."""
import os
import random

import pytest

from tailrl.speculative.sources.suffix_index import NATIVE, NativeSuffixIndex, PySuffixIndex, SuffixIndex


def test_native_extension_is_built():
    if os.environ.get("TAILRL_PURE_PYTHON"):
        pytest.skip("TAILRL_PURE_PYTHON forces the reference")
    assert NATIVE, "tailrl/speculative/sources/_suffix_index.cpp was not built: reinstall with `pip install -e .` (needs g++)"
    assert SuffixIndex is NativeSuffixIndex


def _pair(lo, hi, occ):
    return PySuffixIndex(lo, hi, max_occurrences=occ), NativeSuffixIndex(lo, hi, max_occurrences=occ)


def _same_draft(a, b):
    if a is None or b is None:
        return a is None and b is None
    return (a.tokens, a.parents, a.probs, a.source, a.match_len) == \
        (b.tokens, b.parents, b.probs, b.source, b.match_len)


@pytest.mark.skipif(not NATIVE, reason="native extension not built")
@pytest.mark.parametrize("seed", range(6))
def test_native_equals_reference_on_random_growing_sequences(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 12])
    lo = rng.choice([1, 2, 3])
    hi = rng.choice([lo, 6, 16, 20])
    py, nat = _pair(lo, hi, rng.choice([3, 32, 10**9]))
    seqs = []
    for step in range(300):
        r = rng.random()
        if r < 0.05 or not seqs:
            tokens = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
            assert py.add(tokens) == nat.add(tokens)
            seqs.append(list(tokens))
        elif r < 0.5:
            sid = rng.randrange(len(seqs))
            tokens = [rng.randrange(vocab) for _ in range(rng.choice([1, 1, 1, 3, 17]))]
            py.extend(sid, tokens)
            nat.extend(sid, tokens)
            seqs[sid] += tokens
        else:
            sid = rng.randrange(len(seqs))
            q = seqs[sid]
            cut = rng.randrange(len(q) + 1)
            ctx = q[max(0, cut - hi):cut] if rng.random() < 0.8 else \
                [rng.randrange(vocab) for _ in range(rng.randrange(1, hi + 2))]
            exclude = rng.choice([None, sid, 0])
            assert py.match(ctx, exclude) == nat.match(ctx, exclude), ctx
            assert py.continuations(ctx, exclude) == nat.continuations(ctx, exclude), ctx
            kw = dict(min_token_prob=rng.choice([0.0, 0.05, 0.1, 0.3]), tokens_per_match=rng.choice([0.0, 1.0, 2.5]),
                      source="s", exclude=exclude)
            for paths in (1, 2, 4):
                max_tokens = rng.choice([0, 1, 4, 16])
                assert _same_draft(py.propose(ctx, max_tokens, paths, **kw), nat.propose(ctx, max_tokens, paths, **kw)), \
                    (ctx, max_tokens, paths, kw)
    assert len(py) == len(nat) and py.num_tokens == nat.num_tokens
    assert all(py.tokens(i) == nat.tokens(i) == seqs[i] for i in range(len(seqs)))


@pytest.mark.skipif(not NATIVE, reason="native extension not built")
def test_native_rejects_unknown_sequence_ids():
    index = NativeSuffixIndex()
    index.add([1, 2, 3])
    with pytest.raises(IndexError):
        index.extend(1, [4])
    with pytest.raises(IndexError):
        index.tokens(-1)


@pytest.mark.skipif(not NATIVE, reason="native extension not built")
def test_native_equals_reference_on_many_distinct_keys():
    """Thousands of distinct keys per key length (a wide vocabulary): the native tables grow
    many times over, their slots collide and probe, and every match still equals the
    reference's, the repeated phrases' occurrences in order."""
    rng = random.Random(7)
    py, nat = _pair(2, 16, 4)
    seqs = []
    for _ in range(4):
        seq = []
        while len(seq) < 3000:
            if seq and rng.random() < 0.1:
                a = rng.randrange(len(seq))
                seq += seq[a:a + rng.randrange(2, 24)]
            else:
                seq.append(rng.randrange(5000))
        seqs.append(seq)
        assert py.add(seq[:100]) == nat.add(seq[:100])
    for at in range(100, 3000, 50):
        for sid, seq in enumerate(seqs):
            py.extend(sid, seq[at:at + 50])
            nat.extend(sid, seq[at:at + 50])
            cut = rng.randrange(2, at + 50)
            ctx = seq[max(0, cut - 16):cut]
            assert py.match(ctx, sid) == nat.match(ctx, sid)
            assert _same_draft(py.propose(ctx, 16, 1, source="s"), nat.propose(ctx, 16, 1, source="s"))
    assert py.num_tokens == nat.num_tokens


@pytest.mark.parametrize("seed", range(4))
def test_propose_many_equals_propose_per_context(seed):
    """One call for many (index, context) pairs: each pair's draft is ``propose``'s, native or
    reference, chains and trees, with excluded sequences and per-pair depths."""
    from tailrl.speculative.sources.suffix_index import propose_many
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 6])
    kinds = [PySuffixIndex] + ([NativeSuffixIndex] if NATIVE else [])
    for kind in kinds:
        indexes, seqs = [], []
        for _ in range(4):
            ix = kind(2, 16)
            own = []
            for _ in range(rng.randrange(1, 4)):
                toks = [rng.randrange(vocab) for _ in range(rng.randrange(0, 60))]
                ix.add(toks)
                own.append(toks)
            indexes.append(ix)
            seqs.append(own)
        lookups, contexts, depths = [], [], []
        for _ in range(40):
            i = rng.randrange(len(indexes))
            q = rng.choice(seqs[i])
            cut = rng.randrange(len(q) + 1)
            contexts.append(q[max(0, cut - rng.choice([2, 16, 30])):cut])
            lookups.append((indexes[i], rng.choice([None, 0, len(seqs[i]) - 1])))
            depths.append(rng.choice([0, 1, 5, 16]))
        for paths in (1, 3):
            kw = dict(min_token_prob=rng.choice([0.0, 0.1]), tokens_per_match=rng.choice([0.0, 1.0]), source="s")
            many = propose_many(lookups, contexts, depths, paths, **kw)
            one = [ix.propose(c, k, paths, exclude=ex, **kw) for (ix, ex), c, k in zip(lookups, contexts, depths)]
            assert len(many) == len(one) and all(_same_draft(a, b) for a, b in zip(many, one))
            assert any(d is not None for d in many)
        with pytest.raises(ValueError, match="max_tokens"):
            propose_many(lookups, contexts, depths[:-1])
