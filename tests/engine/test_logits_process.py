"""vLLM's logit processing (engine/logits_process.py): repetition, presence and frequency
penalties, min_p and min_tokens. Their arithmetic against a reference written from the
definitions; each sampled position's history (a verify step's draft nodes: their paths); the
draw following the processed distribution (a statistical test on a small vocabulary) while the
log-probability reported stays the unprocessed one; and in the engine, outputs identical with
and without speculation (chains and trees), alone and in a batch, with steps launched ahead
or not, in bfloat16 and float64."""
import math

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from mixed_requests import lossless_engines

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.engine import logits_process
from tailrl.engine.batch import RowPlan
from tailrl.engine.request import Request
from tailrl.engine.sampler import sample, token_logprobs

PROMPTS = [[5, 6, 7], [9, 8, 7, 6], [20, 21], [30, 31, 32, 33]]
EOS = 3
SETTINGS = [dict(repetition_penalty=1.6), dict(presence_penalty=1.5, frequency_penalty=0.7), dict(min_p=0.2),
            dict(min_tokens=40),
            dict(repetition_penalty=0.7, frequency_penalty=-0.4, min_p=0.05, min_tokens=10, temperature=0.7,
                 top_k=30, top_p=0.9)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("process")), vocab_size=97, init_std=1.0, max_pos=512,
                           eos_token_id=EOS)


def reference(logits: np.ndarray, p: SamplingParams, history: list[int], prompt: list[int],
              eos: tuple[int, ...]) -> np.ndarray:
    """The processed logits of one position, from the definitions (float64, no vectorisation)."""
    x = logits.astype(np.float64).copy()
    counts: dict[int, int] = {}
    for t in history:
        counts[t] = counts.get(t, 0) + 1
    for t in set(prompt) | set(history) if p.repetition_penalty != 1 else ():
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in counts.items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    x = x / p.temperature if p.temperature else x
    if len(history) < p.min_tokens:
        for t in (() if p.ignore_eos else eos) + tuple(p.stop_token_ids or ()):
            x[t] = -np.inf
    if p.min_p > 0 and p.temperature:
        x[x - x.max() < math.log(p.min_p)] = -np.inf
    return x


def fake_plan(params, prompt, out, parents=(), tokens=(), entry=0):
    req = Request("r", list(prompt), params, seed_key=1)
    req.output_token_ids = list(out)
    return RowPlan(req, 1, list(parents), list(tokens), entry)


@pytest.mark.parametrize("kw", SETTINGS)
def test_processed_logits_match_the_definitions_at_every_node_of_a_tree(kw):
    p = SamplingParams(max_tokens=60, stop_token_ids=[11], **kw)
    rng = np.random.default_rng(0)
    prompt, out = [4, 5, 5, 9], [9, 9, 12, 4, 60, 60, 60]
    parents, tokens = [-1, 0, 0, 1, -1], [60, 12, 7, 60, 3]       # a tree: two children of the root
    plan = fake_plan(p, prompt, out, parents, tokens, entry=1)
    procs = logits_process.positions([plan], 1 + 1 + len(tokens), (EOS,))
    assert procs[0] is None and all(q is not None for q in procs[1:])
    logits = torch.from_numpy(rng.normal(0, 3, (len(procs), 97)))
    t = p.temperature
    scaled = logits * (1 / t) if t not in (0, 1) else logits
    got = logits_process.apply(logits, scaled, [t] * len(procs), procs)
    paths = [[], [60], [60, 12], [60, 7], [60, 12, 60], [3]]
    for k, path in enumerate(paths):
        want = reference(logits[1 + k].numpy(), p, out + path, prompt, (EOS,))
        np.testing.assert_allclose(got[1 + k].numpy(), want, rtol=1e-13, atol=0)
    assert torch.equal(got[0], scaled[0])                           # a row that asks nothing: untouched


