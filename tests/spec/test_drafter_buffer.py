"""The spot trainer's buffer: bounded, runs split at gaps, windows laid out as the drafter loss
reads them; fed by the engine with exactly the hidden states that sampled each token (checked
against a teacher-forced forward, through accepted and rejected drafts)."""
import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.config import SamplingParams as SP
from tailrl.engine.request import Request
from tailrl.spec.drafter_buffer import DrafterBuffer


def req(rid="a", prompt=(1, 2, 3)):
    return Request(rid, list(prompt), SP(), 0)


def grow(buf: DrafterBuffer, r: Request, tokens: list[int], h0: float = 0.0) -> None:
    """Append ``tokens`` to ``r`` and hand the buffer states that encode (value, column 0)."""
    r.output_token_ids.extend(tokens)
    hidden = torch.tensor([[h0 + k, float(t)] for k, t in enumerate(tokens)])
    buf.add(r, tokens, hidden)


def test_layout_matches_the_drafter_loss():
    buf = DrafterBuffer(100)
    r = req()
    grow(buf, r, [5, 6], h0=0)
    grow(buf, r, [7, 8, 9], h0=2)                       # contiguous: the same run
    data = buf.data(unroll=2)
    assert data.hidden[:, 0].tolist() == [0, 1, 2, 3, 4]
    # position j's state sampled x_{j+1} = tokens[j + 1]
    assert data.tokens[1:].tolist() == [5, 6, 7, 8]
    assert data.starts.tolist() == [0, 1, 2]            # windows j .. j + 2 inside the run
    assert buf.data(unroll=2) is data                  # cached until the next change
    assert buf.data(unroll=5) is None                  # no run is long enough


def test_a_gap_starts_a_new_run_and_windows_never_span_runs():
    buf = DrafterBuffer(100)
    r = req()
    grow(buf, r, [5, 6, 7])
    r.output_token_ids.append(4)                       # a token whose state was not kept (recompute)
    grow(buf, r, [8, 9, 10], h0=10)
    other = req("b")
    grow(buf, other, [1, 1, 1], h0=20)
    data = buf.data(unroll=2)
    assert len(buf) == 9 and data.starts.tolist() == [0, 3, 6]
    with pytest.raises(ValueError, match="3 tokens but 2 hidden"):
        buf.add(r, [1, 2, 3], torch.zeros(2, 2))


@pytest.mark.parametrize("capacity", [2, 5, 7])
def test_the_buffer_is_bounded_and_keeps_the_newest(capacity):
    buf = DrafterBuffer(capacity)
    reqs = [req(str(i)) for i in range(4)]
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


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return ckpt_dir("qwen2", init_std=3.0, max_pos=1024)


class Recorder:
    """A collector that keeps every request's states, and feeds a real buffer too."""

    def __init__(self, buf: DrafterBuffer):
        self.buf, self.states, self.tokens = buf, {}, {}

    def add(self, r, tokens, hidden):
        self.states.setdefault(r.request_id, []).append(hidden.clone())
        self.tokens.setdefault(r.request_id, []).extend(tokens)
        self.buf.add(r, tokens, hidden)

    def finish(self, r):
        self.buf.finish(r)


def test_the_engine_hands_over_the_states_that_sampled_each_token(model):
    """float64: every generated token is handed over once, with the state that sampled it,
    equal to a teacher-forced forward's, with suffix drafts accepted and rejected."""
    from tailrl.rl.drafter_train import teacher_forced
    llm = LLM(model, dtype="float64", speculative=SpeculativeConfig(sources=("self",), min_token_prob=0.0,
                                                                    min_match_len=1))
    rec = Recorder(DrafterBuffer(10_000))
    llm.engine.speculator.collector = rec
    prompts = [[1, 2, 3, 1, 2, 3], [(7 * i) % 89 + 1 for i in range(30)]]
    outs = llm.generate(prompts, SamplingParams(n=2, max_tokens=40, seed=3))
    m = llm.last_metrics
    assert 0 < m["rollout/spec_accepted_tokens"] < m["rollout/spec_draft_tokens"]
    seqs = [(o.prompt_token_ids, c.token_ids) for o in outs for c in o.outputs]
    assert len(rec.buf) == sum(len(r) for _, r in seqs)
    assert sorted(rec.tokens.values()) == sorted(list(r) for _, r in seqs)
    ref = teacher_forced(model, seqs, unroll=1)                        # HF, float32
    offset = 0
    by_tokens = {tuple(t): torch.cat(rec.states[rid]) for rid, t in rec.tokens.items()}
    for p, r in seqs:
        want = ref.hidden[offset + len(p) - 1: offset + len(p) + len(r) - 1]   # the states that sampled r
        assert torch.allclose(by_tokens[tuple(r)].float(), want, atol=1e-3)
        offset += len(p) + len(r)
