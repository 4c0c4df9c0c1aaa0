"""Per request and step: suffix draft, drafter draft or none, from measured acceptance and cost;
and the speculator calls the drafter only for the requests the choice asks for."""
from spec_fakes import FakeRequest

from tailrl.config import SpeculativeConfig
from tailrl.speculative.draft import Draft
from tailrl.speculative.policies.base import FixedPolicy
from tailrl.speculative.source_choice import SourceChoice
from tailrl.speculative.speculator import Speculator


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


def test_an_unmeasured_drafter_explores_a_random_sample_of_the_requests_without_a_certain_draft():
    choice = SourceChoice(FlatCost(), explore_rows=2)
    rs = reqs(4)
    have = {"r0": None, "r1": chain(2), "r2": chain(6, p=1.0), "r3": None}
    limits = {r.request_id: 6 for r in rs}
    asked = choice.ask(rs, have, limits, 4)
    assert choice.exploring and len(asked) == 2 and set(asked) <= {rs[0], rs[1], rs[3]}
    assert asked == sorted(asked, key=rs.index)                 # in batch order
    again = SourceChoice(FlatCost(), explore_rows=2)            # seeded: the same sample
    assert again.ask(rs, have, limits, 4) == asked
    choice.observe_call(0.005, 2)                               # unmeasured still, but the share is spent
    assert choice.ask(rs, have, limits, 4) == [] and not choice.exploring
    choice.observe_step(1.0)
    assert len(choice.ask(rs, have, limits, 4)) == 2 and choice.exploring


def test_always_asks_for_every_request_without_a_certain_draft_and_picks_the_drafter_s():
    choice = SourceChoice(FlatCost(), always=True)
    rs = reqs(3)
    have = {"r0": None, "r1": chain(2), "r2": chain(6, p=1.0)}
    for _ in range(3):
        assert choice.ask(rs, have, {r.request_id: 6 for r in rs}, 3) == rs[:2] and not choice.exploring
    drafted = Draft.chain([1, 2], [0.1, 0.1], "drafter")
    assert choice.pick(chain(2), drafted, 6, 3) is drafted


def test_a_good_cheap_drafter_is_asked_where_suffix_drafts_are_weak():
    choice = SourceChoice(FlatCost())
    measured(choice, drafter_accepts=3)
    rs = reqs(3)
    have = {"r0": None, "r1": chain(1, p=0.5), "r2": chain(5, p=0.99)}
    assert choice.ask(rs, have, {r.request_id: 5 for r in rs}, 3) == rs[:2]


def test_calls_made_put_off_exploring():
    """A call's verified drafts measure the drafter: exploring waits for ``explore_every``
    steps without one (the gate makes every other approved call while it learns)."""
    choice = SourceChoice(FlatCost(), explore_every=3)
    measured(choice, drafter_accepts=3, calls=((0.0001, 1), (0.0004, 4)))
    rs = reqs(2)
    have, limits = {r.request_id: None for r in rs}, {r.request_id: 6 for r in rs}
    flags = []
    for _ in range(8):
        asked = choice.ask(rs, have, limits, 2)
        flags.append((bool(asked), choice.exploring))
    assert flags == [(True, False), (False, False)] * 4