@pytest.mark.parametrize("kw", SETTINGS[:2])
def test_counts_kept_on_the_request_follow_its_output_as_it_grows_and_is_cut(kw):
    p = SamplingParams(max_tokens=200, **kw)
    rng = np.random.default_rng(3)
    plan = fake_plan(p, [4, 5, 5, 9], [])
    for step in range(40):
        out = plan.req.output_token_ids
        if step == 25:
            del out[-7:]                                             # a stop string's cut
        else:
            out += rng.integers(0, 30, int(rng.integers(1, 4))).tolist()
        kept = logits_process.positions([plan], 1, (EOS,))[0]
        fresh = logits_process.positions([fake_plan(p, [4, 5, 5, 9], out)], 1, (EOS,))[0]
        assert np.array_equal(kept.cols, fresh.cols) and np.array_equal(kept.counts, fresh.counts)


def test_min_tokens_lifts_at_its_index_and_ignore_eos_keeps_eos_open():
    p = SamplingParams(max_tokens=60, min_tokens=8, stop_token_ids=[11])
    procs = logits_process.positions([fake_plan(p, [4], [1] * 6, [-1, 0, 1], [2, 2, 2])], 4, (EOS,))
    assert [q.banned if q else None for q in procs] == [(EOS, 11), (EOS, 11), None, None]   # histories of 6-9
    p = SamplingParams(max_tokens=60, min_tokens=8, ignore_eos=True)
    assert logits_process.positions([fake_plan(p, [4], [])], 1, (EOS,)) is None        # nothing left to do


def test_the_draw_follows_the_processed_distribution_and_reports_the_unprocessed_log_probability():
    """A small vocabulary, one row drawn at 40k uniforms: token frequencies against the processed
    softmax (chi-square, 7 degrees of freedom, a bound at p ~ 1e-6); every row's log-probability
    is log_softmax(logits / T) of its token, as the scorer (token_logprobs) computes it."""
    v, n = 8, 40_000
    p = SamplingParams(temperature=0.8, repetition_penalty=1.4, presence_penalty=0.5, min_p=0.03)
    history, prompt = [1, 1, 2, 6], [2, 5]
    logits = torch.tensor([[1.5, 2.0, -0.5, 0.3, 1.0, 0.8, -1.0, -4.0]], dtype=torch.float64)
    procs = logits_process.positions([fake_plan(p, prompt, history)], 1, (EOS,))
    u = np.random.default_rng(1).random(n)
    toks, lps = sample(logits.expand(n, v).contiguous(), [0.8] * n, [-1] * n, [1.0] * n, u, procs * n)
    want = torch.softmax(torch.from_numpy(reference(logits[0].numpy(), p, history, prompt, (EOS,))), 0).numpy()
    assert want[7] == 0 and toks.count(7) == 0                       # under min_p: never drawn
    seen = np.bincount(toks, minlength=v)
    kept = want > 0
    chi2 = float((((seen - n * want) ** 2)[kept] / (n * want[kept])).sum())
    assert chi2 < 40, (chi2, seen, n * want)
    assert lps == token_logprobs(logits.expand(n, v).contiguous(), [0.8] * n, toks)


def test_a_processed_row_is_the_same_alone_and_among_others():
    rng = np.random.default_rng(2)
    logits = torch.from_numpy(rng.normal(0, 2, (6, 97))).float()
    u = rng.random(6)
    params = [SamplingParams(repetition_penalty=1.3, min_p=0.1), SamplingParams(),
              SamplingParams(temperature=0.5, frequency_penalty=1.0, top_p=0.8), SamplingParams(temperature=0),
              SamplingParams(temperature=0, presence_penalty=2.0), SamplingParams(top_k=5, min_tokens=3)]
    plans = [fake_plan(q, [4, 4, 8], [8, 9, 9, 10], entry=i) for i, q in enumerate(params)]
    procs = logits_process.positions(plans, 6, (EOS,))
    args = [q.temperature for q in params], [q.top_k for q in params], [q.top_p for q in params]
    batch = sample(logits, *args, u, procs)
    for i in range(6):
        alone = sample(logits[i:i + 1], *([a[i]] for a in args), u[i:i + 1], procs[i:i + 1] if procs[i] else None)
        assert (alone[0][0], alone[1][0]) == (batch[0][i], batch[1][i])


