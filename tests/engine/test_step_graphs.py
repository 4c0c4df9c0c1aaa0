"""Steps replayed from graphs (engine/graphs.py, engine/graph_pool.py), tested on the CPU.

The CUDA capture itself needs a GPU (benchmarks/gpu.py runs it); everything around it runs
here with ``eager_capture``: the buckets, the static inputs filled by one copy, the padding
tokens (written to and read from the scratch slot only), the pool's budget and eviction.
Since every kernel is row-invariant, the real rows of a padded step must equal the eager
step's bit for bit: the tests compare whole rollouts, with and without speculation (chains
and trees), in bfloat16 and float64 (the dtypes whose CPU kernels are batch invariant).
"""
import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.config import EngineConfig
from tailrl.engine.batch import ModelRunner
from tailrl.engine.graph_pool import GraphPool, eager_capture, error_chain
from tailrl.engine.graphs import StepGraphs, token_buckets, warm_up

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]
PARAMS = [SamplingParams(n=2, temperature=1.0, max_tokens=40, ignore_eos=True, seed=3),
          SamplingParams(n=2, temperature=0.0, max_tokens=40, ignore_eos=True),
          SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, max_tokens=40, seed=5),
          SamplingParams(n=2, temperature=1.0, max_tokens=30, ignore_eos=True, seed=8)]


def with_graphs(llm: LLM, max_tokens: int = 64, budget: int = 1 << 30, capture=eager_capture,
                **kw) -> StepGraphs:
    e = llm.engine
    e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(budget, capture), max_tokens, **kw))
    e.begin_rollout()
    return e.runner.graphs


def outputs(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS)
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]


def test_no_graphs_for_heads_the_triton_attention_does_not_take_or_latent_attention(caplog):
    """Heads whose width is not a power of two (Phi-3-mini's 96, DeepSeek-V3's latent 576) or below
    the float32 dot's 8 take the reference attention on a GPU, which reads a step's draft
    positions on the host; DeepSeek-V3's absorbed weights are copies made again after a weight
    update, outside any graph: such models get no CUDA graphs, and the log says why (the
    configuration alone: nothing runs on a GPU)."""
    from types import SimpleNamespace

    from tailrl.engine.graphs import engine_graphs
    from tailrl.model.args import parse_config
    config = EngineConfig(model="unused", device="cuda")
    phi3 = {"architectures": ["Phi3ForCausalLM"], "vocab_size": 32064, "hidden_size": 3072,
            "intermediate_size": 8192, "num_hidden_layers": 32, "num_attention_heads": 32}
    deepseek = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 448}          # a latent head of 512
    narrow = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}   # heads of 4: below a dot
    for cfg, why in ((phi3, "heads of 96 dimensions"), (deepseek, "absorbed weights"), (narrow, "heads of 4 ")):
        model = SimpleNamespace(args=parse_config(cfg))
        with caplog.at_level("INFO", logger="tailrl.engine.graphs"):
            assert engine_graphs(model, None, config, torch.bfloat16, grouped=True) is None
        assert why in caplog.text


def test_token_buckets():
    b = token_buckets(512)
    assert b[:5] == [1, 2, 4, 8, 10] and b[-1] == 512 and b == sorted(set(b))
    assert all(hi <= lo * 1.25 for lo, hi in zip(b[3:], b[4:]))       # padding wastes at most a quarter
    assert token_buckets(1) == [1] and token_buckets(3) == [1, 2, 3] and token_buckets(12) == [1, 2, 4, 8, 10, 12]


def _sized_pool(sizes: dict, budget: int) -> GraphPool:
    return GraphPool(budget, lambda fn: (fn, sizes[fn()]))


