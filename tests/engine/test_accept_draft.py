"""Accept/reject of speculative drafts: the pure function (table-driven), then stop tokens and
max_tokens inside an accepted run, with a real model and real history drafts."""
import pytest

from tailrl import EngineConfig, SamplingParams, SpeculativeConfig
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request
from tailrl.engine.verify import accept_draft
from tailrl.noise import mix
from tailrl.speculative.history import HistoryStore
from tailrl.speculative.policies.base import FixedPolicy
from tailrl.speculative.speculator import Speculator

# (case, parents, draft tokens, targets, emitted, accepted node indices)
# targets[0]: the target token after the root; targets[1 + j]: the target after node j.
CASES = [
    ("no draft", [], [], [5], [5], []),
    ("chain, immediate rejection", [-1, 0, 1], [7, 8, 9], [6, 0, 0, 0], [6], []),
    ("chain, rejected in the middle", [-1, 0, 1], [7, 8, 9], [7, 8, 4, 0], [7, 8, 4], [0, 1]),
    ("chain, full acceptance: bonus after the last node", [-1, 0, 1], [7, 8, 9], [7, 8, 9, 3],
     [7, 8, 9, 3], [0, 1, 2]),
    ("chain, a later node matching does not help after a rejection", [-1, 0, 1], [7, 8, 9], [7, 2, 9, 3],
     [7, 2], [0]),
    ("tree, the second sibling is accepted", [-1, -1], [4, 5], [5, 0, 6], [5, 6], [1]),
    ("tree, no sibling matches", [-1, -1], [4, 5], [6, 0, 0], [6], []),
    ("tree, duplicate siblings: the first one wins", [-1, -1, 0, 1], [4, 4, 8, 9], [4, 8, 9, 1, 2],
     [4, 8, 1], [0, 2]),
    # root -> 1 -> 2 -> 3 (nodes 0, 1, 2) and root -> 1 -> 5 -> 6 -> 7 (nodes 0, 3, 4, 5)
    ("tree, deep second branch", [-1, 0, 1, 0, 3, 4], [1, 2, 3, 5, 6, 7], [1, 5, 0, 0, 6, 7, 8],
     [1, 5, 6, 7, 8], [0, 3, 4, 5]),
    ("tree, deep first branch, full acceptance", [-1, 0, 1, 0, 3, 4], [1, 2, 3, 5, 6, 7],
     [1, 2, 3, 9, 0, 0, 0], [1, 2, 3, 9], [0, 1, 2]),
    ("tree, branch point in the middle, rejection at depth 3", [-1, 0, 1, 1], [1, 2, 3, 4],
     [1, 2, 4, 0, 7], [1, 2, 4, 7], [0, 1, 3]),
]


@pytest.mark.parametrize("case,parents,draft,targets,emitted,accepted", CASES, ids=[c[0] for c in CASES])
def test_accept_draft(case, parents, draft, targets, emitted, accepted):
    got_emitted, got_accepted = accept_draft(parents, draft, targets)
    assert (got_emitted, got_accepted) == (emitted, accepted)
    assert len(got_emitted) == len(got_accepted) + 1
    # every emitted token but the bonus is an accepted node's token
    assert [draft[j] for j in got_accepted] == got_emitted[:-1]


# ---- stop tokens and max_tokens inside an accepted run (engine level) ----------------------
PROMPT = [3, 1, 4, 1, 5]


def _request(sp: SamplingParams) -> Request:
    return Request("x", list(PROMPT), sp, mix(0, 11), group_id="x", prompt_id="p")


def _plain(path: str, sp: SamplingParams) -> Request:
    engine = LLMEngine(EngineConfig(model=path, dtype="float64"))
    req = _request(sp)
    engine.add_request(req)
    while engine.has_unfinished():
        engine.step()
    return req


def _speculative(path: str, sp: SamplingParams, history: list[list[int]]) -> tuple[Request, list[tuple[int, int]]]:
    """Run with history drafts and a fixed 8-node policy; returns the request and, per step,
    (tokens the request gained, draft tokens accepted)."""
    store = HistoryStore()
    store.record("p", history)
    spec = Speculator(SpeculativeConfig(), store, policy=FixedPolicy(k=8))
    engine = LLMEngine(EngineConfig(model=path, dtype="float64"), speculator=spec)
    req = _request(sp)
    engine.add_request(req)
    steps = []
    while engine.has_unfinished():
        before, acc = req.num_output_tokens, spec.metrics()["rollout/spec_accepted_tokens"]
        engine.step()
        steps.append((req.num_output_tokens - before, int(spec.metrics()["rollout/spec_accepted_tokens"] - acc)))
    return req, steps


@pytest.fixture(scope="module")
def model(ckpt_dir):
    return ckpt_dir("qwen2", init_std=1.0, max_pos=1024)


