"""Continuous batching behaviour: preemption, chunked prefill, shared prefill, stops, abort,
export/import between instances."""
import pytest

from tailrl import LLM, EngineConfig, SamplingParams
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request, RequestStatus
from tailrl.noise import mix

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], list(range(10, 70)), [4, 4]]


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(ckpt_dir):
    path = ckpt_dir("qwen2")
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True)
    return path, sp, tokens(LLM(path, dtype="float64").generate(PROMPTS, sp))


def test_preemption_under_small_kv_budget_keeps_outputs(reference):
    path, sp, ref = reference
    llm = LLM(path, dtype="float64", max_model_len=128, kv_cache_tokens=300)
    assert tokens(llm.generate(PROMPTS, sp)) == ref
    m = llm.last_metrics
    assert m["rollout/preemptions"] > 0
    assert m["kv/blocks"] == 300 // 32 and m["kv/blocks_used_peak"] == m["kv/blocks"]   # the pool, full, never more
    assert m["kv/allocations"] == 0                        # allocated with the engine, never again
    assert llm.engine.kv.used == 0                         # every block back


def test_chunked_prefill_and_small_token_budget_keep_outputs(reference):
    path, sp, ref = reference
    llm = LLM(path, dtype="float64", max_num_batched_tokens=16)
    assert tokens(llm.generate(PROMPTS, sp)) == ref


def test_group_shares_prompt_prefill(ckpt_dir):
    llm = LLM(ckpt_dir("qwen2"))
    prompt = list(range(1, 61))
    llm.generate([prompt], SamplingParams(n=8, max_tokens=1, ignore_eos=True))
    # one prefill of 60 tokens, then each of 8 samples computes only the prompt's last token
    assert llm.last_metrics["rollout/batched_tokens"] == 60 + 7


def test_a_group_holds_its_prompt_once(ckpt_dir):
    """8 samples of a 300-token prompt, 10 new tokens each: 310 positions, 10 blocks per sample
    unshared (80 in all); sharing holds the prompt's 9 full blocks once, plus each sample's own
    last block: 17. The outputs are those of samples that do not share (one at a time)."""
    path = ckpt_dir("qwen2", max_pos=1024)
    prompt = [(7 * i) % 89 + 1 for i in range(300)]
    sp = SamplingParams(n=8, max_tokens=10, ignore_eos=True, seed=5)
    llm = LLM(path, dtype="float64")
    out = tokens(llm.generate([prompt], sp))
    m = llm.last_metrics
    assert m["kv/blocks_shared_peak"] == 9 and m["kv/blocks_used_peak"] == 9 + 8
    alone = LLM(path, dtype="float64", max_num_seqs=1)                 # no sibling running to share with
    assert tokens(alone.generate([prompt], sp)) == out
    assert alone.last_metrics["kv/blocks_shared_peak"] == 0


def test_max_seqs_one_serialises_but_keeps_outputs(reference):
    path, sp, ref = reference
    assert tokens(LLM(path, dtype="float64", max_num_seqs=1).generate(PROMPTS, sp)) == ref


def test_stop_token_eos_and_length(ckpt_dir):
    path = ckpt_dir("qwen2")
    llm = LLM(path)
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 12
    stop_tok = greedy.token_ids[4]
    first = greedy.token_ids.index(stop_tok)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_tok]))[0]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == greedy.token_ids[:first + 1]
    eos_path = ckpt_dir("qwen2", eos_token_id=stop_tok)
    out = LLM(eos_path).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop_tok


def _request(rid: str, prompt: list[int], sp: SamplingParams, seed: int = 7) -> Request:
    return Request(rid, list(prompt), sp, mix(0, seed), group_id=rid, prompt_id=rid)


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_abort_frees_the_row_and_others_continue(ckpt_dir):
    engine = LLMEngine(EngineConfig(model=ckpt_dir("qwen2")))
    sp = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    a, b = _request("a", [1, 2, 3], sp, 1), _request("b", [3, 2, 1], sp, 2)
    engine.add_request(a)
    engine.add_request(b)
    for _ in range(5):
        engine.step()
    engine.abort("a")
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort" and a.row == -1
    _run(engine)
    assert b.finish_reason == "length" and b.num_output_tokens == 30