def test_the_pool_keeps_its_graphs_within_the_budget_least_recently_used_out():
    pool = _sized_pool({"a": 40, "b": 30, "c": 50, "big": 101}, 100)
    replay = lambda key: pool.replay(key, lambda: key)   # noqa: E731
    assert replay("a") == "a" and replay("b") == "b" and pool.bytes == 70
    assert replay("a") == "a"                            # a hit: "b" is now the least recently used
    assert replay("c") == "c"                            # 70 + 50 > 100: "b" goes
    assert "b" not in pool and "a" in pool and "c" in pool and pool.bytes == 90 and pool.evictions == 1
    assert replay("big") is None and "big" in pool.refused and pool.bytes == 90   # alone over the budget
    assert replay("big") is None and pool.captures == 4                         # refused for good: no recapture
    s = pool.stats()
    assert (s["graphs/hits"], s["graphs/misses"], s["graphs/held"], s["graphs/peak_bytes"]) == (1, 5, 2, 90)
    pool.clear()
    assert len(pool) == 0 and pool.bytes == 0 and replay("a") == "a" and pool.captures == 5
    with pytest.raises(ValueError, match="cuda_graph_gib"):
        GraphPool(-1, eager_capture)


def test_a_failed_capture_costs_its_key_the_graph_not_the_step(caplog):
    def capture(fn):
        raise RuntimeError("operation not permitted when stream is capturing")
    pool = GraphPool(100, capture)
    assert pool.replay("k", lambda: 1) is None and pool.failures == 1 and "k" in pool.refused
    assert "capturing" in caplog.text


def test_a_failed_capture_is_logged_with_its_first_cause(caplog):
    """CUDA reports a broken capture at its end ("a previous error"): the log names the error
    the capture was raised during, first."""
    def capture(fn):
        try:
            raise RuntimeError("operation not permitted when stream is capturing (cudaMalloc)")
        except RuntimeError:
            raise RuntimeError("operation failed due to a previous error during capture")
    pool = GraphPool(100, capture)
    assert pool.replay("k", lambda: 1) is None
    first, second = caplog.text.index("cudaMalloc"), caplog.text.index("previous error")
    assert first < second
    assert error_chain(ValueError("x")) == "ValueError: x"


SPECS = [None, SpeculativeConfig(policy="fixed"), SpeculativeConfig(policy="fixed", max_tree_paths=3)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("spec", SPECS, ids=["plain", "chains", "trees"])
def test_replayed_steps_equal_eager_steps_bit_for_bit(model, dtype, spec):
    """Two calls (the second drafts from the first's history): tokens, logprobs and finish
    reasons identical to plain eager decoding; every step without prefill came from a graph."""
    want = outputs(LLM(model, dtype=dtype))
    llm = LLM(model, dtype=dtype, speculative=spec)
    graphs = with_graphs(llm)
    for _ in range(2):
        assert outputs(llm) == want
        m = llm.last_metrics
        assert m["graphs/replayed_steps"] > 0 and m["graphs/eager_steps"] == 0
    if spec is not None:
        assert m["rollout/spec_accepted_tokens"] > 0
    if spec is not None and spec.max_tree_paths > 1:
        assert any(key[1] > 1 for key in graphs._static)          # tree visibility went through the graphs
    if spec is None:                                       # the same shapes again: nothing left to capture
        assert m["graphs/misses"] == 0 and m["graphs/hits"] == m["graphs/replayed_steps"]


@pytest.mark.parametrize("temperature", [1.0, 0.0], ids=["sample", "greedy"])
@pytest.mark.parametrize("spec", SPECS[:2], ids=["plain", "chains"])
def test_graphs_that_sample_give_the_eager_sampler_bits(model, temperature, spec):
    """Where every row samples alike (T = 1 without top-k or top-p: an RL rollout's; or greedy)
    the step's graph runs the LM head and the sampler too, its uniforms a static input staged
    as float32: tokens and log-probabilities equal plain eager decoding's, bit for bit, in
    bfloat16; float64 keeps the sampler out of the graph (its uniforms are float64)."""
    params = SamplingParams(n=3, temperature=temperature, max_tokens=30, ignore_eos=True, seed=11)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(PROMPTS, params)]  # noqa: E731
    for dtype in ("bfloat16", "float64"):
        want = run(LLM(model, dtype=dtype))
        llm = LLM(model, dtype=dtype, speculative=spec)
        graphs = with_graphs(llm)
        for _ in range(2):
            assert run(llm) == want
        assert llm.last_metrics["graphs/replayed_steps"] > 0 and llm.last_metrics["graphs/eager_steps"] == 0
        modes = {key[2] for key in graphs._static}
        assert modes == ({"sample" if temperature else "greedy"} if dtype == "bfloat16" or not temperature
                         else {None}), modes


