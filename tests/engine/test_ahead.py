"""Steps launched ahead (engine/ahead.py, ``async_scheduling``), on the CPU: every token and
log-probability the one plain decoding gives, whatever stops requests (stop tokens, which a
step launched ahead can not know, and length limits), with rows waiting for room, with
preemptions, through the graphs' static inputs; no placeholder ever visible between steps;
a request exported mid-flight continues elsewhere to the same tokens."""
import os

import pytest
import torch
from mixed_requests import PARAMS, PROMPTS, outputs
from safetensors.torch import load_file

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.config import EngineConfig
from tailrl.engine import engine as engine_mod
from tailrl.engine.ahead import PENDING
from tailrl.engine.batch import ModelRunner
from tailrl.engine.graph_pool import GraphPool, eager_capture
from tailrl.engine.graphs import StepGraphs
from tailrl.speculative.speculator import Speculator


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("rows", [256, 5], ids=["all-rows", "waiting"])
def test_steps_launched_ahead_give_plain_decodings_outputs(model, dtype, graphs, rows, fed):
    """Against the same engine stepping one step at a time, through the same inputs path, where
    a CPU's kernels are batch invariant (a step launched ahead keeps the rows of requests that
    stopped in the step before it: other batches than plain stepping's): not float32, whose
    CPU products change in the last bits with the batch."""
    def engine(ahead: bool) -> LLM:
        llm = LLM(model, dtype=dtype, max_num_seqs=rows, async_scheduling=ahead)
        e = llm.engine
        if graphs:
            e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64))
        return llm
    want = outputs(engine(False))
    reasons = {r for o in want for _, _, r in o}
    assert reasons == {"stop", "length"}
    llm = engine(True)
    e = llm.engine
    assert e.ahead
    for _ in range(2):
        assert outputs(llm) == want
        assert e._launched is None
    assert fed[0] > 20
    if graphs:
        assert llm.last_metrics["graphs/replayed_steps"] > 20


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_a_speculative_engine_steps_ahead_in_the_bulk_and_verifies_drafts_in_the_tail(model, dtype, fed):
    """``ahead_above``: while more requests run or wait, plain steps launched ahead; from that
    many down (``tail="speculate"``), drafts verified one step at a time, the step in flight
    settled first. Every
    token and log-probability is plain decoding's, in both rounds (the second drafts from the
    first's responses and from the tokens of steps launched ahead, which its sources indexed)."""
    want = outputs(LLM(model, dtype=dtype, max_num_seqs=256, async_scheduling=False))
    llm = LLM(model, dtype=dtype, max_num_seqs=256, async_scheduling=True,
              speculative=SpeculativeConfig(policy="fixed", ahead_above=4, tail="speculate"))
    e = llm.engine
    e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64,
                                                      grouped=True))
    assert not e.ahead and e.ahead_above == 4 and e.tail is None
    verified = []
    for _ in range(2):
        assert outputs(llm) == want
        assert e._launched is None
        verified.append(llm.last_metrics["rollout/spec_verify_steps"])
    assert fed[0] > 10 and min(verified) > 0


def each_way_twice(engine, monkeypatch) -> None:
    """The engine's measured tail made to go each way twice in turn (a speculative step's first
    call settles the step in flight), whatever it measures."""
    calls = [0]

    def alternate() -> bool:
        calls[0] += 1
        return calls[0] % 4 < 2
    monkeypatch.setattr(engine.tail, "plain", alternate)


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_a_measured_tail_switches_its_two_ways_mid_request_with_plain_decodings_outputs(model, dtype, fed,
                                                                                       monkeypatch):
    """``tail="measured"`` (the default): the tail steps whichever way its measurements say,
    speculating one step at a time or plain and launched ahead; here each way twice in turn (a
    speculative step's first call settles the step in flight; a plain one is launched right
    after a verification), every token and log-probability still plain decoding's, both ways
    counted and measured."""
    want = outputs(LLM(model, dtype=dtype, max_num_seqs=256, async_scheduling=False))
    llm = LLM(model, dtype=dtype, max_num_seqs=256, async_scheduling=True,
              speculative=SpeculativeConfig(policy="fixed", ahead_above=8))
    e = llm.engine
    e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64,
                                                      grouped=True))
    assert e.tail is not None and e._tail()
    each_way_twice(e, monkeypatch)
    for _ in range(2):
        fed[0] = 0
        assert outputs(llm) == want
        assert e._launched is None
        m = llm.last_metrics
        assert m["rollout/tail_plain_steps"] >= 2 and m["rollout/tail_speculate_steps"] >= 2
    assert m["rollout/spec_verify_steps"] > 0 and fed[0] > 0
    assert e.tail.rate["plain"] > 0 and e.tail.rate["speculate"] > 0


