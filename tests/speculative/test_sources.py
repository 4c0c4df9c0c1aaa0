import json

import pytest
from spec_fakes import FakeRequest

from tailrl.speculative.history import HistoryStore
from tailrl.speculative.sources.base import DraftSource, MatchParams, context_tail
from tailrl.speculative.sources.group_source import GroupSource
from tailrl.speculative.sources.history_source import HistorySource
from tailrl.speculative.sources.self_source import SelfSource

PROMPT = [50, 51, 52]
FULL = MatchParams(tokens_per_match=0)          # no match-length cap: test the matching itself


def test_sources_follow_the_protocol():
    for s in (SelfSource(), GroupSource(), HistorySource(HistoryStore())):
        assert isinstance(s, DraftSource)


def test_context_tail_uses_the_prompt_when_output_is_short():
    r = FakeRequest("a", [1, 2, 3, 4], output_token_ids=[9])
    assert context_tail(r, 3) == [3, 4, 9]
    r.output_token_ids = [5, 6, 7, 8]
    assert context_tail(r, 3) == [6, 7, 8]


def test_self_source_drafts_from_prompt_and_output():
    src = SelfSource(FULL)
    r = FakeRequest("a", [5, 6, 7, 8, 9])
    src.start(r)
    assert src.propose(r, 8, 1) is None                     # "8 9" only occurs at the end
    r.emit([src], [5, 6])
    d = src.propose(r, 8, 1)
    assert d.tokens == [7, 8, 9, 5, 6] and d.source == "self" and d.match_len == 2
    assert src.propose(r, 2, 1).tokens == [7, 8]
    src.finish(r)
    r.emit([src], [7])                           # the engine reports last tokens after finish
    assert len(src) == 0


def test_short_matches_earn_short_drafts():
    src = SelfSource(MatchParams(tokens_per_match=1.0))
    r = FakeRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    assert src.propose(r, 16, 1).tokens == [3, 4]              # 2-token match: 2 nodes
    r.output_token_ids = [3]
    assert src.propose(r, 16, 1).tokens == [4, 5, 6]           # 3-token match: 3 nodes
    assert SelfSource(FULL).propose(r, 16, 1).tokens == [4, 5, 6, 7, 8, 9, 1, 2, 3]


def test_group_source_feeds_siblings_not_self():
    src = GroupSource(FULL)
    a = FakeRequest("a", PROMPT, group_id="g")
    b = FakeRequest("b", PROMPT, group_id="g")
    src.start(a)
    src.start(b)
    a.emit([src], [1, 2, 3, 1, 2])
    assert src.propose(a, 8, 1) is None         # "1 2 -> 3" is a's own pattern only
    b.emit([src], [7, 1, 2])
    d = src.propose(b, 8, 1)
    assert d.tokens[:3] == [3, 1, 2] and d.source == "group"
    assert src.propose(a, 8, 1) is None         # b's "1 2" has no continuation yet
    b.emit([src], [9])
    a.emit([src], [4, 7, 1, 2])                 # a's context now ends in "7 1 2"
    d = src.propose(a, 8, 1)
    assert d.tokens == [9] and d.match_len == 3  # longest sibling match, own "1 2 3" excluded


def test_group_source_leaves_out_a_siblings_token_still_on_the_device():
    """A step launched ahead leaves a placeholder as a row's last token until it settles
    (engine/ahead.py): a sibling's draft never contains it, and the token settled takes its place."""
    src = GroupSource(FULL)
    a = FakeRequest("a", PROMPT, group_id="g")
    b = FakeRequest("b", PROMPT, group_id="g")
    src.start(a)
    src.start(b)
    a.emit([src], [1, 2, 3])
    a.output_token_ids.append(-1)               # ahead.PENDING
    b.emit([src], [7, 1, 2])
    assert src.propose(b, 8, 1).tokens == [3]
    a.output_token_ids[-1] = 4
    b.emit([src], [3, 8, 1, 2])
    assert src.propose(b, 8, 1).tokens == [3, 4]


def test_self_source_indexes_settled_tokens_only():
    src = SelfSource(FULL)
    r = FakeRequest("a", PROMPT)
    r.emit([src], [1, 2, 3, 1, 2])
    r.output_token_ids.append(-1)               # ahead.PENDING
    assert src.propose(r, 8, 1) is None         # "... 2 -1": no match, and -1 is not indexed
    r.output_token_ids[-1] = 3
    r.emit([src], [1, 2])
    assert src.propose(r, 8, 1).tokens[:2] == [3, 1]