@pytest.mark.parametrize("spec,ahead", [(SPECS[0], False), (SPECS[1], False), (None, True)],
                         ids=["plain", "chains", "ahead"])
def test_graph_steps_of_processed_requests_sample_outside_their_graphs(model, spec, ahead, fed):
    """A step with a request whose logits are processed (engine/logits_process.py: here a
    repetition penalty and min_p, at T = 1, a graph-sampling rollout otherwise) replays its
    graph up to the final norm and samples eagerly: eager decoding's bits, bfloat16; launched
    ahead, each row's in-flight token read from the graph's static input."""
    params = SamplingParams(n=3, max_tokens=30, seed=11, repetition_penalty=1.3, min_p=0.05)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(PROMPTS, params)]  # noqa: E731
    want = run(LLM(model, dtype="bfloat16"))
    llm = LLM(model, dtype="bfloat16", speculative=spec, async_scheduling=ahead)
    graphs = with_graphs(llm)
    for _ in range(2):
        assert run(llm) == want
    assert llm.last_metrics["graphs/replayed_steps"] > 0 and {key[2] for key in graphs._static} == {None}
    assert (fed[0] > 10) == ahead


def test_only_buckets_whose_logits_fit_cuda_graph_sample_mib_sample_inside_their_graph(model):
    """``sample_bytes`` (``EngineConfig.cuda_graph_sample_mib``) bounds the buckets that run the
    LM head and sampler inside their graph: the small ones sample in it, the larger ones end at
    the final norm and sample after it, in one rollout of verify steps, with eager decoding's
    bits either way; 0 keeps the sampler out of every graph."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True, seed=11)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(PROMPTS, params)]  # noqa: E731
    want = run(LLM(model, dtype="bfloat16"))
    for fit, modes in ((8, {"sample", None}), (0, {None})):          # tokens whose logits fit
        llm = LLM(model, dtype="bfloat16", speculative=SPECS[1])
        graphs = with_graphs(llm, sample_bytes=fit * llm.engine.model.args.vocab_size * 4)
        assert run(llm) == want
        assert {key[2] for key in graphs._static} == modes
        assert all((key[2] == "sample") == (key[0] <= fit) for key in graphs._static)


def test_steps_over_the_largest_bucket_and_refused_keys_run_eagerly_with_the_same_results(model):
    want = outputs(LLM(model, dtype="bfloat16"))
    llm = LLM(model, dtype="bfloat16", speculative=SpeculativeConfig(policy="fixed"))
    # a graph's bytes: 2 per padded token; budget 20: buckets 8 and 10 (16 + 20 bytes) evict
    # each other, 12 (24 bytes) is refused; steps of more than 12 tokens have no bucket
    graphs = with_graphs(llm, max_tokens=12, budget=20, capture=lambda fn: (fn, 2 * fn().shape[0]))
    assert outputs(llm) == want
    m = llm.last_metrics
    assert m["graphs/eager_steps"] > 0 and m["graphs/replayed_steps"] > 0 and m["graphs/evictions"] > 0
    assert graphs.pool.refused and graphs.pool.bytes <= 20


def test_a_reallocated_kv_pool_drops_the_graphs(model):
    llm = LLM(model, dtype="bfloat16")
    graphs = with_graphs(llm)
    first = outputs(llm)
    held = len(graphs.pool)
    llm.engine.free_cache()                              # the next step allocates a new pool
    assert outputs(llm) == first
    assert held > 0 and llm.last_metrics["graphs/captures"] >= held


@pytest.mark.parametrize("spec", [None, SpeculativeConfig(policy="fixed")], ids=["plain", "chains"])
def test_graphs_captured_at_start_up_serve_every_step_with_its_bits(model, spec):
    """``cuda_graph_warmup``: every bucket's graph captured from steps of padding alone (plain:
    up to max_num_seqs tokens; with drafts, up to the graphs' cap), in each sampler mode; then a
    rollout (every row at T = 1) captures nothing, replays every step without prefill, and
    gives the tokens and log-probabilities of eager steps."""
    params = SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True, seed=3)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(PROMPTS, params)]  # noqa: E731
    want = run(LLM(model, dtype="bfloat16"))
    llm = LLM(model, dtype="bfloat16", speculative=spec, max_num_seqs=16)
    graphs = with_graphs(llm)
    forms, forward = [], graphs.model.forward           # attention's forms the warm-up's forwards take
    graphs.model.forward = lambda ids, pos, layers, meta: forms.append((len(ids), meta.multi)) or forward(
        ids, pos, layers, meta)
    warm_up(graphs, llm.engine.config, drafts=spec is not None)
    del graphs.model.forward
    top = 64 if spec is not None else 16
    keys = {graphs.key(n, 0, m) for n in graphs.buckets if n <= top for m in ("sample", None)}
    assert graphs.pool.captures == len(keys) == graphs.warmup_captures and graphs.warmup_s > 0
    # each bucket's step eagerly in both forms (an eager prefill's kernels compiled at start-up),
    # then its capture in the graphs' form
    assert {(n, multi) for n, multi in forms} == {(k[0], multi) for k in keys for multi in (False, True)}
    assert sum(multi == graphs.grouped for _, multi in forms) == 2 * len(keys)
    for _ in range(2):                                   # the second call drafts from the first's history
        assert run(llm) == want
        m = llm.last_metrics
        assert m["graphs/captures"] == 0 and m["graphs/replayed_steps"] > 0 and m["graphs/eager_steps"] == 0
        assert m["graphs/warmup_captures"] == len(keys)                    # a level, not a count since the call
    if spec is not None:
        assert m["rollout/spec_accepted_tokens"] > 0


def test_graph_settings_are_checked():
    for field, bad in (("cuda_graphs", 1), ("cuda_graph_max_tokens", 0), ("cuda_graph_gib", -1.0),
                       ("cuda_graph_warmup", 1), ("cuda_graph_sample_mib", -1.0)):
        with pytest.raises(ValueError, match=field):
            EngineConfig(model="m", **{field: bad})


def test_a_pool_reports_its_instances_graphs_summed(model):
    """``LLM(instances=2)``: the rollout's ``graphs/...`` are the instances' summed."""
    want = outputs(LLM(model, dtype="bfloat16"))
    llm = LLM(model, dtype="bfloat16", instances=2, pool={"processes": False, "chunk_tokens": 16})
    engines = [h.worker.engine for h in llm.pool.instances]
    for e in engines:
        e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64))
    assert outputs(llm) == want
    m = llm.last_metrics
    assert m["graphs/replayed_steps"] == sum(e.runner.graphs.replays for e in engines)
    assert all(e.runner.graphs.replays > 0 for e in engines)
    assert m["graphs/captures"] == sum(e.runner.graphs.pool.captures for e in engines)


def test_a_step_that_captured_a_graph_teaches_no_prices(model):
    """A step during which a graph was captured (its first, compiling run and the capture: on a
    GPU far more than a step) reaches the speculator as untypical, like a prefill step: its
    time teaches neither the cost model nor the policy's step curve."""
    from tailrl.engine.graph_pool import captures_made
    llm = LLM(model, speculative=SpeculativeConfig(policy="fixed"))
    graphs = with_graphs(llm)
    sp, seen, last = llm.engine.speculator, [], [captures_made()]
    real = sp.observe_step

    def observe_step(*args, prefill=False, **kw):
        now = captures_made()
        seen.append((now != last[0], prefill))
        last[0] = now
        return real(*args, prefill=prefill, **kw)
    sp.observe_step = observe_step
    outputs(llm)
    assert graphs.pool.captures > 0
    assert all(untypical for captured, untypical in seen if captured)
    assert any(not untypical for _, untypical in seen)


