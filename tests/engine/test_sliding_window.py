"""Sliding-window attention (Mistral's, Phi-3's, Gemma 2's and 3's, OLMo 3's): a context longer than the window, equal
to Hugging Face's, and speculation lossless in bfloat16 with windows shorter than the responses."""
import pytest
import torch
import transformers
from lossless import assert_speculation_lossless

from tailrl import LLM, SamplingParams, SpeculativeConfig


def test_the_context_runs_past_the_window_as_hugging_faces_does(ckpt_dir):
    """A window of 32 positions, not a cap on the context: greedy tokens equal Hugging Face's
    for 60 positions."""
    path = ckpt_dir("mistral_window")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32")
    assert llm.engine.max_model_len == 512 and llm.engine.args.layer_windows == (32, 32)
    p = [3, 5, 7, 11, 13, 2, 4] * 4
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].outputs[0]
    ref = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                      pad_token_id=0)[0, len(p):].tolist()
    assert out.token_ids == ref


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "mistral_window", "olmo3"])
def test_speculation_with_chains_and_trees_is_lossless_past_the_window(ckpt_dir, arch):
    """bfloat16, T=1, responses of 48 tokens past windows of 8 (Gemma's, OLMo 3's sliding layers)
    and 32, Gemma 2's scores and logits soft-capped: tokens and log-probabilities identical with
    and without drafts (chains, then trees of 3 paths), the second call drafting from the
    first's history."""
    assert_speculation_lossless(ckpt_dir(arch, init_std=3.0, dtype=torch.bfloat16))


def test_drafts_as_long_as_the_window_are_refused_before_loading(ckpt_dir):
    with pytest.raises(ValueError, match="max_draft_tokens: 8 must be below the model's smallest sliding window, 8"):
        LLM(ckpt_dir("gemma3"), speculative=SpeculativeConfig(max_draft_tokens=8))
