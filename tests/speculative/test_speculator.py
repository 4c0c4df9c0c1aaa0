import pytest
from spec_fakes import FakeRequest

from tailrl.config import SpeculativeConfig
from tailrl.speculative.draft import Draft
from tailrl.speculative.factory import make_sources
from tailrl.speculative.history import HistoryStore
from tailrl.speculative.policies.base import FixedPolicy
from tailrl.speculative.speculator import Speculator

PROMPT = [40, 41, 42]


def make(policy="fixed", **kw):
    store = HistoryStore()
    cfg = SpeculativeConfig(policy=policy, max_draft_tokens=8, **kw)
    return Speculator(cfg, store), store


def group(spec, n):
    rs = [FakeRequest(f"r{i}", PROMPT, group_id="g", prompt_id="p") for i in range(n)]
    for r in rs:
        spec.start(r)
    return rs


def emit(spec, r, toks):
    r.output_token_ids.extend(toks)
    spec.observe(r, list(toks))


def test_sources_from_config_and_best_score_wins():
    spec, store = make()
    assert [s.name for s in spec.sources] == ["history", "group", "self"]
    store.record("p", [[1, 2, 3, 4, 5, 6]] * 3)
    a, b = group(spec, 2)
    emit(spec, a, [1, 2, 9, 9])
    emit(spec, b, [1, 2])
    drafts = spec.propose([a, b], 2)
    assert drafts["r1"].source == "history" and drafts["r1"].tokens == [3, 4, 5, 6]
    assert "r0" not in drafts                    # "9 9": no source has a continuation
    emit(spec, a, [7, 7, 7, 7, 9, 9])
    d = spec.propose([a], 2)["r0"]               # self repeats beat nothing elsewhere
    assert d.source == "self" and d.tokens[0] == 7


def test_metrics_keys_and_accounting():
    spec, store = make()
    store.record("p", [[1, 2, 3, 4, 5, 6]])
    (a,) = group(spec, 1)
    emit(spec, a, [1, 2])
    d = spec.propose([a], 1)["r0"]
    spec.record_verification(a, d, 2)
    emit(spec, a, [3, 4, 99])
    spec.observe_step(1, 1 + len(d), 0.01)
    m = spec.metrics()
    for key in ("rollout/spec_draft_tokens", "rollout/spec_accepted_tokens", "rollout/spec_accept_length",
                "rollout/spec_accept_rate", "rollout/spec_verify_steps", "rollout/spec_draft_hit_rate",
                "rollout/spec_off_steps", "timing_s/draft", "timing_s/draft_index"):
        assert key in m
    for src in ("history", "group", "self"):
        assert f"rollout/spec_accepted_tokens/{src}" in m and f"rollout/spec_draft_tokens/{src}" in m
    assert m["rollout/spec_draft_tokens"] == len(d) == 4
    assert m["rollout/spec_accepted_tokens"] == m["rollout/spec_accepted_tokens/history"] == 2
    assert m["rollout/spec_accept_length"] == pytest.approx(3.0)
    assert m["timing_s/draft"] > 0
    with pytest.raises(ValueError):
        spec.record_verification(a, d, 5)
    spec.reset_metrics()
    assert spec.metrics()["rollout/spec_draft_tokens"] == 0


def test_policy_off_skips_drafting_and_total_cap_applies():
    spec = Speculator(sources=[], policy=FixedPolicy(0))
    assert spec.propose([FakeRequest("x", [1])], 1) == {}
    spec, store = make(max_spec_batch=2)
    store.record("p", [[1, 2, 3, 4, 5, 6]])
    a, b, c = group(spec, 3)
    for r in (a, b, c):
        emit(spec, r, [1, 2])
    assert spec.propose([a, b, c], 3) == {}
    assert spec.metrics()["rollout/spec_off_steps"] == 1
    drafts = spec.propose([a, b], 2, max_total_tokens=5)
    assert sum(len(d) for d in drafts.values()) == 5


def test_finish_releases_everything():
    spec, store = make(policy="adaptive")
    store.record("p", [[1, 2, 3]])
    rs = group(spec, 3)
    for r in rs:
        emit(spec, r, [1, 2])
        spec.propose([r], 1)
    for r in rs:
        spec.finish(r)
    assert all(len(s) == 0 for s in spec.sources)


def test_adaptive_speculator_drafts_at_small_batch():
    spec, store = make(policy="adaptive")
    store.record("p", [[5, 6, 7, 8, 9, 10, 11, 12]] * 4)
    (a,) = group(spec, 1)
    emit(spec, a, [5, 6])
    d = spec.propose([a], 1)["r0"]
    assert isinstance(d, Draft) and d.tokens[:2] == [7, 8] and len(d) == spec.policy.window(a)


