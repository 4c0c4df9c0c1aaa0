"""build_batch's fast paths (a plain decode row; a decode row verifying a chain) build what the
general path builds: the same tokens, positions, slots, sampled positions, noise and plans,
and the same visible positions for every token."""
import numpy as np
import pytest
import torch

from tailrl import SamplingParams
from tailrl.engine.batch import build_batch
from tailrl.engine.kv import KVCache
from tailrl.engine.request import Request
from tailrl.model.loader import read_args
from tailrl.noise import uniforms
from tailrl.speculative.draft import Draft


def visible(meta, t: int) -> list[int]:
    """The cache positions token t attends to."""
    s, c = int(meta.estart[t]), int(meta.ecount[t])
    return list(range(int(meta.prefix[t]))) + [int(x) for x in meta.extra[s:s + c]]


def test_fast_rows_build_what_the_general_path_builds(ckpt_dir):
    args = read_args(ckpt_dir("qwen2"))
    kv = KVCache(args, torch.float32, "cpu", 4096, 4, 512)
    plain = Request("a", [5, 6, 7], SamplingParams(temperature=0.7, top_k=3, top_p=0.9), seed_key=11)
    plain.output_token_ids = [8, 9]
    chained = Request("b", [1, 2], SamplingParams(), seed_key=12)
    chained.output_token_ids = [3]
    prefill = Request("c", [4, 4, 4, 4, 4], SamplingParams(), seed_key=13)
    for row, (req, computed) in enumerate(((plain, 4), (chained, 2), (prefill, 0))):
        req.row, req.num_computed_tokens = row, computed
        kv.grow(row, req.num_tokens + 4)
    rows = [(plain, 1), (chained, 1), (prefill, 3)]
    nodes = [21, 22, 23]
    as_chain = Draft.unchecked(nodes, [-1, 0, 1], [1.0] * 3, "t", chain=True)
    as_tree = Draft.unchecked(nodes, [-1, 0, 1], [1.0] * 3, "t", chain=False)   # the general path
    fast, general = (build_batch(rows, {"b": d}, kv) for d in (as_chain, as_tree))
    for f in ("input_ids", "positions", "sample_index"):
        assert torch.equal(getattr(fast, f), getattr(general, f)), f
    assert torch.equal(fast.meta.write_slot, general.meta.write_slot)
    assert torch.equal(fast.meta.q_row, general.meta.q_row)
    assert (fast.meta.kv_len, fast.meta.reads, fast.meta.work) == (general.meta.kv_len, general.meta.reads,
                                                                   general.meta.work)
    n = len(fast.input_ids)
    assert [visible(fast.meta, t) for t in range(n)] == [visible(general.meta, t) for t in range(n)]
    assert (fast.temperature, fast.top_k, fast.top_p) == (general.temperature, general.top_k, general.top_p)
    assert np.array_equal(fast.u, general.u) and fast.num_draft_tokens == general.num_draft_tokens == 3
    assert [(p.req, p.n, p.parents, p.draft_tokens, p.entry) for p in fast.plans] == \
        [(p.req, p.n, p.parents, p.draft_tokens, p.entry) for p in general.plans]
    assert fast.spans == general.spans == [(prefill, 0, 5, 3)]
    # the plain row, by hand: its last token at position 4, seeing [0, 5), its noise at output position 2
    assert fast.input_ids[0] == 9 and fast.positions[0] == 4 and visible(fast.meta, 0) == list(range(5))
    assert fast.sample_index.tolist() == [0, 1, 2, 3, 4] and fast.plans[0].entry == 0 and fast.plans[1].entry == 1
    assert fast.u[0] == uniforms([11], [2])[0] and fast.u[1:].tolist() == uniforms([12] * 4, [1, 2, 3, 4]).tolist()
    assert (fast.temperature[0], fast.top_k[0], fast.top_p[0]) == (0.7, 3, 0.9)


def test_commit_of_a_chain_equals_the_general_rule():
    """commit's fast path for chains (the run of nodes equal to the targets) against the
    general rule (accept_draft over the same nodes marked as a tree): the same tokens,
    accepted count, finish status, sampled rows and request state, through acceptance runs of
    every length, a stop token inside the run and max_tokens inside the run."""
    import random

    from tailrl.engine.batch import RowPlan
    from tailrl.engine.verify import commit
    rng = random.Random(0)
    for case in range(300):
        d = rng.randint(1, 6)
        nodes = [rng.randint(1, 4) for _ in range(d)]
        targets = [nodes[j] if j < d and rng.random() < 0.7 else rng.randint(1, 4) for j in range(d + 1)]
        stop = [3] if case % 3 == 0 else None
        max_tokens = rng.randint(1, 8) if case % 5 == 0 else 100
        got = []
        for chain in (True, False):
            req = Request("r", [1, 2], SamplingParams(max_tokens=max_tokens, stop_token_ids=stop), seed_key=1)
            req.output_token_ids, req.num_computed_tokens = [9], 3
            draft = Draft.unchecked(nodes, list(range(-1, d - 1)), [1.0] * d, "t", chain=chain)
            plan = RowPlan(req, 1, list(draft.parents), list(nodes), 2, draft)
            tokens = [0, 0] + targets + [0]
            out = commit(plan, tokens, [float(t) for t in tokens], None, (0,))
            got.append((out, plan.last, plan.rows, req.output_token_ids, req.output_logprobs, req.num_computed_tokens))
        assert got[0] == got[1], (nodes, targets, stop, max_tokens)


