"""End-to-end simulations small enough to check by hand.

The step model is calibrated to a constant 1 s per step and 1 s per prefill (c0 = 1), so
times count steps: a request of L tokens admitted alone finishes 1 + L seconds later.
"""
import numpy as np
import pytest

from tailrl.rollout.policies import PolicyConfig, make_policy
from tailrl.sim.simulator import SimConfig, simulate
from tailrl.sim.step_model import CalibratedStepModel
from tailrl.sim.workload import Trace, WorkloadConfig, generate

UNIT = CalibratedStepModel(1.0, 0.0, 0.0, 0.0)


def trace(lengths, group_size=1, max_tokens=1000, prompt_len=10, prev=None):
    n = len(lengths)
    g = np.arange(n) // group_size
    return Trace(group_id=g, prompt_id=g.copy(), prompt_len=np.full(n, prompt_len),
                 max_tokens=np.full(n, max_tokens), length=np.array(lengths),
                 prev_length=None if prev is None else np.array(prev))


def run(name, tr, chunk=1000, **cfg):
    cfg = SimConfig(**{"instances": 2, "max_num_seqs": 64, "kv_capacity": 10**6, **cfg})
    policy = make_policy(name, PolicyConfig(chunk_tokens=chunk), history=tr.history(),
                         true_lengths=dict(enumerate(tr.length.tolist())))
    res = simulate(tr, policy, cfg, UNIT)
    assert policy.buffer.all_finished
    assert sum(r.generated for r in policy.buffer) == int(tr.length.sum())   # every token, once
    return res


def test_static_makespan_is_the_slowest_share():
    tr = trace([5, 50, 7, 20, 30, 3, 8, 9, 10, 40])
    res = run("static", tr)      # shares: requests 0-4 and 5-9, each all admitted at t = 0
    assert res.finish_time.tolist() == pytest.approx([6, 51, 8, 21, 31, 4, 9, 10, 11, 41])
    assert res.makespan_s == pytest.approx(1 + 50)          # share A's longest
    assert res.tail_s == pytest.approx(51 - 41)             # after the 9th of 10 finished
    assert res.throughput_tok_s == pytest.approx(182 / 51)


def test_one_slot_hand_schedules():
    tr = trace([10, 10, 10, 30])
    # static: [10, 10] on A: 1+10+1+10 = 22; [10, 30] on B: 1+10+1+30 = 42
    assert run("static", tr, max_num_seqs=1).makespan_s == pytest.approx(42)
    # oracle, longest first: A runs 30 (31 s); B runs the three 10s (3 x 11 = 33 s)
    res = run("oracle", tr, max_num_seqs=1)
    assert res.makespan_s == pytest.approx(33) and res.idle_frac == pytest.approx(1 - (31 + 33) / 66)


def test_divided_chunks_resume_locally_without_prefill():
    tr = trace([25])
    res = run("divided", tr, chunk=10, instances=1)
    assert res.chunks == 3 and res.makespan_s == pytest.approx(1 + 25)   # one prefill only
    assert res.migrated_gb == 0


def test_static_preempts_when_kv_runs_out_and_divided_does_not():
    tr = generate(WorkloadConfig(requests=64, group_size=8, max_tokens=2000, mean_tokens=600, prompt_mean=50))
    kv = 12_000
    st = run("static", tr, kv_capacity=kv)
    dv = run("divided", tr, chunk=256, kv_capacity=kv)
    assert st.preemptions > 0 and dv.preemptions == 0
    assert st.prefill_mtok * 1e6 > tr.prompt_len.sum()          # recomputation after preemption


def test_speculation_divides_steps_by_the_accepted_length():
    tr = trace([100])
    plain = run("static", tr, instances=1)
    spec = run("static", tr, instances=1, draft_tokens=3, accept_mean=2.5)
    assert plain.makespan_s == pytest.approx(101) and spec.makespan_s == pytest.approx(1 + 40)


def test_migration_costs_link_time():
    # two instances with one slot each. B finishes the short request at t = 11 and runs dry;
    # when A's first chunk of the long one ends (t = 21) B, less loaded, pulls it first
    # (fair share): its KV (100 prompt + 20 generated tokens) moves from A to B.
    tr = trace([40, 10], prompt_len=100)
    fast = run("divided", tr, chunk=20, max_num_seqs=1, link_bw=1e15)
    slow = run("divided", tr, chunk=20, max_num_seqs=1, link_bw=1e6)
    nbytes = 120 * SimConfig().kv_bytes_per_token
    assert fast.migrated_gb == slow.migrated_gb == pytest.approx(nbytes / 1e9)
    assert fast.makespan_s == pytest.approx(1 + 20 + 20)
    assert slow.makespan_s - fast.makespan_s == pytest.approx(nbytes / 1e6)


@pytest.mark.parametrize("name", ["static", "divided", "context", "history", "oracle"])
def test_every_policy_finishes_a_long_tailed_step(name):
    tr = generate(WorkloadConfig(requests=320, group_size=8, max_tokens=4000, mean_tokens=800, seed=3))
    res = run(name, tr, chunk=300, instances=4, kv_capacity=60_000, max_num_seqs=32)
    assert res.makespan_s > 0 and 0 <= res.idle_frac < 1 and res.tail_s >= 0


def test_schedulers_beat_static_on_a_long_tail():
    tr = generate(WorkloadConfig(requests=640, group_size=8, max_tokens=4000, mean_tokens=600, rho=0.9, seed=5))
    res = {n: run(n, tr, chunk=250, instances=8, kv_capacity=80_000, max_num_seqs=32)
           for n in ("static", "divided", "context", "oracle")}
    assert res["oracle"].makespan_s < res["static"].makespan_s
    assert res["context"].makespan_s < res["static"].makespan_s
    assert res["context"].tail_s < res["static"].tail_s
    assert res["oracle"].makespan_s <= res["context"].makespan_s * 1.02


def test_capacity_must_hold_the_longest_request():
    with pytest.raises(ValueError, match="kv_capacity"):
        run("static", trace([10], max_tokens=1000), kv_capacity=500)
    with pytest.raises(ValueError, match="accept_mean"):
        SimConfig(draft_tokens=1, accept_mean=3.0)
