"""Per request and step: suffix draft, drafter draft or none, from measured acceptance and cost;
and the speculator calls the drafter only for the requests the choice asks for."""
from spec_fakes import FakeRequest

from tailrl.config import SpeculativeConfig
from tailrl.spec.draft import Draft
from tailrl.spec.policy import FixedPolicy
from tailrl.spec.source_choice import SourceChoice
from tailrl.spec.speculator import Speculator


class FlatCost:
    """A step of B requests costs 10 ms; one more verified node costs ``slope``."""

    def __init__(self, slope=1e-4):
        self.context, self._slope = 0, slope

    def predict(self, batch_size, num_tokens):
        return 0.01 + self._slope * (num_tokens - batch_size)

    def slope(self, batch_size):
        return self._slope

    def observe(self, *a, **kw):
        pass


def reqs(n):
    return [FakeRequest(f"r{i}", [1, 2, 3]) for i in range(n)]


def chain(n, p=0.9, source="self"):
    return Draft.chain(list(range(1, n + 1)), [p] * n, source)


def measured(choice, drafter_accepts, calls=((0.001, 4),)):
    for _ in range(20):
        choice.record("drafter", 3.0, drafter_accepts)
        choice.record("self", 3.0, 3)
    for call in calls:
        choice.observe_call(*call)


def test_an_unmeasured_drafter_is_asked_for_every_request_without_a_certain_draft():
    choice = SourceChoice(FlatCost())
    rs = reqs(3)
    have = {"r0": None, "r1": chain(2), "r2": chain(6, p=1.0)}
    assert choice.ask(rs, have, {r.request_id: 6 for r in rs}, 3) == rs[:2]
    assert choice.exploring


def test_a_good_cheap_drafter_is_asked_where_suffix_drafts_are_weak():
    choice = SourceChoice(FlatCost())
    measured(choice, drafter_accepts=3)
    rs = reqs(3)
    have = {"r0": None, "r1": chain(1, p=0.5), "r2": chain(5, p=0.99)}
    assert choice.ask(rs, have, {r.request_id: 5 for r in rs}, 3) == rs[:2]


def test_a_poor_or_costly_drafter_is_not_asked_except_to_explore():
    poor = SourceChoice(FlatCost(), explore_every=4)
    measured(poor, drafter_accepts=0)
    rs = reqs(4)
    have = {r.request_id: None for r in rs}
    limits = {r.request_id: 6 for r in rs}
    asked = [poor.ask(rs, have, limits, 4) for _ in range(8)]
    assert [len(a) for a in asked] == [0, 0, 0, 4, 0, 0, 0, 4]      # one step in 4 explores
    costly = SourceChoice(FlatCost())
    measured(costly, drafter_accepts=2, calls=((0.05, 1), (0.2, 4)))  # a call costs more than the gain
    assert costly.ask(rs, have, limits, 4) == []
    cheap = SourceChoice(FlatCost())
    measured(cheap, drafter_accepts=2, calls=((0.0001, 1), (0.0004, 4)))
    assert cheap.ask(rs, have, limits, 4) == rs


def test_exploring_calls_stay_within_their_share_of_the_steps_time():
    choice = SourceChoice(FlatCost(), explore_every=2, explore_share=0.1)
    measured(choice, drafter_accepts=0)
    rs = reqs(2)
    have, limits = {r.request_id: None for r in rs}, {r.request_id: 6 for r in rs}
    explored = []
    for _ in range(12):                       # steps of 10 ms; an exploring call costs 5 ms
        explored.append(bool(choice.ask(rs, have, limits, 2)))
        if choice.exploring:
            choice.observe_call(0.005, 2)
        choice.observe_step(0.010)
    assert sum(explored) >= 2 and choice.explore_s <= 0.1 * choice.elapsed_s + 0.005
    assert explored[1] and not explored[3]    # the second exploring call waits for its share
    assert SourceChoice(FlatCost()).explore_share == 0.02


def test_a_call_s_catch_up_on_queued_positions_is_priced():
    """A call first computes the drafter K/V of the positions queued since the request was last
    drafted for: a request with a long queue is not worth a call that a fresh one is."""
    choice = SourceChoice(FlatCost())
    measured(choice, drafter_accepts=3, calls=((0.0001, 1, 0), (0.0002, 2, 0), (0.0101, 1, 1000), (0.0202, 2, 2000)))
    d0, d1, d2 = choice.call_prices()
    assert abs(d1 - 1e-4) < 1e-6 and abs(d2 - 1e-5) < 1e-7 and d0 < 1e-6
    rs = reqs(2)
    choice.pending = lambda r: {"r0": 0, "r1": 5000}[r.request_id]
    have = {r.request_id: None for r in rs}
    assert choice.ask(rs, have, {r.request_id: 6 for r in rs}, 2) == rs[:1]


def test_pick_the_more_valuable_draft_or_none():
    choice = SourceChoice(FlatCost(slope=1e-4))         # a token is worth 2.5 ms, a node costs 0.1 ms
    measured(choice, drafter_accepts=1)                 # drafter calibration 1/3, suffix 1
    choice.exploring = False
    suffix, drafted = chain(3, p=0.5, source="self"), Draft.chain([1, 2, 3], [0.9] * 3, "drafter")
    assert choice.pick(suffix, drafted, 6, 4) is suffix
    assert choice.pick(None, drafted, 6, 4) is drafted
    assert choice.pick(None, None, 6, 4) is None
    pricey = SourceChoice(FlatCost(slope=0.05))         # verifying costs more than a token is worth
    assert pricey.pick(suffix, None, 6, 4) is suffix    # drafter not asked: the suffix policy's choice
    measured(pricey, drafter_accepts=1)
    pricey.exploring = False
    assert pricey.pick(suffix, drafted, 6, 4) is None   # asked: neither pays
    choice.exploring = True                             # exploring: the drafter's draft is verified
    assert choice.pick(suffix, drafted, 6, 4) is drafted


class FakeDrafter:
    name, needs_hidden = "drafter", True

    def __init__(self):
        self.prepared: list[list[str]] = []

    def prepare(self, requests, max_tokens, max_paths):
        self.prepared.append([r.request_id for r in requests])

    def propose(self, req, max_tokens, max_paths):
        return Draft.chain([7] * max_tokens, [0.8] * max_tokens, "drafter")

    def start(self, req):
        pass

    def observe(self, req, tokens):
        pass

    def finish(self, req):
        pass


def test_the_speculator_calls_the_drafter_only_when_the_choice_asks():
    drafter = FakeDrafter()
    spec = Speculator(SpeculativeConfig(), sources=[drafter], policy=FixedPolicy(4), cost_model=FlatCost())
    rs = reqs(3)
    out = spec.propose(rs, 3)
    assert drafter.prepared == [["r0", "r1", "r2"]] and set(out) == {"r0", "r1", "r2"}
    for r in rs:                                        # the drafter's drafts are never accepted
        spec.record_verification(r, out[r.request_id], 0)
    spec.choice.explore_every = 1000
    for _ in range(5):
        assert spec.propose(rs, 3) == {}
    assert len(drafter.prepared) == 1
    assert spec.choice.call_cost(3) >= 0
