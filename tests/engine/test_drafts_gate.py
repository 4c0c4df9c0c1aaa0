"""The gate of rows drafting inside steps launched ahead (engine/drafts_gate.py): the chosen
rows draft where the rows that set the makespan progress faster with drafts, measured."""
import math

import pytest

from tailrl.engine import ahead_drafts as ad
from tailrl.engine.drafts_gate import DraftsGate
from tailrl.engine.tail_choice import MAX_PROBE, PROBE, TRY


def run(gate: DraftsGate, n: int, cost: dict, spread: float = math.inf) -> list[tuple[str, int]]:
    """n steps, each the way the gate asks for: ``cost[way]`` = (period, gain); the runs of ways."""
    runs: list[tuple[str, int]] = []
    for _ in range(n):
        way = "draft" if gate.drafting() else "plain"
        seconds, gain = cost[way]
        gate.record(way, seconds, gain if way == "draft" else None, spread)
        runs = runs[:-1] + [(way, runs[-1][1] + 1)] if runs and runs[-1][0] == way else runs + [(way, 1)]
    return runs


def test_drafts_that_cost_no_step_time_stay_on_and_plain_is_probed_less_and_less_often():
    gate = DraftsGate()
    runs = run(gate, 300, {"draft": (1.0e-3, 2.5), "plain": (1.0e-3, None)})
    assert runs[:5] == [("draft", TRY), ("plain", TRY), ("draft", PROBE), ("plain", TRY),
                        ("draft", 2 * PROBE)]      # the probe left the choice as it was: its interval doubled
    assert gate.steps["draft"] > 250


def test_drafts_whose_steps_cost_more_than_they_gain_stop_after_their_trial():
    gate = DraftsGate()
    runs = run(gate, 200, {"draft": (2.0e-3, 1.5), "plain": (1.0e-3, None)})
    assert runs[:4] == [("draft", TRY), ("plain", PROBE), ("draft", TRY), ("plain", 2 * PROBE)]


def test_the_spread_of_expected_lengths_bounds_what_drafts_gain():
    """With 4 tokens a step for the chosen rows but steps 1.3x longer: drafting wins only if the
    first row not chosen is expected to end well before the longest (spread > 1.3)."""
    cost = {"draft": (1.3e-3, 4.0), "plain": (1.0e-3, None)}
    for spread, wins in ((1.2, "plain"), (1.5, "draft"), (math.inf, "draft")):
        gate = DraftsGate()
        runs = run(gate, 2 * TRY + 1, cost, spread)
        assert runs[-1][0] == wins, spread
    gate = DraftsGate()                             # no lengths known: drafts pay only where they are free
    assert run(gate, 2 * TRY + 1, cost, spread=1.0)[-1][0] == "plain"


def test_a_way_measured_again_is_measured_anew():
    """A rollout's batch shrinks: the plain steps of its first window (a large batch) say nothing
    about plain steps later; a probe's first step replaces them."""
    gate = DraftsGate()
    run(gate, 2 * TRY, {"draft": (1.0e-3, 1.2), "plain": (5.0e-3, None)})
    assert gate.drafting() and gate.period["plain"] == pytest.approx(5.0e-3)
    run(gate, PROBE, {"draft": (1.0e-3, 1.2), "plain": (0.5e-3, None)})
    assert not gate.drafting()                      # the probe now
    gate.record("plain", 0.5e-3, None, math.inf)
    assert gate.period["plain"] == pytest.approx(0.5e-3)


def test_each_rollout_measures_both_ways_afresh_starting_with_drafts():
    gate = DraftsGate()
    run(gate, 40, {"draft": (2.0e-3, 1.0), "plain": (1.0e-3, None)})
    assert not gate.drafting()
    gate.new_rollout()
    assert gate.drafting() and gate.period == {"draft": None, "plain": None} and gate.gain is None
    assert gate.metrics() == {"rollout/ahead_draft_steps": 0.0, "rollout/ahead_plain_steps": 0.0}
    with pytest.raises(ValueError, match="way"):
        gate.record("speculate", 1e-3, None, 1.0)


def test_the_probe_interval_grows_to_its_cap():
    gate = DraftsGate()
    run(gate, 20_000, {"draft": (1.0e-3, 3.0), "plain": (1.0e-3, None)})
    assert gate.turns.probe == MAX_PROBE


# ---- what AheadDrafts hands the gate ------------------------------------------------------------

def test_the_spread_is_the_longest_rows_expected_tokens_over_the_first_not_chosen():
    assert ad._spread(400.0, 100.0) == 4.0
    assert ad._spread(400.0, None) == math.inf      # every row chosen
    assert ad._spread(0.0, 0.0) == 1.0              # nothing known
    assert ad._spread(50.0, 0.0) == math.inf


class Plan:
    def __init__(self, req, rows):
        self.req, self.rows = req, rows


class Req:
    def __init__(self, rid):
        self.request_id = rid


def test_the_gain_counts_the_chosen_rows_tokens_and_a_row_sitting_out_gains_none():
    a = ad.AheadDrafts(None, rows=3)
    assert a.gain([]) is None
    a._chosen = {"a", "b", "c"}                     # c sits this step out
    plans = [Plan(Req("a"), [0, 1, 2, 3, 4]), Plan(Req("b"), [5]), Plan(Req("z"), [6])]
    assert a.gain(plans) == 2.0


def test_the_gate_closed_means_no_drafts_and_the_rows_still_ranked():
    from test_ahead_drafts import Told, chain, request
    reqs = [request("a", [5] * 40), request("b", [5] * 10), request("c", [5] * 3)]
    a = ad.AheadDrafts(Told({r.request_id: chain([7, 8, 9]) for r in reqs}), rows=2)
    assert set(a.propose([(r, 1) for r in reqs], reqs, 100)) == {"a", "b"}
    assert a.spread == pytest.approx(40 / 3)
    a.gate.turns.restart("plain")
    assert a.propose([(r, 1) for r in reqs], reqs, 100) == {}
    a.new_rollout()
    assert a.drafting() and a._age == ad.REFRESH
    assert ad.AheadDrafts(None, rows=2, measured=False).drafting()
