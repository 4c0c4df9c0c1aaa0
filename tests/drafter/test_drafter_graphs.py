"""The drafter's chain depths from graphs (tailrl/drafter/graphs.py): a depth replayed from a
key's static inputs gives the eager step's results for the real rows, whatever the padding
(rows, past columns, stale rows of earlier calls); a whole rollout drafting through graphs
is identical to plain decoding; keys over the static budget or refused by the pool run
eagerly. On the CPU the capture is ``eager_capture`` (replay = the same function over the
same static buffers); with CUDA the same tests run with ``cuda_capture``."""
import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.drafter.graphs import DrafterGraphs
from tailrl.drafter.network import Drafter
from tailrl.engine.graph_pool import GraphPool, cuda_capture, eager_capture
from tailrl.model.loader import load_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]
PARAMS = [SamplingParams(n=3, max_tokens=40, seed=1), SamplingParams(n=2, temperature=0, max_tokens=30),
          SamplingParams(n=2, top_p=0.8, max_tokens=40, ignore_eos=True), SamplingParams(n=2, max_tokens=24)]


def pool_for(device: str, budget: int = 1 << 30) -> GraphPool:
    return GraphPool(budget, cuda_capture if device == "cuda" else eager_capture)


def inputs(d: Drafter, b: int, width: int, depth: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    c, dev = d.cfg, d.fc.weight.device
    r = lambda *shape: torch.randn(*shape, generator=g).to(dev)   # noqa: E731
    seen = torch.randint(1, width + 1, (b,), generator=g)
    bias = torch.where(torch.arange(width)[None] < seen[:, None], 0.0, float("-inf")).to(dev)
    past = (r(b, c.num_heads, c.head_dim, width), r(b, c.num_heads, width, c.head_dim), bias)
    path = (r(b, c.num_heads, depth, c.head_dim), r(b, c.num_heads, depth, c.head_dim)) if depth else None
    toks = torch.randint(0, c.vocab_size, (b,), generator=g).to(dev)
    pos = torch.randint(width + depth, 300, (b,), generator=g).to(dev)
    return r(b, c.hidden_size), toks, pos, past, path


@pytest.mark.parametrize("draft_vocab", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_a_replayed_depth_equals_the_eager_step_for_the_real_rows(model, device, draft_vocab):
    target = load_model(model, "float32", device)
    vocab = torch.arange(3, target.args.vocab_size, 7) if draft_vocab else None    # tokens the graph maps to
    d = Drafter.for_target(target, intermediate_size=64, vocab=vocab)
    graphs = DrafterGraphs(pool_for(device))
    # two calls per key (7 then 5 rows: bucket 8; widths 37 then 40: bucket 64): the second
    # replays over the first's stale rows and columns
    for b, width, depth, seed in [(7, 37, 2, 0), (5, 40, 2, 1), (3, 9, 0, 2), (1, 64, 1, 3)]:
        feats, toks, pos, past, path = inputs(d, b, width, depth, seed)
        with torch.inference_mode():
            got = graphs.depth(d, feats, toks, pos, past, path, 300)
            out, logits, k, v = d.step(feats, toks, pos, past, None, path, 300)
        q, t = torch.softmax(logits.float(), -1).max(-1)
        t = d.token_ids(t)                               # the target's ids
        assert got is not None and all(x.shape[0] == b for x in got)
        assert vocab is None or set(got[2].tolist()) <= set(vocab.tolist())
        for x, y in zip(got, (out, q, t, k, v)):
            assert torch.allclose(x.float(), y.float(), atol=1e-5, rtol=1e-4)
    assert graphs.replays == 4 and graphs.pool.captures == 3 and graphs.pool.hits == 1


def test_keys_over_the_static_budget_or_refused_run_eagerly(model):
    d = Drafter.for_target(load_model(model, "float32"), intermediate_size=64)
    small = DrafterGraphs(pool_for("cpu"), max_static_bytes=1024)
    with torch.inference_mode():
        assert small.depth(d, *inputs(d, 4, 16, 1, 0), 300) is None and small.eager == 1
        tiny = DrafterGraphs(pool_for("cpu", budget=1024))          # the graph's inputs exceed the pool's budget
        assert tiny.depth(d, *inputs(d, 4, 16, 1, 0), 300) is None and tiny.pool.refused
        assert tiny.depth(d, *inputs(d, 4, 16, 1, 0), 300) is None and tiny.eager == 2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rollouts_drafting_through_graphs_are_identical_to_plain(model, drafter_dir, device, dtype):
    plain = LLM(model, dtype=dtype, device=device, kv_cache_gib=0.25)
    spec = LLM(model, dtype=dtype, device=device, kv_cache_gib=0.25, speculative=SpeculativeConfig(
        policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0))
    src = next(s for s in spec.engine.speculator.sources if s.name == "drafter")
    if device == "cpu":
        src.use_graphs(pool_for("cpu"))
    spec.engine.speculator.choice.always = True
    for _ in range(2):          # unseeded samples draw new seeds per call: plain's call in step
        want = [(list(c.token_ids), c.finish_reason) for o in plain.generate(PROMPTS, PARAMS) for c in o.outputs]
        got = [(list(c.token_ids), c.finish_reason) for o in spec.generate(PROMPTS, PARAMS) for c in o.outputs]
        assert got == want
    assert src.graphs.replays > 0 and src.graphs.pool.hits > 0
    assert spec.last_metrics["rollout/spec_draft_tokens/drafter"] > 0


def test_a_call_that_captured_is_not_timed(model, drafter_dir):
    """The precision choice learns step times from calls without a capture (a capture costs
    far more than the step it serves)."""
    from tailrl.engine.request import Request
    from tailrl.speculative.sources.drafter_source import DrafterSource
    target = load_model(model)
    src = DrafterSource(Drafter.load(drafter_dir, target))
    src.use_graphs(pool_for("cpu"))
    reqs = [Request(f"r{i}", p, SamplingParams(), 0) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        r.keep_hidden(torch.randn(target.args.hidden_size))
    src.grow(reqs, 4, 1)
    assert src.graphs.pool.captures > 0 and src.precision.step_seconds(len(reqs)) is None
    captures = src.graphs.pool.captures
    src.grow(reqs, 4, 1)                                   # the same shapes: replayed, timed
    assert src.graphs.pool.captures == captures and src.precision.step_seconds(len(reqs)) is not None


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
