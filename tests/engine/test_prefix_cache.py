"""Automatic prefix caching (engine/kv/prefix.py): requests take the K/V blocks of their longest
prefix computed before, and every token and log-probability is what the engine gives without
it: prompts sharing a long prefix, a second call on the same prompts, a conversation's next
turn (its prompt the last turn's prompt and response), with speculation (chains, trees), steps
launched ahead, preemptions and evictions under a small pool, a pool of instances, in
bfloat16 and float64; new weights forget the cached prefixes."""
import pytest
import torch
from checkpoints import make_checkpoint

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.engine.kv.prefix import PrefixCache
from tailrl.kernels import BLOCK

SYSTEM = [(11 * i) % 89 + 3 for i in range(3 * BLOCK + 5)]          # a "system prompt" over 3 blocks
PROMPTS = [SYSTEM + [40 + i, 41, 42 + i] for i in range(4)] + [[5, 6, 7], SYSTEM[:BLOCK]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(str(tmp_path_factory.mktemp("prefix")), vocab_size=97, init_std=1.0, max_pos=1024)


def run(llm, prompts, seed=7, max_tokens=50):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, sp)]


def conversation(llm, turns=3):
    """Each turn's prompt: the last turn's prompt, its first response and a few new tokens."""
    prompts, out = [p[:] for p in PROMPTS[:3]], []
    for t in range(turns):
        got = run(llm, prompts, seed=t)
        out.append(got)
        prompts = [p + got[i][0][0] + [50 + t, 51] for i, p in enumerate(prompts)]
    return out


ENGINES = {
    "plain": {},
    "ahead": {"async_scheduling": True},
    "chains": {"speculative": SpeculativeConfig(policy="fixed", max_draft_tokens=6)},
    "trees": {"speculative": SpeculativeConfig(policy="fixed", max_draft_tokens=6, max_tree_paths=3)},
    # preemptions and evictions
    "small_pool": {"kv_cache_tokens": 12 * BLOCK, "max_num_seqs": 6, "max_model_len": 12 * BLOCK},
    "instances": {"instances": 2, "pool": {"processes": False, "chunk_tokens": 16}},
}


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
@pytest.mark.parametrize("name", list(ENGINES))
def test_cached_prefixes_change_no_token(model, dtype, name):
    kw = ENGINES[name]
    want = LLM(model, dtype=dtype, enable_prefix_caching=False, **kw)
    llm = LLM(model, dtype=dtype, **kw)
    for seed in (7, 8):                                   # the second call finds the first's blocks
        assert run(llm, PROMPTS, seed) == run(want, PROMPTS, seed)
    if name != "instances":
        assert llm.last_metrics["kv/prefix_hit_tokens"] > 0
    assert conversation(llm) == conversation(want)
    if name == "small_pool":
        assert llm.engine.kv.prefix.evictions > 0 and llm.engine.metrics.num_preemptions > 0


def test_a_conversations_next_turn_finds_its_last_turn_response(model):
    llm = LLM(model)
    conversation(llm, turns=2)
    m = llm.last_metrics
    responses = 3 * 50                                    # the first responses, now inside the prompts
    assert m["kv/prefix_hit_tokens"] >= 3 * ((len(SYSTEM) + 3 + responses // 3) // BLOCK) * BLOCK - 3 * BLOCK
    assert m["kv/prefix_hit_tokens"] <= m["kv/prefix_query_tokens"]


def test_new_weights_forget_the_cached_prefixes(model, tmp_path):
    import transformers
    other = make_checkpoint(str(tmp_path / "other"), vocab_size=97, init_std=1.0, max_pos=1024, seed=1)
    weights = transformers.AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32).state_dict()
    llm = LLM(model, dtype="float64")
    run(llm, PROMPTS)
    llm.load_weights(weights)
    assert llm.engine.kv.prefix.by_key == {}
    assert run(llm, PROMPTS) == run(LLM(other, dtype="float64"), PROMPTS)


def test_keys_name_whole_prefixes_and_idle_blocks_go_oldest_first():
    cache = PrefixCache(max_rows=2)
    toks = list(range(3 * BLOCK))
    cache.register(0, [7, 8, 9], lambda a, b: toks[a:b], 3 * BLOCK - 1)     # two full blocks computed
    assert [b for b, _ in cache.lookup(toks, 3)] == [7, 8]
    assert cache.lookup([1] + toks[1:], 3) == []                          # another first block: nothing
    other = toks[:BLOCK] + [5] * BLOCK
    assert [b for b, _ in cache.lookup(other, 2)] == [7]                   # the same first block only
    cache.register(1, [7, 4], lambda a, b: other[a:b], 2 * BLOCK)          # block 7 found, 4 registered
    assert [b for b, _ in cache.lookup(other, 2)] == [7, 4]
    third = [9] * BLOCK + [6] * BLOCK
    cache.reset_row(1)
    cache.register(1, [2, 3], lambda a, b: third[a:b], 2 * BLOCK)
    assert [b for b, _ in cache.lookup(toks[:BLOCK] + [6] * BLOCK, 2)] == [7]    # [6]s follow another block
    for b in (8, 4, 7):                                                    # released, last first
        assert cache.released(b)
    assert not cache.released(5)                                           # never cached: free
    assert cache.evict() == 8 and [b for b, _ in cache.lookup(toks, 3)] == [7]
    cache.register(0, [7, 8], lambda a, b: [-1] * (b - a), 2 * BLOCK)       # tokens not known yet: nothing
    assert cache.clear() == [4, 7] and cache.by_key == {} and cache.lookup(toks, 2) == []


def test_enable_prefix_caching_is_checked(model):
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(model, enable_prefix_caching="yes")


@pytest.mark.parametrize("kw", [{}, {"instances": 2, "pool": {"processes": False}}], ids=["engine", "pool"])
def test_reset_prefix_cache_forgets_what_was_cached(model, kw):
    llm = LLM(model, **kw)
    run(llm, PROMPTS)
    run(llm, PROMPTS)
    assert llm.last_metrics["kv/prefix_hit_tokens"] > 0
    llm.reset_prefix_cache()
    run(llm, PROMPTS)
    assert llm.last_metrics["kv/prefix_hit_tokens"] == 0 and llm.last_metrics["kv/prefix_query_tokens"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU: CUDA graphs, steps launched ahead")
def test_on_a_gpu_cached_prefixes_change_no_token(model):
    """Through real graphs, copies and steps launched ahead (the GPU's defaults), plain and with
    a speculative tail: every token and log-probability of second calls and conversations equals
    an engine's without the cache, and prefixes were found."""
    kw = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.15)
    want = LLM(model, enable_prefix_caching=False, **kw)
    for spec in (None, SpeculativeConfig(policy="fixed", ahead_above=4, tail="speculate")):
        llm = LLM(model, speculative=spec, **kw)
        for seed in (7, 8):
            assert run(llm, PROMPTS, seed) == run(want, PROMPTS, seed)
        assert llm.last_metrics["kv/prefix_hit_tokens"] > 0 and llm.last_metrics["graphs/replayed_steps"] > 0
        assert conversation(llm) == conversation(want)
        del llm
