"""Sliding-window attention (Mistral's, Phi-3's, Gemma 2's and 3's, OLMo 3's): a context longer than the window, equal
to Hugging Face's, and speculation lossless in bfloat16 with windows shorter than the responses."""
import pytest
import torch
import transformers

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
    path = ckpt_dir(arch, init_std=3.0, dtype=torch.bfloat16)
    prompts = [[5, 17, 30, 8, 9, 5, 17, 30], [40, 41, 42, 40, 41], [7] * 12]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=48, ignore_eos=True, seed=3)
    plain = LLM(path)
    want = [plain.generate(prompts, sp) for _ in range(2)]
    for paths in (1, 3):
        spec = LLM(path, speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=6, max_tree_paths=paths))
        for a in want:
            b = spec.generate(prompts, sp)
            for x, y in zip(a, b, strict=True):
                for cx, cy in zip(x.outputs, y.outputs, strict=True):
                    assert (cy.token_ids, cy.logprobs) == (cx.token_ids, cx.logprobs), (arch, paths)
        assert spec.last_metrics["rollout/spec_accepted_tokens"] > 0


def test_drafts_as_long_as_the_window_are_refused_before_loading(ckpt_dir):
    with pytest.raises(ValueError, match="max_draft_tokens: 8 must be below the model's smallest sliding window, 8"):
        LLM(ckpt_dir("gemma3"), speculative=SpeculativeConfig(max_draft_tokens=8))
