"""The learned drafter's chains on the engine's kernels (tailrl/drafter/paged.py) over its K/V
blocks (tailrl/drafter/blocks.py): a depth equals ``Drafter.step`` over the same past padded
(float64 to 1e-10, float32 to 1e-4) for pasts crossing blocks, rows with no past and rows
whose root is held; the Triton kernels (under the interpreter on a CPU) give the CPU backend's
chains; the blocks keep their ids and contents through growth, and never hand out the
scratch block."""
import pytest
import torch

from tailrl.drafter.blocks import KVBlocks
from tailrl.drafter.network import Drafter
from tailrl.drafter.paged import ChainLayout, kernels_for, paged_step, rope_tables
from tailrl.kernels import BLOCK
from tailrl.model.loader import load_model


def drafter(model, dtype: torch.dtype) -> Drafter:
    torch.manual_seed(0)
    d = Drafter.for_target(load_model(model, "float32"), intermediate_size=64)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return d.to(dtype).eval()


def chains(d: Drafter, seen: list[int], held: list[bool], depths: int, seed: int = 0):
    """Both ways, the same inputs: per depth (next feature, logits) from ``paged_step`` over
    blocks and from ``Drafter.step`` over the padded past plus the path so far. Row b sees
    ``seen[b]`` committed positions; ``held[b]``: its root's own K/V is held too (index seen)."""
    g = torch.Generator().manual_seed(seed)
    c, dt = d.cfg, d.fc.weight.dtype
    blocks = KVBlocks(c.num_heads, c.head_dim, dt, torch.device("cpu"), blocks=2)   # grows on the way
    lists, ks, vs = [], [], []
    for n, h in zip(seen, held):
        k, v = (torch.randn(n + h, c.num_heads, c.head_dim, generator=g).to(dt) for _ in range(2))
        ids: list[int] = []
        blocks.write(ids, 0, k, v)
        blocks.reserve(ids, n + depths)
        lists.append(ids)
        ks.append(k[:n])
        vs.append(v[:n])
    b, width = len(seen), max(max(seen), 1)
    roots = [n + 5 for n in seen]
    layout = ChainLayout.build(blocks, lists, seen, roots, depths)
    past = (torch.zeros(b, c.num_heads, c.head_dim, width, dtype=dt), torch.zeros(b, c.num_heads, width, c.head_dim,
            dtype=dt), torch.full((b, width), float("-inf"), dtype=dt))
    for i, n in enumerate(seen):
        past[0][i, :, :, :n] = ks[i].permute(1, 2, 0)
        past[1][i, :, :n] = vs[i].transpose(0, 1)
        past[2][i, :n] = 0.0
    feats = torch.randn(b, c.hidden_size, generator=g).to(dt)
    toks = torch.randint(0, c.vocab_size, (b,), generator=g)
    kernels, tables = kernels_for(d), rope_tables(d, max(roots) + depths, dt)
    got, want, path = [], [], None
    f1, t1, f2, t2 = feats, toks, feats, toks
    with torch.inference_mode():
        for t in range(depths):
            out, logits = paged_step(d, kernels, f1, t1, kernels.rope(tables, layout.positions[t]), blocks,
                                     layout.meta(t))
            got.append((out, logits))
            ref, ref_logits, k, v = d.step(f2, t2, layout.positions[t], past, None, path)
            want.append((ref, ref_logits))
            path = (k.unsqueeze(2), v.unsqueeze(2)) if path is None else \
                (torch.cat([path[0], k.unsqueeze(2)], 2), torch.cat([path[1], v.unsqueeze(2)], 2))
            nxt = torch.randint(0, c.vocab_size, (b,), generator=g)         # teacher-forced tokens: both ways alike
            f1, t1, f2, t2 = out, nxt, ref, nxt
    return got, want, blocks


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4)])
def test_a_depth_on_the_kernels_equals_the_padded_step(model, dtype, tol):
    d = drafter(model, dtype)
    seen = [0, 1, BLOCK - 1, BLOCK, 2 * BLOCK + 7, 70]         # none, across block edges, longer
    held = [False, True, False, True, True, False]             # root's K/V held: overwritten by depth 0
    got, want, blocks = chains(d, seen, held, depths=4)
    assert blocks.num_blocks > 2                               # grew during the writes
    for (out, logits), (ref, ref_logits) in zip(got, want):
        assert torch.allclose(out, ref, atol=tol, rtol=tol) and torch.allclose(logits, ref_logits, atol=tol, rtol=tol)