def test_group_source_drafts_sibling_openings_from_the_prompt_tail():
    src = GroupSource(FULL)
    reqs = [FakeRequest(str(i), PROMPT, group_id="g") for i in range(4)]
    for r in reqs:
        src.start(r)
    for r in reqs[:3]:
        r.emit([src], [10, 11, 12] if r.request_id != "2" else [20, 21])
    d = src.propose(reqs[3], 8, 2)
    assert d.tokens[0] == 10 and d.probs[0] == pytest.approx(2 / 3)
    assert 20 in d.tokens and not d.is_chain
    assert src.propose(reqs[0], 8, 2) is None    # its twin "1" ends where it ends
    reqs[1].emit([src], [13])
    assert src.propose(reqs[0], 8, 2).tokens == [13]


def test_group_member_resumes_and_group_is_dropped_when_empty():
    src = GroupSource()
    a = FakeRequest("a", PROMPT, group_id="g")
    b = FakeRequest("b", PROMPT, group_id="g")
    src.start(a)
    src.start(b)
    a.emit([src], [1, 2, 3])
    src.finish(a)                                # a's tokens stay for b
    b.emit([src], [1, 2])
    assert src.propose(b, 4, 1).tokens == [3]
    a.output_token_ids += [4, 5]                 # a resumes with more output (divided rollout)
    src.start(a)
    b.emit([src], [3])
    assert src.propose(b, 4, 1).tokens == [4, 5]
    assert src.propose(a, 4, 1) is None          # b's "4 5"? no: b never wrote it
    src.finish(a)
    src.finish(b)
    assert len(src) == 0
    b.emit([src], [6])                           # the engine reports last tokens after finish
    assert len(src) == 0


def test_history_store_replace_and_json_roundtrip(tmp_path):
    store = HistoryStore()
    store.record("p", [[1, 2, 3], [1, 2]])
    v1 = store.version("p")
    store.record("p", [[4, 5]])
    assert store.get("p") == [[4, 5]] and store.lengths("p") == [2]
    assert store.version("p") != v1 and "p" in store and len(store) == 1
    assert store.get("q") == [] and store.version("q") == 0
    path = tmp_path / "h.json"
    store.save(path)
    other = HistoryStore()
    other.load(path)
    assert other.get("p") == [[4, 5]]
    path.write_text(json.dumps({"prompts": []}))
    with pytest.raises(ValueError):
        other.load(path)
    with pytest.raises(ValueError):
        store.record("p", ["abc"])


def test_history_source_rebuilds_when_history_is_replaced():
    store = HistoryStore()
    src = HistorySource(store, MatchParams(max_match_len=4, tokens_per_match=0))
    r = FakeRequest("a", PROMPT, prompt_id="p")
    src.start(r)
    assert src.propose(r, 8, 1) is None                     # no history yet
    store.record("p", [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 3, 4]])
    d = src.propose(r, 8, 1)                                 # output empty: prompt tail matches
    assert d.tokens == [1, 2, 3, 4] and d.probs[3] == pytest.approx(2 / 3)
    r.emit([src], [1, 2])
    assert src.propose(r, 8, 1).tokens == [3, 4]
    assert src.builds == 1
    store.record("p", [[1, 2, 7]])
    assert src.propose(r, 8, 1).tokens == [7] and src.builds == 2
    src.finish(r)
    assert len(src) == 0


def test_group_source_catches_up_once_a_step_and_only_when_asked():
    """The speculator calls ``observe_step`` once a step, for all its rows: a group's next
    ``propose`` reads its members' new tokens then, and not again within the step."""
    src = GroupSource(FULL)
    a = FakeRequest("a", PROMPT, group_id="g")
    b = FakeRequest("b", PROMPT, group_id="g")
    src.start(a)
    src.start(b)
    a.output_token_ids += [1, 2, 3]
    b.output_token_ids += [1, 2]
    assert src.propose(b, 8, 1).tokens == [3]              # a start: the group catches up
    a.output_token_ids += [4]
    assert src.propose(b, 8, 1).tokens == [3]              # same step: a's new token not read
    src.observe_step()
    assert src.propose(b, 8, 1).tokens == [3, 4]
    assert not getattr(GroupSource, "observes", True)      # no row's observe needed
