"""The drafter's per-request K/V of committed positions: appended only for committed
positions, each computed once (batched); kept through preemption, carried by a migrating
request (else partial after a migration with K/V, rebuilt by a recomputing import), shared by
a group's samples, freed on finish; and batched drafting over pasts of different lengths
equals drafting each request alone."""
import pytest
import torch

from tailrl import EngineConfig, SamplingParams, SpeculativeConfig
from tailrl.drafter.network import Drafter
from tailrl.drafter.past import DrafterPast
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request
from tailrl.model.loader import load_model
from tailrl.speculative.sources.drafter_source import DrafterSource

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]


@pytest.fixture(scope="module")
def drafter_dir(model, tmp_path_factory):
    """A random drafter (its drafts are mostly rejected: rejections must leave no K/V)."""
    out = str(tmp_path_factory.mktemp("random_drafter"))
    torch.manual_seed(0)
    d = Drafter.for_target(load_model(model, "float32"), intermediate_size=64)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.05 * torch.randn_like(p))
    d.save(out)
    return out


def source_of(engine) -> DrafterSource:
    return next(s for s in engine.speculator.sources if s.name == "drafter")


def counting(src: DrafterSource) -> list[int]:
    """Rows of committed K/V computed, per call (wraps the drafter's ``committed_kv``)."""
    calls: list[int] = []
    inner = src.drafter.committed_kv

    def wrapped(hidden, tokens, positions, end=None):
        calls.append(hidden.shape[0])
        return inner(hidden, tokens, positions, end)
    src.drafter.committed_kv = wrapped
    return calls


def req(rid: str, prompt: list[int], group: str = "") -> Request:
    return Request(rid, list(prompt), SamplingParams(), 0, group_id=group)


def test_add_skips_held_positions_restarts_after_a_gap_borrows_a_prompt_and_frees(model, drafter_dir):
    d = Drafter.load(drafter_dir, load_model(model))
    past = DrafterPast(d)
    h = torch.randn(20, d.cfg.hidden_size)
    a = req("a", list(range(1, 9)), group="g")
    a.output_token_ids += [3, 4]
    past.add(a, 0, h[:7])                                  # prefill: positions 0 .. 6
    past.add(a, 7, h[7:9])                                 # two emitted tokens
    past.add(a, 0, h[:9] + 1)                              # a recomputed prefill: already held
    assert past.span(a) == (0, 9)
    past.flush()
    k, v = d.committed_kv(h[:9], torch.tensor(a.tokens(1, 10)), torch.arange(9))
    got = past.kv(a)
    assert torch.allclose(got[0], k.permute(1, 2, 0), atol=1e-5) and torch.allclose(got[1], v.transpose(0, 1), atol=1e-5)
    assert past.seen(a, 9)[1] == 9 and past.seen(a, 4)[1] == 4     # a draft rooted at 4 sees positions < 4
    assert past.seen(req("none", [1, 2]), 1) == (None, 0)
    b = req("b", list(range(1, 9)), group="g")             # a sibling that shared the prompt's target K/V
    b.output_token_ids += [5]
    past.add(b, 7, h[12:13])
    assert past.span(b) == (0, 8)
    past.flush()
    kb = past.kv(b)[0]
    assert torch.allclose(kb[:, :, :7], k.permute(1, 2, 0)[:, :, :7], atol=1e-5)   # computed in another batch
    c = req("c", [1, 2])                                   # resumed here after 5 tokens elsewhere: a gap
    c.output_token_ids += [3, 4, 5, 6, 7]
    past.add(c, 5, h[:1])
    assert past.span(c) == (5, 6)
    past.flush()
    assert past.pool.used == 3                             # a block (32 positions) each
    for r in (a, b, c):
        past.free(r)
        assert r.request_id not in past
    assert past.pool.used == 0                             # blocks back in the pool
    with pytest.raises(ValueError, match="next tokens"):
        past.add(c, 6, h[:1])                              # position 6's next token is not there yet


