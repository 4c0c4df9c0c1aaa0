"""Gemma 2 and 3: the published configs read as Hugging Face reads them, Gemma 2's soft caps
(Hugging Face's logits with them, not without), the image-text model's language model loaded
from either naming of its checkpoint (equal to Hugging Face's logits), and a trainer's weights
(norms stored as 1 + weight) updating it in place."""
import json
import os

import pytest
import torch
import transformers
from parity import assert_fields_make_hf_logits, assert_language_model_equals_hf_under_either_naming, noisy_norms

from tailrl import LLM, SamplingParams
from tailrl.model.args import parse_config
from tailrl.model.transformer import Transformer

# google/gemma-3-1b-it's and google/gemma-3-4b-it's config.json (the fields that matter)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attn_logit_softcapping": None, "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 1152, "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
    "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144}
GEMMA3_4B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "model_type": "gemma3",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}}


def test_the_published_configs_read_as_transformers_reads_them():
    a = parse_config(GEMMA3_1B)
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B.items() if k != "architectures"})
    assert a.layer_windows == tuple(512 if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert a.layer_windows[5] == 0 and a.layer_windows.count(0) == 4          # every sixth layer full
    assert (a.rope_theta, a.local_rope_theta, a.rope_linear) == (1e6, 1e4, 1.0)
    assert (a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size) == (4, 1, 256, 262144)
    assert a.tie_word_embeddings and a.norm_plus_one and a.sandwich_norms and a.scale_embeddings
    assert a.attn_scale == 256 ** -0.5 and a.hidden_act == "gelu_pytorch_tanh" and a.eos_token_ids == (1, 106)
    b = parse_config(GEMMA3_4B)                          # the text model's fields from text_config, defaults filled
    assert (b.num_layers, b.hidden_size, b.num_heads, b.num_kv_heads, b.vocab_size) == (34, 2560, 8, 4, 262208)
    assert (b.rope_linear, b.rope_theta, b.local_rope_theta) == (8.0, 1e6, 1e4) and b.layer_windows[0] == 1024
    assert b.eos_token_ids == (1, 106)
    assert a.num_parameters == sum(p.numel() for p in Transformer(a, 1, torch.bfloat16, "meta").parameters())


# google/gemma-2-2b-it's config.json (the fields that matter)
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "intermediate_size": 9216,
    "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
    "num_key_value_heads": 4, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
    "sliding_window": 4096, "vocab_size": 256000}


def test_gemma2s_config_reads_as_transformers_reads_it():
    a = parse_config(GEMMA2_2B)
    hf = transformers.Gemma2Config(**{k: v for k, v in GEMMA2_2B.items() if k != "architectures"})
    assert a.layer_windows == tuple(4096 if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert a.layer_windows[:2] == (4096, 0) and a.layer_windows.count(0) == 13    # every other layer full
    assert (a.attn_softcap, a.logit_softcap, a.attn_scale) == (50.0, 30.0, 256 ** -0.5)
    assert (a.rope_theta, a.local_rope_theta, a.hidden_act) == (1e4, 0.0, "gelu_pytorch_tanh")
    assert a.norm_plus_one and a.sandwich_norms and a.scale_embeddings and not a.qk_norm
    assert a.num_parameters == sum(p.numel() for p in Transformer(a, 1, torch.bfloat16, "meta").parameters())
    # left out: transformers' defaults; null: none
    bare = {k: v for k, v in GEMMA2_2B.items() if k not in ("attn_logit_softcapping", "final_logit_softcapping",
                                                             "sliding_window", "hidden_act", "hidden_activation")}
    b = parse_config(bare)
    assert (b.attn_softcap, b.logit_softcap, b.layer_windows[0], b.hidden_act) == (50.0, 30.0, 4096,
                                                                                   "gelu_pytorch_tanh")
    c = parse_config({**GEMMA2_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (c.attn_softcap, c.logit_softcap) == (0.0, 0.0)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        parse_config({**GEMMA2_2B, "final_logit_softcapping": -1.0})


def test_gemma2s_soft_caps_are_what_makes_its_logits_hugging_faces(ckpt_dir, monkeypatch):
    """Without either cap our logits are far from Hugging Face's (the caps of the test checkpoint
    bite); with both they are within 1e-4 (tests/engine/test_hf_parity.py)."""
    assert_fields_make_hf_logits(ckpt_dir("gemma2"), monkeypatch, dict(attn_softcap=0.0), dict(logit_softcap=0.0))


def test_the_image_text_models_language_model_equals_hugging_faces_under_either_naming(tmp_path):
    text = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"], initializer_range=0.2,
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=96, boi_token_index=94, eoi_token_index=95)
    torch.manual_seed(0)
    hf = noisy_norms(transformers.Gemma3ForConditionalGeneration(cfg).eval())
    assert_language_model_equals_hf_under_either_naming(hf, str(tmp_path))


def test_a_trainers_weights_update_the_engine_as_a_checkpoint_of_them_would(ckpt_dir, tmp_path):
    """Gemma's norms are loaded as 1 + weight, from a checkpoint and from a trainer alike."""
    path = ckpt_dir("gemma3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.1)
    hf.save_pretrained(str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == ["Gemma3ForCausalLM"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(path, dtype="float32")
    llm.load_weights(hf.named_parameters())
    want = LLM(str(tmp_path), dtype="float32").generate([[3, 5, 7]], sp)[0].outputs[0].token_ids
    assert llm.generate([[3, 5, 7]], sp)[0].outputs[0].token_ids == want
