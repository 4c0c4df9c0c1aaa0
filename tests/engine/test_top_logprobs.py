"""vLLM's ``logprobs = N``: each output token's N most probable tokens and the sampled one,
ranked, under the distribution ``CompletionOutput.logprobs`` reports; the same with and
without speculation, alone or in a batch, in one engine or a pool (engine/top_logprobs.py)."""
import numpy as np
import pytest
import torch
import transformers
from checkpoints import make_checkpoint
from mixed_requests import lossless_engines
from text_tokenizer import save_char_tokenizer

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.engine.outputs import Logprob
from tailrl.engine.top_logprobs import top_entries

PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [3, 4], [20, 21, 22, 23, 24]]


def run(llm, prompts=PROMPTS, **kw):
    kw = {"n": 3, "temperature": 1.0, "max_tokens": 50, "seed": 7, "logprobs": 4, **kw}
    return [[(c.token_ids, c.logprobs, c.top_logprobs, c.finish_reason) for c in o.outputs]
            for o in llm.generate(prompts, SamplingParams(**kw))]


def test_the_alternatives_are_hugging_faces_top_n(ckpt_dir):
    """float64, T = 0.7 with top-k 5 (the draw filtered, the reported distribution not): per
    position, the 5 best tokens of HF's log_softmax(logits / T) in order, their values, and the
    sampled token's rank; its entry is its ``logprobs`` value bit for bit."""
    path = ckpt_dir("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    prompt = [4, 8, 15, 16, 23, 42]
    sp = SamplingParams(temperature=0.7, top_k=5, max_tokens=20, ignore_eos=True, logprobs=5, seed=3)
    out = LLM(path, dtype="float64").generate([prompt], sp)[0].outputs[0]
    with torch.no_grad():
        lp = (hf(torch.tensor([prompt + out.token_ids])).logits[0] / 0.7).log_softmax(-1)
    assert len(out.top_logprobs) == len(out.token_ids) == 20
    outside = 0
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.top_logprobs)):
        row = lp[len(prompt) - 1 + j]
        want = torch.sort(row, descending=True, stable=True)
        best = want.indices[:5].tolist()
        assert [t for t, e in sorted(entry.items(), key=lambda kv: kv[1].rank) if e.rank <= 5] == best
        assert [entry[t].rank for t in best] == [1, 2, 3, 4, 5]
        assert np.allclose([entry[t].logprob for t in best], want.values[:5].tolist(), rtol=0, atol=1e-5)
        assert entry[tok].logprob == out.logprobs[j]
        assert entry[tok].rank == 1 + int((row > row[tok] + 1e-9).sum())
        assert len(entry) == 5 + (tok not in best)
        outside += tok not in best
        assert all(e.decoded_token is None for e in entry.values())   # this checkpoint has no tokenizer
    assert outside == 0                                                # top-k 5 draws inside the top 5


def test_ties_go_to_the_lower_id_and_ranks_follow():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    top = top_entries(logits, [1.0, 0.0], [3, 5], 2)
    assert list(top[0]) == [1, 2, 3] and [r for _, r in top[0].values()] == [1, 2, 6]
    assert list(top[1]) == [0, 1, 5] and [r for _, r in top[1].values()] == [1, 2, 1]   # all tied: rank 1
    assert top[1][5][0] == top[1][0][0] == pytest.approx(-np.log(6))


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_speculation_steps_ahead_and_a_pool_leave_the_alternatives_as_they_are(model, dtype):
    """Every engine setting gives the plain engine's tokens, log-probabilities and alternatives,
    bit for bit: chains, trees, steps launched ahead (a request that asks is stepped one step at
    a time), and a pool whose requests move between instances in chunks of 16 tokens."""
    plain = LLM(model, dtype=dtype)
    want = run(plain)
    assert all(len(top) == len(ids) and all(4 <= len(e) <= 5 for e in top)
               for g in want for ids, _, top, _ in g)
    assert all(e[t] == Logprob(lp, e[t].rank) for g in want for ids, lps, top, _ in g
               for t, lp, e in zip(ids, lps, top))
    engines = lossless_engines(model, dtype)   # the last: one step at a time while requests ask
    for llm in engines:
        for _ in range(2):                                     # speculation drafts from the first round
            assert run(llm) == want, llm
        if getattr(llm, "engine", None) is not None and llm.engine.speculator is not None:
            assert llm.last_metrics["rollout/spec_accepted_tokens"] > 0
    without = run(plain, logprobs=None)
    assert [[(ids, lps, r) for ids, lps, _, r in g] for g in without] == \
        [[(ids, lps, r) for ids, lps, _, r in g] for g in want]         # asking changes no token
    assert all(top is None for g in without for _, _, top, _ in g)


