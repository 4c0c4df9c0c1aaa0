"""The native row-attention kernel against the SDPA reference, both reading K/V through block
tables of a shuffled pool, and its batch invariance."""
import random
from functools import partial

import pytest
import torch

from tailrl.kernels import cpu
from tailrl.kernels.cpu import attend
from tailrl.kernels.layout import BLOCK, AttentionMeta, pack_keys
from tailrl.kernels.reference import reference_attend

pytestmark = pytest.mark.skipif(not cpu.NATIVE, reason="native row attention not built")

KV, G, D = 2, 2, 32


def make_meta(rows_queries: list[list[tuple[int, list[int]]]], table: torch.Tensor) -> AttentionMeta:
    """rows_queries[r] = [(prefix, extras), ...] for the queries of row r, in flat order."""
    q_row, prefix, estart, ecount, extra = [], [], [], [], []
    for r, queries in enumerate(rows_queries):
        for p, ex in queries:
            q_row.append(r)
            prefix.append(p)
            estart.append(len(extra))
            ecount.append(len(ex))
            extra += ex
    i32 = dict(dtype=torch.int32)
    kv_len = max(max([p] + [e + 1 for e in ex]) for qs in rows_queries for p, ex in qs)
    n = len(q_row)
    return AttentionMeta(torch.zeros(n, dtype=torch.long), torch.tensor(q_row, **i32), torch.tensor(prefix, **i32),
                         torch.tensor(estart, **i32), torch.tensor(ecount, **i32), torch.tensor(extra or [0], **i32),
                         table, kv_len, 0, 0)


