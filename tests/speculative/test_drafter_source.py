"""Speculation with the learned drafter is lossless: outputs with drafter (and hybrid) drafts
equal plain outputs, in float64 and bfloat16, for chains and trees; drafts are valid and the
configuration is checked. The drafter is warm-started for a few steps on the test model, so
its drafts are partly accepted and partly rejected (both paths of verification run); its head
covers 48 of the model's 97 tokens (a draft vocabulary: the drafter's indices are mapped to the
target's ids; the whole-vocabulary drafter runs in tests/drafter)."""
import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.cli.train_drafter import warm_start
from tailrl.drafter.graphs import DrafterGraphs
from tailrl.drafter.network import Drafter
from tailrl.engine.request import Request
from tailrl.model.loader import load_model
from tailrl.speculative.draft import Draft
from tailrl.speculative.sources.drafter_source import DrafterSource

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("drafter"))
    warm_start(model, out, PROMPTS, n=4, max_tokens=48, steps=40, batch=128, lr=3e-3, unroll=2, draft_vocab=48)
    return out


def test_drafts_are_valid_chains_and_trees(model, drafter_dir):
    target = load_model(model)
    src = DrafterSource(Drafter.load(drafter_dir, target))
    reqs = [Request(f"r{i}", p, SamplingParams(), 0) for i, p in enumerate(PROMPTS)]
    assert src.propose(reqs[0], 6, 1) is None                 # no hidden state kept yet: nothing to draft from
    for r in reqs:
        r.keep_hidden(torch.randn(target.args.hidden_size))
    for paths in (1, 3):
        src.prepare(reqs[:3], 8, paths)
        for r in reqs:                                          # r3 was not prepared: drafted alone
            d = src.propose(r, 5, paths)
            Draft(d.tokens, d.parents, d.probs, d.source)      # the checked constructor accepts it
            assert 0 < len(d) <= 5 and d.source == "drafter"
            assert d.is_chain == (paths == 1)
            depth1 = [t for t, p in zip(d.tokens, d.parents) if p < 0]
            assert len(depth1) == len(set(depth1)) <= paths
            assert 0 < d.score <= len(d)
    # the same weights over the upper 48 tokens: every drafted token is one of them (the head's
    # indices mapped to the target's ids, chains and trees)
    upper = Drafter.for_target(target, vocab=torch.arange(49, target.args.vocab_size))
    upper.load_state_dict({**src.drafter.state_dict(), "vocab": upper.vocab})
    hi = DrafterSource(upper)
    for paths in (1, 3):
        hi.prepare(reqs[:3], 8, paths)
        for r in reqs:
            d = hi.propose(r, 5, paths)
            assert d is not None and min(d.tokens) >= 49
    cut = DrafterSource(src.drafter, min_path_prob=0.3)
    for paths in (1, 3):
        for r in reqs:                                          # unlikely paths are not drafted
            d = cut.propose(r, 8, paths)
            assert d is None or min(d.path_probs) >= 0.3
    reqs[0].output_token_ids.append(3)                          # the kept hidden state is stale now
    assert reqs[0].last_hidden is None and src.propose(reqs[0], 5, 1) is None