def test_a_request_that_asks_alone_equals_it_among_others_and_greedy_ranks_its_token_first(model):
    llm = LLM(model, dtype="bfloat16", speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6))
    params = [SamplingParams(n=2, max_tokens=40, seed=s, logprobs=lp, temperature=t)
              for s, lp, t in zip(range(4), [3, None, 20, 1], [1.0, 1.0, 0.8, 0.0])]
    together = llm.generate(PROMPTS, params)
    for prompt, p, out in zip(PROMPTS, params, together):
        alone = llm.generate([prompt], p)[0]
        assert [(c.token_ids, c.logprobs, c.top_logprobs) for c in alone.outputs] == \
            [(c.token_ids, c.logprobs, c.top_logprobs) for c in out.outputs]
    greedy = together[3].outputs[0]
    assert all(len(e) == 1 and e[t].rank == 1 for t, e in zip(greedy.token_ids, greedy.top_logprobs))
    assert all(len(e) in (20, 21) for e in together[2].outputs[0].top_logprobs)


def test_alternatives_carry_their_text_and_stop_strings_cut_them_with_the_tokens(tmp_path):
    make_checkpoint(str(tmp_path), vocab_size=97, init_std=1.0, max_pos=512)
    save_char_tokenizer(str(tmp_path), chat_template=False)
    llm = LLM(str(tmp_path), speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6))
    tok = llm.get_tokenizer()
    full = run(llm, ignore_eos=True, logprobs=3)
    for g in full:
        for ids, _, top, _ in g:
            assert len(top) == len(ids)
    outs = llm.generate(PROMPTS, SamplingParams(n=3, max_tokens=50, seed=7, ignore_eos=True, logprobs=3))
    entries = [e for o in outs for c in o.outputs for e in c.top_logprobs]
    assert all(lp.decoded_token == tok.decode([t]) for e in entries for t, lp in e.items())
    stop = [full[0][0][0][8:10]]                                # the text of two tokens of the first response
    stop = [tok.decode(stop[0])]
    cut = run(llm, ignore_eos=True, logprobs=3, stop=stop)
    ended = 0
    for gf, gc in zip(full, cut):
        for (ids, lps, top, _), (ids_c, lps_c, top_c, reason) in zip(gf, gc):
            assert ids_c == ids[:len(ids_c)] and top_c == top[:len(ids_c)] and len(top_c) == len(ids_c)
            ended += reason == "stop"
    assert ended >= 1


@pytest.mark.parametrize("value", [21, -1, True, 2.0, "3"])
def test_bad_logprobs_are_named(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)


