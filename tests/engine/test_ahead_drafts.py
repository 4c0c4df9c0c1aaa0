"""Drafts inside steps launched ahead (engine/ahead_drafts.py, ``ahead_drafts``), on the CPU:
every token and log-probability plain decoding gives, with rows verifying every other step,
drafts whose first node guesses a token still on the device, stop tokens and length limits,
rows waiting for room and preemptions, through the graphs' static inputs; the row choice."""
import pytest
import torch
from mixed_requests import outputs

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.engine import ahead_drafts as ad
from tailrl.engine.ahead import PENDING
from tailrl.engine.ahead_drafts import AheadDrafts
from tailrl.engine.batch import ModelRunner, RowPlan
from tailrl.engine.graph_pool import GraphPool, eager_capture
from tailrl.engine.graphs import StepGraphs
from tailrl.engine.request import Request
from tailrl.engine.tail_choice import TRY
from tailrl.speculative.draft import Draft
from tailrl.speculative.history import HistoryStore
from tailrl.speculative.speculator import Speculator


def engine(model, dtype="bfloat16", graphs=False, rows=8, gate="always", **kw) -> LLM:
    """Every step launched ahead (the tail's way forced plain), ``rows`` rows drafting in them."""
    llm = LLM(model, dtype=dtype, async_scheduling=True, **kw,
              speculative=SpeculativeConfig(policy="fixed", ahead_above=1, ahead_drafts=rows, ahead_drafts_gate=gate))
    e = llm.engine
    if graphs:
        e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64,
                                                          grouped=True))
    e.tail.plain = lambda: True
    return llm


@pytest.fixture
def guessed(monkeypatch):
    """Counts the drafts made for rows whose last token was still on the device."""
    count = [0]
    chain_from = Speculator.chain_from

    def counting(self, req, skip, room):
        d, expected = chain_from(self, req, skip, room)
        count[0] += skip == 1 and d is not None and expected >= ad.MIN_EXPECTED
        return d, expected
    monkeypatch.setattr(Speculator, "chain_from", counting)
    return count


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_rows_drafting_inside_steps_launched_ahead_give_plain_decodings_outputs(model, dtype, graphs, guessed):
    """Three rounds (the later ones draft from the earlier's responses): tokens, log-probabilities
    and finish reasons equal plain stepping's, with drafts verified and accepted inside steps
    launched ahead, some of them after a guessed first token; no step left in flight."""
    want = outputs(LLM(model, dtype=dtype, max_num_seqs=256, async_scheduling=False))
    llm = engine(model, dtype, graphs, max_num_seqs=256)
    e = llm.engine
    assert e.ahead_drafts is not None and not e.ahead
    steps = []
    for _ in range(3):
        assert outputs(llm) == want
        assert e._launched is None
        m = llm.last_metrics
        steps.append(m["rollout/num_forward"])
    assert m["rollout/spec_verify_steps"] > 10 and m["rollout/spec_accepted_tokens"] > 20
    assert guessed[0] > 0
    # verifying rows followed up in the next step: some had their accept length, some not
    assert 0 < m["rollout/ahead_follow_hits"] < m["rollout/ahead_follow_ups"]
    assert steps[-1] < steps[0]                 # the drafts shortened the rollout's steps
    if graphs:
        assert m["graphs/replayed_steps"] > 5


def test_the_gate_opening_and_closing_mid_rollout_changes_no_output(model):
    """The measured gate (both ways stepped each rollout), and a gate flipped every few steps
    (rows caught mid-verification when drafts stop, and drafting again after plain steps):
    plain stepping's outputs."""
    want = outputs(LLM(model, dtype="bfloat16", max_num_seqs=256, async_scheduling=False))
    llm = engine(model, gate="measured", max_num_seqs=256)
    for _ in range(2):
        assert outputs(llm) == want
        m = llm.last_metrics
        assert m["rollout/ahead_draft_steps"] >= TRY and m["rollout/ahead_plain_steps"] >= TRY
    gate = llm.engine.ahead_drafts.gate
    flips = iter(int(i % 7 < 3) for i in range(10**6))
    gate.drafting = lambda: bool(next(flips))
    for _ in range(2):
        assert outputs(llm) == want
    assert llm.last_metrics["rollout/spec_verify_steps"] > 0
    with pytest.raises(ValueError, match="ahead_drafts_gate"):
        SpeculativeConfig(ahead_drafts_gate="sometimes")