@pytest.mark.parametrize("ahead_above", [3, 0])
def test_every_token_reaches_the_speculators_sources_once_in_order(model, monkeypatch, ahead_above):
    """Each token a step settles, launched ahead or not, is observed once, in order: every
    request's observed tokens are its output (with ``ahead_above`` 0, every step one at a time:
    the reference)."""
    seen: dict = {}
    llm = LLM(model, dtype="bfloat16", max_num_seqs=256, async_scheduling=True,
              speculative=SpeculativeConfig(policy="fixed", ahead_above=ahead_above))
    spec = llm.engine.speculator
    observe_many = spec.observe_many
    # the rows' tokens as a source that reads them gets them (the default sources read none)
    monkeypatch.setattr(Speculator, "tokens_wanted", property(lambda self: True))

    def recording(items):
        for req, new_tokens in items:
            seen.setdefault(req.request_id, []).extend(new_tokens)
        return observe_many(items)
    monkeypatch.setattr(spec, "observe_many", recording)
    outs = llm.generate(PROMPTS, PARAMS)
    responses = sorted(list(c.token_ids) for o in outs for c in o.outputs)
    assert sorted(seen.values()) == responses and len(responses) == 12


def test_preempted_requests_settle_and_recompute_the_same_tokens(model, fed):
    kw = dict(dtype="bfloat16", max_model_len=128, kv_cache_tokens=256, max_num_seqs=16)
    want = outputs(LLM(model, async_scheduling=False, **kw))
    llm = LLM(model, async_scheduling=True, **kw)
    assert outputs(llm) == want
    assert llm.last_metrics["rollout/preemptions"] > 0 and fed[0] > 0


def test_no_placeholder_between_steps_and_an_export_continues_elsewhere(model):
    """Step by step: after each ``step()`` every request's tokens are settled and at most one
    step is in flight; a request exported after a few steps (the step in flight is settled
    first) and imported into a plain engine ends with the tokens it has in a plain rollout."""
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=30, stop_token_ids=[11], seed=2)
    plain = LLM(model, async_scheduling=False)
    want = {c.index: c.token_ids for c in plain.generate([PROMPTS[2]], sp)[0].outputs}
    llm = LLM(model, async_scheduling=True)
    e = llm.engine
    reqs = llm.inputs.requests(0, [PROMPTS[2]], sp)[3][0]
    for r in reqs:
        e.add_request(r)
    for _ in range(6):
        e.step()
        assert all(PENDING not in r.output_token_ids for r in reqs)
    assert e._launched is not None
    state = e.export_request(reqs[1].request_id)
    assert e._launched is None and PENDING not in state.output_token_ids
    while e.has_unfinished():
        e.step()
        assert all(PENDING not in r.output_token_ids for r in reqs)
    moved = plain.engine.import_request(state)
    while plain.engine.has_unfinished():
        plain.engine.step()
    assert moved.output_token_ids == want[1]
    assert [r.output_token_ids for r in reqs if r is not reqs[1]] == [want[i] for i in (0, 2, 3)]


def test_abort_and_weights_settle_the_step_in_flight(model):
    """An abort after k calls of ``step()`` leaves the request with the tokens of every step
    launched so far, as a plain engine's after k steps; new weights wait for the step in flight."""
    got = {}
    for ahead in (False, True):
        llm = LLM(model, async_scheduling=ahead)
        e = llm.engine
        e.step_log = []
        groups = llm.inputs.requests(0, PROMPTS[:2], SamplingParams(n=2, max_tokens=20, ignore_eos=True, seed=1))[3]
        for r in [r for g in groups for r in g]:
            e.add_request(r)
        for _ in range(4):
            e.step()
        victim = groups[0][0]
        e.abort(victim.request_id)
        assert e._launched is None and victim.finish_reason == "abort"
        got[ahead] = list(victim.output_token_ids)
        e.step()
        e.load_weights(load_file(os.path.join(model, "model.safetensors")))     # the same weights again
        assert e._launched is None
        assert len(e.step_log) == e.metrics.num_forward and all(s["seconds"] > 0 for s in e.step_log)
    assert got[True] == got[False] and len(got[True]) == 3      # the first step prefills the shared prompt


def test_async_scheduling_is_checked():
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(model="m", async_scheduling="yes")
    for field, bad in (("ahead_above", -1), ("tail", "plain")):
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig(**{field: bad})


