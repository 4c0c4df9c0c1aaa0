"""Ministral 3 (Ministral3ForCausalLM: queries scaled by position past YaRN's original context)
and Mistral 3's image-text checkpoints (Mistral3ForConditionalGeneration: Mistral Small 3.1/3.2,
Magistral Small, Ministral 3), their language model alone: configs read as transformers reads
them, logits equal to Hugging Face's under either naming, the scale what makes them so, and
speculation lossless where the scale is on."""
import pytest
import torch
import transformers
from lossless import assert_speculation_lossless
from parity import assert_fields_make_hf_logits, assert_language_model_equals_hf_under_either_naming, noisy_norms

from tailrl.model.args import parse_config
from tailrl.model.transformer import Transformer

MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
TEXT = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
            tie_word_embeddings=False)


def test_ministral3s_defaults_read_as_transformers_reads_them():
    a = parse_config({"architectures": ["Ministral3ForCausalLM"]})
    hf = transformers.Ministral3Config()
    rope = hf.rope_parameters
    assert a.query_scale == (rope["llama_4_scaling_beta"], rope["original_max_position_embeddings"]) == (0.1, 16384)
    assert a.rope_yarn[:2] == (rope["factor"], rope["original_max_position_embeddings"]) and a.rope_yarn[4] == 1.0
    assert (a.hidden_size, a.num_layers, a.head_dim, a.vocab_size, a.max_position_embeddings) == (
        hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.vocab_size, hf.max_position_embeddings)
    assert a.rope_theta == rope["rope_theta"] and a.eos_token_ids == (2,) and not a.tie_word_embeddings
    assert a.layer_windows == () and a.num_parameters == sum(
        p.numel() for p in Transformer(a, 1, torch.bfloat16, "meta").parameters())


def test_the_image_text_configs_language_model_is_read_by_its_model_type():
    mistral = parse_config({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {}})
    hf = transformers.Mistral3Config().text_config                       # Mistral Small 3.1's shape
    assert mistral.architecture == "MistralForCausalLM" and mistral.query_scale is None
    assert (mistral.hidden_size, mistral.num_layers, mistral.rope_theta, mistral.vocab_size) == (
        hf.hidden_size, hf.num_hidden_layers, hf.rope_parameters["rope_theta"], hf.vocab_size)
    ministral = parse_config({"architectures": ["Mistral3ForConditionalGeneration"], "eos_token_id": 7,
                              "text_config": {"model_type": "ministral3"}})
    assert ministral.architecture == "Ministral3ForCausalLM" and ministral.query_scale == (0.1, 16384)
    assert ministral.eos_token_ids == (7,)
    with pytest.raises(ValueError, match="text_config.model_type 'llama'"):
        parse_config({"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {"model_type": "llama"}})


def test_the_query_scale_table_is_hugging_faces_formula():
    from transformers.models.ministral3.modeling_ministral3 import get_llama_4_attn_scale
    a = parse_config({"architectures": ["Ministral3ForCausalLM"], **TEXT, "rope_parameters": MINISTRAL3_ROPE})
    model = Transformer(a, 200)
    positions = torch.arange(200)
    theirs = get_llama_4_attn_scale(positions[None], 0.1, 8).reshape(-1)
    ours = model.query_scale[positions // 8]
    assert torch.allclose(ours, theirs, rtol=2 ** -23, atol=0) and ours[:8].eq(1).all() and ours[8] > 1


def test_the_query_scale_is_what_makes_the_logits_hugging_faces(ckpt_dir, monkeypatch):
    assert_fields_make_hf_logits(ckpt_dir("ministral3"), monkeypatch, dict(query_scale=None))


def test_speculation_is_lossless_past_the_original_context(ckpt_dir):
    assert_speculation_lossless(ckpt_dir("ministral3", init_std=3.0, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["ministral3", "mistral"])
def test_the_image_text_models_language_model_equals_hugging_faces_under_either_naming(tmp_path, kind):
    text = {**TEXT, "model_type": kind, **({"rope_parameters": MINISTRAL3_ROPE} if kind == "ministral3" else {})}
    vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, head_dim=16, image_size=32, patch_size=16)
    cfg = transformers.Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = noisy_norms(transformers.Mistral3ForConditionalGeneration(cfg).eval())
    with torch.no_grad():                       # the language model's weights as large as the other tests'
        for name, p in hf.named_parameters():
            if "norm" not in name and ("language_model" in name or "lm_head" in name):
                p.normal_(std=0.2)
    assert_language_model_equals_hf_under_either_naming(hf, str(tmp_path))