def test_with_rows_waiting_and_preemptions(model):
    kw = dict(dtype="bfloat16", max_model_len=128, kv_cache_tokens=256, max_num_seqs=6)
    want = outputs(LLM(model, async_scheduling=False, **kw))
    llm = engine(model, rows=3, **kw)
    verified = preempted = hits = 0
    for _ in range(3):
        assert outputs(llm) == want
        verified += llm.last_metrics["rollout/spec_verify_steps"]
        preempted += llm.last_metrics["rollout/preemptions"]
        hits += llm.last_metrics["rollout/ahead_follow_hits"]
    assert verified > 0 and preempted > 0 and hits > 0


def test_follow_ups_take_a_step_from_each_verification_they_hit(model, monkeypatch):
    """Rows that verify a draft follow it up in the next step (the likeliest accept lengths):
    the same outputs as without follow-ups, in fewer engine steps (calls: where every row sits a
    step out, the engine has nothing to launch and waits for the step in flight instead)."""
    prompts, params = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4]], SamplingParams(n=4, temperature=1.0, max_tokens=120, seed=4)
    runs = {}
    for k in (0, ad.FOLLOW_UPS):
        monkeypatch.setattr(ad, "FOLLOW_UPS", k)
        llm = engine(model, max_num_seqs=256)
        e, count = llm.engine, [0]
        step = e.step

        def counted():
            count[0] += 1
            return step()
        e.step = counted
        llm.generate(prompts, params)                                  # the history the next round drafts from
        count[0] = 0
        got = [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, params)]
        runs[k] = got, count[0], llm.last_metrics["rollout/ahead_follow_hits"]
    assert runs[0][0] == runs[ad.FOLLOW_UPS][0]
    assert runs[0][2] == 0 < runs[ad.FOLLOW_UPS][2]
    assert runs[ad.FOLLOW_UPS][1] < runs[0][1], (runs[0][1:], runs[ad.FOLLOW_UPS][1:])


def test_the_follow_ups_are_the_likeliest_accept_lengths():
    gets = AheadDrafts(None, 1)
    req = Request("a", [1, 2], SamplingParams(max_tokens=50), 0)
    gets._reach["a"] = [1.0, 0.9, 0.81, 0.405, 0.0405]      # P(accepted >= k): chain probs .9 .9 .5 .1
    plan = RowPlan(req, 1, [-1, 0, 1, 2], [5, 6, 7, 8], 0)
    got = gets.follow([plan], [(req, 0)], budget=100)
    assert got["a"].lengths == [2, 3, 0] and got["a"].depth == 4     # P(a = k): .1 .09 .405 .3645 .0405
    gets._reach["a"] = [1.0, 0.9, 0.81, 0.405, 0.0405]
    assert gets.follow([plan], [(req, 0)], budget=2)["a"].lengths == [2, 3]
    assert gets.follow([plan], [(req, 1)], budget=100) == {}        # a row with a token to compute: none


def test_every_token_reaches_the_speculators_sources_once_in_order(model, monkeypatch):
    seen: dict = {}
    llm = engine(model, max_num_seqs=256)
    spec = llm.engine.speculator
    observe_many = spec.observe_many
    # the rows' tokens as a source that reads them gets them (the default sources read none)
    monkeypatch.setattr(Speculator, "tokens_wanted", property(lambda self: True))

    def recording(items):
        for req, new_tokens in items:
            assert PENDING not in new_tokens
            seen.setdefault(req.request_id, []).extend(new_tokens)
        return observe_many(items)
    monkeypatch.setattr(spec, "observe_many", recording)
    llm.generate(PROMPTS_ONCE, PARAMS_ONCE)                  # a history to draft from
    seen.clear()
    outs = llm.generate(PROMPTS_ONCE, PARAMS_ONCE)
    responses = sorted(list(c.token_ids) for o in outs for c in o.outputs)
    assert sorted(seen.values()) == responses
    assert llm.last_metrics["rollout/spec_verify_steps"] > 0


PROMPTS_ONCE = [[1, 2, 3], [9, 8, 7, 6, 5]]
PARAMS_ONCE = SamplingParams(n=3, temperature=1.0, max_tokens=30, seed=2)


def test_ahead_drafts_is_checked():
    for bad in (-1, 1.5, True, "4"):
        with pytest.raises(ValueError, match="ahead_drafts"):
            SpeculativeConfig(ahead_drafts=bad)


def test_not_with_a_learned_drafter_nor_where_steps_are_not_launched_ahead(model):
    llm = LLM(model, speculative=SpeculativeConfig(ahead_drafts=4))      # a CPU: one step at a time
    assert llm.engine.ahead_drafts is None


# ---- the row choice, with a speculator that drafts what it is told -----------------

