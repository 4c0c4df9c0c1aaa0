import pytest

from tailrl.rollout.buffer import BufferEntry, EntryStatus, RequestBuffer


def make_buffer(n=4, group_size=2, prompt_len=10, max_tokens=100):
    return RequestBuffer(BufferEntry(i, i // group_size, f"p{i // group_size}", prompt_len, max_tokens)
                         for i in range(n))


def test_groups_keep_insertion_order():
    buf = make_buffer(6, 3)
    assert buf.group_ids() == [0, 1]
    assert [r.request_id for r in buf.group(1)] == [3, 4, 5]


def test_chunk_cycle_keeps_kv_location_and_counts_migrations():
    buf = make_buffer()
    r = buf.start(0, instance=2, max_tokens=30)
    assert r.status == EntryStatus.RUNNING and r.instance == 2
    buf.complete(0, 30, finished=False)
    assert r.status == EntryStatus.WAITING and r.location == 2 and r.generated == 30
    assert r.context_len == 40 and r.remaining == 70
    buf.start(0, instance=2, max_tokens=30)       # same instance: no migration
    buf.complete(0, 30, finished=False)
    buf.start(0, instance=1, max_tokens=40)       # KV lives on 2: a migration
    assert r.migrations == 1 and r.chunks == 3
    buf.complete(0, 12, finished=True)
    assert r.finished and r.generated == 72 and buf.num_finished == 1


def test_length_limit_finishes_even_if_driver_says_not():
    buf = make_buffer(max_tokens=50)
    buf.start(1, 0, 50)
    assert buf.complete(1, 50, finished=False).finished


def test_invalid_transitions_raise():
    buf = make_buffer()
    with pytest.raises(ValueError, match="not RUNNING"):
        buf.complete(0, 1, True)
    buf.start(0, 0, 20)
    with pytest.raises(ValueError, match="not WAITING"):
        buf.start(0, 1, 20)
    with pytest.raises(ValueError, match="new_tokens"):
        buf.complete(0, 21, False)
    with pytest.raises(ValueError, match="stopped early"):
        buf.complete(0, 5, False)
    with pytest.raises(ValueError, match="max_tokens"):
        buf.start(1, 0, 101)


def test_preempt_drops_kv_and_keeps_tokens():
    buf = make_buffer()
    buf.start(0, 3, 100)
    r = buf.preempt(0, 42)
    assert r.status == EntryStatus.WAITING and r.location is None
    assert r.generated == 42 and r.preemptions == 1


def test_bad_request_fields_and_duplicates():
    with pytest.raises(ValueError, match="max_tokens"):
        BufferEntry(0, 0, 0, 10, 0)
    with pytest.raises(ValueError, match="prompt_len"):
        BufferEntry(0, 0, 0, -1, 10)
    with pytest.raises(ValueError, match="twice"):
        RequestBuffer([BufferEntry(0, 0, 0, 1, 1), BufferEntry(0, 0, 0, 1, 1)])