def assert_same(plain, spec):
    for a, b in zip(plain, spec, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert cb.token_ids == ca.token_ids
            assert cb.finish_reason == ca.finish_reason


PARAMS = [SamplingParams(n=3, max_tokens=40, seed=1), SamplingParams(n=2, temperature=0, max_tokens=30),
          SamplingParams(n=3, top_k=5, temperature=0.7, max_tokens=50, seed=2),
          SamplingParams(n=2, top_p=0.8, max_tokens=40, ignore_eos=True)]


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize("method,paths", [("drafter", 1), ("drafter", 3), ("hybrid", 2)])
def test_outputs_identical_with_drafter_speculation(model, drafter_dir, dtype, method, paths):
    plain = LLM(model, dtype=dtype)
    spec = LLM(model, dtype=dtype, speculative=SpeculativeConfig(policy="fixed",
        method=method, drafter=drafter_dir, max_tree_paths=paths, min_token_prob=0.0))
    spec.engine.speculator.choice.always = True     # verify the drafter's drafts at every step
    for _ in range(2):                                          # the second call: hybrid has history too
        assert_same(plain.generate(PROMPTS, PARAMS), spec.generate(PROMPTS, PARAMS))
    m = spec.last_metrics
    drafted, accepted = m["rollout/spec_draft_tokens/drafter"], m["rollout/spec_accepted_tokens/drafter"]
    assert 0 < accepted < drafted                               # acceptances and rejections both ran


@pytest.mark.parametrize("paths", [1, 3])
def test_a_draft_scored_on_the_emitted_tokens_gets_what_verification_gave_it(model, drafter_dir, paths):
    """Shadow drafts are scored by ``Draft.accepted_by`` on the tokens the request goes on to
    emit. On the drafter's verified drafts (float64, chains and trees, acceptances and
    rejections) it gives the verifier's count for every draft that lies inside its response."""
    spec = LLM(model, dtype="float64", speculative=SpeculativeConfig(policy="fixed",
        method="drafter", drafter=drafter_dir, max_tree_paths=paths, min_token_prob=0.0))
    s = spec.engine.speculator
    at, seen = {}, []
    propose, record = s.propose, s.record_verification
    s.propose = lambda reqs, *a, **k: (at.update({r.request_id: r.num_tokens for r in reqs}), propose(reqs, *a, **k))[1]
    s.record_verification = lambda req, d, n: (seen.append((req, d, n, at[req.request_id])), record(req, d, n))[1]
    spec.generate(PROMPTS, PARAMS)
    inside = [(req, d, n, first) for req, d, n, first in seen if first + d.max_depth <= req.num_tokens]
    assert len(inside) > 20 and {0, 1} <= {n for _, _, n, _ in inside}
    assert any(not d.is_chain for _, d, _, _ in inside) == (paths > 1)
    for req, d, n, first in inside:
        assert d.accepted_by(req.tokens(first, first + d.max_depth)) == n


def test_config_names_the_drafter_field(drafter_dir, tmp_path):
    for bad in (dict(method="drafter"), dict(method="hybrid", drafter=str(tmp_path / "missing")),
                dict(method="suffix", drafter=drafter_dir), dict(method="drafter", drafter=3)):
        with pytest.raises(ValueError, match="drafter"):
            SpeculativeConfig(**bad)
    assert SpeculativeConfig(method="hybrid", drafter=drafter_dir).drafter == drafter_dir
    assert SpeculativeConfig(drafter=drafter_dir).method == "hybrid"          # the default with a drafter
    assert SpeculativeConfig().method == "suffix"


def test_a_drafter_for_another_model_is_refused(ckpt_dir, drafter_dir):
    other = ckpt_dir("qwen2", hidden_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(other, speculative=dict(method="drafter", drafter=drafter_dir))


def test_identical_under_preemption_and_after_migration(model, drafter_dir):
    """Preempted (recomputed) requests keep drafting; a request exported mid-flight resumes in
    another engine with its draft root's hidden state (it drafts at its first step there)."""
    from tailrl import EngineConfig
    from tailrl.engine.engine import LLMEngine
    sp = [SamplingParams(n=2, temperature=t, max_tokens=50, ignore_eos=True, seed=3) for t in (0.0, 1.0) * 2]
    kw = dict(max_model_len=512, kv_cache_tokens=512)
    cfg = SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0)
    plain = LLM(model, dtype="float64", **kw).generate(PROMPTS, sp)
    spec = LLM(model, dtype="float64", speculative=cfg, **kw)
    assert_same(plain, spec.generate(PROMPTS, sp))
    assert spec.last_metrics["rollout/preemptions"] > 0 and spec.last_metrics["rollout/spec_accepted_tokens"] > 0
    engines = [LLMEngine(EngineConfig(model=model, dtype="float64"), cfg) for _ in range(2)]
    req = Request("x", PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True), seed_key=11)
    ref = Request("x", PROMPTS[1], SamplingParams(max_tokens=40, ignore_eos=True), seed_key=11)
    engines[0].add_request(ref)
    while engines[0].has_unfinished():
        engines[0].step()
    engines[0].release("x")
    engines[1].add_request(req)
    while req.num_output_tokens < 12:
        engines[1].step()
    at = req.last_hidden.clone()
    moved = engines[0].import_request(engines[1].export_request("x"))
    assert torch.equal(moved.last_hidden, at)
    while engines[0].has_unfinished():
        engines[0].step()
    assert moved.output_token_ids == ref.output_token_ids