def caches(rows: int, cap: int, dtype, seed: int = 0):
    """Plain keys [rows, KV, D, cap] and values [rows, KV, cap, D] (cap a multiple of 32)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, KV, D, cap, generator=g).to(dtype)
    v = torch.randn(rows, KV, cap, D, generator=g).to(dtype)
    return k, v


def pool(k: torch.Tensor, v: torch.Tensor, seed: int = 0, spare: int = 5):
    """The rows' K/V in a pool of blocks, placed at random (a fragmented pool), with ``spare``
    blocks of NaN: (pool keys [blocks, KV, 32 * D], values [blocks, KV, 32, D], table [rows,
    cap / 32])."""
    rows, kv, dim, cap = k.shape
    nb = cap // BLOCK
    order = torch.randperm(rows * nb + spare, generator=torch.Generator().manual_seed(seed))
    table = order[:rows * nb].view(rows, nb).to(torch.int32)
    pk = torch.full((rows * nb + spare, kv, BLOCK * dim), float("nan"), dtype=k.dtype)
    pv = torch.full((rows * nb + spare, kv, BLOCK, dim), float("nan"), dtype=v.dtype)
    packed = pack_keys(k).view(rows, kv, nb, BLOCK * dim)
    for r in range(rows):
        for j in range(nb):
            pk[table[r, j]] = packed[r, :, j]
            pv[table[r, j]] = v[r, :, j * BLOCK:(j + 1) * BLOCK]
    return pk, pv, table


def run(q, k, v, rows_queries, fn=attend, seed=0):
    pk, pv, table = pool(k, v, seed)
    return fn(q, pk, pv, make_meta(rows_queries, table))


def hide_unseen(k: torch.Tensor, v: torch.Tensor, rows_queries) -> None:
    """NaN at every position no query of its row sees: a kernel that read one would show it."""
    for r, queries in enumerate(rows_queries):
        seen = set()
        for p, ex in queries:
            seen.update(range(p), ex)
        unseen = [i for i in range(k.shape[-1]) if i not in seen]
        k[r, :, :, unseen] = float("nan")
        v[r, :, unseen] = float("nan")


def random_queries(rng: random.Random, cap: int) -> list[tuple[int, list[int]]]:
    """A plain query, a chain of 1-6 nodes, or tree nodes with 1-4 scattered extras."""
    kind = rng.random()
    p = rng.randint(1, cap - 8)
    if kind < 0.3:
        return [(p, [])]
    if kind < 0.6:
        return [(p + i, []) for i in range(rng.randint(1, 6))]
    return [(p, sorted(rng.sample(range(p, cap), rng.randint(1, 4)))) for _ in range(rng.randint(1, 4))]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_native_matches_reference(dtype, tol):
    rng = random.Random(1)
    cap = 160                                          # blocks of 32: full, partial, straddled
    rows = [random_queries(rng, cap) for _ in range(12)]
    k, v = caches(len(rows), cap, dtype)
    hide_unseen(k, v, rows)
    q = torch.randn(sum(map(len, rows)), KV * G, D).to(dtype)
    got = run(q, k, v, rows)
    ref = run(q.double(), k.double(), v.double(), rows, fn=reference_attend, seed=1)
    assert torch.isfinite(got).all() and torch.isfinite(ref).all()
    assert (got.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("softcap,sinks", [(None, None), (1.5, None), (None, [0.5, -1.0, 2.0, 0.0])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_query_bits_do_not_depend_on_the_batch(dtype, softcap, sinks):
    """A query's output is the same bits alone, next to other rows, next to other queries of
    its row, and as a tree node whose ancestors sit elsewhere in the cache: what makes
    speculative and plain decoding agree exactly in every dtype (with soft-capped scores, and
    with attention sinks, too)."""
    cap = 192
    k, v = caches(3, cap, dtype, seed=2)
    q = torch.randn(1, KV * G, D).to(dtype)
    sinks = None if sinks is None else torch.tensor(sinks).to(dtype)
    run = partial(globals()["run"], fn=partial(attend, softcap=softcap, sinks=sinks))
    # the key sequence plain decoding sees at position 99: positions [0, 100)
    alone = run(q, k, v, [[(100, [])]])
    # the same keys for a tree node: committed prefix 70, ancestors copied to 150.., itself last
    k2, v2 = k.clone(), v.clone()
    extras = list(range(150, 180))
    k2[0, :, :, 150:180] = k[0, :, :, 70:100]
    v2[0, :, 150:180] = v[0, :, 70:100]
    tree = run(q, k2, v2, [[(70, extras)]], seed=3)
    # in a batch: other rows before it, another query of its row after it
    qs = torch.cat([torch.randn(2, KV * G, D).to(dtype), q, torch.randn(1, KV * G, D).to(dtype)])
    kb = torch.cat([k[1:], k[:1]])                     # our row is row 2 now
    vb = torch.cat([v[1:], v[:1]])
    batch = run(qs, kb, vb, [[(37, [])], [(150, [])], [(100, []), (101, [])]], seed=4)
    assert torch.equal(alone[0], tree[0])
    assert torch.equal(alone[0], batch[2])


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_soft_capped_scores_match_the_reference(dtype, tol):
    """Gemma 2's soft cap (a score s becomes cap * tanh(s / cap)) on chains, trees and plain
    queries, alone and with a sliding window; scores large enough that the cap changes the
    result (the uncapped kernel's is far from the capped reference)."""
    rng = random.Random(3)
    cap = 160
    rows = [random_queries(rng, cap) for _ in range(12)]
    k, v = caches(len(rows), cap, dtype)
    hide_unseen(k, v, rows)
    q = (3 * torch.randn(sum(map(len, rows)), KV * G, D)).to(dtype)
    for origin in (None, window_origins(rows, 40)):
        pk, pv, table = pool(k, v)
        got = attend(q, pk, pv, make_meta(rows, table), origin, softcap=2.0)
        plain = attend(q, pk, pv, make_meta(rows, table), origin)
        pk, pv, table = pool(k.double(), v.double(), seed=1)
        ref = reference_attend(q.double(), pk, pv, make_meta(rows, table), origin, softcap=2.0)
        assert torch.isfinite(got).all() and torch.isfinite(ref).all()
        assert (got.double() - ref).abs().max().item() < tol
        assert (plain.double() - ref).abs().max().item() > 0.1


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_sinks_match_the_reference(dtype, tol):
    """gpt-oss's sinks (a logit per query head in each softmax's denominator, weighing no value)
    on chains, trees and plain queries, with and without a sliding window: the reference's
    result, and not the result without them; a sink far below every score changes nothing."""
    rng = random.Random(4)
    cap = 160
    rows = [random_queries(rng, cap) for _ in range(12)]
    k, v = caches(len(rows), cap, dtype)
    hide_unseen(k, v, rows)
    q = torch.randn(sum(map(len, rows)), KV * G, D).to(dtype)
    sinks = torch.tensor([3.0, -2.0, 0.5, 6.0]).to(dtype)
    for origin in (None, window_origins(rows, 40)):
        pk, pv, table = pool(k, v)
        got = attend(q, pk, pv, make_meta(rows, table), origin, sinks=sinks)
        plain = attend(q, pk, pv, make_meta(rows, table), origin)
        low = attend(q, pk, pv, make_meta(rows, table), origin, sinks=torch.full((KV * G,), -80.0).to(dtype))
        pk, pv, table = pool(k.double(), v.double(), seed=1)
        ref = reference_attend(q.double(), pk, pv, make_meta(rows, table), origin, sinks=sinks.double())
        assert torch.isfinite(got).all() and torch.isfinite(ref).all()
        assert (got.double() - ref).abs().max().item() < tol
        assert (plain.double() - ref).abs().max().item() > 0.1
        assert torch.equal(low, plain)
    with pytest.raises(ValueError, match="sinks"):
        attend(q, pk, pv, make_meta(rows, table), sinks=sinks[:2])


def test_empty_step_and_bad_layout():
    k, v = caches(1, 64, torch.float32)
    pk, pv, table = pool(k, v)
    meta = make_meta([[(5, [])]], table)
    assert attend(torch.zeros(0, KV * G, D), pk, pv, meta).shape == (0, KV * G * D)
    with pytest.raises(ValueError, match="keys must be"):
        attend(torch.randn(1, KV * G, D), k, v, meta)      # plain per-row tensors, not a pool
    with pytest.raises(ValueError, match="contiguous"):
        attend(torch.randn(1, KV * G, D), pk, pv.transpose(-1, -2).contiguous().transpose(-1, -2), meta)
    with pytest.raises(ValueError, match="block_table"):
        attend(torch.randn(1, KV * G, D), pk, pv, make_meta([[(5, [])]], table.long()))


def window_origins(rows_queries, window: int) -> torch.Tensor:
    """Each query's sliding-window origin: its position (a plain or chain query's prefix - 1, a
    tree node's committed prefix plus its depth) minus window - 1, at least 0."""
    pos = [p + len(ex) - 1 for queries in rows_queries for p, ex in queries]
    return torch.tensor([max(0, x - window + 1) for x in pos], dtype=torch.int32)


def hide_outside_windows(k: torch.Tensor, v: torch.Tensor, rows_queries, origin: torch.Tensor) -> None:
    """NaN at every position no query of its row sees inside its window."""
    i = 0
    for r, queries in enumerate(rows_queries):
        seen = set()
        for p, ex in queries:
            seen.update(range(int(origin[i]), p), ex)
            i += 1
        unseen = [j for j in range(k.shape[-1]) if j not in seen]
        k[r, :, :, unseen] = float("nan")
        v[r, :, unseen] = float("nan")


@pytest.mark.parametrize("window", [5, 40, 100])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.bfloat16, 2e-2)])
def test_sliding_windows_match_the_reference_and_read_nothing_below_their_origins(window, dtype, tol):
    """A sliding window's origin inside a block, on a block boundary, below every query (5 keys:
    chains of 6 nodes, trees whose extras reach past it)."""
    rng = random.Random(7)
    cap = 160
    rows = [random_queries(rng, cap) for _ in range(12)]
    origin = window_origins(rows, window)
    k, v = caches(len(rows), cap, dtype)
    hide_outside_windows(k, v, rows, origin)
    q = torch.randn(sum(map(len, rows)), KV * G, D).to(dtype)
    pk, pv, table = pool(k, v)
    got = attend(q, pk, pv, make_meta(rows, table), origin)
    pk, pv, table = pool(k.double(), v.double(), seed=1)
    ref = reference_attend(q.double(), pk, pv, make_meta(rows, table), origin)
    assert torch.isfinite(got).all() and torch.isfinite(ref).all()
    assert (got.double() - ref).abs().max().item() < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_windowed_querys_bits_do_not_depend_on_the_batch(dtype):
    """Plain decoding at position 99 with a window of 45 (origin 55, inside a block), the same
    token as a tree node (committed prefix 70, ancestors elsewhere) and in a batch whose other
    queries of its row have other origins: the same bits."""
    k, v = caches(3, 192, dtype, seed=2)
    q = torch.randn(1, KV * G, D).to(dtype)

    def run_w(qs, kk, vv, rows, seed):
        pk, pv, table = pool(kk, vv, seed)
        return attend(qs, pk, pv, make_meta(rows, table), window_origins(rows, 45))

    alone = run_w(q, k, v, [[(100, [])]], 0)
    k2, v2 = k.clone(), v.clone()
    k2[0, :, :, 150:180] = k[0, :, :, 70:100]
    v2[0, :, 150:180] = v[0, :, 70:100]
    tree = run_w(q, k2, v2, [[(70, list(range(150, 180)))]], 3)
    qs = torch.cat([torch.randn(2, KV * G, D).to(dtype), torch.randn(1, KV * G, D).to(dtype), q])
    batch = run_w(qs, torch.cat([k[1:], k[:1]]), torch.cat([v[1:], v[:1]]),
                  [[(37, [])], [(150, [])], [(64, []), (100, [])]], 4)
    assert torch.equal(alone[0], tree[0])
    assert torch.equal(alone[0], batch[3])