def test_a_steps_inputs_start_16_bytes_apart_whatever_their_sizes():
    """One buffer, one copy, every tensor 16-byte aligned within it (Triton compiles a kernel
    per pattern of its pointers' alignment: a step's sizes must not make new patterns), the
    values unchanged, empty ones included."""
    from tailrl.engine.batch import to_device
    rng = np.random.default_rng(0)
    for sizes in ([1, 3, 0, 5], [2, 2, 7, 1], [0, 0, 0, 0], [5, 1, 9, 13]):
        longs = [rng.integers(-2**40, 2**40, n) for n in sizes[:2]]
        ints = [rng.integers(-2**30, 2**30, n, dtype=np.int32) for n in sizes[2:]] + [np.arange(6).reshape(2, 3)]
        lo, it = to_device(longs, ints, "cpu")
        base = lo[0].data_ptr()
        for t, want in zip(lo + it, longs + ints):
            assert (t.data_ptr() - base) % 16 == 0
            assert t.tolist() == np.asarray(want).ravel().tolist()
        assert [t.dtype for t in lo] == [torch.int64] * 2 and [t.dtype for t in it] == [torch.int32] * 3


@pytest.mark.parametrize("one_kind", [False, True], ids=["sampling_varies", "one_sampling"])
@pytest.mark.parametrize("chains", [False, True], ids=["plain", "chains"])
@pytest.mark.parametrize("idle", [False, True], ids=["all", "some_idle"])
def test_a_step_of_decode_rows_only_builds_what_the_general_path_builds(ckpt_dir, monkeypatch, idle, chains, one_kind):
    """``_decode_batch`` (every row a plain decode row or one with nothing to compute) and
    ``_chain_batch`` (decode rows verifying chains too), more than ``FEW_TOKENS`` rows: the
    same batch as the general path, rows whose token a step in flight samples (placeholders), rows whose first token
    comes from the prompt, rows waiting or sitting out a step included; a step with a prefill
    chunk or a tree takes the general path."""
    from tailrl.engine import batch as batch_mod
    from tailrl.engine.ahead import PENDING
    args = read_args(ckpt_dir("qwen2"))
    kv = KVCache(args, torch.float32, "cpu", 8192, 24, 512)
    rows = []
    for r in range(20):
        params = SamplingParams(temperature=1.0) if one_kind else \
            SamplingParams(temperature=0.5 + r / 10, top_k=r % 4 or -1, top_p=1.0 - r / 100)
        req = Request(f"r{r}", [1 + r] * (3 + r % 5), params, seed_key=100 + r + (1 << 63) * (r % 2))
        req.output_token_ids = [7 + r] * (r % 6) + ([PENDING] if r % 3 == 0 else [])
        req.row, req.num_computed_tokens = r, req.num_tokens - 1
        kv.grow(r, req.num_tokens + 8)
        rows.append((req, 0 if idle and r in (4, 11) else 1))      # 4, 11: waiting or sitting out
    drafts = {f"r{r}": Draft.unchecked(list(range(30, 30 + k)), list(range(-1, k - 1)), [1.0] * k, "t", chain=True)
              for r, k in ((1, 3), (2, 1), (6, 7), (11, 2), (19, 16))} if chains else {}
    one_pass = (lambda rs, ds: batch_mod._chain_batch(rs, ds, kv, None)) if chains else \
        (lambda rs, ds: batch_mod._decode_batch(rs, kv, None))
    assert one_pass(rows, drafts) is not None                     # the step takes the one-pass form
    fast = build_batch(rows, drafts, kv)
    monkeypatch.setattr(batch_mod, "FEW_TOKENS", 1 << 30)         # the general path
    general = build_batch(rows, drafts, kv)
    n = len(general.input_ids)
    for f in ("input_ids", "positions", "sample_index"):
        assert torch.equal(getattr(fast, f), getattr(general, f)), f
    for f in ("write_slot", "q_row", "prefix", "estart", "ecount", "block_table"):
        assert torch.equal(getattr(fast.meta, f), getattr(general.meta, f)), f
    assert [visible(fast.meta, t) for t in range(n)] == [visible(general.meta, t) for t in range(n)]
    assert (fast.meta.kv_len, fast.meta.reads, fast.meta.work, fast.meta.multi) == \
        (general.meta.kv_len, general.meta.reads, general.meta.work, general.meta.multi)
    assert (fast.temperature, fast.top_k, fast.top_p) == (general.temperature, general.top_k, general.top_p)
    drafted = (27 if idle else 29) if chains else 0         # r11 waits or sits out where rows idle
    assert np.array_equal(fast.u, general.u) and fast.num_draft_tokens == general.num_draft_tokens == drafted
    assert n == (18 if idle else 20) + drafted
    assert [(p.req, p.n, p.parents, p.draft_tokens, p.entry, p.draft) for p in fast.plans] == \
        [(p.req, p.n, p.parents, p.draft_tokens, p.entry, p.draft) for p in general.plans]
    assert len(fast.plans) == 18 if idle else 20
    assert fast.ahead == general.ahead and len(fast.ahead) == 7 and fast.spans == general.spans == []
    prefill = rows[:5] + [(rows[5][0], 2)] + rows[6:]
    rows[5][0].num_computed_tokens -= 1
    assert one_pass(prefill, drafts) is None
    assert one_pass([(r, 0) for r, _ in rows], drafts) is None     # nothing to compute
    rows[5][0].num_computed_tokens += 1
    tree = {"r3": Draft.unchecked([30, 31], [-1, -1], [0.5, 0.5], "t", chain=False)}
    assert batch_mod._chain_batch(rows, tree, kv, None) is None
