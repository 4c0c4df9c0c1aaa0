"""RoPE's scalings read from configs as transformers computes them: YaRN (Qwen's long-context
setting, DeepSeek's mscale pair, OLMo 3's full-attention layers) and OLMo 3's layer kinds."""
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tailrl.model.args import parse_config
from tailrl.model.rope import inv_frequencies

QWEN3_8B_YARN = dict(architectures=["Qwen3ForCausalLM"], hidden_size=4096, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, intermediate_size=12288, num_hidden_layers=36,
                     vocab_size=151936, max_position_embeddings=131072, rope_theta=1000000,
                     rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})


@pytest.mark.parametrize("extra", [{}, {"mscale": 0.707, "mscale_all_dim": 1.0}, {"beta_fast": 16, "truncate": False}])
def test_yarn_frequencies_and_factor_equal_transformers(extra):
    cfg = dict(QWEN3_8B_YARN, rope_scaling={**QWEN3_8B_YARN["rope_scaling"], **extra})
    args = parse_config(cfg)
    hf = transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    ref, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    got = inv_frequencies(args.head_dim, args.rope_theta, yarn=args.rope_yarn)
    assert torch.allclose(got.float(), ref.float(), rtol=1e-6, atol=0)
    assert args.rope_yarn[4] == pytest.approx(factor, rel=1e-12)


def test_olmo3s_layers_read_as_transformers_reads_them():
    cfg = dict(architectures=["Olmo3ForCausalLM"], hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
               intermediate_size=11008, num_hidden_layers=8, vocab_size=100278, max_position_embeddings=65536,
               rms_norm_eps=1e-6, rope_theta=500000, sliding_window=4096,
               rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
                             "attention_factor": 1.2079441541679836, "beta_fast": 32, "beta_slow": 1})
    a = parse_config(cfg)
    hf = transformers.Olmo3Config(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert a.layer_windows == tuple(4096 if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert a.layer_windows == (4096, 4096, 4096, 0) * 2 and a.local_rope_theta == 500000.0
    assert a.rope_yarn[:2] == (8.0, 8192) and a.rope_yarn[4] == 1.2079441541679836
    assert not a.pre_norms and a.sandwich_norms and a.qk_norm_whole and not a.qk_norm
