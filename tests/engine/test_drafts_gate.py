"""The gate of rows drafting inside steps launched ahead (engine/drafts_gate.py): the chosen
rows draft where the rows that gain least (the running rows' lower quartile) gain more tokens
a second with the drafts than without, measured over a window of steps."""
import pytest

from tailrl.engine import ahead_drafts as ad
from tailrl.engine.drafts_gate import WINDOW, DraftsGate, Window
from tailrl.engine.tail_choice import MAX_PROBE, PROBE, TRY


def step(period: float, running: int, chosen_tokens: list[int]) -> tuple:
    return period, running, {f"c{i}": n for i, n in enumerate(chosen_tokens)}


def run(gate: DraftsGate, n: int, cost: dict) -> list[tuple[str, int]]:
    """n steps, each the way the gate asks for: ``cost[way](i)`` = (period, running, chosen
    tokens) of that way's i-th step; the runs of ways."""
    runs: list[tuple[str, int]] = []
    count = {"draft": 0, "plain": 0}
    for _ in range(n):
        way = "draft" if gate.drafting() else "plain"
        gate.record(way, *step(*cost[way](count[way])))
        count[way] += 1
        runs = runs[:-1] + [(way, runs[-1][1] + 1)] if runs and runs[-1][0] == way else runs + [(way, 1)]
    return runs


def alternating(gain: int, rows: int):
    """Chosen rows verifying every other step (half of them each step), ``gain`` tokens a verify."""
    return lambda i: [gain if (j + i) % 2 else 0 for j in range(rows)]


def test_in_the_bulk_drafts_pay_only_where_they_do_not_make_steps_longer():
    """16 of 256 rows draft: the quartile row is a plain row, so the steps' pace decides (rows
    sitting out a step compute nothing: a drafting step may be the shorter)."""
    free = {"draft": lambda i: (0.98e-3, 256, alternating(8, 16)(i)), "plain": lambda i: (1.0e-3, 256, [1] * 16)}
    gate = DraftsGate()
    assert run(gate, 100, free)[:4] == [("draft", TRY), ("plain", TRY), ("draft", PROBE), ("plain", TRY)]
    dearer = {"draft": lambda i: (1.05e-3, 256, alternating(8, 16)(i)), "plain": free["plain"]}
    gate = DraftsGate()
    assert run(gate, 200, dearer)[:4] == [("draft", TRY), ("plain", PROBE), ("draft", TRY), ("plain", 2 * PROBE)]


def test_in_the_tail_the_drafting_rows_gain_counts():
    """8 rows running, all chosen: drafting steps 1.5x longer, each row 4.5 tokens a step on
    average (every other step 9): drafting; at 1.2 tokens a step: plain."""
    tail = {"draft": lambda i: (1.5e-3, 8, alternating(9, 8)(i)), "plain": lambda i: (1.0e-3, 8, [1] * 8)}
    gate = DraftsGate()
    runs = run(gate, 300, tail)
    assert runs[:5] == [("draft", TRY), ("plain", TRY), ("draft", PROBE), ("plain", TRY), ("draft", 2 * PROBE)]
    assert gate.rate["draft"] == pytest.approx(4.5 / 1.5e-3)
    poor = {"draft": lambda i: (1.5e-3, 8, alternating(2, 8)(i)), "plain": tail["plain"]}
    gate = DraftsGate()
    assert run(gate, 200, poor)[:2] == [("draft", TRY), ("plain", PROBE)]


def window(*steps) -> Window:
    w = Window()
    for x in steps:
        w.append(*x)
    return w


def test_the_quartile_row_and_the_window():
    w = window(step(1e-3, 4, [3, 0, 8, 1]))
    assert w.rate() == pytest.approx(1 / 1e-3)            # rows 0, 1, 3, 8: the second of four
    w.append(*step(1e-3, 4, [1, 5, 0, 1]))
    assert w.rate() == pytest.approx(2 * 2 / 2e-3)        # over 2 steps 2, 2.5, 4, 1 a step: 2
    assert window(step(1e-3, 8, [0, 0, 0, 5, 5, 5, 5, 5])).rate() == 0.0      # three rows of eight sat out
    assert window(step(1e-3, 12, [4, 4, 4])).rate() == pytest.approx(1e3)   # 9 plain rows at 1: the quartile row
    assert window(step(1e-3, 12, [0, 0, 0, 0])).rate() == 0.0   # 4 chosen rows sat out, 8 plain: the third row
    w = window((1e-3, 4, {"c0": 0, "c1": 3}), (1e-3, 4, {"c0": 6, "new": 5}))
    assert w.rate() == pytest.approx(2 / 2e-3)            # c0 3 a step, "new" 5 (its one step), 2 plain rows at 1


