"""The drafter's chain depths from graphs (tailrl/drafter/graphs.py): a depth replayed from a
key's static inputs gives the launched depth's results for the real rows, whatever the padding
(rows, block-table columns, stale rows of earlier calls), and its padding rows write nothing
into a request's blocks; a whole rollout drafting through graphs is identical to plain
decoding; keys over the static budget or refused by the pool run eagerly. On the CPU the
capture is ``eager_capture`` (replay = the same function over the same static buffers); with
CUDA the same tests run with ``cuda_capture``."""
import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.drafter.blocks import KVBlocks
from tailrl.drafter.graphs import DrafterGraphs
from tailrl.drafter.network import Drafter
from tailrl.drafter.paged import ChainLayout, kernels_for, paged_step, rope_tables
from tailrl.engine.graph_pool import GraphPool, cuda_capture, eager_capture
from tailrl.model.loader import load_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]
PARAMS = [SamplingParams(n=3, max_tokens=40, seed=1), SamplingParams(n=2, temperature=0, max_tokens=30),
          SamplingParams(n=2, top_p=0.8, max_tokens=40, ignore_eos=True), SamplingParams(n=2, max_tokens=24)]


def pool_for(device: str, budget: int = 1 << 30) -> GraphPool:
    return GraphPool(budget, cuda_capture if device == "cuda" else eager_capture)


def call(d: Drafter, blocks: KVBlocks, b: int, seed: int, depths: int = 2):
    """A call's chains over random committed pasts (1 .. 70 positions) in ``blocks``: its
    layout and the first depth's inputs."""
    g = torch.Generator().manual_seed(seed)
    c, dev = d.cfg, d.fc.weight.device
    lists, seen = [], torch.randint(1, 70, (b,), generator=g).tolist()
    for n in seen:
        ids: list[int] = []
        blocks.write(ids, 0, torch.randn(n, c.num_heads, c.head_dim, generator=g).to(dev),
                     torch.randn(n, c.num_heads, c.head_dim, generator=g).to(dev))
        blocks.reserve(ids, n + depths)
        lists.append(ids)
    roots = [n + int(x) for n, x in zip(seen, torch.randint(0, 50, (b,), generator=g))]
    layout = ChainLayout.build(blocks, lists, seen, roots, depths)
    feats = torch.randn(b, c.hidden_size, generator=g).to(dev)
    toks = torch.randint(0, c.vocab_size, (b,), generator=g).to(dev)
    return layout, feats, toks