def run(llm, prompts=PROMPTS, **kw):
    kw = {"n": 3, "temperature": 1.0, "max_tokens": 60, "seed": 7, **kw}
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs]
            for o in llm.generate(prompts, SamplingParams(**kw))]


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_speculation_and_steps_ahead_leave_processed_outputs_as_they_are(model, dtype, fed):
    """Steps launched ahead (``fed``: from a step in flight) count a row's in-flight token on
    the device (``Position.pending``)."""
    plain = LLM(model, dtype=dtype)
    engines = lossless_engines(model, dtype)   # the last: one step at a time while requests ask
    base = run(plain)
    for kw in SETTINGS:
        want = run(plain, **kw)
        assert want != base                                          # the setting changes the rollout
        for llm in engines:
            for _ in range(2):                                       # speculation drafts from the first round
                assert run(llm, **kw) == want, (kw, llm)
            if getattr(llm, "engine", None) is not None and llm.engine.speculator is not None:
                assert llm.last_metrics["rollout/spec_accepted_tokens"] > 0
    assert fed[0] > 100                                              # processed steps were launched ahead
    assert run(engines[0]) == base


def test_a_processed_request_alone_equals_it_among_plain_ones(model):
    llm = LLM(model, dtype="bfloat16", speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6))
    params = [SamplingParams(n=2, max_tokens=50, seed=s, **kw)
              for s, kw in zip(range(4), [SETTINGS[0], {}, SETTINGS[4], {}])]
    together = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, together):
        alone = llm.generate([prompt], p)[0]
        assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in out.outputs]
        assert [c.logprobs for c in alone.outputs] == [c.logprobs for c in out.outputs]


def test_min_tokens_keeps_eos_and_stop_tokens_away_until_its_length(model):
    llm = LLM(model)
    prompts = [[i, i + 1] for i in range(10, 40, 3)]
    free = run(llm, prompts, n=4, stop_token_ids=[11])
    early = [ids for g in free for ids, _, r in g if r == "stop" and len(ids) <= 20]
    assert early                                                     # without it, some stop early
    held = run(llm, prompts, n=4, stop_token_ids=[11], min_tokens=20)
    for g in held:
        for ids, _, reason in g:
            assert not {EOS, 11} & set(ids[:20])
            assert reason == "length" or len(ids) > 20


@pytest.mark.parametrize("field,value", [("repetition_penalty", 0), ("repetition_penalty", float("nan")),
                                         ("presence_penalty", float("inf")), ("frequency_penalty", "1"),
                                         ("min_p", 1.5), ("min_p", -0.1), ("min_tokens", -1), ("min_tokens", 2.5),
                                         ("min_tokens", 100)])
def test_bad_processing_settings_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=50, **{field: value})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU: CUDA graphs, steps launched ahead")
def test_on_a_gpu_processed_requests_give_eager_steppings_outputs(model):
    """Through real graphs (sampling outside them for processed steps) and steps launched ahead
    (a row's in-flight token counted on the device), plain and with a speculative tail: the
    tokens and log-probabilities of an eager engine stepping one step at a time, bfloat16."""
    kw = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.15)
    want = LLM(model, cuda_graphs=False, async_scheduling=False, **kw)
    for spec in (None, SpeculativeConfig(policy="fixed", ahead_above=4, tail="speculate")):
        llm = LLM(model, speculative=spec, **kw)
        for kw_p in SETTINGS:
            for _ in range(2):
                assert run(llm, **kw_p) == run(want, **kw_p), kw_p
        assert llm.last_metrics["graphs/replayed_steps"] > 0
        assert run(llm) == run(want)                                 # and steps launched ahead again
        del llm