def test_every_capture_tried_is_counted():
    from tailrl.engine.graph_pool import captures_made
    pool, before = GraphPool(1 << 30, eager_capture), captures_made()
    pool.replay("a", lambda: None)
    pool.replay("a", lambda: None)
    pool.replay("b", lambda: None)
    assert captures_made() - before == 2 == pool.captures


def test_every_token_past_a_step_s_own_is_padding_whatever_came_before(model):
    """A staging buffer writes padding only where an earlier step left real tokens: after any
    sequence of step sizes in one bucket, the tokens past the step's own are inert (token 0,
    the scratch slot and row, prefix 1) and its own are the step's."""
    import numpy as np
    g = with_graphs(LLM(model, max_num_seqs=4))
    key = g.key(7, 0, None)
    size = key[0]
    for n in (3, 5, 7, 1, 2, 2, 7, 0, 4):
        longs = [[11] * n, [1] * n, list(range(n)), [5] * n]
        ints = [[0] * n, [2] * n, [0] * n, [0] * n]
        ids, _, _, meta = g.place(key, longs, ints, [0], np.zeros(n), 1, 4, 4, 4)
        b = g._static[key]
        assert b.ids[n:].tolist() == [0] * (size - n) and ids.tolist() == [11] * n
        assert b.meta.write_slot[n:].tolist() == [g.kv.scratch_slot] * (size - n)
        assert b.meta.q_row[n:].tolist() == [g.kv.max_rows] * (size - n)
        assert b.meta.prefix[n:].tolist() == [1] * (size - n)
        assert meta.write_slot.tolist() == [5] * n and meta.prefix.tolist() == [2] * n


