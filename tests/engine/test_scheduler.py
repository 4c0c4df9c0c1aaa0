"""The scheduler's step where every running row decodes one token (its one-pass form) against
what its general passes give: all rows once each while they fit and nobody waits; a waiting
request still admitted where rows and tokens allow; the newest request preempted where the
pool lacks a block."""
import pytest
import torch

from tailrl import SamplingParams
from tailrl.engine.kv import KVCache
from tailrl.engine.request import Request
from tailrl.engine.scheduler import Scheduler
from tailrl.kernels import BLOCK
from tailrl.model.loader import read_args


def decoding(sched: Scheduler, n: int, prompt: int = 3) -> list[Request]:
    """``n`` requests admitted, prefilled and holding one sampled token each."""
    reqs = [Request(f"r{i}", [1 + i] * prompt, SamplingParams(max_tokens=100), seed_key=i, group_id=f"g{i}")
            for i in range(n)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [k for _, k in out.rows] == [prompt] * n
    for r in reqs:
        r.num_computed_tokens = prompt
        r.output_token_ids.append(7)
    return reqs


def test_rows_that_all_decode_are_scheduled_once_each(ckpt_dir):
    args = read_args(ckpt_dir("qwen2"))
    sched = Scheduler(KVCache(args, torch.float32, "cpu", 64 * BLOCK, 8, 4 * BLOCK), 8, 32)
    reqs = decoding(sched, 5)
    out = sched.schedule()
    assert out.rows == [(r, 1) for r in reqs] and out.num_tokens == 5 and out.token_budget_left == 27
    assert out.preempted == []
    late = Request("late", [9, 9, 9, 9], SamplingParams(max_tokens=100), seed_key=9, group_id="g9")
    sched.add(late)
    for r in reqs:
        r.num_computed_tokens += 1
        r.output_token_ids.append(7)
    out = sched.schedule()                                          # it waits, there is room: admitted
    assert out.rows == [(r, 1) for r in reqs] + [(late, 4)] and out.num_tokens == 9


def test_the_newest_row_is_preempted_where_a_decode_step_lacks_a_block(ckpt_dir):
    args = read_args(ckpt_dir("qwen2"))
    kv = KVCache(args, torch.float32, "cpu", 4 * BLOCK, 8, 2 * BLOCK)
    sched = Scheduler(kv, 8, 256)
    reqs = decoding(sched, 4, prompt=BLOCK - 1)                     # a block each, each one token from full
    for r in reqs:
        r.num_computed_tokens += 1
        r.output_token_ids.append(7)
    out = sched.schedule()                       # every row needs a second block: the newest two give theirs
    assert out.preempted == [reqs[3], reqs[2]] and out.rows == [(reqs[0], 1), (reqs[1], 1)]
    assert out.num_tokens == 2 and list(sched.waiting) == [reqs[2], reqs[3]]


def test_a_row_sitting_out_gets_nothing_in_the_one_pass_form(ckpt_dir, monkeypatch):
    """A row whose tokens are all computed (it verified a draft in the step still in flight:
    engine/ahead_drafts.py) computes nothing this step; the others decode one token each. The
    one-pass form gives what the general passes give (which it makes unnecessary: no prefill
    chunk is asked for)."""
    args = read_args(ckpt_dir("qwen2"))
    sched = Scheduler(KVCache(args, torch.float32, "cpu", 64 * BLOCK, 8, 4 * BLOCK), 8, 32)
    reqs = decoding(sched, 5)
    reqs[2].num_computed_tokens += 1                                # sitting out
    with monkeypatch.context() as m:
        m.setattr(Scheduler, "_may_admit", lambda *a: True)         # the general passes (nobody waits)
        general = sched.schedule()
    monkeypatch.setattr(Scheduler, "_prefill_chunk", lambda *a: pytest.fail("the general passes ran"))
    out = sched.schedule()
    assert out.rows == general.rows == [(r, 0 if r is reqs[2] else 1) for r in reqs]
    assert out.num_tokens == general.num_tokens == 4 and out.token_budget_left == 28
    reqs[2].num_computed_tokens -= 2                                # a prefill chunk: the general passes
    with pytest.raises(pytest.fail.Exception):
        sched.schedule()