def test_a_request_not_drafted_for_keeps_only_its_newest_positions(model, drafter_dir):
    """A request never drafted for queues one reference per step; past ``MAX_WAIT`` queued
    positions its past restarts at its newest ``MAX_WAIT // 2`` (held K/V dropped, an entry
    cut in the middle), and the flush computes exactly those positions' K/V."""
    from tailrl.drafter.past import MAX_WAIT
    d = Drafter.load(drafter_dir, load_model(model))
    past = DrafterPast(d)
    n = MAX_WAIT + 40
    a = req("a", [1, 2, 3], group="g")
    tokens = [(3 * i) % 50 + 1 for i in range(n)]
    a.output_token_ids.append(tokens[0])                            # the prompt's positions' next tokens
    h = torch.randn(n + 2, d.cfg.hidden_size)
    past.add_spans(h[:3].clone(), [(a, 0, 0, 3)])                  # prefill: positions 0 .. 2
    past.flush()
    assert past.span(a) == (0, 3) and past.pending(a) == 0
    pos = 3
    while pos < n + 2:                                              # 3 positions per step
        k = min(3, n + 2 - pos)
        a.output_token_ids += tokens[len(a.output_token_ids):pos + k + 1 - 3]
        past.add_spans(h[pos:pos + k].clone(), [(a, pos, 0, k)])
        pos += k
        assert past.pending(a) == min(pos - 3, MAX_WAIT)            # positions after those held, at most MAX_WAIT
    first, end = past.span(a)
    assert end == n + 2 and MAX_WAIT // 2 <= end - first <= MAX_WAIT and past.pending(a) == end - first   # exact once read
    past.flush()
    k, v = d.committed_kv(h[first:end], torch.tensor(a.tokens(first + 1, end + 1)), torch.arange(first, end))
    got = past.kv(a)
    assert torch.allclose(got[0], k.permute(1, 2, 0), atol=1e-5) and torch.allclose(got[1], v.transpose(0, 1), atol=1e-5)


def test_the_log_keeps_the_last_hand_outs_and_a_new_request_of_an_old_id_reads_none_of_its(model, drafter_dir):
    """Hand-outs are logged, not read, until a request is drafted for: a request read after
    more than ``LOG_HAND_OUTS`` hand-outs starts at the oldest position still logged; a request
    that reuses a departed request's id (exported and imported back) reads none of the old
    one's positions."""
    from tailrl.drafter.past import LOG_HAND_OUTS
    d = Drafter.load(drafter_dir, load_model(model))
    past = DrafterPast(d)
    n = LOG_HAND_OUTS + 30
    a = req("a", [1, 2], group="g")
    a.output_token_ids += [(7 * i) % 50 + 1 for i in range(n)]
    h = torch.randn(n + 1, d.cfg.hidden_size)
    for pos in range(n + 1):
        past.add_spans(h[pos:pos + 1].clone(), [(a, pos, 0, 1)])
    assert "a" not in past                                       # nothing read yet
    assert past.span(a) == (n + 1 - LOG_HAND_OUTS, n + 1)
    past.free(a)
    again = req("a", [1, 2], group="g")                           # the same id, another request
    again.output_token_ids += a.output_token_ids[:3]
    assert past.span(again) == (0, 0)
    past.add_spans(h[2:4].clone(), [(again, 2, 0, 2)])
    assert past.span(again) == (2, 4)


