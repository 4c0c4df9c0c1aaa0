"""The GPU backend's Triton kernels against the reference, run on CPU tensors under Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU): RoPE with the
K/V write into a shuffled pool, attention over chains, trees, GQA and ragged rows through block
tables, RMS norm, the matmuls, experts and activations; a query's bits alone equal its bits in a
batch. Models end to end through these kernels: tests/kernels/test_triton_models.py."""
import dataclasses
import random

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from tailrl.kernels import RopeTables, select  # noqa: E402
from tailrl.kernels.gpu.arrivals import counters  # noqa: E402
from tailrl.kernels.gpu.backend import TRITON  # noqa: E402
from tailrl.kernels.layout import BLOCK, AttentionMeta  # noqa: E402
from tailrl.kernels.reference import REFERENCE  # noqa: E402
from tailrl.model.rope import rope_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, KV, D = 4, 2, 32
# slow under the interpreter (a mixture of experts' graph steps: ~2 min), quick on a GPU
SLOW_HERE = pytest.mark.slow if DEVICE == "cpu" else ()


def step(rows_queries, n_blocks: int, seed: int):
    """A step over rows of random committed K/V, placed at random in a pool with spare blocks;
    each query (position, extras) writes its own K/V at its slot. Returns what rope_attend takes."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    rows = len(rows_queries)
    per_row = max(max([p] + ex) // BLOCK + 1 for qs in rows_queries for p, ex in qs)
    order = list(range(n_blocks))
    rng.shuffle(order)
    table = torch.tensor(order[:rows * per_row], dtype=torch.int32).view(rows, per_row)
    q_row, prefix, estart, ecount, extra, slots, positions = [], [], [], [], [], [], []
    for r, queries in enumerate(rows_queries):
        for p, ex in queries:
            q_row.append(r)
            prefix.append(p)                        # it sees [0, p), then its extras (a tree node: ancestors, itself)
            estart.append(len(extra))
            ecount.append(len(ex))
            extra += ex
            at = ex[-1] if ex else p - 1            # its own position (written this step)
            slots.append(int(table[r, at // BLOCK]) * BLOCK + at % BLOCK)
            positions.append(at)
    i32 = dict(dtype=torch.int32)
    kv_len = max(max([p] + [e + 1 for e in ex]) for qs in rows_queries for p, ex in qs)
    meta = AttentionMeta(torch.tensor(slots), torch.tensor(q_row, **i32), torch.tensor(prefix, **i32),
                         torch.tensor(estart, **i32), torch.tensor(ecount, **i32), torch.tensor(extra or [0], **i32),
                         table, kv_len, 0, 0)
    k = torch.randn(n_blocks, KV, BLOCK * D, generator=g)
    v = torch.randn(n_blocks, KV, BLOCK, D, generator=g)
    qkv = torch.randn(len(q_row), (H + 2 * KV) * D, generator=g)
    return qkv, torch.tensor(positions), k, v, meta


def random_rows(rng: random.Random, n: int, cap: int = 150):
    out = []
    for _ in range(n):
        p = rng.randint(1, cap)
        kind = rng.random()
        if kind < 0.35:
            out.append([(p, [])])
        elif kind < 0.7:
            out.append([(p + i, []) for i in range(rng.randint(1, 5))])      # a chain
        else:
            nodes = sorted(rng.sample(range(p, p + 40), rng.randint(1, 4)))
            out.append([(p, nodes[:i + 1]) for i in range(len(nodes))])     # tree nodes: ancestors, then self
    return out


def run(backend, dtype, qkv, positions, k, v, meta, window=0, softcap=None, sinks=None):
    cos, sin = rope_table(D, 1024, 1e4, torch.float32)
    dev = dict(device=DEVICE)
    tables = RopeTables(cos.to(dtype=dtype, **dev), sin.to(dtype=dtype, **dev), cos.to(**dev), sin.to(**dev))
    fields = (getattr(meta, f) for f in meta.__dataclass_fields__)
    meta = AttentionMeta(*(f.to(**dev) if isinstance(f, torch.Tensor) else f for f in fields))
    kc, vc = k.to(dtype=dtype, **dev).clone(), v.to(dtype=dtype, **dev).clone()
    rope = backend.rope(tables, positions.to(**dev), window, softcap=softcap)
    sinks = None if sinks is None else sinks.to(dtype=dtype, **dev)
    out = backend.rope_attend(qkv.to(dtype=dtype, **dev), rope, kc, vc, meta, H, sinks)
    return out.cpu(), kc.cpu(), vc.cpu()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_rope_attend_matches_the_reference(dtype, tol):
    rows = random_rows(random.Random(1), 6)
    args = step(rows, n_blocks=6 * 8 + 3, seed=2)
    got, kg, vg = run(TRITON, dtype, *args)
    ref, kr, vr = run(REFERENCE, torch.float32 if dtype == torch.float32 else dtype, *args)
    want, _, _ = run(REFERENCE, torch.float32, *args)
    assert torch.isfinite(got).all()
    assert (got.float() - want).abs().max().item() < tol
    # the K/V written: equal to the reference's up to the rounding of RoPE in the model's dtype
    assert (kg.float() - kr.float()).abs().max().item() < tol * 4 and torch.equal(vg, vr)


@pytest.mark.parametrize("lanes,keys", [(16, 32), pytest.param(16, 16, marks=SLOW_HERE),
                                        pytest.param(4, 64, marks=SLOW_HERE)])
def test_attention_lanes_merged_in_one_program_or_by_a_second_kernel_give_the_same_bits(monkeypatch, lanes, keys):
    """Long rows (up to 600 positions: several chunks of keys per lane) and short ones, chains
    and trees: every lane in one program (a step with programs enough to fill a GPU) and one
    program per lane, merged by the last lane to finish (few tokens), compute the same bits; both near
    float64. Lanes and keys per step of a lane's walk: the defaults (tests/conftest.py sets 2
    lanes under the interpreter), and, on a GPU or with ``-m slow`` under the interpreter (~50 and
    ~14 s), one pool block per step and four lanes of 64-key chunks."""
    from tailrl.kernels.gpu import backend
    monkeypatch.setattr(backend, "LANES", lanes)
    monkeypatch.setattr(backend, "KEYS", keys)
    rows = random_rows(random.Random(5), 3, cap=600)
    args = step(rows, n_blocks=3 * 40 + 3, seed=6)
    want, _, _ = run(REFERENCE, torch.float32, *args)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):     # float32: no rounding hides a bit
        monkeypatch.setattr(backend, "WHOLE_PROGRAMS", 0)
        whole, kw, vw = run(TRITON, dtype, *args)
        monkeypatch.setattr(backend, "WHOLE_PROGRAMS", 1 << 30)
        split, ks, vs = run(TRITON, dtype, *args)
        assert torch.equal(whole, split) and torch.equal(kw, ks) and torch.equal(vw, vs)
        assert (split.float() - want).abs().max().item() < tol
    assert not counters(torch.empty(0, device=DEVICE).device, 1).any()   # every lane group's counter back at zero


def test_a_rows_queries_walk_its_kv_together_with_the_bits_each_has_alone(monkeypatch):
    """Query groups (``AttentionMeta.multi``: chains of drafts and prefill runs of one row walk
    its K/V together, up to ``GROUP`` queries, each masked to its own prefix): every query's
    bits equal those of the launch without groups, in both modes, at groups of 4 and 8, in
    float32 (where no rounding hides a bit) and bfloat16 (its dots on tensor cores, groups of at
    most 32 query rows: here up to 4 queries of 2 heads, padded to 16; and as float32 FMA dots).
    Rows: chains, trees, and a prefill run of 21 positions across group boundaries."""
    from tailrl.kernels.gpu import backend
    rows = random_rows(random.Random(8), 4, cap=120) + [[(p, []) for p in range(50, 71)]]
    qkv, positions, k, v, meta = step(rows, n_blocks=5 * 6 + 3, seed=9)
    grouped = dataclasses.replace(meta, multi=True)
    want, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta)
    for dtype, dots, cases in ((torch.float32, "tensor", [(4, 0), (4, 1 << 30), (8, 1 << 30)]),
                               (torch.bfloat16, "tensor", [(4, 1 << 30)]), (torch.bfloat16, "ieee", [(4, 1 << 30)])):
        monkeypatch.setattr(backend, "DOTS", dots)
        monkeypatch.setattr(backend, "WHOLE_PROGRAMS", 0)
        alone, _, _ = run(TRITON, dtype, qkv, positions, k, v, meta)
        for group, whole_programs in cases:
            monkeypatch.setattr(backend, "GROUP", group)
            monkeypatch.setattr(backend, "WHOLE_PROGRAMS", whole_programs)
            got, _, _ = run(TRITON, dtype, qkv, positions, k, v, grouped)
            assert torch.equal(got, alone), (dtype, group, whole_programs)
        assert (alone.float() - want).abs().max().item() < (2e-5 if dtype == torch.float32 else 3e-2)


def test_sliding_windows_in_every_mode_match_the_reference_with_the_bits_of_a_query_alone(monkeypatch):
    """Sliding windows (each query sees no position of its prefix below its position - 44, a
    tree node's whole prefix where its origin passes it): near the reference in float32, and the
    same bits with every lane in one program, a program per lane, and the queries of a row
    walking its K/V in groups, each alone in a launch where no query has a group."""
    from tailrl.kernels.gpu import backend
    rows = random_rows(random.Random(12), 3, cap=120) + [[(p, []) for p in range(60, 67)]]
    qkv, positions, k, v, meta = step(rows, n_blocks=4 * 6 + 3, seed=13)
    want, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta, window=45)
    outs = []
    for whole_programs, multi in ((0, False), (1 << 30, False), (1 << 30, True)):
        monkeypatch.setattr(backend, "WHOLE_PROGRAMS", whole_programs)
        outs.append(run(TRITON, torch.float32, qkv, positions, k, v, dataclasses.replace(meta, multi=multi),
                        window=45)[0])
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert (outs[0] - want).abs().max().item() < 2e-5
    full, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta)
    assert (full - want).abs().max().item() > 1e-2                  # the window changed what is seen


def test_soft_capped_scores_match_the_reference_with_the_bits_of_a_query_alone(monkeypatch):
    """Gemma 2's soft cap (scores s -> cap * tanh(s / cap)): near the reference in float32 and
    bfloat16 (tensor cores) and far from the uncapped result; with a window of 45, the same bits
    with a program per lane as with query groups in whole programs."""
    from tailrl.kernels.gpu import backend
    rows = random_rows(random.Random(14), 3, cap=120) + [[(p, []) for p in range(60, 67)]]
    qkv, positions, k, v, meta = step(rows, n_blocks=4 * 6 + 3, seed=15)
    qkv[:, :(H + KV) * D] *= 4                                          # scores large enough to be capped
    want, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta, softcap=1.5)
    uncapped, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta)
    assert (uncapped - want).abs().max().item() > 1e-2
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        got, _, _ = run(TRITON, dtype, qkv, positions, k, v, meta, softcap=1.5)
        assert (got.float() - want).abs().max().item() < tol, dtype
    want, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta, window=45, softcap=1.5)
    outs = []
    for whole_programs, multi in ((0, False), (1 << 30, True)):
        monkeypatch.setattr(backend, "WHOLE_PROGRAMS", whole_programs)
        outs.append(run(TRITON, torch.float32, qkv, positions, k, v, dataclasses.replace(meta, multi=multi),
                        window=45, softcap=1.5)[0])
    assert torch.equal(outs[0], outs[1]) and (outs[0] - want).abs().max().item() < 2e-5


def test_attention_sinks_match_the_reference_with_the_bits_of_a_query_alone(monkeypatch):
    """gpt-oss's sinks (a logit per head in each softmax): near the reference in float32 and
    bfloat16 (tensor cores) and far from the result without them; with a window of 45, the same
    bits with a program per lane as with query groups in whole programs."""
    from tailrl.kernels.gpu import backend
    rows = random_rows(random.Random(16), 3, cap=120) + [[(p, []) for p in range(60, 67)]]
    qkv, positions, k, v, meta = step(rows, n_blocks=4 * 6 + 3, seed=17)
    sinks = torch.tensor([2.0, -1.0, 0.5, 4.0])
    want, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta, sinks=sinks)
    plain, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta)
    assert (plain - want).abs().max().item() > 1e-2
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
        got, _, _ = run(TRITON, dtype, qkv, positions, k, v, meta, sinks=sinks)
        assert (got.float() - want).abs().max().item() < tol, dtype
    want, _, _ = run(REFERENCE, torch.float32, qkv, positions, k, v, meta, window=45, sinks=sinks)
    outs = []
    for whole_programs, multi in ((0, False), (1 << 30, True)):
        monkeypatch.setattr(backend, "WHOLE_PROGRAMS", whole_programs)
        outs.append(run(TRITON, torch.float32, qkv, positions, k, v, dataclasses.replace(meta, multi=multi),
                        window=45, sinks=sinks)[0])
    assert torch.equal(outs[0], outs[1]) and (outs[0] - want).abs().max().item() < 2e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, pytest.param(torch.float16, marks=SLOW_HERE)])
def test_the_projection_bias_added_in_ropes_pass_gives_the_separate_adds_bits(dtype, monkeypatch):
    """Where cuBLAS computes the fused projection, RoPE's pass adds its bias (a launch fewer):
    attention, K and V equal, bit for bit, those of the product plus the bias added as PyTorch
    adds it; ``linear_rope_attend`` takes that path for a stock weight only."""
    from tailrl.kernels.gpu import stock
    rows = random_rows(random.Random(11), 4, cap=40)
    qkv, positions, k, v, meta = step(rows, n_blocks=4 * 3 + 3, seed=12)
    dev = dict(device=DEVICE)
    meta = AttentionMeta(*(f.to(**dev) if isinstance(f, torch.Tensor) else f
                           for f in (getattr(meta, name) for name in meta.__dataclass_fields__)))
    bias = torch.randn(qkv.shape[1], generator=torch.Generator().manual_seed(13)) * 3
    cos, sin = rope_table(D, 512, 1e4, torch.float32)
    rope = TRITON.rope(RopeTables(cos.to(dtype=dtype, **dev), sin.to(dtype=dtype, **dev), cos.to(**dev),
                                  sin.to(**dev)), positions.to(**dev))
    x, b = qkv.to(dtype=dtype, **dev), bias.to(dtype=dtype, **dev)
    sep = [k.to(dtype=dtype, **dev), v.to(dtype=dtype, **dev)]
    fused = [c.clone() for c in sep]
    want = TRITON.rope_attend(x + b, rope, *sep, meta, H)
    got = TRITON.rope_attend(x, rope, *fused, meta, H, bias=b)
    assert torch.equal(got, want) and torch.equal(fused[0], sep[0]) and torch.equal(fused[1], sep[1])
    h = torch.randn(len(x), 48, generator=torch.Generator().manual_seed(14)).to(dtype=dtype, **dev)
    w = torch.randn(qkv.shape[1], 48, generator=torch.Generator().manual_seed(15)).to(dtype=dtype, **dev) / 8
    for use in (True, False):
        monkeypatch.setattr(stock, "use_stock", lambda weight, use=use: use)
        calls = []
        monkeypatch.setattr(stock, "stock_linear", lambda x, w, b=None: calls.append(b) or F.linear(x, w, b))
        caches = [c.clone() for c in sep]
        got = TRITON.linear_rope_attend(h, w, b, rope, *caches, meta, H)
        want = TRITON.rope_attend(F.linear(h, w) + b if use else TRITON.linear(h, w, b), rope, *sep, meta, H)
        assert torch.equal(got, want) and calls == ([None] if use else [])


def test_tensor_core_tiles_stay_below_wgmmas_64_rows(monkeypatch):
    """Tensor cores' bits are the same at any tile of query rows only while Triton picks
    mma.sync (below 64 rows): groups shrink to fit 32 rows, and heads wider than that take the
    float32 dots; float32 pools and DOTS=ieee always do."""
    from tailrl.kernels.gpu import backend
    monkeypatch.setattr(backend, "GROUP", 4)
    bf16 = torch.bfloat16
    assert backend.attention_tiles(14, 2, 64, bf16, True) == (True, 7, 16, 4, 32)     # Qwen2.5-0.5B's chains
    assert backend.attention_tiles(14, 2, 64, bf16, False) == (True, 7, 16, 1, 16)
    assert backend.attention_tiles(32, 2, 64, torch.float16, True) == (True, 16, 16, 2, 32)
    assert backend.attention_tiles(64, 2, 64, bf16, True) == (True, 32, 32, 1, 32)
    assert backend.attention_tiles(128, 2, 64, bf16, False)[0] is False
    assert backend.attention_tiles(14, 2, 64, torch.float32, True) == (False, 7, 16, 4, 32)
    # heads narrower than a tensor-core dot's depth (16) take the float32 dots (a tiny test model's 8:
    # Triton 3.6 refused to compile its q . k on an H200)
    assert backend.attention_tiles(8, 2, 8, bf16, True) == (False, 4, 16, 4, 16)
    assert backend.attention_tiles(8, 2, 16, bf16, True)[0] is True
    # narrower than a float32 dot's 8, or not a power of two: the reference attention (and no graphs)
    assert [backend.TritonBackend().attends(d) for d in (4, 8, 64, 96, 128)] == [False, True, True, False, True]
    monkeypatch.setattr(backend, "DOTS", "ieee")
    assert backend.attention_tiles(14, 2, 64, bf16, True) == (False, 7, 16, 4, 32)


@pytest.mark.parametrize("multi,dots", [(False, "tensor"), (True, "tensor"), (True, "ieee")])
def test_a_query_alone_equals_the_query_in_a_batch(multi, dots, monkeypatch):
    from tailrl.kernels.gpu import backend
    monkeypatch.setattr(backend, "DOTS", dots)
    rows = [[(90, [])], [(40, []), (41, []), (42, [])], [(70, [100, 101, 104])]]
    qkv, positions, k, v, meta = step(rows, n_blocks=20, seed=3)
    batch, k, v = run(TRITON, torch.bfloat16, qkv, positions, k, v,             # alone: the same K/V in the pool
                      dataclasses.replace(meta, multi=multi))
    for t, r in ((0, 0), (2, 1), (3, 1), (4, 2)):          # flat index of a query, its row
        one = AttentionMeta(meta.write_slot[t:t + 1], torch.zeros(1, dtype=torch.int32), meta.prefix[t:t + 1],
                            torch.zeros(1, dtype=torch.int32), meta.ecount[t:t + 1],
                            meta.extra[meta.estart[t]:meta.estart[t] + max(1, int(meta.ecount[t]))],
                            meta.block_table[r:r + 1], meta.kv_len, 0, 0)
        alone, _, _ = run(TRITON, torch.bfloat16, qkv[t:t + 1], positions[t:t + 1], k, v, one)
        assert torch.equal(alone[0], batch[t]), t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    got = TRITON.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6).cpu()
    want = F.rms_norm(x.float(), (96,), w.float(), 1e-6)
    # float32: accumulation order; bfloat16: one ulp of the result (relative: an absolute bound
    # fails wherever |result| >= 4; Triton's interpreter truncates on the cast, a GPU rounds)
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * want.abs() + 1e-6
    assert ((got.float() - want).abs() <= tol).all()
    assert torch.equal(TRITON.rms_norm(x[3:4].to(DEVICE), w.to(DEVICE), 1e-6).cpu()[0], got[3])


def test_select_picks_triton_for_cuda_and_when_forced(monkeypatch):
    assert select("cuda", torch.bfloat16) is TRITON and select("cuda", torch.float64) is REFERENCE
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    assert select("cpu", torch.float32) is TRITON
    monkeypatch.setenv("TAILRL_KERNELS", "nope")
    with pytest.raises(ValueError, match="TAILRL_KERNELS"):
        select("cpu", torch.float32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_experts_grouped_on_the_device_match_the_reference_and_a_token_alone(dtype, tol):
    """The routed products grouped by expert (kernels/gpu/experts.py): every (token, j) pair in
    exactly one used block of its expert, the result the definition's (float64 reference,
    relative to the output's scale) and a token's bits alone equal to its bits among 40 tokens."""
    from tailrl.kernels.gpu import experts as ex
    from tailrl.model.moe import route
    g = torch.Generator().manual_seed(0)
    e, h, i, k = 8, 64, 48, 3
    x = torch.randn(40, h, generator=g).to(dtype=dtype, device=DEVICE)
    router = (0.3 * torch.randn(e, h, generator=g)).to(dtype=dtype, device=DEVICE)
    gate_up = (0.2 * torch.randn(e, 2 * i, h, generator=g)).to(dtype=dtype, device=DEVICE)
    down = (0.2 * torch.randn(e, h, i, generator=g)).to(dtype=dtype, device=DEVICE)
    ids, w = route(TRITON.linear(x, router), k, True, False)
    pairs, expert, start, count = (t.cpu() for t in ex.expert_blocks(ids, e))
    flat, seen = ids.reshape(-1).cpu(), []
    for b in range(len(count)):
        got = pairs[start[b]:start[b] + count[b]].tolist()
        assert all(flat[p] == expert[b] for p in got)
        seen += got
    assert sorted(seen) == list(range(len(flat))) and len(count) == -(-len(flat) // ex.BM) + e
    got = TRITON.experts(x, gate_up, down, ids, w).cpu()
    ref = REFERENCE.experts(*(t.double().cpu() for t in (x, gate_up, down)), ids.cpu(), w.double().cpu())
    assert (got.double() - ref).abs().max() <= tol * ref.abs().max()
    for t in (0, 7, 39):
        ids1, w1 = route(TRITON.linear(x[t:t + 1], router), k, True, False)
        assert torch.equal(TRITON.experts(x[t:t + 1], gate_up, down, ids1, w1).cpu()[0], got[t])


@pytest.mark.parametrize("k,n", [(96, 80), (1280, 40), (130, 33)])
def test_matmul_rows_do_not_depend_on_the_batch(k, n, monkeypatch):
    """The Triton matmul: a row alone equals the row in products of any M (tiles of 64 rows:
    rows land at other positions of other tiles), K split in ranges fixed by the shape
    ((1280, 40) takes several; the others one, rounded by the first kernel), bias and rounding
    once, on operands that show any change in a sum's order (stock.probe_operands); close to
    float64 on ordinary ones. From 2 tiles on, a program sums all its tile's ranges itself
    (``matmul.WHOLE_PROGRAMS``, on an H100 132 tiles): the split path's bits."""
    from tailrl.kernels.gpu import matmul, stock
    monkeypatch.setattr(matmul, "WHOLE_PROGRAMS", 2)
    g = torch.Generator().manual_seed(k)
    rows = 140
    x, w = stock.probe_operands(rows, torch.empty(n, k, dtype=torch.bfloat16))
    x, w = x.to(DEVICE), w.to(DEVICE)
    b = torch.randn(n, generator=g).bfloat16().to(DEVICE)
    alone = torch.cat([matmul.linear(x[i:i + 1], w, b) for i in range(rows)])
    for m in (2, 3, 17, 63, 64, 65, 129, rows):
        assert torch.equal(matmul.linear(x[:m], w, b), alone[:m]), m
    assert torch.equal(matmul.linear(x[37:101], w, b), alone[37:101])          # other tile positions
    assert torch.equal(matmul.linear(x[:5], w), matmul.linear(x[:5], w, torch.zeros_like(b)))
    x = torch.randn(rows, k, generator=g).bfloat16().to(DEVICE)
    w = torch.randn(n, k, generator=g).bfloat16().to(DEVICE)
    ref = x.double() @ w.double().T + b.double()
    assert (matmul.linear(x, w, b).double() - ref).abs().max() <= 0.02 * ref.abs().max()
    assert matmul.splits(40, 1280) > 1 and matmul.splits(151936, 896) == 1
    assert not counters(torch.empty(0, device=DEVICE).device, 1).any()   # every tile's counter back at zero
    assert TRITON.linear(x.float(), w.float()).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_activation_computed_as_the_matmul_reads_it_gives_the_two_kernels_bits(dtype, monkeypatch):
    """``silu_mul_linear`` through the Triton matmul computes silu(gate) * up as it loads its
    tiles: the bits of silu_mul_kernel then the product, for K in one range or several, with a
    bias, summed per range or per program (``WHOLE_PROGRAMS``); a row alone equals the row in
    the batch. A weight that cuBLAS computes, or a step of more than ``ACT_ROWS`` rows, takes
    the two launches (the same bits)."""
    from tailrl.kernels.gpu import matmul, stock
    g = torch.Generator().manual_seed(21)
    for k, n, whole in ((96, 40, 1 << 30), (1280, 40, 1 << 30), (1280, 40, 1)):
        monkeypatch.setattr(matmul, "WHOLE_PROGRAMS", whole)
        gu = (torch.randn(70, 2 * k, generator=g) * 3).to(dtype).to(DEVICE)
        w = (torch.randn(n, k, generator=g) / 8).to(dtype).to(DEVICE)
        b = torch.randn(n, generator=g).to(dtype).to(DEVICE)
        fused = matmul.linear(gu, w, b, act=True)
        assert torch.equal(fused, matmul.linear(TRITON.silu_mul(gu), w, b)), (k, whole)
        assert torch.equal(matmul.linear(gu[9:10], w, b, act=True)[0], fused[9])
    with pytest.raises(ValueError, match="gate"):
        matmul.linear(gu[:, 1:].contiguous(), w, act=True)
    from tailrl.kernels.gpu import backend
    monkeypatch.setattr(stock, "use_stock", lambda weight: False)
    monkeypatch.setattr(backend, "ACT_ROWS", 8)               # 70 rows: two launches; 1 row: one
    assert torch.equal(TRITON.silu_mul_linear(gu[9:10], w, b)[0], TRITON.silu_mul_linear(gu, w, b)[9])
    for use, rows in ((False, 8), (True, 8), (False, 9)):
        monkeypatch.setattr(stock, "use_stock", lambda weight, use=use: use)
        calls = []
        monkeypatch.setattr(matmul, "linear", lambda *a, act=False, **kw: calls.append(act) or fused)
        TRITON.silu_mul_linear(gu[:rows], w, b)
        assert calls == ([] if use else [rows <= 8])


def test_matmul_tiles_are_checked():
    from tailrl.kernels.gpu.matmul import Tiles
    assert Tiles.parse("128,64,32,8,4") == Tiles(128, 64, 32, 8, 4)
    for bad in ("64,64,64", "64,48,64,4,3", "8,64,64,4,3", "64,64,64,3,3", "64,64,64,4,0", "a,b"):
        with pytest.raises(ValueError, match="TAILRL_MATMUL_TILES"):
            Tiles.parse(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_residual_add_fused_with_the_norm_gives_the_two_kernels_bits(dtype):
    """One launch: the sum rounded as PyTorch's add rounds it (equal, bit for bit), its norm
    by the norm kernel's own code (equal to the norm kernel run on that sum); a row alone gives
    the row's bits in the batch. Non-contiguous inputs take the two operations."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 96, generator=g) * 4).to(dtype).to(DEVICE)
    y = torch.randn(9, 96, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(96, generator=g).to(dtype).to(DEVICE)
    s, h = TRITON.add_rms_norm(x, y, w, 1e-6)
    assert torch.equal(s, x + y)
    assert torch.equal(h, TRITON.rms_norm(x + y, w, 1e-6))
    s1, h1 = TRITON.add_rms_norm(x[4:5], y[4:5], w, 1e-6)
    assert torch.equal(s1[0], s[4]) and torch.equal(h1[0], h[4])
    xt = x.T.contiguous().T
    assert torch.equal(TRITON.add_rms_norm(xt, y, w, 1e-6)[0], s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    """silu(gate) * up from the fused projection's rows, rounded as PyTorch rounds each op:
    within the exponential's last bit of PyTorch's three ops (bfloat16: one ulp of silu's
    rounding); a row alone equals the row in the batch; rows wider than a program's block."""
    g = torch.Generator().manual_seed(4)
    gu = (torch.randn(5, 2 * 1100, generator=g) * 3).to(dtype).to(DEVICE)
    got = TRITON.silu_mul(gu)
    gate, up = gu.float().chunk(2, dim=-1)
    want = (gate * torch.sigmoid(gate)) * up
    tol = 1e-5 * want.abs() + 1e-6 if dtype == torch.float32 else 2 ** -7 * want.abs() + 1e-6
    assert got.shape == (5, 1100) and ((got.float() - want).abs() <= tol).all()
    if dtype == torch.bfloat16:                         # each op rounded: mostly PyTorch's very bits
        assert (got == F.silu(gu[:, :1100]) * gu[:, 1100:]).float().mean() > 0.95
    assert torch.equal(TRITON.silu_mul(gu[2:3])[0], got[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_clamped(dtype):
    """gpt-oss's activation (limit 7, alpha 1.702; gates and ups reach past the limit): within a
    few roundings of the exact value, mostly the bits of the same ops in PyTorch (the base
    backend's) in bfloat16; a row alone equals the row in the batch."""
    g = torch.Generator().manual_seed(5)
    gu = (torch.randn(5, 2 * 1100, generator=g) * 4).to(dtype).to(DEVICE)
    got = TRITON.swiglu_clamped(gu, 1.702, 7.0)
    gate, up = gu.double().chunk(2, dim=-1)
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
    want = (up + 1) * gate * torch.sigmoid(1.702 * gate)
    tol = 1e-5 * want.abs() + 1e-6 if dtype == torch.float32 else 2 ** -7 * want.abs().max()
    assert got.shape == (5, 1100) and ((got.double() - want).abs() <= tol).all()
    if dtype == torch.bfloat16:                     # (up + 1 near 0 rounds coarsely: hence the max above)
        assert (got == REFERENCE.swiglu_clamped(gu, 1.702, 7.0)).float().mean() > 0.95
    assert torch.equal(TRITON.swiglu_clamped(gu[2:3], 1.702, 7.0)[0], got[2])