def afresh(steps: list) -> float:
    """The window's rate computed from its steps in one pass, as the gate's definition says."""
    running, now = steps[-1][1], steps[-1][2]
    gains = sorted(sum(c[rid] for _, _, c in steps if rid in c) / sum(rid in c for _, _, c in steps) for rid in now)
    rows = sorted(gains + [1.0] * max(0, running - len(gains)))
    return rows[len(rows) // 4] * len(steps) / sum(s for s, _, _ in steps)


def test_the_windows_running_sums_are_its_last_steps():
    """Steps leave the window oldest first, their rows' tokens with them: the rate equals one
    computed afresh from the last ``WINDOW`` steps, whatever rows come and go."""
    import random
    rng = random.Random(3)
    w, steps = Window(), []
    for i in range(200):
        chosen = {f"r{j}": rng.randint(0, 9) for j in rng.sample(range(12), rng.randint(0, 8))}
        x = (rng.uniform(1e-3, 2e-3), rng.randint(len(chosen) or 1, 20), chosen)
        w.append(*x)
        steps.append(x)
        assert w.rate() == pytest.approx(afresh(steps[-WINDOW:]))
        assert len(w.steps) == min(len(steps), WINDOW)
        assert w.seconds == pytest.approx(sum(s for s, _, _ in steps[-WINDOW:]))
        if i % 37 == 36:
            w.clear()
            steps = []


def test_a_way_measured_again_is_measured_anew():
    gate = DraftsGate()
    for _ in range(TRY):
        gate.record("draft", 1e-3, 4, {"a": 2})
    for _ in range(TRY):
        gate.record("plain", 5e-3, 4, {"a": 1})
    assert gate.rate["plain"] == pytest.approx(1 / 5e-3) and gate.drafting()
    for _ in range(PROBE):
        gate.record("draft", 1e-3, 4, {"a": 2})
    assert not gate.drafting()                            # the probe
    gate.record("plain", 0.5e-3, 4, {"a": 1})
    assert gate.rate["plain"] == pytest.approx(1 / 0.5e-3)   # its window started afresh


def test_each_rollout_measures_both_ways_afresh_starting_with_drafts():
    gate = DraftsGate()
    run(gate, 40, {"draft": lambda i: (2e-3, 100, [1] * 4), "plain": lambda i: (1e-3, 100, [1] * 4)})
    assert not gate.drafting()
    gate.new_rollout()
    assert gate.drafting() and gate.rate == {"draft": None, "plain": None}
    assert gate.metrics() == {"rollout/ahead_draft_steps": 0.0, "rollout/ahead_plain_steps": 0.0}
    with pytest.raises(ValueError, match="way"):
        gate.record("speculate", 1e-3, 1, {})


def test_the_probe_interval_grows_to_its_cap():
    gate = DraftsGate()
    run(gate, 20_000, {"draft": lambda i: (1e-3, 4, [3] * 4), "plain": lambda i: (1e-3, 4, [1] * 4)})
    assert gate.turns.probe == MAX_PROBE


class Plan:
    def __init__(self, rid, rows):
        self.req, self.rows = type("R", (), {"request_id": rid})(), rows


def test_the_chosen_rows_tokens_and_a_closed_gate_means_no_drafts():
    from test_ahead_drafts import Told, chain, request
    reqs = [request("a", [5] * 40), request("b", [5] * 10), request("c", [5] * 3)]
    a = ad.AheadDrafts(Told({r.request_id: chain([7, 8, 9]) for r in reqs}), rows=2)
    assert set(a.propose([(r, 1) for r in reqs], reqs, 100)) == {"a", "b"}
    assert a.tokens([Plan("a", [0, 1, 2, 3]), Plan("c", [4])], True) == {"a": 4, "b": 0}    # b sat the step out
    assert a.tokens([Plan("a", [0])], False) == {}          # a plain step: every row gains 1
    a.settled(True, 1e-3, 3, {"a": 4, "b": 0})
    assert a.gate.rate["draft"] == 0.0
    a.gate.turns.restart("plain")
    a._chosen = set()
    assert a.propose([(r, 1) for r in reqs], reqs, 100) == {} and a._chosen == set()   # not ranked either
    a.gate.turns.restart("draft")
    assert set(a.propose([(r, 1) for r in reqs], reqs, 100)) == {"a", "b"}             # ranked at once
    a.new_rollout()
    assert a.drafting() and a._age == ad.REFRESH
    always = ad.AheadDrafts(None, rows=2, measured=False)
    assert always.drafting() and always.tokens([Plan("a", [0])], True) == {}
