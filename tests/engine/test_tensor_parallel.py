"""An engine whose model is split over two ranks (``tensor_parallel_size=2``: a worker process
holds half of every layer; gloo between the ranks on the CPU): the whole model's outputs, and
speculation as lossless as on one rank."""
from __future__ import annotations

import pytest
import torch

from tailrl import LLM, SamplingParams
from tailrl.engine.kv import KVCache
from tailrl.model.loader import load_state_dict

PROMPTS = [[5, 17, 30, 8, 9, 5, 17, 30], [40, 41, 42, 40, 41], [3, 3, 3, 3]]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
GREEDY = SamplingParams(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)


def pairs(outs):
    return [(o.token_ids, o.logprobs) for r in outs for o in r.outputs]


def assert_same_tokens_close_logprobs(a, b):
    assert [t for t, _ in a] == [t for t, _ in b]
    assert max(abs(x - y) for (_, p), (_, q) in zip(a, b) for x, y in zip(p, q)) < 1e-9


@pytest.mark.parametrize("arch", ["qwen3", "llama_bias", "qwen2_moe", "mixtral", "gemma3", "glm4", "olmo3", "glm4_moe",
                                  "gpt_oss", "deepseek_v3", "deepseek_v2",
                                  pytest.param("ministral3", marks=pytest.mark.slow)])
def test_a_model_split_over_two_ranks_computes_the_whole_models_outputs_in_float64(ckpt_dir, arch):
    """Fused QKV rows by head (with their biases), Qwen3's per-head norms, output projections
    whose bias only rank 0 adds, every expert's and the shared expert's units, Gemma's norms of
    the summed outputs and its sliding window (8 positions, 24 tokens generated), GLM-4's heads
    reordered for RoPE on half of them and its fused gate/up, OLMo 3's q/k norms over every
    rank's heads, gpt-oss's sinks by head and its experts' biases, DeepSeek-V3's latent attention by
    head: tokens equal,
    log-probabilities to float64 rounding (Qwen2: test_weight_updates_reach_every_rank)."""
    path = ckpt_dir(arch, init_std=1.0)
    split = LLM(path, dtype="float64", tensor_parallel_size=2)
    try:
        whole = split.engine.model.whole
        layer = split.engine.model.local.layers[0]
        o, value = (layer.o, whole.head_dim) if layer.mla is None else (layer.mla.o, whole.mla[4])
        assert o.weight.shape[1] * 2 == whole.num_heads * value
        got = pairs(split.generate(PROMPTS, PARAMS))
    finally:
        split.close()
    assert_same_tokens_close_logprobs(got, pairs(LLM(path, dtype="float64").generate(PROMPTS, PARAMS)))


def test_speculation_stays_lossless_in_bfloat16_on_a_split_model(model, monkeypatch):
    """Tree drafts (accepted nodes' K/V moved) and groups sharing a prompt's partial block (a
    block copied): the copies rank 0 makes reach the other rank, so its K/V stay the same."""
    copies = []
    for name in ("copy_block", "move_slots"):               # rank 0's own copies (the workers' are theirs)
        real = getattr(KVCache, name)
        monkeypatch.setattr(KVCache, name, lambda self, *a, real=real, name=name: (copies.append(name),
                                                                                  real(self, *a)))
    plain = LLM(model, dtype="bfloat16", tensor_parallel_size=2)
    spec = LLM(model, dtype="bfloat16", tensor_parallel_size=2, speculative={"policy": "fixed", "max_tree_paths": 3})
    try:
        want = pairs(plain.generate(PROMPTS, PARAMS))
        spec.generate(PROMPTS, PARAMS)                                   # history for the next call's drafts
        got = pairs(spec.generate(PROMPTS, PARAMS))
        accepted = spec.last_metrics["rollout/spec_accept_length"]
        alone = pairs(plain.generate(PROMPTS[1:2], PARAMS))             # a prompt's group alone, not in a batch
    finally:
        plain.close()
        spec.close()
    assert got == want
    assert alone == want[3:6]
    assert accepted > 1.5 and {"copy_block", "move_slots"} <= set(copies)


def test_weight_updates_reach_every_rank(ckpt_dir):
    """A stream and a bucket of whole Hugging Face tensors, each rank taking its part; a bucket
    that does not fit is refused before any rank copies a tensor of it."""
    old, new = ckpt_dir("qwen2", init_std=1.0), ckpt_dir("qwen2", init_std=1.0, seed=1)
    split = LLM(old, dtype="float64", tensor_parallel_size=2)
    try:
        before = pairs(split.generate(PROMPTS, GREEDY))
        sd = load_state_dict(new)
        bad = [("model.layers.0.self_attn.o_proj.weight", sd["model.layers.0.self_attn.o_proj.weight"]),
               ("model.layers.1.mlp.down_proj.weight", torch.zeros(3, 3, dtype=torch.float64))]
        with pytest.raises(ValueError, match="'model.layers.1.mlp.down_proj.weight' has shape"):
            split.load_weights(bad)
        assert pairs(split.generate(PROMPTS, GREEDY)) == before
        items = list(sd.items())
        assert split.load_weights(iter(items[:7])) | split.load_weights(items[7:]) == set(split.weight_names())
        got = pairs(split.generate(PROMPTS, GREEDY))
    finally:
        split.close()
    assert_same_tokens_close_logprobs(got, pairs(LLM(new, dtype="float64").generate(PROMPTS, GREEDY)))


def test_a_rank_that_dies_is_an_error_naming_it_not_a_hang(model):
    split = LLM(model, dtype="bfloat16", tensor_parallel_size=2)
    split.engine.model.procs[0].kill()
    split.engine.model.procs[0].wait()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) killed by SIGKILL"):
        split.generate(PROMPTS, GREEDY)
    split.close()


@pytest.mark.parametrize("kwargs, match", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(tensor_parallel_size=3), "tensor_parallel_size: 3 does not divide the model's 4 attention heads"),
])
def test_what_does_not_split_is_refused_before_any_process_starts(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(model, dtype="bfloat16", **kwargs)


@pytest.mark.skipif(torch.cuda.device_count() != 1, reason="needs exactly one GPU")
def test_more_ranks_than_visible_gpus_is_refused(model):
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 devices from cuda are needed, 1 are visible"):
        LLM(model, dtype="bfloat16", device="cuda", tensor_parallel_size=2)


def test_a_learned_drafter_is_refused(ckpt_dir, tmp_path):
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 is not supported with a learned drafter"):
        LLM(ckpt_dir("qwen2"), dtype="bfloat16", tensor_parallel_size=2,
            speculative={"method": "drafter", "drafter": str(tmp_path)})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_on_two_gpus_speculation_stays_lossless_on_a_split_model(model):
    """NCCL between the ranks, the Triton kernels on each GPU: tree drafts change no bit."""
    kw = dict(dtype="bfloat16", device="cuda", tensor_parallel_size=2, gpu_memory_utilization=0.3)
    plain = LLM(model, **kw)
    spec = LLM(model, speculative={"policy": "fixed", "max_tree_paths": 3}, **kw)
    try:
        want = pairs(plain.generate(PROMPTS, PARAMS))
        spec.generate(PROMPTS, PARAMS)
        assert pairs(spec.generate(PROMPTS, PARAMS)) == want
    finally:
        plain.close()
        spec.close()
