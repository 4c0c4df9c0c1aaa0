"""Bad input raises ValueError naming the field, before any work, and the engine stays usable."""
import json
import os
import shutil

import pytest

from tailrl import LLM, SamplingParams, SpeculativeConfig

BAD_PARAMS = [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(n=0), "n"),
]


@pytest.fixture(scope="module")
def llm(ckpt_dir):
    return LLM(ckpt_dir("qwen2", max_pos=64))


def still_works(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kw,field", BAD_PARAMS)
def test_bad_sampling_params(llm, kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)
    sp = SamplingParams()
    setattr(sp, *next(iter(kw.items())))                  # mutated after construction: caught by generate
    with pytest.raises(ValueError, match=field):
        llm.generate([[1, 2]], sp)
    still_works(llm)


@pytest.mark.parametrize("prompts,field", [
    ([[]], "prompts\\[0\\] is empty"),
    ([[1, 2], [5, 97]], "prompts\\[1\\].*token id 97 outside the vocabulary"),
    ([[1, -1]], "prompts\\[0\\].*token id -1"),
    ([list(range(1, 65))], "prompts\\[0\\].*longer than the context"),
    (["text"], "prompts\\[0\\].*no tokenizer"),
    ([[1, 2], 3], "prompts\\[1\\]"),
    ([{"prompt_token_ids": [1, 2], "multi_modal_data": {}}], "prompts\\[0\\].*multi_modal_data"),
    ([{"prompt": 5}], "prompts\\[0\\]"),
    ([{"prompt": "text"}], "prompts\\[0\\].*no tokenizer"),
    ([{"prompt_token_ids": [1, 97]}], "prompts\\[0\\].*token id 97"),
])
def test_bad_prompts(llm, prompts, field):
    before = llm.engine.metrics.num_forward
    with pytest.raises(ValueError, match=field):
        llm.generate(prompts, SamplingParams(max_tokens=4))
    assert llm.engine.metrics.num_forward == before           # no work was done
    still_works(llm)


def test_bad_stop_tokens_and_lengths(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate([[1]], SamplingParams(stop_token_ids=[1000]))
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match="prompt_ids"):
        llm.generate([[1], [2]], SamplingParams(), prompt_ids=["a"])
    still_works(llm)


def test_bad_speculative_config():
    with pytest.raises(ValueError, match="method"):
        SpeculativeConfig(method="magic")
    with pytest.raises(ValueError, match="speculative"):
        SpeculativeConfig.coerce({"methd": "suffix"})


def test_bad_model_directories(ckpt_dir, tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path))
    src = ckpt_dir("qwen2")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(src, no_weights)
    os.remove(no_weights / "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(no_weights))
    arch = tmp_path / "arch"
    shutil.copytree(src, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(arch))
    with pytest.raises(ValueError, match="dtype"):
        LLM(src, dtype="float16")


def test_vllm_prompt_dicts_are_prompts(llm):
    """vLLM's ``TokensPrompt`` dicts (and one dict alone) make the same requests as token lists."""
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    want = llm.generate([[1, 2, 3], [7, 8]], sp)
    got = llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [7, 8]}], sp)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    one = llm.generate({"prompt_token_ids": [1, 2, 3]}, sp)
    assert [c.token_ids for c in one[0].outputs] == [c.token_ids for c in want[0].outputs]
