"""A speculative engine that steps ahead (``async_scheduling``: a GPU's by default) chooses per
step between verifying drafts one step at a time and a plain step launched ahead (engine/modes.py):
outputs are plain decoding's whatever the sequence of modes; the choice follows the measured
seconds per token per batch-size bucket, tries the losing mode again at a pace that backs off,
and never steps ahead while hidden states are handed out."""
import random

import pytest

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.engine import modes
from tailrl.engine.ahead import PENDING
from tailrl.engine.batch import ModelRunner
from tailrl.engine.graph_pool import GraphPool, eager_capture
from tailrl.engine.graphs import StepGraphs
from tailrl.engine.modes import AHEAD, DRAFT, ModeChoice
from tailrl.speculative.speculator import Speculator

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]
PARAMS = [SamplingParams(n=3, temperature=1.0, max_tokens=40, stop_token_ids=[11, 23], seed=3),
          SamplingParams(n=2, temperature=0.0, max_tokens=25, stop_token_ids=[7]),
          SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=20, max_tokens=30, seed=5),
          SamplingParams(n=3, temperature=1.2, max_tokens=35, stop_token_ids=[3, 50], seed=9)]


def outputs(llm: LLM):
    outs = llm.generate(PROMPTS, PARAMS, prompt_ids=[f"p{i}" for i in range(len(PROMPTS))])
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_drafting_and_stepping_ahead_in_any_order_give_plain_decodings_outputs(model, dtype, graphs, monkeypatch):
    """Modes drawn at random per step (switches both ways, many of them), two calls (the
    second drafts from the first's history): every token, log-probability and finish reason
    equals plain decoding's; both modes ran; no placeholder is left between calls."""
    want = outputs(LLM(model, dtype=dtype, async_scheduling=False))
    rng = random.Random(0)
    monkeypatch.setattr(ModeChoice, "choose", lambda self, rows: rng.choice([DRAFT, AHEAD, AHEAD]))
    llm = LLM(model, dtype=dtype, speculative=SpeculativeConfig(policy="fixed"), async_scheduling=True)
    e = llm.engine
    assert e.modes is not None and not e.ahead
    if graphs:
        e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), 64,
                                                          grouped=True))
    for _ in range(2):
        assert outputs(llm) == want
        assert e._launched is None and all(PENDING not in r.output_token_ids for r in e.requests.values())
    m = llm.last_metrics
    assert m["rollout/spec_ahead_steps"] > 10 and m["rollout/spec_verify_steps"] > 10
    assert m["rollout/spec_accepted_tokens"] > 0


def test_hidden_states_handed_out_keep_every_step_drafting(model, monkeypatch):
    monkeypatch.setattr(Speculator, "needs_hidden", property(lambda self: True))
    monkeypatch.setattr(ModeChoice, "choose", lambda self, rows: AHEAD)
    llm = LLM(model, speculative=SpeculativeConfig(policy="fixed"), async_scheduling=True)
    outputs(llm)
    assert llm.last_metrics["rollout/spec_ahead_steps"] == 0


def test_only_an_engine_that_steps_ahead_chooses(model):
    assert LLM(model, speculative=SpeculativeConfig()).engine.modes is None        # a CPU: no CUDA graphs
    assert LLM(model, async_scheduling=True).engine.modes is None                  # no speculator: always ahead


def run(choice: ModeChoice, costs: dict[str, float], steps: int, rows: int = 8) -> list[str]:
    got = []
    for _ in range(steps):
        mode = choice.choose(rows)
        choice.observe(mode, rows, costs[mode] * rows, rows)
        got.append(mode)
    return got


def test_the_choice_follows_the_cheaper_mode_and_tries_the_other_at_a_pace_that_backs_off():
    c = ModeChoice()
    first = run(c, {DRAFT: 2.0, AHEAD: 1.0}, 2 * modes.TRIAL)
    assert first == [DRAFT] * modes.TRIAL + [AHEAD] * modes.TRIAL          # a fresh bucket tries both
    got = run(c, {DRAFT: 2.0, AHEAD: 1.0}, 2000)
    trials = [i for i in range(1, len(got)) if got[i] == DRAFT and got[i - 1] == AHEAD]
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert got.count(DRAFT) < 0.03 * len(got) and gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]
    assert run(c, {DRAFT: 1.0, AHEAD: 1.0}, 5)[-1] == AHEAD
    # drafting becomes cheaper (good drafts): its next trial wins, and it stays
    got = run(c, {DRAFT: 0.5, AHEAD: 1.0}, modes.MAX_EXPLORE + 20)
    assert got[-10:] == [DRAFT] * 10
    # each batch-size bucket learns alone: a fresh one tries both modes again
    assert run(c, {DRAFT: 0.5, AHEAD: 1.0}, modes.TRIAL, rows=200) == [DRAFT] * modes.TRIAL
    assert set(c.costs()) == {modes.bucket(8), modes.bucket(200)}