class Told:
    """``chain_from`` as the speculator's, from a fixed chain per request."""
    def __init__(self, chains: dict):
        self.chains, self.asked = chains, []

    def chain_from(self, req, skip, room):
        self.asked.append((req.request_id, skip, list(req.output_token_ids)))
        d = self.chains.get(req.request_id)
        if d is None or len(d) <= skip:
            return None, 0.0
        k = min(len(d) - skip, room)
        return (d.rest(skip) if skip else d).truncate(k), float(sum(d.path_probs[skip:skip + k]))


def request(rid: str, out: list[int], max_tokens: int = 100, prior: tuple = ()) -> Request:
    r = Request(rid, [1, 2], SamplingParams(max_tokens=max_tokens), seed_key=0)
    r.output_token_ids = list(out)
    r.length_prior = prior
    return r


def chain(tokens, p=0.9) -> Draft:
    return Draft(list(tokens), list(range(-1, len(tokens) - 1)), [p] * len(tokens), "history")


def test_the_rows_expected_to_run_longest_draft_within_the_budget():
    reqs = [request("a", [5] * 3), request("b", [5] * 40), request("c", [5] * 20),
            request("d", [5] * 2, prior=(300,))]         # a prior says d runs long
    told = Told({r.request_id: chain([7, 8, 9, 10]) for r in reqs})
    a = ad.AheadDrafts(told, rows=2)
    got = a.propose([(r, 1) for r in reqs], reqs, budget=100)
    assert set(got) == {"b", "d"}
    assert a.expected_left(reqs[0]) == 3 and a.expected_left(reqs[3]) == 98   # capped by max_tokens
    a._age = ad.REFRESH
    got = a.propose([(r, 1) for r in reqs], reqs, budget=6)   # the first fits, the second gets the rest
    assert [len(d) for d in got.values()] == [4, 2]
    got = a.propose([(reqs[1], 0), (reqs[3], 1)], reqs, budget=100)   # a row sitting out a step drafts not
    assert set(got) == {"d"}


def test_without_priors_a_prompts_history_says_which_rows_run_long():
    """The lengths of a prompt's responses in the history store (the previous round's) are its
    requests' priors: a request of a prompt whose responses ran 400 tokens outranks one that has
    generated more so far, and outranks its sibling once the sibling has outlived them."""
    store = HistoryStore()
    store.record("long", [[1] * 400, [1] * 40])
    store.record("short", [[1] * 20])
    reqs = [request(rid, [5] * g, max_tokens=1000) for rid, g in (("a", 30), ("b", 10), ("c", 50))]
    reqs[0].prompt_id, reqs[1].prompt_id, reqs[2].prompt_id = "short", "long", "long"
    a = ad.AheadDrafts(Told({}), rows=1, history=store)
    assert [a.expected_left(r) for r in reqs] == [30, 210, 350]
    a.propose([(r, 1) for r in reqs], reqs, budget=100)
    assert a._chosen == {"c"}
    assert ad.AheadDrafts(Told({}), rows=1).expected_left(reqs[1]) == 10


def test_a_row_waiting_on_the_device_drafts_the_chain_less_its_guess():
    r = request("a", [5, 6, PENDING])
    told = Told({"a": chain([7, 8, 9])})
    got = ad.AheadDrafts(told, rows=1).propose([(r, 1)], [r], budget=100)
    assert got["a"].tokens == [8, 9]
    assert told.asked == [("a", 1, [5, 6])]                  # the sources saw the settled tokens
    assert r.output_token_ids == [5, 6, PENDING]             # the placeholder is back


def test_drafts_expected_to_accept_too_little_are_not_verified():
    r = request("a", [5, 6])
    assert ad.AheadDrafts(Told({"a": chain([7, 8], p=0.4)}), rows=1).propose([(r, 1)], [r], 100) == {}
    assert set(ad.AheadDrafts(Told({"a": chain([7, 8], p=0.7)}), rows=1).propose([(r, 1)], [r], 100)) == {"a"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU: CUDA graphs, streams and copies not waited for")
def test_on_a_gpu_rows_drafting_inside_steps_launched_ahead_give_plain_steppings_outputs(model, guessed):
    kw = dict(device="cuda", dtype="bfloat16", max_num_seqs=64, gpu_memory_utilization=0.2)
    want = outputs(LLM(model, **kw))
    spec = SpeculativeConfig(policy="fixed", ahead_above=1, ahead_drafts=8, ahead_drafts_gate="always")
    llm = LLM(model, speculative=spec, **kw)
    llm.engine.tail.plain = lambda: True
    for _ in range(3):
        assert outputs(llm) == want
    assert llm.last_metrics["rollout/spec_verify_steps"] > 0 and guessed[0] > 0
    assert llm.last_metrics["graphs/replayed_steps"] > 5
    assert llm.last_metrics["rollout/ahead_follow_hits"] > 0     # K/V moved on the device, not waited for
