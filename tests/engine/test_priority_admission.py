"""Admission by Request.priority: longest expected first, FIFO at equal priority, preempted first."""
from tailrl import SamplingParams
from tailrl.config import EngineConfig
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request, RequestStatus


def _req(i: int, priority: float = 0.0, prompt: list[int] | None = None) -> Request:
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(f"r{i}", prompt or [1 + i, 2 + i, 3 + i], sp, seed_key=i, group_id=f"g{i}",
                   priority=priority)


def _engine(ckpt_dir, max_num_seqs: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ckpt_dir("qwen2"), max_num_seqs=max_num_seqs))


def test_equal_priorities_keep_fifo(ckpt_dir):
    eng = _engine(ckpt_dir, 2)
    for i in range(5):
        eng.add_request(_req(i))
    assert [r.request_id for r in eng.scheduler.waiting] == ["r0", "r1", "r2", "r3", "r4"]


def test_higher_priority_is_admitted_first(ckpt_dir):
    eng = _engine(ckpt_dir, 2)
    for i, p in enumerate([1.0, 5.0, 3.0, 5.0, 0.0]):
        eng.add_request(_req(i, p))
    assert [r.request_id for r in eng.scheduler.waiting] == ["r1", "r3", "r2", "r0", "r4"]
    eng.step()
    assert sorted(r.request_id for r in eng.scheduler.running) == ["r1", "r3"]


def test_preempted_requests_stay_first(ckpt_dir):
    eng = _engine(ckpt_dir, 1)
    eng.add_request(_req(0, 1.0))
    eng.step()
    victim = eng.scheduler.running[0]
    eng.scheduler.preempt(victim)
    eng.add_request(_req(1, 100.0))
    assert eng.scheduler.waiting[0] is victim and victim.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in eng.scheduler.waiting] == ["r0", "r1"]