def test_calibration_feeds_the_adaptive_policy():
    spec, _ = make(policy="adaptive")
    assert spec.policy.cost is spec.cost_model
    spec.calibrate(lambda bs, n: sum(range(200 * n)), batch_sizes=(1, 2), extra_per_request=(0, 4), repeats=1)
    assert spec.cost_model.num_observations == 4


class RecordingSource:
    name = "rec"

    def __init__(self):
        self.asked = []

    def propose(self, req, max_tokens, max_paths):
        self.asked.append((max_tokens, max_paths))
        return Draft.chain([1] * max_tokens, source=self.name)

    def observe(self, req, new_tokens):
        pass

    def start(self, req):
        pass

    def finish(self, req):
        pass


def test_sources_are_asked_for_no_more_than_the_policy_can_give():
    src = RecordingSource()
    spec = Speculator(SpeculativeConfig(max_draft_tokens=8, max_tree_paths=2), sources=[src],
                      policy=FixedPolicy(3, paths=4))
    d = spec.propose([FakeRequest("x", [1])], 1)["x"]
    assert src.asked == [(3, 2)] and len(d) == 3


def test_a_certain_full_draft_stops_the_search():
    first, second = RecordingSource(), RecordingSource()
    spec = Speculator(SpeculativeConfig(), sources=[first, second], policy=FixedPolicy(3))
    spec.propose([FakeRequest("x", [1])], 1)
    assert len(first.asked) == 1 and second.asked == []


def test_make_sources_follows_the_config():
    with pytest.raises(ValueError, match="drafter"):          # the learned drafter needs its checkpoint
        SpeculativeConfig(method="drafter")
    srcs = make_sources(SpeculativeConfig(sources=("self", "group"), min_match_len=3, max_draft_tokens=6))
    assert [s.name for s in srcs] == ["self", "group"]
    assert srcs[0].params.min_match_len == 3 and srcs[0].params.max_draft_depth == 6


class CountingSource(RecordingSource):
    """Drafts the continuation of a fixed token stream, and counts the calls."""

    def __init__(self, stream):
        super().__init__()
        self.stream = stream

    def propose(self, req, max_tokens, max_paths):
        self.asked.append((max_tokens, max_paths))
        n = len(req.output_token_ids)
        return Draft.chain(self.stream[n:n + max_tokens], source=self.name)


def carrying_speculator():
    """Chains of 3 verified out of 8 drafted from a known stream, for one request."""
    stream = list(range(100, 140))
    src = CountingSource(stream)
    spec = Speculator(SpeculativeConfig(max_draft_tokens=8, max_tree_paths=1), sources=[src],
                      policy=FixedPolicy(3, paths=1))
    return stream, src, spec, FakeRequest("x", [1])


def test_a_fully_accepted_chain_carries_its_rest_to_the_next_step():
    stream, src, spec, r = carrying_speculator()
    d = spec.propose([r], 1)["x"]
    assert d.tokens == stream[:3] and src.asked == [(8, 1)]        # drafted 8, verifies 3
    spec.record_verification(r, d, 3)
    emit(spec, r, stream[:4])                                        # 3 accepted + the bonus token
    d = spec.propose([r], 1)["x"]
    assert d.tokens == stream[4:7] and len(src.asked) == 1          # the rest, no source asked
    spec.record_verification(r, d, 1)                                # a rejection: no carry
    emit(spec, r, stream[4:5] + [7])
    spec.propose([r], 1)
    assert len(src.asked) == 2


def test_a_carried_rest_is_dropped_when_the_bonus_token_differs():
    stream, src, spec, r = carrying_speculator()
    d = spec.propose([r], 1)["x"]
    spec.record_verification(r, d, 3)
    emit(spec, r, stream[:3] + [5])                                  # the bonus token is not the rest's
    spec.propose([r], 1)
    assert len(src.asked) == 2


def test_a_carried_rest_that_does_not_apply_is_forgotten():
    """A carry whose first token is not the bonus token is dropped when the request drafts
    again (it could match a later token by chance and draft a stale rest)."""
    stream, src, spec, r = carrying_speculator()
    d = spec.propose([r], 1)["x"]
    spec.record_verification(r, d, 3)
    assert "x" in spec._carry
    emit(spec, r, stream[:3] + [5])
    spec.propose([r], 1)
    assert "x" not in spec._carry


class HalfSource(RecordingSource):
    """Drafts of two nodes at probability 0.5 each (score 0.75), named as given."""

    def __init__(self, name):
        super().__init__()
        self.name = name

    def propose(self, req, max_tokens, max_paths):
        self.asked.append((max_tokens, max_paths))
        return Draft.chain([3, 4], [0.5, 0.5], source=self.name)


