import pytest
from spec_fakes import FakeRequest

from tailrl.config import SpeculativeConfig
from tailrl.speculative.draft import Draft
from tailrl.speculative.factory import make_spec_policy
from tailrl.speculative.policies.adaptive import AdaptivePolicy
from tailrl.speculative.policies.bandit import BanditPolicy
from tailrl.speculative.policies.base import FixedPolicy, SpecPolicy
from tailrl.speculative.policies.cost_model import CostModel, batch_bucket
from tailrl.speculative.policies.priced import PricedPolicy


def cpu_like_cost():
    """FACTS-like costs: verifying extra tokens is nearly free at batch 1, costly at 256."""
    cm = CostModel()
    for _ in range(3):
        for e in (0, 1, 3, 7, 15):
            cm.observe(1, 1 + e, 0.004 + 8e-5 * (1 + e))
            cm.observe(256, 256 * (1 + e), 0.010 + 1.2e-3 * 256 * (1 + e))
    return cm


def reqs(n, out_lens=None):
    out_lens = out_lens or [0] * n
    return [FakeRequest(f"r{i}", [1, 2], output_token_ids=[7] * out_lens[i]) for i in range(n)]


def test_policies_follow_the_protocol():
    for p in (FixedPolicy(4), AdaptivePolicy(), BanditPolicy()):
        assert isinstance(p, SpecPolicy)


def test_window_doubles_on_full_acceptance_and_halves_otherwise():
    pol = AdaptivePolicy(max_draft_tokens=16, min_draft_tokens=2, initial_window=4)
    r = reqs(1)[0]
    assert pol.window(r) == 4
    pol.update(r, 4, 4, "group")
    assert pol.window(r) == 8
    pol.update(r, 8, 8, "group")
    pol.update(r, 16, 16, "group")
    assert pol.window(r) == 16                         # capped
    pol.update(r, 16, 3, "group")
    assert pol.window(r) == 8
    pol.update(r, 6, 4, "group", max_depth=4)          # a tree fully accepted along its deepest path
    assert pol.window(r) == 16
    for _ in range(5):
        pol.update(r, 4, 0, "group")
    assert pol.window(r) == 2                          # floored
    pol.finish(r)
    assert pol.window(r) == 4


def test_allocation_respects_window_and_draft_size():
    pol = AdaptivePolicy(cpu_like_cost(), initial_window=4)
    rs = reqs(2)
    props = [(rs[0], Draft.chain(list(range(10)))), (rs[1], Draft.chain([1, 2]))]
    assert pol.allocate(props, 1 + 1) == [4, 2]


def test_zero_allocation_when_speculation_cannot_pay():
    pol = AdaptivePolicy(cpu_like_cost())
    rs = reqs(256)
    props = [(r, Draft.chain(list(range(8)), [0.9] * 8)) for r in rs]
    assert pol.max_paths(256) == 0
    assert pol.allocate(props, 256) == [0] * 256
    assert pol.max_paths(1) > 0
    assert pol.allocate(props[:1], 1)[0] > 0


def test_unlikely_nodes_get_nothing_when_verification_is_not_free():
    cm = CostModel()
    for e in (0, 1, 3, 7):                             # an extra token costs half a plain one
        cm.observe(8, 8 * (1 + e), 0.004 + 0.0005 * 8 * (1 + e))
    pol = AdaptivePolicy(cm, min_gain=0.0)
    r, other = reqs(2)
    assert pol.allocate([(r, Draft.chain([1, 2, 3], [0.2, 1.0, 1.0]))], 8) == [0]
    assert pol.last_depth == 1                     # prior acceptance 0.5: Seer's g* is small
    assert AdaptivePolicy(cm).best_depth(8, 1, 0.5) == 0   # a gain that small is within the margin
    for _ in range(30):                            # measured: drafts are accepted in full
        pol.update(other, 3, 3, "self")
    assert pol.allocate([(r, Draft.chain([1, 2, 3], [0.95, 0.95, 0.2], source="self"))], 8) == [2]
    assert pol.last_depth >= 2