def test_prompt_logprobs_are_hugging_faces(ckpt_dir):
    """float64, T = 0.7: per prompt token after the first, its value and rank and its position's
    3 best tokens under HF's log_softmax(logits / T) (to 1e-5: HF's rotary tables are float32,
    as the sampled tokens' logprobs are); the first is None."""
    path = ckpt_dir("qwen2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    prompt = [4, 8, 15, 16, 23, 42, 7, 7, 30, 2, 11, 60]
    out = LLM(path, dtype="float64").generate([prompt], SamplingParams(temperature=0.7, max_tokens=4,
                                                                       prompt_logprobs=3))[0]
    with torch.no_grad():
        lp = (hf(torch.tensor([prompt])).logits[0] / 0.7).log_softmax(-1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry, row, tok = out.prompt_logprobs[p], lp[p - 1], prompt[p]
        best = torch.sort(row, descending=True, stable=True).indices[:3].tolist()
        assert [t for t, e in sorted(entry.items(), key=lambda kv: kv[1].rank) if e.rank <= 3] == best
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-5)   # HF's RoPE is float32
        assert entry[tok].rank == 1 + int((row > row[tok] + 1e-9).sum())
        assert len(entry) == 3 + (tok not in best)


def test_prompt_logprobs_ignore_cached_prefixes_chunks_siblings_and_speculation(model):
    """bfloat16: the prompt's entries are the same from a first prefill, a second call whose
    prefix is cached (the request computes it anyway), prefill in chunks of 16 tokens, with
    speculation, for n = 3 siblings (one computes, the others share its K/V); asking changes no
    output token; 0 gives the prompt token's entry alone; a pool's instances (requests moving
    between them in chunks of 4 tokens) give the same."""
    prompts = [list(range(5, 45)), [9, 10, 11, 12], [3]]
    sp = dict(n=3, max_tokens=20, seed=2, prompt_logprobs=2)

    def prompt_lps(llm, **kw):
        outs = llm.generate(prompts, SamplingParams(**{**sp, **kw}))
        return [o.prompt_logprobs for o in outs], [[c.token_ids for c in o.outputs] for o in outs]

    plain = LLM(model, dtype="bfloat16")
    want, tokens = prompt_lps(plain)
    assert [len(w) for w in want] == [40, 4, 1] and want[2] == [None]
    assert all(2 <= len(e) <= 3 for w in want for e in w[1:])
    assert prompt_lps(plain) == (want, tokens)                       # its prefix cached now: not taken
    assert plain.last_metrics["kv/prefix_hit_tokens"] == 0
    assert prompt_lps(plain, prompt_logprobs=None) == ([None] * 3, tokens)
    assert plain.last_metrics["kv/prefix_hit_tokens"] > 0            # taken without prompt logprobs
    assert prompt_lps(LLM(model, dtype="bfloat16", max_num_batched_tokens=16)) == (want, tokens)
    spec = LLM(model, dtype="bfloat16", speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6))
    for _ in range(2):
        assert prompt_lps(spec) == (want, tokens)
    bare, _ = prompt_lps(plain, prompt_logprobs=0)
    assert all(len(e) == 1 and e[p] == w[k][p] for b, w, q in zip(bare, want, prompts)
               for k, (e, p) in enumerate(zip(b, q)) if k > 0)
    pool = LLM(model, dtype="bfloat16", instances=2, pool={"processes": False, "chunk_tokens": 4})
    assert prompt_lps(pool) == (want, tokens)
    assert pool.last_metrics["pool/migrations"] > 0


@pytest.mark.parametrize("value", [21, -1, True, 2.0])
def test_bad_prompt_logprobs_are_named(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU: CUDA graphs, steps launched ahead")
def test_on_a_gpu_alternatives_are_an_eager_engines(model):
    """Through real graphs (an asking request's steps sampled outside them, one at a time) and a
    speculative tail: the tokens, logprobs, alternatives and prompt entries of an eager engine,
    bfloat16; a request that asks nothing keeps replaying graphs."""
    kw = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.15)
    want = LLM(model, cuda_graphs=False, async_scheduling=False, **kw)
    for spec in (None, SpeculativeConfig(policy="fixed", ahead_above=4, tail="speculate")):
        llm = LLM(model, speculative=spec, **kw)
        for extra in ({}, {"prompt_logprobs": 3}):
            outs = [e.generate(PROMPTS, SamplingParams(n=3, max_tokens=40, seed=7, logprobs=4, **extra))
                    for e in (llm, want)]
            assert [[(c.token_ids, c.logprobs, c.top_logprobs) for c in o.outputs] for o in outs[0]] == \
                [[(c.token_ids, c.logprobs, c.top_logprobs) for c in o.outputs] for o in outs[1]]
            assert [o.prompt_logprobs for o in outs[0]] == [o.prompt_logprobs for o in outs[1]]
        assert run(llm, logprobs=None) == run(want, logprobs=None)
        assert llm.last_metrics["graphs/replayed_steps"] > 0
        del llm
