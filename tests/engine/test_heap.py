"""A rollout runs with full garbage collections held off (engine/heap.py), and leaves the
collector as it found it."""
import gc
import threading
import weakref

from tailrl import LLM, SamplingParams
from tailrl.engine.heap import HELD, held_collections, timed_collections


class _Node:
    pass


def _cycle() -> weakref.ref:
    """Garbage that only the cyclic collector frees: two objects referring to each other."""
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def _churn() -> list:
    """Objects that outlive young collections, enough (against the heap) for a full one."""
    keep = []
    for _ in range(400_000):
        keep.append([])
    return keep


def _thresholds_at_steps(llm) -> list[tuple]:
    """The collector's thresholds at each of the engine's steps from now on."""
    seen = []
    step = llm.engine.step

    def recording_step():
        seen.append(gc.get_threshold())
        return step()
    llm.engine.step = recording_step
    return seen


def test_full_collections_are_held_off_during_a_rollout_only(model):
    llm = LLM(model, max_num_seqs=4)
    seen = _thresholds_at_steps(llm)
    before = gc.get_threshold()
    garbage = _cycle()
    out = llm.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=6, seed=0))
    assert len(out[0].outputs) == 2 and seen
    assert all(t == (before[0], before[1], HELD) for t in seen)     # every step held them off
    assert gc.get_threshold() == before
    gc.collect()
    assert garbage() is None                 # collected after the rollout, not leaked


def test_no_full_collection_inside_young_ones_go_on():
    with timed_collections() as control:    # what the churn below triggers, not held off
        keep = _churn()
    del keep
    assert control.full > 0
    with held_collections() as heap:
        keep = _churn()
    del keep
    assert heap.full == 0 and heap.collections > 0


def test_blocks_nest_and_overlap_across_threads_and_the_last_restores():
    before = gc.get_threshold()
    inside, release = threading.Event(), threading.Event()

    def other():
        with held_collections():
            inside.set()
            release.wait(10)
    t = threading.Thread(target=other)
    with held_collections():
        t.start()
        assert inside.wait(10)
        with held_collections():
            assert gc.get_threshold()[2] == HELD
    assert gc.get_threshold()[2] == HELD     # the other thread's block is still open
    release.set()
    t.join(10)
    assert gc.get_threshold() == before


def test_a_disabled_collector_is_left_alone_and_an_error_restores():
    before = gc.get_threshold()
    gc.disable()
    try:
        with held_collections():
            assert gc.get_threshold() == before
    finally:
        gc.enable()
    try:
        with held_collections():
            raise RuntimeError("a step failed")
    except RuntimeError:
        pass
    assert gc.get_threshold() == before


def test_the_block_times_its_collections():
    with held_collections() as heap:
        for _ in range(3):
            _cycle()
        gc.collect()                        # a full collection asked for, timed
    assert heap.full >= 1 and heap.collections >= heap.full and heap.gc_s > 0
    n = heap.collections
    gc.collect()
    assert heap.collections == n            # the callback left with the block


def test_a_rollout_reports_its_time_in_the_collector(model):
    llm = LLM(model, max_num_seqs=4)
    step = llm.engine.step

    def collecting_step():                  # one full collection inside the rollout
        gc.collect()
        llm.engine.step = step
        return step()
    llm.engine.step = collecting_step
    llm.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=6, seed=0))
    m = llm.last_metrics
    assert m["rollout/gc_full_collections"] >= 1
    assert 0 < m["timing_s/gc"] < m["timing_s/gen"]


def test_a_server_holds_off_full_collections_while_busy(model):
    """The server's loop thread holds them off for each stretch of steps (at most
    ``HEAP_STEPS``) and restores the collector when the engine runs out of work."""
    import time

    from tailrl.engine.request import Request
    from tailrl.serve.loop import EngineLoop
    llm = LLM(model, max_num_seqs=4)
    seen = _thresholds_at_steps(llm)
    before = gc.get_threshold()
    done = threading.Event()
    loop = EngineLoop(llm, on_retire=lambda reqs: None).start()
    try:
        loop.submit([Request("a", [1, 2, 3], SamplingParams(max_tokens=6, seed=0), seed_key=1)],
                    lambda updates: done.set() if any(u.finish_reason for u in updates) else None)
        assert done.wait(60)
        deadline = time.monotonic() + 10
        while gc.get_threshold() != before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.get_threshold() == before  # idle: restored
    finally:
        loop.stop()
    assert seen and all(t[2] == HELD for t in seen)
