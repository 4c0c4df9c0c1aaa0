"""``SampleGroups`` (serve/samples.py): the history a group of per-sample calls records."""
from tailrl.config import SamplingParams
from tailrl.serve.samples import SampleGroups


def finish(groups: SampleGroups, req, tokens):
    req.output_token_ids = list(tokens)
    return groups.retire([req])


def test_a_sibling_called_after_the_others_finished_joins_their_history():
    """verl sends a prompt's samples one call at a time: when the first three finish before the
    fourth is called, the history is recorded with three, then again with all four."""
    g = SampleGroups(seed=0)
    sp = SamplingParams()
    first = [g.make(f"c{i}", [1, 2, 3], sp) for i in range(3)]
    assert finish(g, first[0], [4]) == [] and finish(g, first[1], [5]) == []
    assert finish(g, first[2], [6]) == [(first[0].prompt_id, [[4], [5], [6]])]
    late = g.make("c3", [1, 2, 3], sp)
    assert late.group_id == first[0].group_id and late.index == 3
    assert finish(g, late, [7]) == [(late.prompt_id, [[4], [5], [6], [7]])]


def test_a_group_cut_short_records_nothing_and_old_groups_are_let_go():
    g = SampleGroups(seed=0)
    sp = SamplingParams()
    a, b = g.make("a", [1], sp), g.make("b", [1], sp)
    g.forget(a)
    assert finish(g, b, [3]) == []
    g.KEEP = 4
    for i in range(20):
        finish(g, g.make(f"x{i}", [10 + i], sp), [i])
    assert len(g._done) <= 4
    live = g.make("live", [99], sp)
    other = g.make("live2", [99], sp)
    finish(g, live, [1])                   # its group still runs: kept whatever the cap
    for i in range(20):
        finish(g, g.make(f"y{i}", [50 + i], sp), [i])
    assert finish(g, other, [2]) == [(other.prompt_id, [[1], [2]])]