def test_a_token_is_worth_the_realized_time_per_emitted_token():
    """tau: seconds per emitted token over recent steps of the batch size (drafts included),
    so a call worth making were each token a plain step's is not when drafts already emit
    several tokens per row."""
    choice = SourceChoice(FlatCost(), explore_every=1000)
    assert choice.token_seconds(2) == 0.005                    # before any step: a plain step per row
    measured(choice, drafter_accepts=3, calls=((0.006, 1), (0.006, 2)))   # a call costs 6 ms
    choice.observe_step(0.010, batch_size=2, prefill=True)     # a prefill step teaches nothing
    rs = reqs(2)
    have, limits = {r.request_id: None for r in rs}, {r.request_id: 6 for r in rs}
    assert choice.ask(rs, have, limits, 2) == rs               # 2 x 3 tokens x 5 ms > 6 ms
    choice.record("self", 3.0, 4)
    choice.record("self", 3.0, 4)
    choice.observe_step(0.010, batch_size=2)                   # 10 tokens in 10 ms
    assert choice.token_seconds(2) == 0.001 and choice.token_seconds(64) == 0.01 / 64
    choice.observe_step(0.010, batch_size=2)                   # 2 tokens: with forgetting
    assert abs(choice.token_seconds(2) - (0.98 * 0.001 + 0.02 * 0.005)) < 1e-12
    assert choice.ask(rs, have, limits, 2) == []               # 2 x 3 tokens x ~1 ms < 6 ms


def test_a_poor_or_costly_drafter_is_not_asked_except_to_explore():
    poor = SourceChoice(FlatCost(), explore_every=4)
    measured(poor, drafter_accepts=0)
    rs = reqs(4)
    have = {r.request_id: None for r in rs}
    limits = {r.request_id: 6 for r in rs}
    asked = [poor.ask(rs, have, limits, 4) for _ in range(8)]
    assert [len(a) for a in asked] == [0, 0, 0, 4, 0, 0, 0, 4]      # one step in 4 explores (4 rows)
    costly = SourceChoice(FlatCost())
    measured(costly, drafter_accepts=2, calls=((0.05, 1), (0.2, 4)))  # a call costs more than the gain
    assert costly.ask(rs, have, limits, 4) == []
    cheap = SourceChoice(FlatCost())
    measured(cheap, drafter_accepts=2, calls=((0.0001, 1), (0.0004, 4)))
    assert cheap.ask(rs, have, limits, 4) == rs


def test_no_exploring_where_even_a_perfect_drafter_could_not_pay_unless_tracking():
    """A call priced above what all of its draft tokens would be worth cannot pay whatever the
    drafter's acceptance: measuring it changes no decision, so it is not explored (the
    readiness is all it costs), unless ``track`` asks to follow its acceptance anyway."""
    rs = reqs(4)
    have, limits = {r.request_id: None for r in rs}, {r.request_id: 6 for r in rs}
    for track in (False, True):
        choice = SourceChoice(FlatCost(), explore_every=2, track=track)
        measured(choice, drafter_accepts=3, calls=((0.5, 1), (0.5, 4)))   # 6 x 2.5 ms per request < 0.5 s
        explored = []
        for _ in range(8):
            choice.ask(rs, have, limits, 4)
            explored.append(choice.exploring)
            choice.observe_step(1.0)
        assert any(explored) == track


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
    assert SourceChoice(FlatCost()).explore_share == 0.01


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
    suffix, drafted = chain(3, p=0.5, source="self"), Draft.chain([1, 2, 3], [0.9] * 3, "drafter")
    assert choice.pick(suffix, drafted, 6, 4) is suffix
    assert choice.pick(None, drafted, 6, 4) is drafted
    assert choice.pick(None, None, 6, 4) is None
    pricey = SourceChoice(FlatCost(slope=0.05))         # verifying costs more than a token is worth
    assert pricey.pick(suffix, None, 6, 4) is suffix    # drafter not asked: the suffix policy's choice
    measured(pricey, drafter_accepts=1)
    assert pricey.pick(suffix, drafted, 6, 4) is None   # asked: neither pays


class Lifecycle:
    """A source's request lifecycle, with nothing to do."""

    def start(self, req):
        pass

    def observe(self, req, tokens):
        pass

    def finish(self, req):
        pass


class FakeDrafter(Lifecycle):
    name, needs_hidden = "drafter", True

    def __init__(self):
        self.prepared: list[list[str]] = []

    def prepare(self, requests, max_tokens, max_paths):
        self.prepared.append([r.request_id for r in requests])

    def propose(self, req, max_tokens, max_paths):
        return Draft.chain([7] * max_tokens, [0.8] * max_tokens, "drafter")


