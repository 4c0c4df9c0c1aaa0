"""Hand-checkable orders of service for each policy, driven by a fake pool (no simulator)."""
import pytest

from tailrl.rollout.buffer import BufferEntry, RequestBuffer
from tailrl.rollout.policies import (
    ContextPolicy,
    DividedPolicy,
    GroupOraclePolicy,
    HistoryPolicy,
    InstanceView,
    OraclePolicy,
    PolicyConfig,
    StaticPolicy,
    make_policy,
)

BIG = 10 ** 9


def buffer(n, group_size=1, max_tokens=1000, prompt_len=10):
    return RequestBuffer(BufferEntry(i, i // group_size, i // group_size, prompt_len, max_tokens)
                         for i in range(n))


def ask(policy, instance, slots, now=0.0, cap=BIG, used=0):
    return [(a.request_id, a.max_tokens) for a in policy.schedule(InstanceView(instance, slots, cap, used), now)]


def ids(assignments):
    return [rid for rid, _ in assignments]


def test_static_splits_contiguously_and_never_moves_work():
    p = StaticPolicy()
    p.reset(buffer(10), 3)
    assert [p.share(i) for i in range(3)] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    assert ask(p, 1, 10) == [(4, 1000), (5, 1000), (6, 1000)]   # its share, to the end
    assert not p.has_work_for(1) and p.has_work_for(0)
    assert ask(p, 1, 10) == []
    # a preempted request returns to the front of its own instance's queue
    p.on_preempt(5, 7, 1.0)
    assert p.has_work_for(1) and ids(ask(p, 1, 1)) == [5]


def test_static_admits_on_current_kv_with_watermark():
    p = StaticPolicy(PolicyConfig(watermark=0.0))
    p.reset(buffer(4, prompt_len=100), 1)
    # 250 free slots of KV hold two prompts of 100; growth is not reserved
    assert ids(ask(p, 0, 10, cap=1000, used=750)) == [0, 1]


def test_divided_pulls_fifo_in_chunks_and_resumes_where_kv_lives():
    p = DividedPolicy(PolicyConfig(chunk_tokens=300))
    p.reset(buffer(4), 2)
    assert ask(p, 0, 2) == [(0, 300), (1, 300)]
    assert ask(p, 1, 1) == [(2, 300)]
    p.on_chunk_done(0, 300, False, 1.0)      # back to the buffer, KV on instance 0
    p.on_chunk_done(2, 300, False, 1.0)      # KV on instance 1
    # fair share: (1 running + 3 waiting) / 2 instances = 2 each
    assert ids(ask(p, 0, 5)) == [0]           # its own request first, although 3 is older
    assert ids(ask(p, 1, 5)) == [2, 3]        # its own, then the oldest anywhere
    p.on_chunk_done(0, 300, False, 2.0)
    assert ask(p, 0, 1) == [(0, 300)]
    p.on_chunk_done(0, 300, False, 3.0)
    assert ask(p, 0, 1) == [(0, 100)]         # the last chunk is capped by what remains


def test_fair_share_spreads_scarce_work():
    p = DividedPolicy(PolicyConfig(chunk_tokens=300))
    p.reset(buffer(4), 4)
    assert ids(ask(p, 0, 10)) == [0]          # 4 requests, 4 instances: one each
    assert ids(ask(p, 1, 10)) == [1]


def test_divided_reserves_kv_for_the_whole_chunk():
    p = DividedPolicy(PolicyConfig(chunk_tokens=100))
    p.reset(buffer(5, prompt_len=50), 1)
    assert ids(ask(p, 0, 5, cap=330)) == [0, 1]         # 2 x (50 + 100) fits, 3 do not
    assert ids(ask(p, 0, 5, cap=330)) == []             # reservations persist
    p.on_chunk_done(0, 100, False, 1.0)                 # frees 150, but 0 now needs 250
    assert ids(ask(p, 0, 5, cap=330)) == []             # head-of-line: it waits for room
    p.on_chunk_done(1, 20, True, 1.0)
    assert ids(ask(p, 0, 5, cap=330)) == [0]


def test_idle_instance_always_gets_one_request():
    p = DividedPolicy(PolicyConfig(chunk_tokens=1000))
    p.reset(buffer(2, prompt_len=50), 1)
    assert ids(ask(p, 0, 2, cap=500)) == [0]


def test_context_serves_probes_then_longest_estimate_first():
    # three groups of three: probes are 0, 3, 6
    p = ContextPolicy(PolicyConfig(chunk_tokens=200))
    p.reset(buffer(9, group_size=3), 2)
    assert ids(ask(p, 0, 3)) == [0, 3, 6]                # one probe per group first
    assert ids(ask(p, 1, 2)) == [1, 2]                   # unknown groups: max length, in order
    p.on_chunk_done(3, 100, True, 5.0)                   # group 1 estimate: 100
    p.on_chunk_done(6, 50, True, 5.0)                    # group 2 estimate: 50
    p.on_chunk_done(0, 200, False, 5.0)                  # probe 0 goes on: group 0 unknown
    assert p.estimate(p.buffer[4]) == 100 and p.estimate(p.buffer[7]) == 50
    # probe first, then group 1 (100), then group 2 (50); fair shares are of expected work:
    # instance 1 runs two members of the unknown group 0 (max length each), more than all
    # that waits, so instance 0 takes everything
    assert ids(ask(p, 0, 10)) == [0, 4, 5, 7, 8]
    assert ids(ask(p, 1, 10)) == []


def test_context_outrunning_the_estimate_counts_as_unknown_and_sorts_by_progress():
    p = ContextPolicy(PolicyConfig(chunk_tokens=100))
    p.reset(buffer(6, group_size=3), 1)
    assert ids(ask(p, 0, 6)) == [0, 3, 1, 2, 4, 5]
    p.on_chunk_done(0, 80, True, 1.0)                    # group 0 estimate 80
    for rid in (1, 2):
        p.on_chunk_done(rid, 100, False, 1.0)            # both outran 80: unknown again
    p.on_chunk_done(4, 100, False, 1.0)                  # group 1 unknown: probe 3 runs
    assert p.estimate(p.buffer[1]) == 1000 and p.estimate(p.buffer[4]) == 1000
    assert ids(ask(p, 0, 3)) == [1, 2, 4]                # equal estimate and progress: FIFO
    p.on_chunk_done(4, 100, False, 2.0)
    assert ids(ask(p, 0, 1)) == [4]
    for rid in (1, 2, 4):
        p.on_chunk_done(rid, 100, False, 3.0)
    # 4 (300 generated) returned last but has most progress: it resumes first
    assert ids(ask(p, 0, 3)) == [4, 1, 2]


def test_context_anti_starvation():
    p = ContextPolicy(PolicyConfig(chunk_tokens=100, starvation_s=10.0))
    p.reset(buffer(4, group_size=2), 1)
    assert ids(ask(p, 0, 2)) == [0, 2]                   # the probes
    p.on_chunk_done(0, 30, True, 1.0)                    # group 0 short: 1 waits behind 3
    assert ids(ask(p, 0, 1, now=5.0)) == [3]
    p.on_chunk_done(3, 100, False, 6.0)
    assert ids(ask(p, 0, 1, now=12.0)) == [1]            # waited since 0 > 10 s: first now


def test_oracle_is_longest_remaining_first():
    true = {0: 10, 1: 500, 2: 90, 3: 499}
    p = OraclePolicy(true, PolicyConfig(chunk_tokens=100))
    p.reset(buffer(4, prompt_len=0), 1)
    assert ids(ask(p, 0, 4, cap=250)) == [1, 3]          # two chunks of 100 fit, a third does not
    p.on_chunk_done(1, 100, False, 1.0)                  # 1 has 400 left, 3 has 499
    assert ids(ask(p, 0, 4, cap=250)) == []              # 1 (now 100 + 100) waits for room: order kept
    p.on_chunk_done(3, 100, False, 2.0)                  # 3 has 399 left
    assert ids(ask(p, 0, 4, cap=1000)) == [1, 3, 2, 0]   # 400 > 399 > 90 > 10
    with pytest.raises(ValueError, match="true_lengths"):
        OraclePolicy({0: 1}).reset(buffer(2), 1)


def test_history_serves_longest_history_first_and_migrates_outliers():
    hist = {0: [900], 1: [500, 300], 2: [400], 3: [100], 4: [50]}
    p = HistoryPolicy(hist, PolicyConfig(chunk_tokens=10_000, outlier_factor=1.5))
    p.reset(buffer(5, max_tokens=2000), 2)
    assert ask(p, 0, 1) == [(0, 1350)]                   # longest first; chunk to 1.5 x history
    assert ask(p, 1, 2) == [(1, 750), (2, 600)]          # the prompt's longest previous response
    p.on_chunk_done(0, 900, True, 1.0)                   # instance 0 is free
    p.on_chunk_done(2, 600, False, 1.0)                  # ran past 1.5 x history: outlier
    assert p.estimate(p.buffer[2]) == 2000
    # now the longest-estimated request: the idle instance takes it, off instance 1
    assert ask(p, 0, 1) == [(2, 1400)]
    assert p.buffer[2].migrations == 1
    assert ids(ask(p, 1, 5)) == [3, 4]


def test_history_shortest_first_and_no_history():
    hist = {0: [900], 1: [500], 2: [400], 3: [100], 4: [50]}
    p = HistoryPolicy(hist, PolicyConfig(chunk_tokens=100), shortest_first=True)
    p.reset(buffer(5), 2)
    # reversed order; the fair share is half the expected work (975 tokens): 50 + 100 + 400
    # + 500 overshoots it by less than the 500 fills
    assert ids(ask(p, 0, 10)) == [4, 3, 2, 1]
    p = HistoryPolicy({}, PolicyConfig(chunk_tokens=100))
    p.reset(buffer(6), 2)
    assert ids(ask(p, 0, 10)) == [0, 1, 2]               # all estimated at max length: FIFO


def test_group_oracle_ranks_whole_groups_by_their_max_or_mean():
    truth = {0: 10, 1: 500, 2: 300, 3: 300}   # group 0 = {0, 1}, group 1 = {2, 3}
    p = make_policy("group-oracle", PolicyConfig(chunk_tokens=1000), true_lengths=truth)
    p.reset(buffer(4, group_size=2), 1)
    assert ids(ask(p, 0, 4)) == [0, 1, 2, 3]              # group 0's max 500 > 300: both first
    p = GroupOraclePolicy(truth, PolicyConfig(chunk_tokens=100), stat="mean")
    p.reset(buffer(4, group_size=2), 1)
    assert ids(ask(p, 0, 2)) == [2, 3]                    # means: 255 < 300
    p.on_chunk_done(2, 100, False, 1.0)
    assert ids(ask(p, 0, 1)) == [0]                       # 2 has 200 to go; 0 and 1 have 255
    p.on_chunk_done(0, 10, True, 2.0)
    p.on_chunk_done(3, 100, False, 2.0)
    assert ids(ask(p, 0, 3)) == [1, 2, 3]                 # 255 left, then 200 (2 and 3: FIFO)
    p.on_chunk_done(3, 100, False, 3.0)                   # 3: 100 left
    p.on_chunk_done(1, 100, False, 3.0)                   # 1: 155 left
    assert ids(ask(p, 0, 1)) == [1]
    p.on_chunk_done(1, 100, False, 4.0)                   # 1: 55 left
    assert ids(ask(p, 0, 1)) == [3]                       # 100 > 55
    p.on_chunk_done(3, 100, True, 5.0)
    assert ids(ask(p, 0, 1)) == [1]
    p.on_chunk_done(1, 100, False, 6.0)                   # 300 generated: it outran the mean 255
    p.on_chunk_done(2, 100, False, 6.0)                   # 2: 100 left
    assert ids(ask(p, 0, 1)) == [1]                       # ranked at its max length (700 left)
    with pytest.raises(ValueError, match="stat"):
        GroupOraclePolicy(truth, stat="median")


def test_make_policy_names():
    for name in ("static", "divided", "context", "history"):
        assert make_policy(name).name == name
    assert make_policy("oracle", true_lengths={}).name == "oracle"
    assert make_policy("group-oracle", true_lengths={}).name == "group-oracle"
    with pytest.raises(ValueError, match="policy"):
        make_policy("fifo")
    with pytest.raises(ValueError, match="true_lengths"):
        make_policy("oracle")
    with pytest.raises(ValueError, match="chunk_tokens"):
        PolicyConfig(chunk_tokens=0)


def test_ranked_policies_share_expected_work_not_request_counts():
    """Longest-first list scheduling: the first instance to ask takes the longest request but
    only its share of the expected work, so the long ones do not pile up on one instance."""
    truth = {0: 900, 1: 500, 2: 400, 3: 100, 4: 50, 5: 50}
    p = make_policy("oracle", PolicyConfig(chunk_tokens=1000), true_lengths=truth)
    p.reset(buffer(6), 2)
    assert ids(ask(p, 0, 10)) == [0]                      # 900 of 2,000: its share is 1,000
    assert ids(ask(p, 1, 10)) == [1, 2, 3]                # 500 + 400 + 100 of its 1,000
    assert ids(ask(p, 1, 10)) == []                       # a 50 would only overshoot
    assert ids(ask(p, 0, 10)) == [4, 5]                   # 900 + 50 + 50: its 1,000


def test_known_lengths_are_what_each_policy_knows():
    """What the engines' critical-path estimate conditions on (speculative/critical.py)."""
    ctx = ContextPolicy(PolicyConfig(chunk_tokens=200))
    ctx.reset(buffer(6, group_size=3), 1)
    ask(ctx, 0, 6)
    assert ctx.known_lengths(ctx.buffer[1]) == ()             # nothing of group 0 finished yet
    ctx.on_chunk_done(0, 70, True, 1.0)
    ctx.on_chunk_done(2, 30, True, 1.0)
    assert ctx.known_lengths(ctx.buffer[1]) == (70, 30) and ctx.known_lengths(ctx.buffer[4]) == ()
    hist = HistoryPolicy({0: [900, 40], 1: [5]})
    hist.reset(buffer(3), 1)
    assert hist.known_lengths(hist.buffer[0]) == (900, 40) and hist.known_lengths(hist.buffer[2]) == ()
    true = {0: 12, 1: 3000, 2: 7}
    oracle = OraclePolicy(true)
    oracle.reset(buffer(3), 1)
    assert [oracle.known_lengths(oracle.buffer[i]) for i in range(3)] == [(12,), (1000,), (7,)]
    group = GroupOraclePolicy(true, stat="max")
    group.reset(buffer(3, group_size=3), 1)
    assert group.known_lengths(group.buffer[2]) == (1000,)    # the group's statistic, not its own
    assert StaticPolicy().known_lengths(BufferEntry(0, 0, 0, 1, 10)) == ()
