"""New weights into a running engine: a whole set, or a trainer's stream of (name, tensor) pairs."""
from __future__ import annotations

import pytest
import torch

from tailrl import LLM, SamplingParams
from tailrl.model.loader import load_state_dict

PROMPTS = [[5, 17, 30, 8, 9, 5, 17, 30], [40, 41, 42, 40, 41], [3, 3, 3, 3]]
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)


def pairs(outs):
    return [(o.token_ids, o.logprobs) for r in outs for o in r.outputs]


def test_a_stream_of_pairs_updates_a_speculative_engine_as_the_new_checkpoint_runs(ckpt_dir):
    old, new = ckpt_dir("qwen2", init_std=1.0), ckpt_dir("qwen2", init_std=1.0, seed=1)
    llm = LLM(old, dtype="bfloat16", speculative={"policy": "fixed"})
    llm.generate(PROMPTS, PARAMS)                                   # history and cached prefixes of the old weights
    items = list(load_state_dict(new).items())
    stream = (item for item in reversed(items))                     # a generator, in the trainer's order
    assert llm.load_weights(stream) == set(llm.weight_names())
    assert pairs(llm.generate(PROMPTS, PARAMS)) == pairs(LLM(new, dtype="bfloat16").generate(PROMPTS, PARAMS))


def test_a_tensor_that_does_not_fit_stops_a_stream_and_the_engine_stays_usable(ckpt_dir):
    old, new = ckpt_dir("qwen2", init_std=1.0), ckpt_dir("qwen2", init_std=1.0, seed=1)
    llm = LLM(old, dtype="bfloat16")
    before = pairs(llm.generate(PROMPTS, PARAMS))
    sd = load_state_dict(new)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.weight' has shape"):
        llm.load_weights(iter([("model.layers.0.mlp.up_proj.weight", torch.zeros(2, 2))]))
    assert pairs(llm.generate(PROMPTS, PARAMS)) == before           # nothing was copied
    with pytest.raises(ValueError, match="'lm_head.bias'"):          # the first pair was copied, then the error
        llm.load_weights(iter([("model.norm.weight", sd["model.norm.weight"]),
                               ("lm_head.bias", sd["model.norm.weight"])]))
    assert pairs(llm.generate(PROMPTS, PARAMS)) != before           # the new norm (and no stale cached prefix)
    llm.load_weights(sd)
    assert pairs(llm.generate(PROMPTS, PARAMS)) == pairs(LLM(new, dtype="bfloat16").generate(PROMPTS, PARAMS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_host_tensors_in_buckets_update_the_engine_as_the_new_checkpoint_runs(ckpt_dir):
    """The engine on the GPU (loaded there directly, CUDA graphs on), a trainer's buckets of host
    tensors: the same tokens and log-probabilities as the new checkpoint loaded on the GPU."""
    old, new = ckpt_dir("qwen2", init_std=1.0), ckpt_dir("qwen2", init_std=1.0, seed=1)
    kw = dict(dtype="bfloat16", device="cuda", gpu_memory_utilization=0.2)
    llm = LLM(old, speculative={"policy": "fixed"}, **kw)
    llm.generate(PROMPTS, PARAMS)
    assert llm.engine.model.norm.device.type == "cuda"
    items = list(load_state_dict(new).items())
    written = set()
    for i in range(0, len(items), 4):
        written |= llm.load_weights(items[i:i + 4])
    assert written == set(llm.weight_names())
    assert pairs(llm.generate(PROMPTS, PARAMS)) == pairs(LLM(new, **kw).generate(PROMPTS, PARAMS))
