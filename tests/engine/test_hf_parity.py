"""Our module equals Hugging Face's: logits (float32, <= 1e-4) and greedy generate."""
import pytest
import torch
import transformers
from parity import our_logits

from tailrl import LLM, SamplingParams

VARIANTS = {
    "qwen2": ("qwen2", {}),
    "qwen2_gqa_tied": ("qwen2", dict(num_kv_heads=1, tie=True)),
    "qwen3": ("qwen3", {}),
    "llama_mha": ("llama", dict(num_kv_heads=4)),
    "mistral": ("mistral", {}),
    "phi3": ("phi3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "mixtral": ("mixtral", {}),
    "glm4_moe": ("glm4_moe", {}),
    "ministral3": ("ministral3", {}),
    "mistral_window": ("mistral_window", {}),
    "gemma2": ("gemma2", {}),
    "gemma3": ("gemma3", {}),
    "gemma3_tied": ("gemma3", dict(tie=True)),
    "qwen2_yarn": ("qwen2_yarn", {}),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", {}),
    "smollm3": ("smollm3", {}),
    "glm4": ("glm4", {}),
    "phi3_partial": ("phi3_partial", {}),
    "gpt_oss": ("gpt_oss", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3_plain": ("deepseek_v3_plain", {}),
    "deepseek_v2": ("deepseek_v2", {}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_hf(ckpt_dir, variant):
    arch, kw = VARIANTS[variant]
    path = ckpt_dir(arch, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for n in (7, 60):                                   # batched path and the prefill-alone path
        tokens = torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0]
        diff = (our_logits(path, tokens) - ref).abs().max().item()
        assert diff <= 1e-4, f"{variant}: max abs logit diff {diff}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_matches_hf_generate(ckpt_dir, variant):
    arch, kw = VARIANTS[variant]
    path = ckpt_dir(arch, **kw)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[3, 5, 7, 11, 13], [2, 4, 6], list(range(10, 50))]
    outs = LLM(path, dtype="float32").generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