@pytest.mark.parametrize("steps", [0, 1, 9])
def test_export_import_resumes_identically(ckpt_dir, steps):
    path = ckpt_dir("qwen2")
    sp = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True)
    whole = LLMEngine(EngineConfig(model=path, dtype="float64"))
    ref = _request("x", [7, 1, 7, 2], sp)
    whole.add_request(ref)
    _run(whole)
    src = LLMEngine(EngineConfig(model=path, dtype="float64", seed=1))
    dst = LLMEngine(EngineConfig(model=path, dtype="float64", seed=2))   # engine seeds don't matter
    src.add_request(_request("x", [7, 1, 7, 2], sp))
    src.add_request(_request("other", [5, 5, 5], sp, 3))
    for _ in range(steps):
        src.step()
    state = src.export_request("x")
    assert (state.kv is not None) == (steps > 0)
    resumed = dst.import_request(state)
    _run(dst)
    _run(src)                                             # the source engine is still usable
    assert resumed.output_token_ids == ref.output_token_ids
    assert resumed.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-9)


def test_every_position_is_handed_to_the_speculator_once(model):
    """Hidden states go to the speculator once per computed position whose next token is
    known: prefill chunks (prompt positions) before the step commits, the positions that
    sampled the emitted tokens after it, none twice, in order, with chunked prefill and
    drafts; and the speculator's share of the step is its own stage (timing_s/observe)."""
    from tailrl import SpeculativeConfig
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=50, ignore_eos=True)
    llm = LLM(model, dtype="float64", max_num_batched_tokens=16, speculative=SpeculativeConfig(policy="fixed"))
    spec = llm.engine.speculator
    seen: dict[str, list[int]] = {}
    observe = spec.observe_hidden
    spec.wants_hidden = lambda batch_size: True

    def record(hidden, spans):
        for req, start, _, n in spans:
            seen.setdefault(req.request_id, []).extend(range(start, start + n))
        observe(hidden, spans)
    spec.observe_hidden = record
    outs = llm.generate(PROMPTS, sp)
    # in order, each once, from the first position the request computed (a sibling sharing its
    # group's prompt K/V starts after it) to the last whose next token is known
    assert all(got == list(range(got[0], got[0] + len(got))) for got in seen.values())
    want = sorted(len(p) + len(c.token_ids) - 2 for o, p in zip(outs, PROMPTS) for c in o.outputs)
    assert sorted(got[-1] for got in seen.values()) == want
    assert sum(got[0] == 0 for got in seen.values()) >= len(PROMPTS)          # one of each group from 0
    assert llm.last_metrics["rollout/spec_accepted_tokens"] > 0 and llm.last_metrics["timing_s/observe"] > 0


def test_a_speculative_rollout_reports_the_engine_s_whole_draft_stage(model):
    """``timing_s/draft`` in a rollout's metrics is the engine's draft stage, like every
    ``timing_s/<stage>``; the speculator's own count, part of it, does not replace it."""
    from tailrl import SpeculativeConfig
    llm = LLM(model, max_num_seqs=8, speculative=SpeculativeConfig(policy="fixed"))
    llm.generate([[1, 2, 3]], SamplingParams(n=4, max_tokens=24, seed=0), prompt_ids=["p"])
    llm.generate([[1, 2, 3]], SamplingParams(n=4, max_tokens=24, seed=0), prompt_ids=["p"])
    m, stage = llm.last_metrics, llm.engine.rollout_counters().draft_s
    assert m["rollout/spec_verify_steps"] > 0
    assert m["timing_s/draft"] == stage >= llm.engine.speculator.counts.draft_s > 0
