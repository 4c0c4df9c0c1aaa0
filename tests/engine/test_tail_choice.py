"""The tail's choice between speculating one step at a time and plain steps launched ahead
(engine/tail_choice.py), from the rates it measures; the engine's use of it is in
tests/engine/test_ahead.py."""
import pytest

from tailrl.engine.tail_choice import MAX_PROBE, PROBE, TRY, TailChoice


def steps(tc: TailChoice, way: str, n: int, seconds: float, tokens: list[int]) -> list[str]:
    """Record n steps of ``way`` (each as the choice asked for it); the ways chosen after each."""
    out = []
    for _ in range(n):
        tc.record(way, seconds, tokens)
        out.append(tc.way)
    return out


def test_the_tail_speculates_first_then_measures_plain_and_keeps_the_faster():
    tc = TailChoice()
    assert not tc.plain()
    assert steps(tc, "speculate", TRY, 0.004, [3, 3, 3, 3]) == ["speculate"] * (TRY - 1) + ["plain"]
    assert tc.rate["speculate"] == pytest.approx(750.0)                  # 3 tokens in 4 ms
    assert steps(tc, "plain", TRY, 0.002, [1] * 4)[-1] == "speculate"    # 500 a second: slower
    tc2 = TailChoice()
    steps(tc2, "speculate", TRY, 0.004, [1, 1, 4, 4])                    # a quarter gains 1: 250 a second
    assert steps(tc2, "plain", TRY, 0.002, [1] * 4)[-1] == "plain"       # 500: faster, kept


def follow(tc: TailChoice, n: int, cost: dict) -> list[tuple[str, int]]:
    """n steps, each the way the choice asks for, costing ``cost[way]`` (seconds, tokens a row):
    the runs of ways stepped, (way, steps)."""
    runs: list[tuple[str, int]] = []
    for _ in range(n):
        way = tc.way
        tc.record(way, *cost[way])
        runs = runs[:-1] + [(way, runs[-1][1] + 1)] if runs and runs[-1][0] == way else runs + [(way, 1)]
    return runs


def test_the_slower_way_is_measured_again_less_often_while_it_stays_slower():
    tc = TailChoice()
    slow_drafts = {"speculate": (0.004, [1] * 4), "plain": (0.002, [1] * 4)}
    runs = follow(tc, 4 + 32 + 4 + 64 + 4 + 128 + 4 + 256 + 4 + 512 + 4 + 512 + 4, slow_drafts)
    assert runs == [("speculate", TRY), ("plain", PROBE), ("speculate", TRY), ("plain", 2 * PROBE), ("speculate", TRY),
                    ("plain", 4 * PROBE), ("speculate", TRY), ("plain", 8 * PROBE), ("speculate", TRY),
                    ("plain", MAX_PROBE), ("speculate", TRY), ("plain", MAX_PROBE), ("speculate", TRY)]
    # the tail changes: drafts get good, the next probe finds speculation faster and the choice follows
    good_drafts = {"speculate": (0.004, [8] * 4), "plain": (0.002, [1] * 4)}
    runs = follow(tc, MAX_PROBE + 100, good_drafts)
    assert runs[:4] == [("plain", MAX_PROBE), ("speculate", PROBE), ("plain", TRY), ("speculate", 2 * PROBE)]


def test_the_rate_is_the_lower_quartile_of_rows_a_second_averaged():
    tc = TailChoice()
    tc.record("speculate", 1.0, [9, 1, 9, 1, 9, 9, 1, 9])        # sorted: 1, 1, 1, 9, ...: the third
    assert tc.rate["speculate"] == 1.0
    tc.record("speculate", 1.0, [5])
    assert tc.rate["speculate"] == pytest.approx(1.0 + 0.25 * 4)
    tc.record("speculate", 0.0, [5])                              # nothing to learn from: ignored
    tc.record("speculate", 1.0, [])
    assert tc.turns.measured["speculate"] == 2
    with pytest.raises(ValueError, match="way"):
        tc.record("drafting", 1.0, [1])
    m = tc.metrics()
    assert m["rollout/tail_speculate_steps"] == 2 and m["rollout/tail_plain_steps"] == 0
    assert "rollout/tail_plain_rate" not in m
    tc.new_rollout()
    assert tc.metrics()["rollout/tail_speculate_steps"] == 0 and tc.rate["speculate"] is None


def test_each_rollout_measures_speculation_afresh_and_keeps_plains_rate():
    """An RL run's first round has no history to draft from: its tail goes plain, and the
    next round (with history) must try speculation again from its first tail steps."""
    tc = TailChoice()
    no_history = {"speculate": (0.004, [1] * 4), "plain": (0.002, [1] * 4)}
    follow(tc, 4 + MAX_PROBE * 3, no_history)
    assert tc.turns.probe == MAX_PROBE
    plain_rate = tc.rate["plain"]
    tc.new_rollout()
    assert tc.way == "speculate" and tc.rate["plain"] == plain_rate and tc.turns.probe == PROBE
    history = {"speculate": (0.004, [6] * 4), "plain": (0.002, [1] * 4)}
    assert follow(tc, 40, history) == [("speculate", PROBE), ("plain", TRY), ("speculate", 40 - PROBE - TRY)]


def test_an_engine_stepping_one_at_a_time_measures_both_ways_without_changing_an_output(model, monkeypatch):
    """``SpeculativeConfig(one_at_a_time="measured")`` on an engine that launches no step ahead:
    each step speculates or is plain, the way measured faster; bfloat16 outputs equal plain
    decoding's; a speculator made slow (drafting sleeps) is measured slower and mostly not
    asked; off, every step asks it."""
    import time

    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.speculative.speculator import Speculator
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4], [5, 6, 7, 8]]
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=48, ignore_eos=True, seed=3)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, sp)]  # noqa: E731
    want = run(LLM(model, async_scheduling=False))
    with pytest.raises(ValueError, match="one_at_a_time"):
        SpeculativeConfig(one_at_a_time="sometimes")
    llm = LLM(model, async_scheduling=False, speculative=SpeculativeConfig(policy="fixed", one_at_a_time="measured"))
    assert llm.engine.choice is not None
    assert run(llm) == want                             # no history yet: both ways measured
    m = llm.last_metrics
    assert m["rollout/steps_speculate_steps"] >= TRY and m["rollout/steps_plain_steps"] >= TRY
    assert run(llm) == want                             # drafts from the first call's responses: right
    m = llm.last_metrics
    assert m["rollout/spec_accepted_tokens"] > 0 and m["rollout/steps_speculate_rate"] > m["rollout/steps_plain_rate"]
    propose, asked = Speculator.propose, [0]

    def slow(self, *a, **kw):
        asked[0] += 1
        time.sleep(0.02)
        return propose(self, *a, **kw)
    monkeypatch.setattr(Speculator, "propose", slow)
    assert run(llm) == want
    m = llm.last_metrics
    assert m["rollout/steps_plain_steps"] > 2 * m["rollout/steps_speculate_steps"]
    assert asked[0] < m["rollout/num_forward"] / 2
    off = LLM(model, async_scheduling=False, speculative=SpeculativeConfig())
    assert off.engine.choice is None and "rollout/steps_plain_steps" not in (run(off) and off.last_metrics)