@pytest.mark.parametrize("stop_by", ["stop_token_ids", "eos"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_token_inside_an_accepted_run_cuts_the_run(ckpt_dir, model, temperature, stop_by):
    free = _plain(model, SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True))
    out = free.output_token_ids
    # a stop token whose first occurrence is at output position 2..7: inside the first
    # speculative step's run (position 0 comes from the prefill step, drafts are 8 long)
    stop = next(t for k, t in enumerate(out) if 2 <= k <= 7 and t not in out[:k])
    cut = out.index(stop) + 1
    if stop_by == "eos":                  # the same weights, with the stop token as the model's EOS
        model = ckpt_dir("qwen2", init_std=1.0, max_pos=1024, eos_token_id=stop)
        sp = SamplingParams(temperature=temperature, max_tokens=40)
    else:
        sp = SamplingParams(temperature=temperature, max_tokens=40, stop_token_ids=[stop])
    plain = _plain(model, sp)
    assert plain.output_token_ids == out[:cut] and plain.finish_reason == "stop"
    req, steps = _speculative(model, sp, history=[out])       # the history is the very continuation
    assert req.output_token_ids == plain.output_token_ids
    assert req.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-9)
    assert req.finish_reason == "stop"
    gained, accepted = steps[-1]
    assert accepted >= gained >= 2          # the stop token was an accepted draft node, not the bonus


@pytest.mark.parametrize("max_tokens", [6, 13])
def test_max_tokens_inside_an_accepted_run_ends_the_response(model, max_tokens):
    sp = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    plain = _plain(model, sp)
    longer = _plain(model, sp.clone(max_tokens=40)).output_token_ids
    assert plain.output_token_ids == longer[:max_tokens]
    req, steps = _speculative(model, sp, history=[longer])    # drafts reach past max_tokens
    assert req.output_token_ids == plain.output_token_ids and len(req.output_token_ids) == max_tokens
    assert req.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-9)
    assert req.finish_reason == "length"
    gained, accepted = steps[-1]
    assert gained >= 2 and accepted >= 1    # the last step was an accepted run that hit max_tokens


def test_a_chain_run_appends_as_token_by_token():
    """A verified chain's run is appended in a few list operations (``_append_run``); it must
    end where appending one token at a time ends it: the first stop token (EOS unless
    ignored, or a stop id) or the length limit (max_tokens or the context), a stop token on
    the limit counting as a stop, with the same tokens, log-probabilities and sampled rows."""
    import copy
    import random

    from tailrl.engine.batch import RowPlan
    from tailrl.engine.verify import _append_run, append_token
    rng = random.Random(0)
    ends = set()
    for _ in range(5000):
        max_tokens = rng.randint(1, 12)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.3,
                                stop_token_ids=[rng.randint(0, 9)] if rng.random() < 0.3 else None)
        prompt = [1] * rng.randint(1, 5)
        req = Request("r", prompt, params, 1)
        req.max_model_len = rng.randint(len(prompt) + 1, len(prompt) + 14)
        done = rng.randint(0, min(max_tokens, req.max_model_len - len(prompt)))      # at the limit too
        req.output_token_ids, req.output_logprobs = [5] * done, [0.0] * done
        tokens, logprobs = [rng.randint(0, 9) for _ in range(10)], [rng.random() for _ in range(10)]
        start = rng.randint(0, 3)
        end = rng.randint(start + 1, 10)
        eos = (rng.randint(0, 9),)
        a, b = copy.deepcopy(req), copy.deepcopy(req)
        plan_a, plan_b = RowPlan(a, 1, [], [], start), RowPlan(b, 1, [], [], start)
        got = _append_run(plan_a, tokens, logprobs, start, end, eos)
        want = (tokens[start:end], None)
        for i in range(start, end):
            plan_b.last = i
            plan_b.rows.append(i)
            status = append_token(b, tokens[i], logprobs[i], eos)
            if status is not None:
                want = (tokens[start:i + 1], status)
                break
        assert got == want
        assert (a.output_token_ids, a.output_logprobs) == (b.output_token_ids, b.output_logprobs)
        assert (plan_a.rows, plan_a.last) == (plan_b.rows, plan_b.last)
        ends.add((want[1], len(want[0]) < end - start))
    assert len(ends) >= 4          # stops and length limits, inside runs and at their ends, all met


def random_request(rng) -> Request:
    """A request with a random prompt, max_tokens, context window and output so far."""
    req = Request("r", [1] * rng.randint(1, 6), SamplingParams(max_tokens=rng.randint(1, 12)), 1)
    req.max_model_len = rng.randint(len(req.prompt_token_ids) + 1, len(req.prompt_token_ids) + 14)
    req.output_token_ids = [2] * rng.randint(0, 14)
    return req


def test_at_limit_is_remaining_tokens_spent():
    """``verify.at_limit`` (one pass, asked for every row of every step launched ahead) is
    ``remaining_tokens <= 0``: max_tokens or the context window reached."""
    import random

    from tailrl.engine.verify import at_limit
    rng = random.Random(0)
    seen = set()
    for _ in range(3000):
        req = random_request(rng)
        assert at_limit(req) == (req.remaining_tokens <= 0)
        seen.add(at_limit(req))
    assert seen == {True, False}


def test_takes_drafts_is_decoding_with_room_for_a_draft():
    """``Request.takes_drafts`` (one pass, asked for every row of every speculative step) is
    ``is_decoding and remaining_tokens > 1``."""
    import random
    rng = random.Random(1)
    seen = set()
    for _ in range(3000):
        req = random_request(rng)
        req.num_computed_tokens = max(0, req.num_tokens - rng.randint(0, 2))
        want = req.is_decoding and req.remaining_tokens > 1
        assert req.takes_drafts() == want
        seen.add(want)
    assert seen == {True, False}
