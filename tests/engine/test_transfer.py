"""A request moved between engine instances keeps its drafts: the learned drafter's past,
the target's state at its draft root and a carried chain travel in ``RequestState`` (pickled,
as between worker processes), so the importing engine drafts for it exactly what the
exporting one would have (float64), and its outputs are unchanged."""
import pickle

import pytest

from tailrl import EngineConfig, SamplingParams, SpeculativeConfig
from tailrl.cli.train_drafter import warm_start
from tailrl.drafter.past import PastState
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request
from tailrl.speculative.draft import Draft

PROMPT = [(7 * i) % 89 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    """Warm-started a few steps on the sharp random target: its drafts are partly accepted
    (verify steps of every length happen) and partly rejected."""
    out = str(tmp_path_factory.mktemp("drafter"))
    warm_start(model, out, [PROMPT, [1, 2, 3], [9, 8, 7, 6, 5]], n=4, max_tokens=48, steps=40, batch=128,
               lr=3e-3, unroll=2)
    return out


def recorder(engine: LLMEngine, rid: str, seen: list) -> None:
    """Record every draft the engine's speculator proposes for ``rid`` as (tokens the request
    had, draft tokens, parents, probabilities)."""
    propose = engine.speculator.propose

    def wrapped(requests, batch_size, max_total_tokens=None, eligible=None):
        out = propose(requests, batch_size, max_total_tokens, eligible)
        for r in requests:
            if r.request_id == rid and rid in out:
                d = out[rid]
                seen.append((r.num_tokens, d.tokens, d.parents, d.probs))
        return out
    engine.speculator.propose = wrapped


def run(model, drafter_dir, paths: int, every: int | None):
    """One request in a drafter-only engine, alone; with ``every``, exported after every
    ``every`` steps and imported (pickled) into the other engine, back and forth. Returns
    (request, drafts proposed for it, states moved)."""
    cfg = SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0, max_tree_paths=paths)
    engines = [LLMEngine(EngineConfig(model=model, dtype="float64"), cfg) for _ in range(2)]
    seen: list = []
    for e in engines:
        recorder(e, "x", seen)
    req = Request("x", PROMPT, SamplingParams(max_tokens=60, ignore_eos=True, temperature=1.0), seed_key=11)
    engines[0].add_request(req)
    moved, at, steps = [], 0, 0
    while engines[at].has_unfinished():
        engines[at].step()
        steps += 1
        if every and steps % every == 0 and not req.status.finished:
            state = pickle.loads(pickle.dumps(engines[at].export_request("x")))
            moved.append(state)
            at = 1 - at
            req = engines[at].import_request(state)
    return req, seen, moved


@pytest.mark.parametrize("paths", [1, 3])
def test_a_migrated_request_gets_the_drafts_it_would_have_had(model, drafter_dir, paths):
    """Exported after every step (from its first: mid-prefill hand-outs, a past with queued
    positions, K/V held) or every third step: the drafts proposed for it at every length are
    those of the run that never moved, tokens, tree shape and probabilities; so are its tokens."""
    ref, want, _ = run(model, drafter_dir, paths, None)
    assert len(want) > 20 and any(len(d[1]) > 1 for d in want)
    for every in (1, 3):
        got_req, got, moved = run(model, drafter_dir, paths, every)
        assert len(moved) > 10 and all(isinstance(s.speculation["sources"]["drafter"], PastState)
                                       for s in moved[1:])
        assert all(s.hidden is not None and s.spec_bytes > 0 for s in moved)
        assert got == want
        assert got_req.output_token_ids == ref.output_token_ids
        assert got_req.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-9)


def test_an_unfit_past_is_dropped_and_a_carried_chain_travels(model, drafter_dir, caplog):
    """The speculator's hook on its own: a carried chain (the unverified rest of a fully accepted
    chain) is restored on import; a drafter past of other shapes (another drafter) is dropped
    with a warning, and the request drafts from what the importer computes."""
    cfg = SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0)
    src, dst = (LLMEngine(EngineConfig(model=model, dtype="float64"), cfg) for _ in range(2))
    req = Request("x", PROMPT, SamplingParams(max_tokens=30, ignore_eos=True), seed_key=3)
    src.add_request(req)
    for _ in range(4):
        src.step()
    rest = Draft.chain([5, 6, 7], [0.5, 0.5, 0.5], source="drafter")
    src.speculator._carry["x"] = rest
    state = pickle.loads(pickle.dumps(src.export_request("x")))
    assert state.speculation["carry"] == rest and "x" not in src.speculator._carry
    past = state.speculation["sources"]["drafter"]
    state.speculation["sources"]["drafter"] = PastState(past.base, past.k[:1], past.v[:1], past.queued)
    with caplog.at_level("WARNING"):
        moved = dst.import_request(state)
    assert dst.speculator._carry["x"] == rest and moved.pending_spec is None
    assert "x" not in dst.speculator.sources[0].past and "dropped" in caplog.text
    with pytest.raises(ValueError, match="heads"):
        dst.speculator.sources[0].past.adopt(moved, state.speculation["sources"]["drafter"])
    while dst.has_unfinished():
        dst.step()
    assert moved.num_output_tokens == 30
