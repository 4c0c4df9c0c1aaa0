"""The default path: ``LLM(model, speculative=SpeculativeConfig(...))`` (real draft sources)
gives the outputs of plain ``LLM(model)``, in float64: tokens and finish reasons identical,
logprobs to rounding (batch composition changes float64 sums by ~1e-13).

The model has peaked logits (large init_std) so that history, group and self drafts get
accepted; each test checks that speculation really ran. Whether the default policy
("priced") drafts at a step depends on the step times it measured on this machine, so the
tests of mechanics under speculation (mixed sampling, preemption, chunked prefill, export /
import) use the fixed policy, which drafts at every step; the default's own tests run it
until it has learned its curve (tests/speculative/test_priced_policy.py tests its decisions).
"""
import pytest

from tailrl import LLM, EngineConfig, SamplingParams, SpeculativeConfig
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request
from tailrl.noise import mix
from tailrl.speculative.history import HistoryStore

LONG = [(7 * i) % 89 + 1 for i in range(90)]
PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], LONG[:60], [4, 4]]


def assert_same(plain, spec):
    for a, b in zip(plain, spec, strict=True):
        for ca, cb in zip(a.outputs, b.outputs, strict=True):
            assert cb.token_ids == ca.token_ids
            assert cb.finish_reason == ca.finish_reason
            assert cb.logprobs == pytest.approx(ca.logprobs, abs=1e-9)


def run_both(model, prompts, params, calls=2, policy="fixed", **engine_kw):
    """``calls`` generate calls on a plain and a speculative LLM; every call's outputs must
    match. Returns both LLMs' metrics per call."""
    plain = LLM(model, dtype="float64", **engine_kw)
    spec = LLM(model, speculative=SpeculativeConfig(policy=policy), dtype="float64", **engine_kw)
    plain_m, spec_m = [], []
    for _ in range(calls):
        assert_same(plain.generate(prompts, params), spec.generate(prompts, params))
        plain_m.append(plain.last_metrics)
        spec_m.append(spec.last_metrics)
    return plain_m, spec_m


def assert_speculated(m):
    assert m["rollout/spec_draft_tokens"] > 0 and m["rollout/spec_accepted_tokens"] > 0
    assert m["rollout/spec_accept_length"] > 1


def test_mixed_sampling_params_in_one_batch_and_a_second_call(model):
    params = [SamplingParams(n=3, top_k=5, max_tokens=60, ignore_eos=True),
              SamplingParams(n=3, top_p=0.8, max_tokens=60, ignore_eos=True),
              SamplingParams(n=3, temperature=0, max_tokens=60, ignore_eos=True),
              SamplingParams(n=3, temperature=0.7, max_tokens=60, ignore_eos=True)]
    _, spec = run_both(model, PROMPTS, params)
    assert_speculated(spec[1])
    assert spec[1]["rollout/spec_draft_tokens/history"] > 0     # the first call's responses drafted


def greedy_and_sampled(n: int) -> list[SamplingParams]:
    """Greedy prompts repeat their responses, so the second call's history drafts of them are
    accepted whenever the policy verifies them; sampled prompts check the noise positions."""
    return [SamplingParams(n=2, temperature=0 if i % 2 == 0 else 1.0, max_tokens=50, ignore_eos=True)
            for i in range(n)]


def test_the_default_policy_learns_to_draft_and_stays_lossless(model):
    """The priced default, from a fresh engine: by its third call it drafts (its curve and
    acceptance measured), and every call's outputs equal plain decoding's. The batch drains
    (lengths 20 to 160: the curve is measured at every batch size on the way down) and the
    greedy samples' history drafts are exact from the second call, so drafting pays in the
    tail whatever this machine's step and drafting times are."""
    params = [SamplingParams(n=2, temperature=0 if i % 2 == 0 else 1.0, max_tokens=20 * 2 ** i,
                             ignore_eos=True, seed=i) for i in range(len(PROMPTS))]
    _, spec = run_both(model, PROMPTS, params, calls=3, policy="priced")
    assert_speculated(spec[2])


def test_preemption_under_a_small_kv_budget(model):
    """8 blocks of K/V where the batch needs ~19 at its longest: requests are preempted and
    recomputed, and the outputs do not change."""
    sp = greedy_and_sampled(len(PROMPTS))
    plain, spec = run_both(model, PROMPTS, sp, max_model_len=128, kv_cache_tokens=256)
    assert all(m["rollout/preemptions"] > 0 for m in plain + spec)
    assert_speculated(spec[1])


def test_chunked_prefill_of_long_prompts(model):
    prompts = [LONG, LONG[:45], [5, 6, 7]]
    sp = greedy_and_sampled(len(prompts))
    plain, spec = run_both(model, prompts, sp, max_num_batched_tokens=16)
    # 90 + 45 + 3 prompt tokens in chunks of at most 16 tokens per forward
    assert plain[0]["rollout/num_forward"] >= (90 + 45 + 3) // 16
    assert_speculated(spec[1])


def _request(rid: str, prompt: list[int], seed: int, sp: SamplingParams) -> Request:
    return Request(rid, list(prompt), sp, mix(0, seed), group_id=rid, prompt_id=rid)