def test_engine_appends_committed_positions_only_each_computed_once_and_frees(model, drafter_dir):
    """float64, chains and trees, a random drafter (mostly rejected) and a small KV budget
    (preemptions): after every step each running request's past is exactly its committed
    positions < num_tokens - 1; over the run no position's K/V was computed twice."""
    for paths in (1, 3):
        engine = LLMEngine(EngineConfig(model=model, dtype="float64", max_model_len=128, kv_cache_tokens=160),
                           SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0,
                                             max_tree_paths=paths))
        src = source_of(engine)
        calls = counting(src)
        reqs = [Request(f"r{i}-{j}", p, SamplingParams(max_tokens=60, ignore_eos=True), seed_key=i * 7 + j,
                        group_id=str(i)) for i, p in enumerate(PROMPTS) for j in range(2)]
        for r in reqs:
            engine.add_request(r)
        while engine.has_unfinished():
            engine.step()
            for r in reqs:
                if r.request_id in src.past:
                    assert src.past.span(r) == (0, r.num_tokens - 1)
        assert engine.metrics.num_preemptions > 0
        m = engine.spec_metrics()
        assert 0 < m["rollout/spec_draft_tokens/drafter"] and not src.past._past      # drafted; all freed
        # the spans above are exact and append-only, so no position was computed twice; one sample
        # per group borrowed its prompt; positions still queued when a request finished were never
        # computed (K/V are computed lazily, when a draft is asked for)
        shared = sum(len(p) - 1 for p in PROMPTS)
        assert 0.8 * sum(r.num_tokens - 1 for r in reqs) < sum(calls) <= sum(r.num_tokens - 1 for r in reqs) - shared


def test_past_travels_with_a_migrating_request_else_partial_or_rebuilt(model, drafter_dir):
    """Exported mid-flight, a request takes its past along (``export`` / ``adopt``): the
    importer holds it from position 0, with or without the target K/V. A state without it (from
    an instance without the drafter) attends only over what the importer computes: partial
    after an import with K/V, rebuilt from the recomputed prefill without. Outputs never change."""
    cfg = SpeculativeConfig(policy="fixed", method="drafter", drafter=drafter_dir, min_token_prob=0.0)
    engines = [LLMEngine(EngineConfig(model=model, dtype="float64"), cfg) for _ in range(2)]
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = Request("x", PROMPTS[2], sp, seed_key=11)
    engines[0].add_request(ref)
    while engines[0].has_unfinished():
        engines[0].step()
    engines[0].release("x")
    outs = []
    for carry, keep_kv in ((True, True), (True, False), (False, True), (False, False)):
        req = Request("x", PROMPTS[2], sp, seed_key=11)
        engines[0].add_request(req)
        while req.num_output_tokens < 12:
            engines[0].step()
        state = engines[0].export_request("x")
        assert "x" not in source_of(engines[0]).past               # freed on export
        if not keep_kv:
            state.kv = None                                        # the receiver recomputes the prefix
        if not carry:
            state.speculation = state.hidden = None
        at = req.num_tokens
        moved = engines[1].import_request(state)
        engines[1].step()
        first, end = source_of(engines[1]).past.span(moved)
        assert first == (0 if carry or not keep_kv else at - 1) and end == moved.num_tokens - 1
        while engines[1].has_unfinished():
            engines[1].step()
        outs.append(moved.output_token_ids)
        engines[1].release("x")
    assert outs == [ref.output_token_ids] * 4                      # drafts stay valid either way


@pytest.mark.parametrize("paths", [1, 3])
def test_batched_drafting_equals_drafting_each_request_alone(model, drafter_dir, paths):
    target = load_model(model)
    src = DrafterSource(Drafter.load(drafter_dir, target))
    gen = torch.Generator().manual_seed(0)
    reqs = []
    for i, n in enumerate([3, 17, 9, 1]):                           # pasts of different lengths
        r = req(f"r{i}", [(5 * i + j) % 80 + 3 for j in range(n + 1)])
        r.output_token_ids.append(7 + i)
        src.observe_hidden(torch.randn(n + 1, target.args.hidden_size, generator=gen), [(r, 0, 0, n + 1)])
        r.keep_hidden(torch.randn(target.args.hidden_size, generator=gen))
        reqs.append(r)
    batched = src.grow(reqs, 6, paths)
    for r, d in zip(reqs, batched):
        alone = src.grow([r], 6, paths)[0]
        assert d.tokens == alone.tokens and d.parents == alone.parents
        assert d.probs == pytest.approx(alone.probs, abs=1e-5)