def test_budget_goes_to_long_running_requests_first():
    cm = CostModel()
    for e in (0, 1, 3, 7):
        cm.observe(4, 4 * (1 + e), 0.004 + 1e-5 * 4 * (1 + e))
    pol = AdaptivePolicy(cm, initial_window=16)
    short, long_ = reqs(2, [5, 500])
    draft = Draft.chain(list(range(16)))                     # certain drafts: the budget binds
    alloc = pol.allocate([(short, draft), (long_, draft)], 4)
    assert sum(alloc) == pol.last_budget > 0
    assert alloc[1] > alloc[0]


def test_best_depth_grows_with_acceptance():
    pol = AdaptivePolicy(cpu_like_cost())
    assert pol.best_depth(1, 1, 0.9) > pol.best_depth(1, 1, 0.3) > 0
    assert pol.best_depth(256, 256, 0.5) == 0


def run_bandit(seed, steps=200):
    pol = BanditPolicy(seed=seed, epsilon=0.2)
    chosen = []
    r = reqs(1)[0]
    for _ in range(steps):
        pol.max_paths(2)
        k, _ = pol.current_arm()
        chosen.append(k)
        alloc = pol.allocate([(r, Draft.chain(list(range(16))))], 2)
        accepted = min(alloc[0], 4)                    # this workload accepts 4 tokens at most
        if alloc[0]:
            pol.update(r, alloc[0], accepted, "self")
        pol.observe_step(2, 2 + alloc[0], 0.01 + 0.001 * alloc[0])
    return chosen, pol


def test_bandit_is_deterministic_and_learns():
    a, pol = run_bandit(3)
    b, _ = run_bandit(3)
    c, _ = run_bandit(4)
    assert a == b and a != c
    best = max(range(len(pol.arms)), key=lambda i: pol.means(2)[i] or 0)
    assert pol.arms[best][0] == 4
    assert a[-50:].count(4) > 25                       # exploits the best arm
    assert BanditPolicy(max_spec_batch=8).max_paths(16) == 0


def test_fixed_policy_and_factory():
    r = reqs(1)[0]
    pol = FixedPolicy(3, max_spec_batch=4)
    assert pol.allocate([(r, Draft.chain([1, 2, 3, 4])), (r, Draft.chain([1]))], 2) == [3, 1]
    assert pol.allocate([(r, Draft.chain([1, 2, 3, 4]))], 8) == [0]
    assert isinstance(make_spec_policy(SpeculativeConfig(policy="fixed")), FixedPolicy)
    assert isinstance(make_spec_policy(SpeculativeConfig(policy="bandit")), BanditPolicy)
    assert isinstance(make_spec_policy(SpeculativeConfig()), PricedPolicy)         # the default
    assert make_spec_policy(SpeculativeConfig(policy="fixed")).k == 6
    ad = make_spec_policy(SpeculativeConfig(policy="adaptive", max_draft_tokens=8, min_draft_tokens=4))
    assert isinstance(ad, AdaptivePolicy) and ad.max_draft_tokens == 8 and ad.window(r) == 4


def test_exploration_step_when_estimates_say_off():
    pol = AdaptivePolicy(cpu_like_cost(), explore_every=8, min_draft_tokens=2)
    rs = reqs(64)
    props = [(r, Draft.chain(list(range(8)), [0.9 - i / 100] * 8)) for i, r in enumerate(rs)]
    on = []
    for _ in range(16):
        paths = pol.max_paths(256)
        on.append(paths > 0)
        alloc = pol.allocate(props, 256)
        assert alloc == ([2] * 8 + [0] * 56 if paths else [0] * 64)     # the 8 best drafts probe
    assert on.count(True) == 2 and on[7] and on[15]
    assert AdaptivePolicy(cpu_like_cost(), explore_every=0).max_paths(256) == 0


