"""Steps launched ahead hand out the target's hidden states when they settle
(engine/ahead.py ``HandOut``): a learned drafter's pasts and an online drafter's buffer get
every position's state, bit for bit the state an engine stepping one step at a time hands out,
whatever mix of steps launched ahead and speculative steps ran; so an engine that collects
states steps ahead in its bulk, and the spot trainer gets its turn between those steps."""
import pytest
import torch
from mixed_requests import PARAMS, PROMPTS

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.config import AHEAD_ABOVE
from tailrl.drafter.buffer import DrafterBuffer
from tailrl.engine.batch import ModelRunner
from tailrl.engine.graph_pool import GraphPool, eager_capture
from tailrl.engine.graphs import StepGraphs


class Recorder:
    """A collector (the spot trainer's place) keeping each (request, position)'s state, and a
    real buffer fed the same hand-outs."""

    def __init__(self) -> None:
        self.states: dict[tuple[str, int], torch.Tensor] = {}
        self.buffer = DrafterBuffer(1 << 16)

    def add_spans(self, hidden, spans) -> None:
        for req, start, row, k in spans:
            for i in range(k):
                key, state = (req.request_id, start + i), hidden[row + i]
                if key in self.states:          # handed out again (a preempted request's recompute)
                    assert torch.equal(self.states[key], state)
                self.states[key] = state.clone()
        self.buffer.add_spans(hidden, spans)

    def finish(self, req) -> None:
        self.buffer.finish(req)


def collecting(model, dtype, ahead: bool, ahead_above: int | None, graphs: bool = False, **kw) -> tuple[LLM, Recorder]:
    llm = LLM(model, dtype=dtype, max_num_seqs=256, async_scheduling=ahead,
              speculative=SpeculativeConfig(policy="fixed", ahead_above=ahead_above, tail="speculate"), **kw)
    e = llm.engine
    if graphs:
        e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64,
                                                          grouped=True))
    rec = Recorder()
    e.speculator.collector = rec
    return llm, rec


def assert_same_states(want: Recorder, got: Recorder) -> None:
    assert got.states.keys() == want.states.keys()
    assert all(torch.equal(got.states[k], v) for k, v in want.states.items())
    # the buffers hold the same runs (siblings' prompts copied from the run that computed them)
    runs = [sorted(((r.start, r.tokens, r.states()) for r in rec.buffer._runs.values()), key=lambda x: x[:2])
            for rec in (want, got)]
    assert len(runs[0]) == len(runs[1]) and len(want.buffer) >= len(want.states)
    assert all(a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(*runs))


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_steps_launched_ahead_hand_out_the_states_of_a_waiting_engine(model, dtype, graphs, fed):
    """Mixed requests (stop tokens a step launched ahead cannot know, a length limit of one, a
    long prompt, groups sharing a prefill), stepped ahead while more than 3 requests remain and
    speculating after: every position's state equals the one an engine stepping one at a time
    hands out, no position is missing or handed out twice with other bits."""
    ref, want = collecting(model, dtype, ahead=False, ahead_above=0)
    llm, got = collecting(model, dtype, ahead=True, ahead_above=3, graphs=graphs)
    a, b = ref.generate(PROMPTS, PARAMS), llm.generate(PROMPTS, PARAMS)
    assert [[c.token_ids for c in o.outputs] for o in b] == [[c.token_ids for c in o.outputs] for o in a]
    assert fed[0] > 3 and llm.last_metrics["rollout/spec_verify_steps"] > 0
    assert_same_states(want, got)
    # every request's positions, from its first handed out to the one before its last token
    ends = {}
    for rid, pos in want.states:
        lo, hi = ends.get(rid, (pos, pos))
        ends[rid] = (min(lo, pos), max(hi, pos))
    assert all(hi - lo + 1 == sum(1 for r, _ in want.states if r == rid) for rid, (lo, hi) in ends.items())


def test_preempted_requests_steps_ahead_hand_out_their_states_once_more_unchanged(model, fed):
    """A pool of 8 blocks where the batch needs more: rows preempted while a step is in flight
    are recomputed, their prompt states handed out again with the same bits."""
    kw = dict(max_model_len=128, kv_cache_tokens=256)
    ref, want = collecting(model, "bfloat16", ahead=False, ahead_above=0, **kw)
    llm, got = collecting(model, "bfloat16", ahead=True, ahead_above=2, **kw)
    ref.generate(PROMPTS, PARAMS)
    llm.generate(PROMPTS, PARAMS)
    assert llm.last_metrics["rollout/preemptions"] > 0 and fed[0] > 0
    assert_same_states(want, got)


def test_an_engine_that_collects_states_steps_ahead_above_64_requests_by_default(model, fed):
    """``ahead_above=None`` is AHEAD_ABOVE (64) with an online drafter's collector attached too
    (attached at any time): the bulk's steps go ahead, and the collector gets what an engine
    stepping one at a time gives it."""
    prompts = [[(5 * i + j) % 89 + 1 for j in range(6)] for i in range(40)]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=4)
    ref, want = collecting(model, "bfloat16", ahead=False, ahead_above=0)
    llm, got = collecting(model, "bfloat16", ahead=True, ahead_above=None)
    assert llm.engine._above() == AHEAD_ABOVE == 64
    a, b = ref.generate(prompts, params), llm.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in b] == [[c.token_ids for c in o.outputs] for o in a]
    assert fed[0] > 3                                     # 80 requests: the first steps went ahead
    assert_same_states(want, got)


def test_work_between_steps_runs_after_every_step_launched_ahead_too(model, fed):
    """The engine's between-steps work (the spot trainer's ``after_step``) is called once a
    call, with the settled step's rows, where steps go ahead as where they wait."""
    llm, _ = collecting(model, "bfloat16", ahead=True, ahead_above=3)

    class Idle:
        def __init__(self) -> None:
            self.sizes: list[int] = []

        def after_step(self, batch_size: int) -> None:
            assert llm.engine._launched is None or llm.engine._launched.batch.plans    # never mid-step
            self.sizes.append(batch_size)
    idle = llm.engine.idle_work = Idle()
    llm.generate(PROMPTS, PARAMS)
    m = llm.last_metrics
    assert fed[0] > 3 and max(idle.sizes) > 3 and min(idle.sizes) <= 3
    assert len(idle.sizes) >= m["rollout/num_forward"] - 2     # the last step launched ahead settles alone
