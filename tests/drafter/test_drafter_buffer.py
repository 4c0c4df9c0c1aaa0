"""The spot trainer's buffer: bounded, runs split at gaps, windows laid out as the drafter loss
reads them; fed by the engine with exactly the hidden states that sampled each token (checked
against a teacher-forced forward, through accepted and rejected drafts)."""
import copy

import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.config import SamplingParams as SP
from tailrl.drafter.buffer import DrafterBuffer
from tailrl.engine.request import Request


def req(rid="a", prompt=(1, 2, 3)):
    return Request(rid, list(prompt), SP(), 0)


def grow(buf: DrafterBuffer, r: Request, tokens: list[int], h0: float = 0.0, start: int | None = None) -> None:
    """Append ``tokens`` to ``r`` and hand the buffer the states of the positions that sampled
    them (the root first), encoded as (value, position)."""
    r.output_token_ids.extend(tokens)
    first = r.num_tokens - len(tokens) - 1 if start is None else start
    n = r.num_tokens - 1 - first
    buf.add(r, first, torch.tensor([[h0 + k, float(first + k)] for k in range(n)]))


def test_layout_keeps_whole_sequences_and_counts_roots_from_the_prompts_end():
    buf = DrafterBuffer(100)
    r = req()
    buf.add(r, 0, torch.tensor([[-2.0, 0.0], [-1.0, 1.0]]))  # the prefill: prompt positions 0, 1
    grow(buf, r, [5, 6], h0=0)                            # positions 2, 3
    grow(buf, r, [7, 8, 9], h0=2)                         # contiguous: the same run
    data = buf.data(unroll=2)
    assert data.hidden[:, 0].tolist() == [-2, -1, 0, 1, 2, 3, 4]
    assert data.tokens.tolist() == [1, 2, 3, 5, 6, 7, 8]  # the token at each position
    assert data.offsets.tolist() == [0, 7] and data.first.tolist() == [2]   # roots from the last prompt position
    assert data.windows(2) == 3                           # roots 2, 3, 4 train two steps
    assert buf.data(unroll=2) is data                    # cached until the next change
    assert buf.data(unroll=5) is None                    # no run is long enough


def test_recomputed_positions_are_skipped_and_a_gap_starts_a_new_run():
    buf = DrafterBuffer(100)
    r = req()
    grow(buf, r, [5, 6, 7], start=0)                     # prefill and three tokens: positions 0 .. 4
    buf.add(r, 0, torch.full((5, 2), 99.0))              # a preempted request's recomputed prefill
    assert len(buf) == 5 and 99 not in buf.data(1).hidden[:, 0].tolist()
    r.output_token_ids.append(4)                         # a token whose state was not kept (another instance)
    grow(buf, r, [8, 9, 10], h0=10)
    other = req("b")
    grow(buf, other, [1, 1, 1], h0=20, start=0)
    data = buf.data(unroll=1)
    assert len(buf) == 5 + 3 + 5 and data.offsets.tolist() == [0, 5, 8, 13]
    assert data.first.tolist() == [2, 0, 2]              # the resumed run has no prompt: all its roots count
    with pytest.raises(ValueError, match="outside request"):
        buf.add(r, r.num_tokens - 1, torch.zeros(2, 2))


@pytest.mark.parametrize("capacity", [2, 5, 7])
def test_the_buffer_is_bounded_and_keeps_the_newest(capacity):
    buf = DrafterBuffer(capacity)
    reqs = [req(str(i), prompt=(1,)) for i in range(4)]
    for step in range(6):
        for i, r in enumerate(reqs):
            grow(buf, r, [step + 1] * (1 + i % 2), h0=100 * step + i)
            assert len(buf) <= capacity
        if step == 2:
            buf.finish(reqs[0])
    data = buf.data(unroll=1)
    newest = data.hidden[:, 0].max().item() if data is not None else None
    assert 0 < len(buf) <= capacity and buf.added == 6 * 6
    assert newest is None or newest >= 500               # the last step's states survive
    assert len(buf) == sum(len(run) for run in buf._runs.values())
    with pytest.raises(ValueError, match="capacity"):
        DrafterBuffer(1)


class Recorder:
    """A collector that keeps every request's states by position, and feeds a real buffer too."""

    def __init__(self, buf: DrafterBuffer):
        self.buf, self.states, self.ids = buf, {}, {}

    def add_spans(self, hidden, spans):
        for r, start, row, n in spans:
            for k in range(n):
                self.states.setdefault(r.request_id, {}).setdefault(start + k, []).append(hidden[row + k].clone())
        self.buf.add_spans(hidden, spans)

    def finish(self, r):
        self.ids[r.request_id] = (tuple(r.prompt_token_ids), tuple(r.output_token_ids))
        self.buf.finish(r)