def _run(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_export_import_mid_speculation(model):
    sp = SamplingParams(temperature=1.0, max_tokens=80, ignore_eos=True)
    config = EngineConfig(model=model, dtype="float64")
    plain = LLMEngine(config)
    ref = _request("x", [7, 1, 7, 2], 5, sp)
    plain.add_request(ref)
    earlier = [_request(f"h{s}", [7, 1, 7, 2], s, sp) for s in (1, 2)]   # the previous epoch
    for r in earlier:
        plain.add_request(r)
    _run(plain)
    history = HistoryStore()
    history.record("x", [r.output_token_ids for r in earlier])
    src = LLMEngine(EngineConfig(model=model, dtype="float64", seed=1), SpeculativeConfig(policy="fixed"), history)
    dst = LLMEngine(EngineConfig(model=model, dtype="float64", seed=2), SpeculativeConfig(policy="fixed"), history)
    moved = _request("x", [7, 1, 7, 2], 5, sp)
    src.add_request(moved)
    src.add_request(_request("other", [5, 5, 5], 3, sp))
    speculated = False                    # a step gave the moved request more than one token
    while not speculated or moved.num_output_tokens < 10:
        assert moved.remaining_tokens > 10, "no draft of the request was accepted before it was nearly done"
        before = moved.num_output_tokens
        src.step()
        speculated |= moved.num_output_tokens - before > 1
    state = src.export_request("x")
    resumed = dst.import_request(state)
    _run(dst)
    _run(src)
    assert resumed.output_token_ids == ref.output_token_ids
    assert resumed.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-9)
    assert resumed.finish_reason == ref.finish_reason == "length"


def test_bfloat16_identity_on_a_short_context_model(ckpt_dir):
    """bfloat16 (the default dtype) is exact too: the attention and norm kernels compute a row
    the same way whatever else is in the batch, and bfloat16 matmuls here are row-invariant.
    A 64-position model also checks that speculation needs no start-up forwards that could
    run past the context. The priced default drafts only where its measured step costs say it
    pays, which timing noise can rule out on a busy machine; the fixed policy always drafts, so
    the identity is never checked on rollouts that speculated nothing."""
    path = ckpt_dir("qwen2", init_std=3.0, max_pos=64)
    sp = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=5)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4]]
    plain = LLM(path)
    specs = [LLM(path, speculative=SpeculativeConfig()), LLM(path, speculative=SpeculativeConfig(policy="fixed"))]
    accepted = [0.0, 0.0]
    for _ in range(3):
        a = plain.generate(prompts, sp)
        for i, spec in enumerate(specs):
            b = spec.generate(prompts, sp)
            accepted[i] += spec.last_metrics["rollout/spec_accepted_tokens"]
            for x, y in zip(a, b, strict=True):
                for cx, cy in zip(x.outputs, y.outputs, strict=True):
                    got, want = (cy.token_ids, cy.logprobs, cy.finish_reason), (cx.token_ids, cx.logprobs, cx.finish_reason)
                    assert got == want
    assert accepted[1] > 0


def test_bfloat16_identity_through_preemption_shared_blocks_and_trees(model):
    """bfloat16 bits equal plain decoding's in a pool of 8 blocks where the batch needs ~19:
    requests preempted and recomputed, siblings sharing their prompt's blocks, tree drafts whose
    accepted nodes move inside a row, plain and speculative engines placing K/V in other blocks."""
    sp = [SamplingParams(n=2, temperature=t, max_tokens=50, ignore_eos=True, seed=3) for t in (1.0, 0.0, 0.7, 1.0)]
    kw = dict(max_model_len=128, kv_cache_tokens=256)
    plain = LLM(model, **kw)
    spec = LLM(model, speculative=SpeculativeConfig(policy="fixed", max_tree_paths=3), **kw)
    for _ in range(2):
        a, b = plain.generate(PROMPTS, sp), spec.generate(PROMPTS, sp)
        for x, y in zip(a, b, strict=True):
            for cx, cy in zip(x.outputs, y.outputs, strict=True):
                assert (cy.token_ids, cy.logprobs, cy.finish_reason) == (cx.token_ids, cx.logprobs, cx.finish_reason)
    m = spec.last_metrics
    assert m["rollout/preemptions"] > 0 and plain.last_metrics["rollout/preemptions"] > 0
    assert m["kv/blocks_shared_peak"] > 0 and m["rollout/spec_accepted_tokens"] > 0


def test_critical_path_drafting_above_max_spec_batch(model):
    """With drafting off by batch size (max_spec_batch 1), the two requests the history
    policy expects to run longest still draft; outputs stay those of plain decoding."""
    params = [SamplingParams(n=3, temperature=t, max_tokens=60, seed=5) for t in (1.0, 0.0, 1.0, 0.7)]
    kw = dict(dtype="float64", scheduler="history", pool={"processes": False})
    plain = LLM(model, **kw)
    spec = LLM(model, speculative=SpeculativeConfig(max_spec_batch=1, critical_rows=2), **kw)
    alone = LLM(model, speculative=SpeculativeConfig(max_spec_batch=1, critical_rows=0), **kw)
    for _ in range(2):                          # the second call's estimates come from the first
        want = plain.generate(PROMPTS, params)
        assert_same(want, spec.generate(PROMPTS, params))
        assert_same(want, alone.generate(PROMPTS, params))
    assert_speculated(spec.last_metrics)
    # without critical rows only the steps at batch 1 draft
    assert spec.last_metrics["rollout/spec_draft_tokens"] > alone.last_metrics["rollout/spec_draft_tokens"]