class NoSuffix(Lifecycle):
    """A suffix source that never finds a draft."""
    name = "self"

    def propose(self, req, max_tokens, max_paths):
        return None


def test_the_speculator_calls_the_drafter_only_when_the_choice_asks():
    drafter = FakeDrafter()
    spec = Speculator(SpeculativeConfig(), sources=[NoSuffix(), drafter], policy=FixedPolicy(4), cost_model=FlatCost())
    rs = reqs(3)
    assert spec.propose(rs, 3) == {}                    # exploring: shadow drafts, nothing verified
    assert drafter.prepared == [["r0", "r1", "r2"]] and spec.choice.drafter_mean() is None
    for r in rs:                                        # the drafter's drafts (7, 7, ...) are never right
        r.emit(spec.sources, [1, 2, 3, 4])
        spec.observe(r, [1, 2, 3, 4])
    assert spec.choice.drafter_mean() == 0.0
    spec.choice.explore_every = 1000
    for _ in range(5):
        assert spec.propose(rs, 3) == {}
    assert len(drafter.prepared) == 1
    assert spec.choice.call_cost(3) >= 0


def test_the_drafter_alone_drafts_for_every_request_at_every_step():
    drafter = FakeDrafter()
    spec = Speculator(SpeculativeConfig(), sources=[drafter], policy=FixedPolicy(4), cost_model=FlatCost())
    rs = reqs(3)
    for step in range(3):
        out = spec.propose(rs, 3)
        assert set(out) == {"r0", "r1", "r2"} and len(drafter.prepared) == step + 1
        for r in rs:
            spec.record_verification(r, out[r.request_id], 0)


def test_shadow_drafts_are_scored_when_their_tokens_are_known_as_verification_would():
    drafter = FakeDrafter()                             # drafts 7, 7, 7, 7 (score 0.8 + 0.64 + ...)
    spec = Speculator(SpeculativeConfig(), sources=[NoSuffix(), drafter], policy=FixedPolicy(4), cost_model=FlatCost())
    rs = reqs(3)
    spec.propose(rs, 3)
    emitted = {"r0": [7, 7, 7, 7], "r1": [7, 7, 1, 7], "r2": [1, 7, 7, 7]}     # 4, 2 and 0 accepted
    for r in rs:
        r.emit(spec.sources, emitted[r.request_id][:3])
        spec.observe(r, emitted[r.request_id][:3])
    assert spec.metrics()["rollout/spec_drafter_shadow_drafts"] == 0       # a 4-deep draft needs 4 tokens
    for r in rs:
        r.emit(spec.sources, emitted[r.request_id][3:])
        spec.observe(r, emitted[r.request_id][3:])
    m = spec.metrics()
    assert m["rollout/spec_drafter_shadow_drafts"] == 3
    assert m["rollout/spec_drafter_shadow_accept_length"] == (4 + 2 + 0 + 3) / 3
    assert m["rollout/spec_verify_steps"] == 0 and spec.choice.calibration("drafter") < 1.0
    spec.propose(rs, 3)                                 # unmeasured no more, and not worth a call here
    spec.finish(rs[0])                                  # a request that ends drops its shadow draft
    assert not spec._shadow


def test_drafter_tracking_is_a_checked_config_field_the_choice_follows():
    import pytest
    with pytest.raises(ValueError, match="drafter_tracking"):
        SpeculativeConfig(drafter_tracking="yes")
    drafter = FakeDrafter()
    for track in (False, True):
        spec = Speculator(SpeculativeConfig(drafter_tracking=track), sources=[NoSuffix(), drafter],
                          policy=FixedPolicy(4), cost_model=FlatCost())
        assert spec.choice.track == track



