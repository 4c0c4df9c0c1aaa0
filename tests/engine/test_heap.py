"""A rollout runs with the heap that existed before it frozen out of full collections
(engine/heap.py), and leaves the collector as it found it."""
import gc
import weakref

from tailrl import LLM, SamplingParams
from tailrl.engine.heap import frozen_heap, timed_collections


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


def _freeze_counts(llm) -> list[int]:
    """The objects frozen at each of the engine's steps from now on."""
    counts = []
    step = llm.engine.step

    def counting_step():
        counts.append(gc.get_freeze_count())
        return step()
    llm.engine.step = counting_step
    return counts


def test_the_heap_is_frozen_during_a_rollout_only(model):
    llm = LLM(model, max_num_seqs=4)
    counts = _freeze_counts(llm)
    before = gc.get_freeze_count()
    garbage = _cycle()                       # made before the rollout: frozen with the rest
    out = llm.generate([[1, 2, 3]], SamplingParams(n=2, max_tokens=6, seed=0))
    assert len(out[0].outputs) == 2 and counts
    assert min(counts) > 0                   # every step ran with the older objects frozen
    assert gc.get_freeze_count() == before == 0
    gc.collect()
    assert garbage() is None                 # unfrozen after the rollout: collected, not leaked


def test_a_frozen_heap_is_left_frozen_and_a_disabled_collector_alone():
    thresholds = gc.get_threshold()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with timed_collections() as control:           # what the churn below triggers unheld
            keep = _churn()
        del keep
        assert control.full > 0
        with frozen_heap() as heap:
            assert gc.get_freeze_count() == frozen
            keep = _churn()
        del keep
        assert gc.get_freeze_count() == frozen          # the caller's freeze is not undone
        assert heap.full == 0 and heap.collections > 0  # young collections went on, no full one
        assert gc.get_threshold() == thresholds
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with frozen_heap() as heap:
            assert gc.get_freeze_count() == 0
        assert heap.frozen == 0                          # reported: nothing left out
    finally:
        gc.enable()


def test_the_heap_is_unfrozen_after_an_error():
    try:
        with frozen_heap():
            assert gc.get_freeze_count() > 0
            raise RuntimeError("a step failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0


def test_the_block_times_its_collections():
    with frozen_heap() as heap:
        for _ in range(3):
            _cycle()
        gc.collect()                        # a full collection, timed
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
    assert m["rollout/gc_frozen_objects"] > 1000       # the heap before the rollout, left out


def test_a_server_steps_with_the_older_heap_frozen(model):
    """The server's loop thread freezes the heap for each stretch of steps (at most
    ``HEAP_STEPS``) and unfreezes it when the engine runs out of work."""
    import threading
    import time

    from tailrl.engine.request import Request
    from tailrl.serve.loop import EngineLoop
    llm = LLM(model, max_num_seqs=4)
    counts = _freeze_counts(llm)
    done = threading.Event()
    loop = EngineLoop(llm, on_retire=lambda reqs: None).start()
    try:
        loop.submit([Request("a", [1, 2, 3], SamplingParams(max_tokens=6, seed=0), seed_key=1)],
                    lambda updates: done.set() if any(u.finish_reason for u in updates) else None)
        assert done.wait(60)
        deadline = time.monotonic() + 10
        while gc.get_freeze_count() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gc.get_freeze_count() == 0    # idle: nothing frozen
    finally:
        loop.stop()
    assert counts and min(counts) > 0