def test_an_engine_with_a_speculator_or_on_a_cpu_by_default_does_not_step_ahead(model):
    """By default an engine with CUDA graphs (a GPU's) steps ahead; never one with a speculator
    (its drafts read the tokens on the host) nor a rollout pool's worker (a chunk ends at its
    target)."""
    assert not LLM(model, speculative=SpeculativeConfig(), async_scheduling=True).engine.ahead
    assert not LLM(model).engine.ahead                    # a CPU: no CUDA graphs
    pool = LLM(model, instances=2, pool={"processes": False}, async_scheduling=True).pool
    assert not any(h.worker.engine.ahead for h in pool.instances)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the device itself checks")
def test_steps_launched_ahead_make_no_tensor_on_the_host_by_default(triton_model, monkeypatch, fed):
    """Through the Triton kernels (interpreted) and the graphs' static inputs, each step under
    ``tests/device_guard.py``: the same outputs as stepping one step at a time."""
    from device_guard import guard
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    params = [SamplingParams(n=2, temperature=1.0, max_tokens=12, stop_token_ids=[11, 23], seed=3),
              SamplingParams(n=2, temperature=0.0, max_tokens=9, stop_token_ids=[7])]

    def run(ahead: bool):
        llm = LLM(triton_model, async_scheduling=ahead)
        e = llm.engine
        e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64))
        return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(PROMPTS[:2], params)]
    want = run(False)
    guard(monkeypatch, engine_mod.LLMEngine, "step", "drain")
    assert run(True) == want and fed[0] > 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU: CUDA graphs, streams and copies not waited for")
def test_on_a_gpu_steps_launched_ahead_give_plain_stepping_outputs(model):
    """On a GPU, where the copies and launches really run behind the host: every token and
    log-probability of a rollout with steps launched ahead (the default there) equals stepping
    one step at a time's, with stop tokens and rows waiting for room; steps were replayed from
    CUDA graphs and fed on the device."""
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=5, gpu_memory_utilization=0.2)
    want = outputs(LLM(model, async_scheduling=False, **kw))
    llm = LLM(model, **kw)
    assert llm.engine.ahead
    for _ in range(2):
        assert outputs(llm) == want
    assert llm.last_metrics["graphs/replayed_steps"] > 20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU: CUDA graphs, streams and copies not waited for")
def test_on_a_gpu_a_speculative_engines_bulk_steps_ahead_and_its_tail_verifies(model, fed):
    """The split (``ahead_above``) through real graphs, copies and streams: tokens and
    log-probabilities equal plain stepping's, with steps fed on the device and drafts verified."""
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, gpu_memory_utilization=0.2)
    want = outputs(LLM(model, **kw))
    llm = LLM(model, speculative=SpeculativeConfig(policy="fixed", ahead_above=4, tail="speculate"), **kw)
    assert not llm.engine.ahead and llm.engine.runner.graphs is not None
    for _ in range(2):
        assert outputs(llm) == want
    assert fed[0] > 10 and llm.last_metrics["rollout/spec_verify_steps"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU: CUDA graphs, streams and copies not waited for")
def test_on_a_gpu_a_measured_tail_switching_both_ways_gives_plain_steppings_outputs(model, fed, monkeypatch):
    """The measured tail through real graphs, copies and streams, each way twice in turn: a plain
    step launched right after a verification, a verification right after a plain step settles."""
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, gpu_memory_utilization=0.2)
    want = outputs(LLM(model, **kw))
    llm = LLM(model, speculative=SpeculativeConfig(policy="fixed", ahead_above=8), **kw)
    e = llm.engine
    assert e._tail() and e.runner.graphs is not None
    each_way_twice(e, monkeypatch)
    for _ in range(2):
        assert outputs(llm) == want
    m = llm.last_metrics
    assert m["rollout/tail_plain_steps"] >= 2 and m["rollout/tail_speculate_steps"] >= 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU: whether its steps can be captured")
def test_on_a_gpu_float64_steps_run_eagerly_and_one_at_a_time(model):
    """float64 has no Triton kernels: the reference's attention reads its visibility on the host,
    which a CUDA graph cannot capture. Such an engine captures nothing (no capture tried and
    refused), steps one step at a time, and its tokens are the CPU engine's."""
    kw = dict(dtype="float64", max_num_seqs=5)
    llm = LLM(model, device="cuda", gpu_memory_utilization=0.2, **kw)
    assert llm.engine.runner.graphs is None and not llm.engine.ahead
    assert [[c[0] for c in o] for o in outputs(llm)] == [[c[0] for c in o] for o in outputs(LLM(model, **kw))]


def test_only_the_reference_kernels_are_not_capturable():
    from tailrl.kernels.cpu import CPU
    from tailrl.kernels.reference import REFERENCE
    assert not REFERENCE.capturable and CPU.capturable
