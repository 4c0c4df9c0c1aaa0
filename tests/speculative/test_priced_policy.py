"""The priced policy and its step-cost curve: depth follows what a step costs."""
import pytest

from tailrl.speculative.draft import Draft
from tailrl.speculative.policies.priced import PricedPolicy
from tailrl.speculative.policies.step_curve import StepCurve, token_bucket


class Req:
    def __init__(self, rid: str, generated: int = 0):
        self.request_id = rid
        self.output_token_ids = [0] * generated


def curve_of(fn, points=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> StepCurve:
    c = StepCurve()
    for n in points:
        for _ in range(2):                    # a shape's first step is not counted
            c.observe(n, fn(n))
    return c


def memory_bound(n: int) -> float:          # flat up to 16 tokens, then a row's arithmetic each
    return 0.01 + 0.001 * max(0, n - 16)


def compute_bound(n: int) -> float:         # every token costs as much as a row
    return 0.001 * n


def chain(n: int = 16, p: float = 1.0) -> Draft:
    return Draft.chain(list(range(n)), [p] * n, source="history")


def test_token_buckets():
    assert [token_bucket(n) for n in (1, 2, 16)] == [1, 2, 16]
    assert token_bucket(17) == token_bucket(18) == 17 and token_bucket(32) == 20 and token_bucket(64) == 24


def test_curve_interpolates_holds_and_extrapolates_as_compute_bound():
    c = curve_of(memory_bound, points=(1, 16, 64))
    assert c.predict(1) == pytest.approx(0.01) and c.predict(8) == pytest.approx(0.01)
    assert c.predict(40) == pytest.approx(0.01 + 0.001 * 24)                 # between 16 and 64
    top = memory_bound(64)
    assert c.predict(128) == pytest.approx(top * 2)                           # proportional above
    assert c.predict_flat(100) == pytest.approx(top)                          # optimistic up to 2x
    assert c.max_tokens() == 64


def test_curve_pools_a_noisy_point_instead_of_carrying_it_up():
    c = curve_of(lambda n: 0.01, points=(1, 2, 4, 8, 16, 32))
    c.observe(4, 0.05)                       # one slow step (a neighbour, a page fault)
    ys = [c.predict(n) for n in (1, 2, 4, 8, 16, 32)]
    assert ys == sorted(ys)                  # never falls with more tokens
    assert ys[-1] < 0.02                     # the outlier is averaged in, not carried to the end


def test_deep_drafts_where_steps_are_flat_none_where_tokens_cost_rows():
    flat = PricedPolicy(curve_of(memory_bound), max_draft_tokens=16)
    props = [(Req("a"), chain(16, 1.0))]
    for _ in range(5):                       # high measured acceptance
        flat.update(props[0][0], 8, 8, "history")
    assert flat.max_paths(1) == 1
    assert flat.allocate(props, 1) == [16]   # all 16: past the ridge a token costs a tenth of a step
    steep = PricedPolicy(curve_of(compute_bound), max_draft_tokens=16, explore_every=0)
    many = [(Req(f"r{i}"), chain(16, 0.9)) for i in range(64)]
    assert steep.max_paths(64) == 0
    assert steep.allocate(many, 64) == [0] * 64


def test_unmeasured_acceptance_limits_depth():
    pol = PricedPolicy(curve_of(lambda n: 0.01 + 0.0004 * n), max_draft_tokens=16)
    r = Req("a")
    for _ in range(5):                        # acceptance 1/3 per token
        pol.update(r, 6, 1, "history")
    k = pol.allocate([(r, chain(16))], 1)[0]
    assert 0 < k < 6                          # deep nodes are nearly never reached: not worth a token


def test_among_equal_gains_the_long_requests_go_first():
    pol = PricedPolicy(curve_of(lambda n: 0.002 * max(n, 8)), max_draft_tokens=4)
    reqs = [Req("short", generated=5), Req("long", generated=500), Req("mid", generated=50)]
    props = [(r, chain(4, 1.0)) for r in reqs]
    assert pol.allocate(props, 3, max_tokens=5) == [1, 2, 2]


def test_a_flat_curve_is_learned_doubling_by_doubling_a_steep_one_is_not_explored():
    pol = PricedPolicy(max_draft_tokens=16, explore_every=4)
    r = Req("a")
    for _ in range(2):                            # a fresh engine at batch 1: plain steps seen
        pol.observe_step(1, 1, 0.01)
    measured = []
    for _ in range(10):                           # each new shape twice: its first step is not counted
        assert pol.max_paths(1) == 1 and pol._exploring
        k = pol.allocate([(r, chain(16))], 1)[0]
        assert 1 + k <= 2 * pol.curve.max_tokens()            # never past twice the measured range
        pol.observe_step(1, 1 + k, memory_bound(1 + k))
        pol.update(r, k, k, "history")            # exact drafts: all accepted
        measured.append(1 + k)
    assert measured == [2, 2, 4, 4, 8, 8, 16, 16, 17, 17]   # the whole flat stretch in a few steps
    assert pol.max_paths(1) == 1 and not pol._exploring and pol.allocate([(r, chain(16))], 1) == [16]
    steep = PricedPolicy(curve_of(compute_bound, points=(32, 64)), max_draft_tokens=16, explore_every=4)
    assert [steep.max_paths(64) for _ in range(8)] == [0] * 8
    assert steep.explore_steps == 0


def test_drafting_time_is_not_part_of_the_step_curve():
    pol = PricedPolicy()
    assert pol.max_paths(8) == 0              # nothing measured yet: plain steps first
    pol.observe_step(8, 20, 0.050)            # a shape's first step builds its kernels: not counted
    assert pol.curve.empty
    pol.observe_draft(0.004, requests=8)
    pol.observe_step(8, 20, 0.010)
    assert pol.curve.predict(20) == pytest.approx(0.006)
    assert pol.draft_seconds == pytest.approx(0.0005)
    pol.observe_step(8, 8, 0.005)
    pol.observe_step(8, 8, 0.005)             # the next steps drafted nothing
    assert pol.curve.predict(8) == pytest.approx(0.005)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_draft_tokens"):
        PricedPolicy(max_draft_tokens=0)


def test_the_gate_stops_scanning_layers_only_where_no_deeper_layer_could_save_more():
    """``_layer_saving`` stops at the first layer whose bound on every deeper layer's saving
    is not above the best so far: the same answer as scanning every layer, on curves flat,
    steep and noisy, at any rate and batch size, with drafting time and exploring's reading."""
    import random
    rng = random.Random(0)

    def full_scan(p: PricedPolicy, b: int, rate: float, predict) -> float:
        base = predict(b)
        tau, gain, best = base / b, 0.0, 0.0
        for j in range(1, p.max_draft_tokens + 1):
            gain += b * rate ** j
            best = max(best, tau * gain - (predict(b + b * j) - base) - p.draft_seconds * b)
        return best / base
    stopped = 0
    for _ in range(400):
        knee, slope, noise = rng.choice([4, 16, 64, 512]), rng.choice([1e-5, 1e-4, 1e-3]), rng.random() * 0.3
        c = curve_of(lambda n: (0.01 + slope * max(0, n - knee)) * (1 + noise * rng.random()))
        p = PricedPolicy(c, max_draft_tokens=rng.choice([4, 16]))
        p.draft_seconds = rng.choice([0.0, 1e-5, 1e-4])
        b, rate = rng.choice([1, 3, 16, 64, 256]), rng.choice([0.3, 0.7, 0.9, 0.99])
        for predict in (c.predict, c.predict_flat):
            calls = []
            got = p._layer_saving(b, rate, lambda n: calls.append(n) or predict(n))
            assert got == pytest.approx(full_scan(p, b, rate, predict), rel=1e-12, abs=1e-15)
            stopped += len(calls) < p.max_draft_tokens + 1
    assert stopped > 100                       # the stop is taken, often


def test_a_gate_shut_by_a_stale_rate_probes_it_a_flat_curve_or_a_steep_one_never():
    """Rule 5: where the last measured rate shuts the gate but the highest rate would open it,
    every ``explore_every``-th shut step lets ``PROBE_ROWS`` requests draft, whose
    verifications move the rate, and the gate opens once it is right; where no rate could pay
    (every token costs a row) nothing probes, nor with ``explore_every=0``."""
    from tailrl.speculative.policies.priced import PROBE_ROWS
    pol = PricedPolicy(curve_of(lambda n: 0.01 + 0.0003 * n), max_draft_tokens=16, explore_every=4)
    r = Req("a")
    for _ in range(40):                           # drafts that were poor: a rate near 0.5
        pol.update(r, 4, 1, "history")
    assert pol.max_paths(64) == 0
    probes = []
    for _ in range(12):
        assert pol.max_paths(64) == 0
        probes.append(pol.probe_rows())
    assert probes == [0, 0, PROBE_ROWS] + [0, 0, 0, PROBE_ROWS] * 2 + [0]
    opened = 0
    for _ in range(200):                          # the drafts are right now: each probe accepts all
        if pol.max_paths(64):
            opened += 1
            break
        for _ in range(pol.probe_rows()):
            pol.update(r, 6, 6, "history")
    assert opened and pol.probe_rows() == 0       # an open step is no probe
    steep = PricedPolicy(curve_of(compute_bound), max_draft_tokens=16, explore_every=4)
    for _ in range(40):
        steep.update(r, 4, 1, "history")
    assert [(steep.max_paths(64), steep.probe_rows()) for _ in range(12)] == [(0, 0)] * 12
    never = PricedPolicy(curve_of(lambda n: 0.01 + 0.0003 * n), max_draft_tokens=16, explore_every=0)
    for _ in range(40):
        never.update(r, 4, 1, "history")
    assert [(never.max_paths(64), never.probe_rows()) for _ in range(12)] == [(0, 0)] * 12