def test_a_poor_source_does_not_silence_an_unmeasured_one():
    pol = AdaptivePolicy(cpu_like_cost())
    a, b = reqs(2)
    for _ in range(40):
        pol.update(a, 4, 0, "group")
    poor = pol.allocate([(b, Draft.chain([1, 2, 3, 4], [0.9] * 4, source="group"))], 1)[0]
    fresh = pol.allocate([(b, Draft.chain([1, 2, 3, 4], [0.9] * 4, source="history"))], 1)[0]
    assert poor <= 1 and fresh == 4                    # batch 1: a cheap token is still tried


@pytest.mark.parametrize("seed", range(10))
def test_expected_time_per_token_never_exceeds_plain_decoding(seed):
    import random
    rng = random.Random(seed)
    cm = CostModel()
    for bs in (1, 8, 64, 256):
        base, per_tok = rng.uniform(1e-3, 2e-2), rng.uniform(1e-6, 2e-3)
        for e in (0, 1, 3, 7):
            cm.observe(bs, bs * (1 + e), base + per_tok * bs * (1 + e))
    pol = AdaptivePolicy(cm, initial_window=16, explore_every=0)
    warm = FakeRequest("warm", [1])
    for _ in range(50):                  # measured acceptance is high: Seer's budget is generous,
        pol.update(warm, 8, 8, "self")      # only the per-node rule can say no
    for B in (1, 3, 8, 20, 64, 256):
        n = rng.randint(1, B)
        props = []
        for i in range(n):
            k = rng.randint(1, 12)
            props.append((FakeRequest(f"q{i}", [1], output_token_ids=[0] * rng.randint(0, 50)),
                          Draft([0] * k, [rng.randrange(-1, j) for j in range(k)],
                                [rng.random() for _ in range(k)], "self")))
        alloc = pol.allocate(props, B)
        gain = sum(d.truncate(k).score for (_, d), k in zip(props, alloc))
        spec_time = cm.predict(B, B + sum(alloc)) / (B + gain)
        assert spec_time <= cm.predict(B, B) / B * (1 + 1e-9)


def test_the_clock_check_turns_off_a_bucket_whose_steps_run_slow():
    pol = AdaptivePolicy(cpu_like_cost(), min_gain=0.0)
    rs = reqs(4)
    props = [(r, Draft.chain(list(range(4)))) for r in rs]
    pol.max_paths(4)
    assert sum(pol.allocate(props, 4)) > 0
    for _ in range(20):                       # every speculative step takes 5x its prediction
        if pol.max_paths(4) == 0:
            break
        alloc = pol.allocate(props, 4)
        if not sum(alloc):
            break
        _, predicted, _ = pol._pending
        pol.observe_step(4, 4 + sum(alloc), 5 * predicted)
    assert pol.max_paths(4) == 0 or sum(pol.allocate(props, 4)) == 0
    assert pol._error[batch_bucket(4)] > 1.3


def test_allocation_respects_the_step_token_budget():
    """Depth, budget and the clock check's prediction are for the nodes that really run."""
    cm = CostModel()
    for _ in range(10):
        for e in (0, 1, 3, 7):
            cm.observe(8, 8 * (1 + e), 0.010 + 1e-5 * 8 * (1 + e))        # verifying is nearly free
    pol = AdaptivePolicy(cm, initial_window=16)
    props = [(r, Draft.chain(list(range(16)))) for r in reqs(8)]
    assert pol.max_paths(8) > 0
    free = pol.allocate(props, 8)
    assert sum(free) > 20
    assert pol.max_paths(8) > 0
    capped = pol.allocate(props, 8, max_tokens=20)
    assert sum(capped) <= 20 and pol.last_budget <= 20
    assert pol.max_paths(8) > 0
    assert pol.allocate(props, 8, max_tokens=0) == [0] * 8