def test_every_buckets_inputs_start_16_bytes_apart(model):
    """Triton compiles a kernel per pattern of its pointers' 16-byte alignment: every static
    input of every bucket (tokens of any count, visibility lists of any length) starts a whole
    number of 16 bytes into the bucket's buffer, so that bucket sizes make no patterns."""
    llm = LLM(model, dtype="bfloat16")
    graphs = with_graphs(llm)
    for n, e in ((1, 1), (2, 2), (10, 1), (14, 8), (64, 4)):
        key = graphs.key(n, e)
        graphs.place(key, [[]] * 4, [[]] * 4, [], [], 0, 0, 0, 0)
        b = graphs._static[key]
        views = [b.ids, b.pos, b.sample, b.u, *(getattr(b.meta, f) for f in ("write_slot", "q_row", "prefix",
                                                                               "estart", "ecount", "extra",
                                                                               "block_table"))]
        assert all((t.data_ptr() - b.dev.data_ptr()) % 16 == 0 for t in views), (n, e)
        assert [len(t) for t in views[:8]] == [key[0]] * 8 and len(b.meta.extra) == key[1]


@pytest.mark.parametrize("ahead", [False, True], ids=["waiting", "ahead"])
def test_steps_of_many_decode_rows_through_the_static_inputs_give_eager_decodings_outputs(model, ahead,
                                                                                           monkeypatch):
    """More than 16 decode rows: ``build_batch``'s all-decode form (``_decode_batch``) staged
    into a bucket's static inputs, with and without steps launched ahead (rows fed on the
    device), against eager steps built by the general path."""
    from tailrl.engine import batch as batch_mod
    prompts = [[(3 * i + j) % 89 + 1 for j in range(2 + i % 4)] for i in range(12)]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=20, ignore_eos=True, seed=6)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, params)]  # noqa: E731
    with monkeypatch.context() as m:
        m.setattr(batch_mod, "FEW_TOKENS", 1 << 30)              # every step through the general path
        want = run(LLM(model, dtype="bfloat16", max_num_seqs=64))
    llm = LLM(model, dtype="bfloat16", max_num_seqs=64, async_scheduling=ahead)
    with_graphs(llm)
    assert run(llm) == want
    assert llm.last_metrics["graphs/replayed_steps"] > 10