def test_tree_nodes_on_the_kernels_equal_the_padded_step_over_their_paths(model):
    """Float64, two requests (5 and 40 committed positions): the root steps, then three nodes
    (two children of request 0's root step, one of request 1's), then two grandchildren of
    request 0 in the other order than their parents; each node sees the committed positions,
    the root step and its own path only (``TreeLayout``), as ``Drafter.step`` over the padded
    past with the path's K/V."""
    from tailrl.drafter.paged import TreeLayout
    d = drafter(model, torch.float64)
    c, dt = d.cfg, torch.float64
    g = torch.Generator().manual_seed(1)
    blocks = KVBlocks(c.num_heads, c.head_dim, dt, torch.device("cpu"))
    seen, roots, lists = [5, 40], [9, 44], []
    past = (torch.zeros(2, c.num_heads, c.head_dim, 40, dtype=dt),
            torch.zeros(2, c.num_heads, 40, c.head_dim, dtype=dt), torch.full((2, 40), float("-inf"), dtype=dt))
    for i, n in enumerate(seen):
        k, v = (torch.randn(n, c.num_heads, c.head_dim, generator=g, dtype=dt) for _ in range(2))
        ids: list[int] = []
        blocks.write(ids, 0, k, v)
        blocks.reserve(ids, n + 1 + 6)
        lists.append(ids)
        past[0][i, :, :, :n], past[1][i, :, :n], past[2][i, :n] = k.permute(1, 2, 0), v.transpose(0, 1), 0.0
    layout = TreeLayout(blocks, lists, seen, roots)
    kernels, tables = kernels_for(d), rope_tables(d, 60, dt)
    # (frontier: (request, node path), the previous depth's row each continues from)
    depths = [([(0, []), (1, [])], [0, 1]), ([(0, [0]), (0, [1]), (1, [0])], [0, 0, 1]),
              ([(0, [1, 2]), (0, [0, 3])], [1, 0])]
    feats = torch.randn(2, c.hidden_size, generator=g, dtype=dt)
    ref_feats, path, ref_pos = feats, None, torch.tensor(roots)
    with torch.inference_mode():
        for frontier, rows in depths:
            idx = torch.tensor(rows)
            toks = torch.randint(0, c.vocab_size, (len(rows),), generator=g)
            if frontier[0][1]:                                     # below the root steps: the parents' rows
                feats, ref_feats, ref_pos = feats[idx], ref_feats[idx], ref_pos[idx] + 1
                new = (k[idx].unsqueeze(2), v[idx].unsqueeze(2))
                path = new if path is None else tuple(torch.cat([old[idx], x], 2) for old, x in zip(path, new))
            meta, pos = layout.meta(frontier)
            assert pos.tolist() == ref_pos.tolist()
            feats, logits = paged_step(d, kernels, feats, toks, kernels.rope(tables, pos), blocks, meta)
            owner = torch.tensor([b for b, _ in frontier])
            ref_feats, ref_logits, k, v = d.step(ref_feats, toks, ref_pos, past, owner, path)
            assert torch.allclose(feats, ref_feats, atol=1e-10) and torch.allclose(logits, ref_logits, atol=1e-10)


def test_the_triton_kernels_draft_what_the_cpu_kernels_draft(monkeypatch, model):
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("runs the Triton kernels on CPU tensors under the interpreter")
    d = drafter(model, torch.float32)
    seen, held = [3, BLOCK + 2, 0], [True, False, False]
    cpu, _, _ = chains(d, seen, held, depths=3)
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    assert kernels_for(d).name == "triton"
    tri, _, _ = chains(d, seen, held, depths=3)
    for (a, la), (b, lb) in zip(cpu, tri):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4) and torch.allclose(la, lb, atol=1e-4, rtol=1e-4)


def test_blocks_keep_ids_and_contents_through_growth_and_never_hand_out_the_scratch_block():
    blocks = KVBlocks(2, 8, torch.float32, torch.device("cpu"), blocks=2)
    g = torch.Generator().manual_seed(0)
    data, lists = [], []
    for n in (5, BLOCK + 3, 3 * BLOCK):                        # 1 + 2 + 3 blocks: the pool grows twice
        k, v = torch.randn(n, 2, 8, generator=g), torch.randn(n, 2, 8, generator=g)
        ids: list[int] = []
        blocks.write(ids, 0, k, v)
        data.append((k, v))
        lists.append(ids)
    assert blocks.used == 6 and KVBlocks.SCRATCH not in sum(lists, [])
    for ids, (k, v) in zip(lists, data):
        rk, rv = blocks.read(ids, k.shape[0])
        assert torch.equal(rk, k.permute(1, 2, 0)) and torch.equal(rv, v.transpose(0, 1))
    blocks.release(lists[1])
    assert blocks.used == 4 and lists[1] == []
    ids = []
    blocks.reserve(ids, 2 * BLOCK)                             # the released blocks come back
    assert len(ids) == 2 and KVBlocks.SCRATCH not in ids and blocks.used == 6


def test_trees_on_the_triton_kernels_draft_what_the_cpu_kernels_draft(monkeypatch, model):
    """Trees of 3 paths through ``DrafterSource`` (tree visibility through the kernels' extras),
    float32: the Triton kernels under the interpreter give the CPU backend's drafts."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("runs the Triton kernels on CPU tensors under the interpreter")
    from tailrl import SamplingParams
    from tailrl.engine.request import Request
    from tailrl.speculative.sources.drafter_source import DrafterSource
    d = drafter(model, torch.float32)
    drafts = []
    for kernels in ("native", "triton"):
        if kernels == "triton":
            monkeypatch.setenv("TAILRL_KERNELS", "triton")
        src = DrafterSource(d)
        g = torch.Generator().manual_seed(0)
        reqs = []
        for i, n in enumerate([3, 40, 9]):
            r = Request(f"r{i}", [(5 * i + j) % 80 + 3 for j in range(n + 1)], SamplingParams(), 0)
            r.output_token_ids.append(7 + i)
            src.observe_hidden(torch.randn(n + 1, d.cfg.hidden_size, generator=g), [(r, 0, 0, n + 1)])
            r.keep_hidden(torch.randn(d.cfg.hidden_size, generator=g))
            reqs.append(r)
        drafts.append([(x.tokens, x.parents, x.probs) for x in src.grow(reqs, 6, 3)])
    for (t0, p0, q0), (t1, p1, q1) in zip(*drafts):
        assert t0 == t1 and p0 == p1 and q0 == pytest.approx(q1, abs=1e-4) and len(set(p0)) > 1   # branching