def test_among_drafts_of_equal_score_the_earlier_source_wins():
    spec = Speculator(SpeculativeConfig(max_draft_tokens=4), sources=[HalfSource("first"), HalfSource("second")],
                      policy=FixedPolicy(4))
    r = FakeRequest("y", [1])
    assert spec.propose([r], 1)["y"].source == "first"
    assert all(len(s.asked) == 1 for s in spec.sources)                # a 0.75 draft does not stop the search


class SometimesSource(RecordingSource):
    """A per-request source with a sure 4-token draft for request "sure" only."""
    name = "suffix"

    def propose(self, req, max_tokens, max_paths):
        return Draft.chain([7] * max_tokens, source=self.name) if req.request_id == "sure" else None


class BatchedSource(RecordingSource):
    """A batched source (like the drafter): ``prepare`` once per step, then ``propose``."""
    name = "batched"

    def __init__(self, prob):
        super().__init__()
        self.prob, self.prepared = prob, []

    def prepare(self, requests, max_tokens, max_paths):
        self.prepared.append(sorted(r.request_id for r in requests))

    def propose(self, req, max_tokens, max_paths):
        return Draft.chain([3] * max_tokens, [self.prob] * max_tokens, source=self.name)


def test_batched_sources_are_asked_only_where_the_others_draft_worse_than_they_accept():
    batched = BatchedSource(0.5)
    spec = Speculator(SpeculativeConfig(max_draft_tokens=4), sources=[SometimesSource(), batched],
                      policy=FixedPolicy(4))
    reqs = [FakeRequest("sure", [1]), FakeRequest("none", [1])]
    first = spec.propose(reqs, 2)
    assert batched.prepared == [["none"]]                     # "sure" has a 4-token certain draft
    assert set(first) == {"sure"} and first["sure"].source == "suffix"   # "none": a shadow draft
    emit(spec, reqs[1], [3, 3, 1, 1])                         # the batched source's draft: 2 accepted
    second = spec.propose(reqs, 2)
    assert batched.prepared[-1] == ["none"]
    assert second["none"].source == "batched" and second["sure"].source == "suffix"


def test_above_max_spec_batch_only_the_critical_path_drafts():
    """Drafting is off above max_spec_batch except for the critical_rows requests with the most
    expected tokens left (here from each request's known length, speculative/critical.py)."""
    spec, store = make(max_spec_batch=4, critical_rows=2)
    store.record("p", [[1, 2, 3, 4, 5, 6, 7, 8]] * 3)
    rs = group(spec, 5)
    for r, known in zip(rs, (0, 500, 100, 400, 450)):
        r.length_prior = (known,)
        emit(spec, r, [1, 2])
    rs[4].output_token_ids.extend([0] * 100)          # 450 - 102 left: less than r3's 400 - 2
    assert sorted(spec.propose(rs, 5)) == ["r1", "r3"]
    assert sorted(spec.propose(rs[:4], 4)) == ["r0", "r1", "r2", "r3"]   # at max_spec_batch: everyone
    off, _ = make(max_spec_batch=4, critical_rows=0)
    assert off.propose(rs, 5) == {}
    with pytest.raises(ValueError, match="critical_rows"):
        SpeculativeConfig(critical_rows=-1)


def test_chains_from_are_as_deep_as_the_sources_go_whatever_the_policys_last_step_priced():
    """``chain_from`` (drafts inside steps launched ahead) is not cut by the priced policy's
    ``draft_limit``, which prices the speculator's own steps: where its last step drafted
    nothing (a wide batch), that limit is the critical rows' depth."""
    from tailrl.speculative.policies.priced import CRITICAL_DEPTH
    spec, store = make(policy="priced")
    store.record("p", [list(range(1, 30))] * 3)
    (a,) = group(spec, 1)
    emit(spec, a, list(range(1, 11)))
    assert spec.policy.max_paths(10_000) == 0 and spec.policy.draft_limit(a) == CRITICAL_DEPTH   # closed
    assert spec.best_draft(a, 1).tokens == list(range(11, 11 + CRITICAL_DEPTH))   # the speculator's own steps
    d, expected = spec.chain_from(a, 0, 100)
    assert d.tokens == list(range(11, 19)) and expected > CRITICAL_DEPTH - 1      # max_draft_tokens: 8
    d, _ = spec.chain_from(a, 1, 3)
    assert d.tokens == [12, 13, 14]


