"""SmolLM3: its published config read as Hugging Face reads it (RoPE left out of every fourth
layer), the layers without RoPE being what makes its logits Hugging Face's, and speculation
lossless in bfloat16."""
import pytest
import torch
import transformers
from lossless import assert_speculation_lossless
from parity import assert_fields_make_hf_logits

from tailrl.model.args import parse_config
from tailrl.model.transformer import Transformer

# HuggingFaceTB/SmolLM3-3B's config.json (the fields that matter)
SMOLLM3_3B = {
    "architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "eos_token_id": 128012,
    "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11008, "max_position_embeddings": 65536,
    "mlp_bias": False, "model_type": "smollm3", "no_rope_layer_interval": 4,
    "no_rope_layers": [1, 1, 1, 0] * 9, "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 5000000.0,
    "sliding_window": None, "tie_word_embeddings": True, "use_sliding_window": False, "vocab_size": 128256}


def test_the_published_config_reads_as_transformers_reads_it():
    a = parse_config(SMOLLM3_3B)
    hf = transformers.SmolLM3Config(**{k: v for k, v in SMOLLM3_3B.items() if k != "architectures"})
    assert a.nope_layers == tuple(i for i, r in enumerate(hf.no_rope_layers) if not r) == tuple(range(3, 36, 4))
    assert (a.rope_theta, a.layer_windows, a.head_dim, a.tie_word_embeddings) == (5e6, (), 128, True)
    assert a.num_parameters == sum(p.numel() for p in Transformer(a, 1, torch.bfloat16, "meta").parameters())
    # without the list: every no_rope_layer_interval-th layer, as transformers fills it in
    b = parse_config({k: v for k, v in SMOLLM3_3B.items() if k != "no_rope_layers"})
    assert b.nope_layers == a.nope_layers
    with pytest.raises(ValueError, match="no_rope_layers"):
        parse_config({**SMOLLM3_3B, "no_rope_layers": [1, 0]})
    with pytest.raises(ValueError, match="use_sliding_window"):
        parse_config({**SMOLLM3_3B, "use_sliding_window": True, "sliding_window": 4096})


def test_its_layers_without_rope_are_what_makes_its_logits_hugging_faces(ckpt_dir, monkeypatch):
    """With RoPE in every layer our logits are far from Hugging Face's; as configured, within
    1e-4 (tests/engine/test_hf_parity.py)."""
    assert_fields_make_hf_logits(ckpt_dir("smollm3"), monkeypatch, dict(nope_layers=()))


def test_speculation_is_lossless(ckpt_dir):
    assert_speculation_lossless(ckpt_dir("smollm3", init_std=3.0, dtype=torch.bfloat16))