def test_load_weights_refreshes_the_drafters_shared_embedding_and_head(model, drafter_dir):
    """After an RL update the drafter must read the new embedding and head, not a stale copy."""
    from tailrl.model.loader import load_state_dict
    llm = LLM(model, dtype="float32", speculative=SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir))
    target = llm.engine.model
    drafter = llm.engine.speculator.sources[0].drafter
    sd = load_state_dict(model)                               # the checkpoint under HF names
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 2.0
    before = drafter.embed.clone()
    llm.load_weights(sd)
    assert not torch.equal(drafter.embed, before)
    assert torch.equal(drafter.embed, target.embed.weight.float())
    head = target.embed.weight if target.lm_head is None else target.lm_head.weight
    assert len(drafter.vocab) == 48                            # the draft vocabulary's rows
    assert torch.equal(drafter.head, head[drafter.vocab].float())


def test_bfloat16_targets_draft_in_the_faster_copy_kept_current(model, drafter_dir):
    """With a bfloat16 target, the drafter drafts (chains and trees) and computes its committed
    K/V in a bfloat16 copy (the dtype of its blocks): outputs stay identical to plain decoding,
    and the copy is made again after each in-place change of the drafter's weights (a
    published version, the target's new embedding), never used stale."""
    from tailrl.model.loader import load_state_dict
    prompts = [[(5 * i + j) % 60 + 3 for j in range(4 + i % 5)] for i in range(12)]
    sp = SamplingParams(n=3, max_tokens=30, seed=4)
    plain = LLM(model, dtype="bfloat16").generate(prompts, sp)
    for paths in (1, 2):
        spec = LLM(model, dtype="bfloat16", speculative=SpeculativeConfig(
            policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0, max_tree_paths=paths))
        src = spec.engine.speculator.sources[0]
        assert_same(plain, spec.generate(prompts, sp))
        assert spec.last_metrics["rollout/spec_accepted_tokens/drafter"] > 0
        assert src.past.pool.dtype == torch.bfloat16
    fast = src.fast.get()
    assert fast.fc.weight.dtype == torch.bfloat16 and src.fast.get() is fast      # unchanged: the same copy
    other = src.drafter.shadow()
    with torch.no_grad():
        other.fc.bias.add_(1.0)
    src.drafter.copy_weights_from(other)                       # a new version, published in place
    assert torch.equal(src.fast.get().fc.bias, src.drafter.fc.bias.bfloat16())
    assert src.fast.get() is fast and src.fast.get().fc.bias.data_ptr() == fast.fc.bias.data_ptr()   # in place
    sd = load_state_dict(model)
    sd["model.embed_tokens.weight"] = sd["model.embed_tokens.weight"] * 2.0
    spec.load_weights(sd)
    assert torch.equal(src.fast.get().embed, src.drafter.embed.bfloat16())