def test_the_engine_hands_over_the_state_of_every_position_once(model):
    """float64: every position but the last, prompt included, is handed over once (a small
    prefill chunk splits prompts; a group's later samples share its prefill, and the buffer
    copies their prompt states from a sibling), equal to a teacher-forced forward's state,
    with suffix drafts accepted and rejected."""
    from tailrl.drafter.train import teacher_forced
    llm = LLM(model, dtype="float64", max_num_batched_tokens=16,
              speculative=SpeculativeConfig(sources=("self",), min_token_prob=0.0, min_match_len=1,
                                                policy="fixed"))
    rec = Recorder(DrafterBuffer(10_000))
    llm.engine.speculator.collector = rec
    prompts = [[1, 2, 3, 1, 2, 3], [(7 * i) % 89 + 1 for i in range(30)]]
    outs = llm.generate(prompts, SamplingParams(n=2, max_tokens=40, seed=3))
    m = llm.last_metrics
    assert 0 < m["rollout/spec_accepted_tokens"] < m["rollout/spec_draft_tokens"]
    seqs = [(o.prompt_token_ids, c.token_ids) for o in outs for c in o.outputs]
    ref = teacher_forced(model, seqs)                                  # HF, float32
    for rid, st in rec.states.items():                                 # what the engine handed out: once each
        p, r = rec.ids[rid]
        n = len(p) + len(r) - 1
        assert sorted(st) in (list(range(n)), list(range(len(p) - 1, n))) and all(len(v) == 1 for v in st.values())
    data = rec.buf.data(unroll=1)
    assert len(rec.buf) == sum(len(p) + len(r) - 1 for p, r in seqs) and sorted(data.first.tolist()) == sorted([
        len(p) - 1 for p, _ in seqs])
    runs = {tuple(data.tokens[a:b].tolist()): data.hidden[a:b] for a, b in zip(data.offsets[:-1], data.offsets[1:])}
    for (p, r), start in zip(seqs, ref.offsets.tolist()):
        n = len(p) + len(r) - 1
        mine = runs[tuple(p) + tuple(r[:-1])]
        assert torch.allclose(mine.float(), ref.hidden[start:start + n], atol=1e-3)


def snapshot(buf: DrafterBuffer, unroll: int = 1):
    """What training reads (``data``) plus the bookkeeping that decides future adds."""
    d = buf.data(unroll)
    laid = None if d is None else (d.hidden.tolist(), d.tokens.tolist(), d.offsets.tolist(), d.first.tolist())
    return laid, len(buf), buf.added, sorted(rid for rid, key in buf._open.items() if key in buf._runs)


def test_save_and_load_continue_exactly_as_the_buffer_would_have(tmp_path):
    """A saved and loaded buffer holds the same runs in the same (eviction) order, its open
    runs stay open, and the same adds after it give the same data as the original's; the
    handed-out dtype is kept; a smaller capacity evicts the oldest runs at once."""
    buf = DrafterBuffer(34)
    reqs = [Request(f"r{i}", [1 + i, 2, 3], SP(), 0, group_id=f"g{i % 2}") for i in range(4)]
    for step in range(5):
        for i, r in enumerate(reqs):
            if i > 0 or step < 2:                             # r0 finishes after step 1
                grow(buf, r, [step + 2] * (1 + i % 2), h0=100 * step + i, start=0 if step == 0 else None)
        if step == 1:
            buf.finish(reqs[0])
    buf.add(reqs[3], 0, torch.zeros(1, 2))                  # recomputed: skipped (the run stays open)
    closed = req("c", (7, 8))
    grow(buf, closed, [1, 2], start=0)
    buf.finish(closed)
    half = DrafterBuffer(40)
    half.add_spans(torch.tensor([[1.5, 0.0], [2.5, 1.0]], dtype=torch.bfloat16), [(req("h", (5, 6, 7)), 0, 0, 2)])
    assert buf.added > len(buf) and len(buf._runs) == 4 and snapshot(buf)[3] == ["r1", "r2", "r3"]   # r0 evicted
    path = str(tmp_path / "buffer.safetensors")
    buf.save(path)
    again = DrafterBuffer(34)
    again.load(path)
    assert snapshot(again) == snapshot(buf) and snapshot(again, 2) == snapshot(buf, 2)
    twins = copy.deepcopy(reqs)                               # the same requests, for the loaded buffer
    for b, rs in ((buf, reqs), (again, twins)):               # the same future: open runs grow, old ones go
        sibling = Request("s", [4, 2, 3], SP(), 0, group_id="g1")   # shares r3's prompt: borrows its states
        grow(b, sibling, [9, 9], h0=50, start=2)
        assert b._runs[b._open["s"]].start == 0                  # borrowed from r3's run, open after loading
        for step in range(5, 8):
            for r in rs[1:]:
                grow(b, r, [step], h0=100 * step)
    assert snapshot(again) == snapshot(buf)
    half.save(path)
    h = DrafterBuffer(10)
    h.load(path)
    kept = h._runs[0].states()
    assert kept.dtype == torch.bfloat16 and kept[:, 0].tolist() == [1.5, 2.5]
    buf.save(path)
    small = DrafterBuffer(12)
    small.load(path)
    assert len(small) <= 12 and snapshot(small)[0][1] == snapshot(buf)[0][1][-len(small):]   # the newest runs
    empty = DrafterBuffer(10)
    empty.save(path)
    small.load(path)
    assert len(small) == 0 and small.data(1) is None
    from safetensors.torch import save_file
    save_file({"hidden": torch.zeros(1, 2)}, path, metadata={"format": "pt"})   # not a buffer file
    with pytest.raises(ValueError, match="format"):
        small.load(path)