def test_a_rate_probe_drafts_for_a_few_requests_walking_the_batch():
    """Where the priced policy's gate is shut by a stale rate, its probes (policies/priced.py,
    rule 5) draft for ``PROBE_ROWS`` requests at a time, the next probe starting where the last
    ended: counted as probe steps, not off steps."""
    import sys
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_priced_policy import curve_of

    from tailrl.speculative.policies.priced import PROBE_ROWS
    spec, store = make(policy="priced")
    pol = spec.policy
    pol.curve, pol.explore_every = curve_of(lambda n: 0.01 + 0.0003 * n), 2
    store.record("p", [list(range(1, 16))])
    rs = group(spec, 6)
    for r in rs:
        emit(spec, r, [1, 2, 3, 4])            # the history's next 11 tokens: longer than a probe takes
        for _ in range(40):
            pol.update(r, 4, 1, "history")        # drafts that were poor
    drafted = [spec.propose(rs, 64) for _ in range(6)]     # a batch of 64 rows: the gate shut
    assert [sorted(d) for d in drafted] == [[], ["r0", "r1", "r2", "r3"], [], ["r0", "r1", "r4", "r5"], [],
                                            ["r2", "r3", "r4", "r5"]]
    assert {len(d) for step in drafted for d in step.values()} == {6}    # the critical rows' depth
    m = spec.metrics()
    assert (m["rollout/spec_probe_steps"], m["rollout/spec_off_steps"]) == (3, 3)
    assert PROBE_ROWS == 4


class PerRequestLimits(FixedPolicy):
    """Each request's own draft limit (0 for some: they draft nothing)."""

    def draft_limit(self, req):
        return int(req.request_id[1:]) % 4 * 2

    def allocate(self, proposals, batch_size, max_tokens=None):
        return [min(self.draft_limit(r), len(d)) for r, d in proposals]


class PerRow:
    """A source without its ``propose_many``: the speculator asks it request by request."""

    def __init__(self, source):
        self._source = source

    def __getattr__(self, name):
        if name == "propose_many":
            raise AttributeError(name)
        return getattr(self._source, name)


def _as_tuple(d):
    return None if d is None else (d.tokens, d.parents, d.probs, d.source, d.match_len)


@pytest.mark.parametrize("paths", [1, 3])
def test_sources_drafting_a_steps_rows_in_one_call_give_the_per_request_drafts(paths):
    """Each suffix source asked once for all rows still without a certain draft
    (``propose_many``) against the same sources asked row by row: the same drafts, full chains and carries, step after
    step, with history, group and self sources, trees, limits per request and carried rests."""
    import random
    rng = random.Random(paths)
    history = [[rng.randrange(4) for _ in range(30)] for _ in range(3)]
    specs = []
    for many in (True, False):
        store = HistoryStore()
        store.record("p0", history)
        cfg = SpeculativeConfig(max_draft_tokens=8, max_tree_paths=paths)
        srcs = make_sources(cfg, store) if many else [PerRow(s) for s in make_sources(cfg, store)]
        specs.append(Speculator(cfg, store, sources=srcs, policy=PerRequestLimits(8, paths=paths)))
    reqs = [[FakeRequest(f"r{i}", [9, 8, i % 2], group_id=f"g{i % 2}", prompt_id=f"p{i % 2}") for i in range(8)]
            for _ in specs]
    for spec, rs in zip(specs, reqs):
        for r in rs:
            spec.start(r)
    assert all(hasattr(s, "propose_many") for s in specs[0].sources)
    assert not any(hasattr(s, "propose_many") for s in specs[1].sources)
    # history's responses (long accepted drafts from history), then repeats with noise (self, group)
    streams = [(history[i % 3] if i % 2 == 0 else []) + [rng.choice([t, t, t, rng.randrange(4)])
                                                         for t in [0, 1, 2, 3, 1] * 40] for i in range(8)]
    drafted, sources, carried = 0, set(), 0
    for step in range(40):
        got = [spec.propose(rs, len(rs)) for spec, rs in zip(specs, reqs)]
        assert {k: _as_tuple(d) for k, d in got[0].items()} == {k: _as_tuple(d) for k, d in got[1].items()}
        assert {k: _as_tuple(d) for k, d in specs[0]._full.items()} == \
            {k: _as_tuple(d) for k, d in specs[1]._full.items()}
        drafted += len(got[0])
        sources |= {d.source for d in got[0].values()}
        for spec, rs, drafts in zip(specs, reqs, got):
            for i, r in enumerate(rs):
                at = len(r.output_token_ids)
                d = drafts.get(r.request_id)
                accepted = d.accepted_by(streams[i][at:]) if d is not None else 0
                if d is not None:
                    spec.record_verification(r, d, accepted)
                emit(spec, r, streams[i][at:at + accepted + 1])
            spec.observe_step(len(rs), len(rs), 0.01)
        assert specs[0]._carry.keys() == specs[1]._carry.keys()
        carried += len(specs[0]._carry)
    assert drafted > 100 and specs[0].counts.found == specs[1].counts.found
    assert sources == {"history", "group", "self"} and (carried > 0) == (paths == 1)