def test_step_meter_keeps_the_best_first_calls_then_an_average_per_row_bucket():
    from tailrl.speculative.sources.drafter_source import TRIES, StepMeter
    meter = StepMeter(decay=0.5)
    assert meter.step_seconds(1) is None
    for s in [3e-3, 1e-3][:TRIES]:                        # the first calls: the best stands (kernels built first)
        meter.observe(1, s)
    assert meter.step_seconds(1) == 1e-3 and meter.step_seconds(2) is None    # buckets: 1, 2, 4, ...
    meter.observe(1, 3e-3)
    assert meter.step_seconds(1) == pytest.approx(2e-3)                      # then averaged with forgetting
    meter.observe(40, 5e-3)
    assert meter.step_seconds(33) == 5e-3 and meter.step_seconds(64) == 5e-3 and meter.step_seconds(65) is None


def test_chains_grow_only_as_deep_as_pays(model, drafter_dir):
    """Priced: a chain stops where its rows' path probabilities cannot pay for one more drafter
    step (a token worth nothing: one step; worth everything: the node budget); unpriced, the
    node budget. The step time it weighs is its own, measured per row count."""
    from tailrl.speculative.sources.drafter_source import TRIES
    target = load_model(model)
    src = DrafterSource(Drafter.load(drafter_dir, target))
    reqs = [Request(f"r{i}", p, SamplingParams(), 0) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        r.keep_hidden(torch.randn(target.args.hidden_size, generator=torch.Generator().manual_seed(len(r.prompt_token_ids))))
    for _ in range(TRIES):
        src.grow(reqs, 8, 1)
    assert src.step_time.step_seconds(len(reqs)) > 0
    assert max(len(d) for d in src.grow(reqs, 8, 1)) == 8
    src.pricing = (1e-12, 0.0)
    assert max(len(d) for d in src.grow(reqs, 8, 1)) == 1
    src.pricing = (1e6, 0.0)
    assert max(len(d) for d in src.grow(reqs, 8, 1)) == 8
    src.pricing = (1e6, 2e6)                              # a node costs more than it can be worth
    assert max(len(d) for d in src.grow(reqs, 8, 1)) == 1


def priced_source(model, drafter_dir, pricing, min_path_prob: float, budget: int):
    """A drafter source whose step time is measured (``TRIES`` calls of ``budget`` nodes), then
    priced at ``pricing``, and the requests it drafts for."""
    from tailrl.speculative.sources.drafter_source import TRIES
    target = load_model(model)
    src = DrafterSource(Drafter.load(drafter_dir, target), min_path_prob=min_path_prob)
    reqs = [Request(f"r{i}", p, SamplingParams(), 0) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        seed = torch.Generator().manual_seed(len(r.prompt_token_ids))
        r.keep_hidden(torch.randn(target.args.hidden_size, generator=seed))
    for _ in range(TRIES):                                   # the step time measured (pricing needs it)
        src.grow(reqs, budget, 1)
    src.pricing = pricing
    return src, reqs


@pytest.mark.parametrize("pricing,min_path_prob", [(None, 0.0), (None, 0.3), ((1e-12, 0.0), 0.0), ((1e6, 0.0), 0.0),
                                                   ((1e6, 2e6), 0.0)], ids=["budget", "min-prob", "worthless",
                                                                            "priceless", "dear"])
def test_chain_depths_launched_ahead_of_their_end_give_the_same_chains(model, drafter_dir, monkeypatch, pricing,
                                                                         min_path_prob):
    """``depth_ahead`` (a GPU's default): depth t + 1 is launched before depth t's end is read;
    the chains are the same, and where they end before the node budget one depth more is
    computed and dropped."""
    from tailrl.drafter import paged
    from tailrl.speculative.sources import drafter_source as module
    src, reqs = priced_source(model, drafter_dir, pricing, min_path_prob, 8)
    depths = [0]

    def counting(*a, **kw):
        depths[0] += 1
        return paged.paged_step(*a, **kw)
    monkeypatch.setattr(module, "paged_step", counting)
    got = {}
    for ahead in (False, True):
        src.depth_ahead, depths[0] = ahead, 0
        drafts = src.grow(reqs, 8, 1)
        got[ahead] = ([(d.tokens, d.probs) if d is not None else None for d in drafts], depths[0])
    assert got[True][0] == got[False][0] and any(d is not None for d in got[True][0])
    assert got[True][1] == min(got[False][1] + 1, 8)        # one more, unless the budget ended them


@pytest.mark.parametrize("pricing,min_path_prob", [(None, 0.0), (None, 0.3), ((1e-12, 0.0), 0.0), ((1e6, 0.0), 0.0),
                                                   ((1e6, 2e6), 0.0)], ids=["budget", "min-prob", "worthless",
                                                                            "priceless", "dear"])
@pytest.mark.parametrize("budget", [8, 5])
def test_a_call_from_one_whole_chain_graph_gives_the_depth_walks_chains(model, drafter_dir, pricing, min_path_prob,
                                                                       budget):
    """``whole_chains`` (TAILRL_DRAFTER_WHOLE_CHAINS=1): a call's every depth from one graph
    (5 depths padded to 8), cut on the host where the walk depth after depth stops, gives the
    same chains as that walk (from per-depth graphs and launched)."""
    from tailrl.engine.graph_pool import GraphPool, eager_capture
    src, reqs = priced_source(model, drafter_dir, pricing, min_path_prob, budget)
    got = []
    for graphs, whole in ((False, False), (True, False), (True, True)):
        src.graphs = DrafterGraphs(GraphPool(1 << 30, eager_capture)) if graphs else None
        src.whole_chains = whole
        drafts = src.grow(reqs, budget, 1)
        got.append([(d.tokens, d.probs) if d is not None else None for d in drafts])
    assert got[0] == got[1] == got[2] and any(d is not None for d in got[2])
    assert src.graphs.chains == 1 and src.graphs.replays == 0


def test_hidden_states_are_handed_out_only_where_the_drafter_drafts(model, drafter_dir):
    """Nothing is drafted above max_spec_batch rows, and nothing is handed out above twice
    that (unless a collector keeps every position): pasts start as the batch comes down, and
    outputs stay identical to plain decoding."""
    prompts = [[(3 * i + j) % 70 + 3 for j in range(5)] for i in range(4)]
    sp = [SamplingParams(n=3, max_tokens=m, ignore_eos=True, seed=6) for m in (10, 20, 40, 80)]   # 12 rows, then 9, 6, 3
    spec = LLM(model, dtype="float64", speculative=SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir,
                                                                     min_token_prob=0.0, max_spec_batch=3))
    s = spec.engine.speculator
    assert s.wants_hidden(6) and not s.wants_hidden(7)
    past = s.sources[0].past
    counts = []
    inner = past.add_spans
    past.add_spans = lambda hidden, spans: (counts.append(len(spans)), inner(hidden, spans))[1]
    assert_same(LLM(model, dtype="float64").generate(prompts, sp), spec.generate(prompts, sp))
    assert len(counts) > 5 and max(counts) <= 6 and spec.last_metrics["rollout/spec_draft_tokens/drafter"] > 0
    s.collector = object()                                      # a spot trainer's buffer: every step
    assert s.wants_hidden(7) and s.wants_hidden(512)


def test_hybrid_goes_dormant_where_no_call_pays_and_stays_lossless(model, drafter_dir):
    """Once the drafter is measured and its calls priced, a hybrid engine whose calls cost more
    than any gain hands out no hidden states and calls nothing; tracking keeps it ready.
    Outputs equal plain decoding throughout (float64)."""
    for track in (False, True):
        plain = LLM(model, dtype="float64")
        spec = LLM(model, dtype="float64", speculative=SpeculativeConfig(policy="fixed",
            method="hybrid", drafter=drafter_dir, min_token_prob=0.0, drafter_tracking=track))
        s = spec.engine.speculator
        assert_same(plain.generate(PROMPTS, PARAMS), spec.generate(PROMPTS, PARAMS))   # the drafter is measured
        assert s.choice.drafter_mean() is not None
        for _ in range(4):
            s.choice.observe_call(10.0, 1)                          # a call costs 10 s: none can pay
        past = s.sources[-1].past
        handed = []
        inner = past.add_spans
        past.add_spans = lambda hidden, spans: (handed.append(len(spans)), inner(hidden, spans))[1]
        assert_same(plain.generate(PROMPTS, PARAMS), spec.generate(PROMPTS, PARAMS))
        m = spec.last_metrics
        assert bool(handed) == track                                # tracking keeps the drafter ready
        assert track or m["rollout/spec_drafter_calls"] == 0


def test_a_call_out_of_device_memory_drafts_nothing_and_the_rollout_goes_on(monkeypatch, caplog, model, drafter_dir):
    """The drafter's K/V blocks grow outside the engine's budget: where they cannot (here:
    every growth past the first pool of 16 blocks fails as CUDA's allocator would), that call
    drafts nothing, one warning says so, and outputs stay plain's."""
    from tailrl.drafter.blocks import KVBlocks

    def no_room(self, more):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
    monkeypatch.setattr(KVBlocks, "_grow", no_room)
    spec = LLM(model, speculative=SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir,
                                                    min_token_prob=0.0))
    src = spec.engine.speculator.sources[0]
    with caplog.at_level("WARNING", logger="tailrl.speculative.sources.drafter_source"):
        assert_same(LLM(model).generate(PROMPTS, PARAMS), spec.generate(PROMPTS, PARAMS))
    assert src.out_of_memory > 0 and spec.last_metrics["rollout/spec_accepted_tokens/drafter"] > 0
    assert sum("out of device memory" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_a_measured_tail_hands_the_drafter_every_state_from_steps_launched_ahead(model, drafter_dir, dtype,
                                                                                 monkeypatch):
    """Where steps are launched ahead (a GPU's engine), a hybrid engine's tail is measured as a
    suffix engine's (engine/tail_choice.py): plain steps launched ahead hand their states to the
    drafter's pasts when they settle, so every request's past covers each of its positions, in
    order, to the one before its last token; here the tail goes each way twice in turn. Outputs
    equal plain decoding's, and the drafter's drafts are verified and accepted."""
    plain = LLM(model, dtype=dtype, async_scheduling=False)
    spec = LLM(model, dtype=dtype, async_scheduling=True, speculative=SpeculativeConfig(
        policy="fixed", method="hybrid", drafter=drafter_dir, min_token_prob=0.0, ahead_above=8))
    e, s = spec.engine, spec.engine.speculator
    assert e.tail is not None and e._tail()
    s.choice.always = True                                   # the drafter drafts wherever it can
    calls = [0]

    def alternate() -> bool:
        calls[0] += 1
        return calls[0] % 4 < 2
    monkeypatch.setattr(e.tail, "plain", alternate)
    past = s.sources[-1].past
    spans: dict[str, list[tuple[int, int]]] = {}
    inner = past.add_spans

    def recording(hidden, got):
        for req, start, _, k in got:
            spans.setdefault(req.request_id, []).append((start, k))
        return inner(hidden, got)
    past.add_spans = recording
    want = plain.generate(PROMPTS, PARAMS)
    outs = spec.generate(PROMPTS, PARAMS)
    assert_same(want, outs)
    m = spec.last_metrics
    assert m["rollout/tail_plain_steps"] >= 2 and m["rollout/tail_speculate_steps"] >= 2
    assert m["rollout/spec_accepted_tokens/drafter"] > 0
    ends = {req.request_id: req.num_tokens for req in e.requests.values()} if e.requests else {}
    for rid, got in spans.items():
        pos = [start + i for start, k in got for i in range(k)]
        assert pos == list(range(pos[0], pos[0] + len(pos)))          # in order, no gap, none twice
        if rid in ends:
            assert pos[-1] == ends[rid] - 2
    assert len(spans) == sum(len(o.outputs) for o in outs)