def test_plan_says_from_the_batch_size_alone_whether_anything_may_be_asked():
    rs = reqs(4)
    have, limits = {r.request_id: None for r in rs}, {r.request_id: 6 for r in rs}
    assert SourceChoice(FlatCost()).plan(4, 4) == "explore"             # unmeasured: exploring is due
    assert SourceChoice(FlatCost(), always=True).plan(4, 4) == "all"
    costly = SourceChoice(FlatCost(), explore_every=1000)
    measured(costly, drafter_accepts=2, calls=((0.05, 1), (0.2, 4)))
    assert costly.plan(4, 4) is None and costly.ask(rs, have, limits, 4, None) == []
    cheap = SourceChoice(FlatCost(), explore_every=1000)
    measured(cheap, drafter_accepts=2, calls=((0.0001, 1), (0.0004, 4)))
    assert cheap.plan(4, 4) == "call" and cheap.ask(rs, have, limits, 4, "call") == rs


PRICED = ((0.006, 1), (0.012, 2), (0.006, 1), (0.012, 2))    # enough calls to price one: 6 ms per request


def test_readiness_follows_the_batch_sizes_where_calls_were_approved():
    """Until the drafter and its calls are measured, hidden states go out everywhere; then up
    to twice the largest batch size where the prices approved a call. A call approved where
    the last step handed nothing out is not made (no request has a draft root); it extends
    readiness, and the next step makes it."""
    rs = reqs(2)
    have, limits = {r.request_id: None for r in rs}, {r.request_id: 6 for r in rs}
    choice = SourceChoice(FlatCost(), explore_every=1000)
    assert choice.ready(500)                                         # nothing measured yet
    measured(choice, drafter_accepts=3, calls=PRICED[:3])
    assert choice.ready(500)                                         # three calls: not priced yet
    choice.observe_call(*PRICED[3])
    assert not choice.ready(1)                                       # no call approved yet
    choice.handed = False
    assert choice.ask(rs, have, limits, 2) == []                     # approved (3 x 5 ms > 6 ms), no roots
    assert [b for b in (1, 2, 4, 5, 64) if choice.ready(b)] == [1, 2, 4]
    choice.handed = True
    assert choice.ask(rs, have, limits, 2) == rs
    rejected = SourceChoice(FlatCost(), explore_every=1000)
    measured(rejected, drafter_accepts=3, calls=PRICED)
    rejected.gate.observe_step(2, 1.0)                               # (no call pending: clears measured()'s tokens)
    for _ in range(8):                                               # calls measured slower than skips at 2 rows
        rejected.gate.observe_step(2, 2.0 if rejected.gate.allow(2) else 1.0)
    rejected.ask(rs, have, limits, 2)
    assert rejected.gate.rejects(2) and not rejected.ready(2)
    for track in (True, False):
        other = SourceChoice(FlatCost(), track=track)
        measured(other, drafter_accepts=3, calls=PRICED)
        assert other.ready(500) == track
    alone = SourceChoice(FlatCost(), always=True)
    measured(alone, drafter_accepts=3, calls=PRICED)
    assert alone.ready(500)


def test_the_engine_hands_out_hidden_states_only_where_the_drafter_could_be_used():
    spec = Speculator(SpeculativeConfig(policy="fixed"), sources=[NoSuffix(), FakeDrafter()], policy=FixedPolicy(6),
                      cost_model=FlatCost())
    assert spec.wants_hidden(128) and not spec.wants_hidden(129)      # 2 x max_spec_batch
    measured(spec.choice, drafter_accepts=3, calls=PRICED)
    assert not spec.wants_hidden(8) and not spec.choice.handed
    spec.collector = object()                                        # the spot trainer learns from every step
    assert spec.wants_hidden(500) and spec.choice.handed
    plain = Speculator(SpeculativeConfig(), sources=[NoSuffix()], policy=FixedPolicy(6), cost_model=FlatCost())
    assert not plain.wants_hidden(1)