@pytest.mark.parametrize("draft_vocab", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_a_replayed_depth_equals_the_launched_depth_for_the_real_rows(model, device, draft_vocab):
    target = load_model(model, "float32", device)
    vocab = torch.arange(3, target.args.vocab_size, 7) if draft_vocab else None    # tokens the graph maps to
    d = Drafter.for_target(target, intermediate_size=64, vocab=vocab)
    c, dev = d.cfg, d.fc.weight.device
    graphs, kernels, tables = DrafterGraphs(pool_for(device)), kernels_for(d), rope_tables(d, 300, torch.float32)
    blocks = KVBlocks(c.num_heads, c.head_dim, torch.float32, dev)
    # two calls per key (7 then 5 rows: bucket 8; then 3, then 1 row): the second replays over the
    # first's stale rows and table columns
    for b, seed in [(7, 0), (5, 1), (3, 2), (1, 3)]:
        layout, feats, toks = call(d, blocks, b, seed)
        for t in range(2):
            before_k, before_v = blocks.k.clone(), blocks.v.clone()
            with torch.inference_mode():
                got = graphs.depth(d, kernels, tables, blocks, layout, t, feats, toks)
                assert got is not None and all(x.shape[0] == b for x in got)
                got = tuple(x.clone() for x in got)
                after_k, after_v = blocks.k.clone(), blocks.v.clone()
                blocks.k.copy_(before_k)
                blocks.v.copy_(before_v)
                out, logits = paged_step(d, kernels, feats, toks, kernels.rope(tables, layout.positions[t]), blocks,
                                         layout.meta(t))
            q, top = torch.softmax(logits.float(), -1).max(-1)
            assert vocab is None or set(got[2].tolist()) <= set(vocab.tolist())
            for x, y in zip(got, (out, q, d.token_ids(top))):
                assert torch.allclose(x.float(), y.float(), atol=1e-5, rtol=1e-4)
            # the same writes into every block but the scratch one (the padding rows')
            real = torch.arange(blocks.num_blocks, device=dev) != KVBlocks.SCRATCH
            for after, now in ((after_k, blocks.k), (after_v, blocks.v)):
                assert torch.allclose(after[real], now[real], atol=1e-5)
            feats, toks = out, d.token_ids(top)
    # a call's second depth replays its first's graph
    assert graphs.replays == 8 and graphs.pool.hits >= 4 and graphs.pool.captures + graphs.pool.hits == 8


@pytest.mark.parametrize("device", DEVICES)
def test_a_whole_chain_from_one_graph_equals_its_depths_launched(model, device):
    """``DrafterGraphs.chain``: every depth of a call in one replay (3 depths padded to 4, rows
    to a power of two) gives each depth's launched top probability and token for the real rows,
    writes what the launched depths write into every block but the scratch one, and a call
    again replays its key's graph."""
    d = Drafter.for_target(load_model(model, "float32", device), intermediate_size=64)
    c, dev = d.cfg, d.fc.weight.device
    graphs, kernels, tables = DrafterGraphs(pool_for(device)), kernels_for(d), rope_tables(d, 300, torch.float32)
    blocks = KVBlocks(c.num_heads, c.head_dim, torch.float32, dev)
    for b, seed in [(7, 0), (5, 1), (2, 2)]:
        layout, feats, toks = call(d, blocks, b, seed, depths=3)
        first = feats, toks
        before_k, before_v = blocks.k.clone(), blocks.v.clone()
        with torch.inference_mode():
            got = graphs.chain(d, kernels, tables, blocks, layout, feats, toks)
            assert got is not None and got[0].shape == got[1].shape == (b, 3)
            got = tuple(x.clone() for x in got)
            after_k, after_v = blocks.k.clone(), blocks.v.clone()
            blocks.k.copy_(before_k)
            blocks.v.copy_(before_v)
            qs, ts = [], []
            for t in range(3):
                feats, logits = paged_step(d, kernels, feats, toks, kernels.rope(tables, layout.positions[t]), blocks,
                                           layout.meta(t))
                q, top = torch.softmax(logits.float(), -1).max(-1)
                toks = d.token_ids(top)
                qs.append(q)
                ts.append(toks)
        assert torch.allclose(got[0], torch.stack(qs, 1), atol=1e-5, rtol=1e-4)
        assert torch.equal(got[1], torch.stack(ts, 1))
        real = torch.arange(blocks.num_blocks, device=dev) != KVBlocks.SCRATCH
        for after, now in ((after_k, blocks.k), (after_v, blocks.v)):
            assert torch.allclose(after[real], now[real], atol=1e-5)
    with torch.inference_mode():                            # the last call again: its key's graph replayed
        again = graphs.chain(d, kernels, tables, blocks, layout, *first)
    assert all(torch.equal(x, y) for x, y in zip(again, got)) and graphs.chains == 4 and graphs.pool.hits == 1


def test_keys_over_the_static_budget_or_refused_run_eagerly(model):
    d = Drafter.for_target(load_model(model, "float32"), intermediate_size=64)
    c = d.cfg
    blocks = KVBlocks(c.num_heads, c.head_dim, torch.float32, torch.device("cpu"))
    kernels, tables = kernels_for(d), rope_tables(d, 300, torch.float32)
    layout, feats, toks = call(d, blocks, 4, 0)
    with torch.inference_mode():
        small = DrafterGraphs(pool_for("cpu"), max_static_bytes=1024)
        assert small.depth(d, kernels, tables, blocks, layout, 0, feats, toks) is None and small.eager == 1
        tiny = DrafterGraphs(pool_for("cpu", budget=1024))          # the graph's inputs exceed the pool's budget
        assert tiny.depth(d, kernels, tables, blocks, layout, 0, feats, toks) is None and tiny.pool.refused
        assert tiny.depth(d, kernels, tables, blocks, layout, 0, feats, toks) is None and tiny.eager == 2
        assert small.chain(d, kernels, tables, blocks, layout, feats, toks) is None and small.eager == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("whole", [False, True], ids=["depths", "whole-chains"])
def test_rollouts_drafting_through_graphs_are_identical_to_plain(model, drafter_dir, device, dtype, whole):
    plain = LLM(model, dtype=dtype, device=device, kv_cache_gib=0.25)
    spec = LLM(model, dtype=dtype, device=device, kv_cache_gib=0.25, speculative=SpeculativeConfig(
        policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0))
    src = next(s for s in spec.engine.speculator.sources if s.name == "drafter")
    if device == "cpu":
        src.use_graphs(pool_for("cpu"))
    src.whole_chains = whole
    spec.engine.speculator.choice.always = True
    for _ in range(2):          # unseeded samples draw new seeds per call: plain's call in step
        want = [(list(c.token_ids), c.finish_reason) for o in plain.generate(PROMPTS, PARAMS) for c in o.outputs]
        got = [(list(c.token_ids), c.finish_reason) for o in spec.generate(PROMPTS, PARAMS) for c in o.outputs]
        assert got == want
    assert (src.graphs.chains if whole else src.graphs.replays) > 0 and src.graphs.pool.hits > 0
    assert spec.last_metrics["rollout/spec_draft_tokens/drafter"] > 0


def static_capture(fn):
    """As a CUDA graph on the CPU: a replay writes into the same output tensors each time."""
    out = fn()

    def replay():
        for o, n in zip(out, fn()):
            o.copy_(n)
        return out
    return replay, 0


@pytest.mark.parametrize("whole", [False, True], ids=["depths", "whole-chains"])
@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_chains_through_graphs_draft_what_launched_depths_draft(monkeypatch, model, drafter_dir, kernels, whole):
    """Every depth of a call replays the same graph (same rows and table width), whose outputs
    the next depth overwrites: the draft keeps each depth's tokens and probabilities; or
    (``whole``) the call's 6 depths replay one graph of 8. Also with the Triton kernels (under
    the interpreter on a CPU): a GPU engine's drafting path, padding rows (and depths) in the
    scratch block included."""
    from tailrl.engine.request import Request
    from tailrl.speculative.sources.drafter_source import DrafterSource
    if kernels == "triton":
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("the Triton kernels on CPU tensors, under the interpreter")
        monkeypatch.setenv("TAILRL_KERNELS", "triton")
    target = load_model(model)
    drafts = []
    for graphs in (False, True):
        src = DrafterSource(Drafter.load(drafter_dir, target))
        if graphs:
            src.use_graphs(GraphPool(1 << 30, static_capture))
        src.whole_chains = whole
        gen = torch.Generator().manual_seed(0)
        reqs = []
        for i, p in enumerate(PROMPTS):
            r = Request(f"r{i}", p, SamplingParams(), 0)
            r.output_token_ids.append(5 + i)
            src.observe_hidden(torch.randn(len(p), target.args.hidden_size, generator=gen), [(r, 0, 0, len(p))])
            r.keep_hidden(torch.randn(target.args.hidden_size, generator=gen))
            reqs.append(r)
        drafts.append([(d.tokens, d.probs) for d in src.grow(reqs, 6, 1)])
        assert not graphs or (src.graphs.chains, src.graphs.replays) == ((1, 0) if whole else (0, 6))
    for (t0, p0), (t1, p1) in zip(*drafts):
        assert t0 == t1 and p0 == pytest.approx(p1, abs=1e-5)
    assert all(len(set(p)) > 1 for _, p in drafts[0])       # depths differ: a lost depth would show


def test_a_call_that_captured_is_not_timed(model, drafter_dir):
    """Step times are learned from calls without a capture (a capture costs far more than the
    step it serves)."""
    from tailrl.engine.request import Request
    from tailrl.speculative.sources.drafter_source import DrafterSource
    target = load_model(model)
    src = DrafterSource(Drafter.load(drafter_dir, target))
    src.use_graphs(pool_for("cpu"))
    reqs = [Request(f"r{i}", p, SamplingParams(), 0) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        r.keep_hidden(torch.randn(target.args.hidden_size))
    src.grow(reqs, 4, 1)
    assert src.graphs.pool.captures > 0 and src.step_time.step_seconds(len(reqs)) is None
    captures = src.graphs.pool.captures
    src.grow(reqs, 4, 1)                                   # the same shapes: replayed, timed
    assert src.graphs.pool.captures == captures and src.step_time.step_seconds(len(reqs)) is not None


def test_drafter_calls_that_captured_price_nothing(model, drafter_dir):
    """A drafter call during which a graph was captured (or the engine's first call: kernels
    built) teaches neither the call prices nor the policy's drafting time nor the step curve:
    measured on a GPU, a first call took 0.34 s, and priced as drafting time it switched
    drafting off for good. Here every call "captures" (a counter that moves on each read):
    no call is priced, and outputs stay plain's."""
    spec = LLM(model, speculative=SpeculativeConfig(method="drafter", drafter=drafter_dir, min_token_prob=0.0))
    sp = spec.engine.speculator
    reads = iter(range(10**9))
    sp.captures = lambda: next(reads)
    plain = LLM(model)
    want = [[list(c.token_ids) for c in o.outputs] for o in plain.generate(PROMPTS, PARAMS)]
    got = [[list(c.token_ids) for c in o.outputs] for o in spec.generate(PROMPTS, PARAMS)]
    assert got == want
    assert sp.counts.calls > 0 and sp.choice._calls == 0
    rows = sum(p.n for p in PARAMS)                        # at most this many requests per call
    assert sp.policy.draft_seconds < 0.1 * sp.counts.call_s / sp.counts.calls / rows
    steady = LLM(model, speculative=SpeculativeConfig(method="drafter", drafter=drafter_dir, min_token_prob=0.0))
    steady.generate(PROMPTS, PARAMS)
    assert steady.engine.speculator.choice._calls > 0          # (before this was fixed: 0; the first
                                                               # call's time switched drafting off)
