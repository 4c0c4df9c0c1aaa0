"""RoPE on part of a head (Phi-3's form) and on interleaved pairs (GLM-4's): a head's dimensions
reordered as the query and key projections load, so that our kernels' rotate-half pairs are the
checkpoint's pairs (tailrl/model/rope.py); the order is what makes the logits Hugging Face's,
a trainer's weights take it too, and speculation stays lossless."""
import pytest
import torch
import transformers
from lossless import assert_speculation_lossless
from parity import assert_fields_make_hf_logits

from tailrl import LLM, SamplingParams
from tailrl.model.args import parse_config
from tailrl.model.rope import head_order, rope_table
from tailrl.model.transformer import Transformer

# THUDM/GLM-4-9B-0414's config.json (the fields that matter)
GLM4_9B = {
    "architectures": ["Glm4ForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 13696,
    "max_position_embeddings": 32768, "model_type": "glm4", "num_attention_heads": 32, "num_hidden_layers": 40,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "vocab_size": 151552}


def test_head_order_puts_each_turning_pair_half_a_head_apart():
    # rotate-half on the first 4 of 8: pairs (0, 2), (1, 3) at (0, 4), (1, 5); 4..7 fill the rest
    assert head_order(8, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    # interleaved pairs (0, 1), (2, 3) of the first 4
    assert head_order(8, 4, interleaved=True).tolist() == [0, 2, 4, 5, 1, 3, 6, 7]
    assert head_order(8, 0, interleaved=True).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert head_order(8) is None
    cos, sin = rope_table(8, 16, 1e4, torch.float32, rotary_dim=4)
    full_cos, full_sin = rope_table(4, 16, 1e4, torch.float32)      # the 4 turning dimensions' own table
    for ours, theirs in ((cos, full_cos), (sin, full_sin)):
        assert torch.equal(ours[:, [0, 1, 4, 5]], theirs)
    assert torch.equal(cos[:, [2, 3, 6, 7]], torch.ones(16, 4)) and not sin[:, [2, 3, 6, 7]].any()


def test_glm4s_config_reads_as_transformers_reads_it():
    a = parse_config(GLM4_9B)
    hf = transformers.Glm4Config(**{k: v for k, v in GLM4_9B.items() if k != "architectures"})
    assert a.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"]) == 64
    assert a.rope_interleaved and a.sandwich_norms and a.qkv_bias and not a.o_bias and not a.norm_plus_one
    assert a.eos_token_ids == (151329, 151336, 151338) and a.rms_norm_eps == 1e-5
    assert a.num_parameters == sum(p.numel() for p in Transformer(a, 1, torch.bfloat16, "meta").parameters())
    bare = {k: v for k, v in GLM4_9B.items() if k not in ("partial_rotary_factor", "attention_bias")}
    assert (parse_config(bare).rotary_dim, parse_config(bare).qkv_bias) == (64, True)     # transformers' defaults
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        parse_config({**GLM4_9B, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        parse_config({**GLM4_9B, "partial_rotary_factor": 31 / 128})     # an odd number of dimensions


@pytest.mark.parametrize("arch,wrongs", [("glm4", [dict(rope_interleaved=False), dict(rotary_dim=0)]),
                                         ("phi3_partial", [dict(rotary_dim=0)])])
def test_the_order_is_what_makes_the_logits_hugging_faces(ckpt_dir, monkeypatch, arch, wrongs):
    assert_fields_make_hf_logits(ckpt_dir(arch), monkeypatch, *wrongs)


def test_a_trainers_weights_take_the_order_as_a_checkpoint_does(ckpt_dir, tmp_path):
    path = ckpt_dir("glm4")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf.save_pretrained(str(tmp_path))
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, dtype="float32")
    llm.load_weights(hf.named_parameters())
    want = LLM(str(tmp_path), dtype="float32").generate([[3, 5, 7]], sp)[0].outputs[0].token_ids
    assert llm.generate([[3, 5, 7]], sp)[0].outputs[0].token_ids == want


def test_speculation_is_lossless(ckpt_dir):
    assert_speculation_lossless(ckpt_dir("glm4", init_std=3.0, dtype=torch.bfloat16))
