"""DeepSeek-V3 (DeepseekV3ForCausalLM: DeepSeek-V3 / R1, Kimi K2, Moonlight) and DeepSeek-V2
(DeepseekV2ForCausalLM: V2, V2-Lite): their latent attention (model/mla.py), the published configs
read as transformers reads them, the latent attention's fields as what makes the logits Hugging
Face's, V2's route as its router defines it, V3's multi-token-prediction layers skipped, and what
is refused. Logits and greedy tokens against Hugging Face (with and without a low-rank query) are
in tests/engine/test_hf_parity.py; speculation lossless, a trainer's weights, tensor parallelism
and the Triton kernels in the architecture-wide tests."""
import json
import os

import pytest
import torch
import transformers
from parity import assert_fields_make_hf_logits
from safetensors.torch import save_file

from tailrl import LLM, SamplingParams
from tailrl.model.args import parse_config
from tailrl.model.loader import load_state_dict
from tailrl.model.moe import route_softmax_groups
from tailrl.model.transformer import Transformer

# deepseek-ai/DeepSeek-V3's config.json (the fields that matter; its FP8 quantization apart)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "n_group": 8,
    "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "topk_group": 4, "v_head_dim": 128, "vocab_size": 129280,
    "first_k_dense_replace": 3, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1}
# moonshotai/Moonlight-16B-A3B's: one query projection, no YaRN, every group open
MOONLIGHT = {**DEEPSEEK_V3, "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
             "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
             "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "n_group": 1,
             "topk_group": 1, "routed_scaling_factor": 2.446, "q_lora_rank": None, "vocab_size": 163840,
             "rope_theta": 50000.0, "max_position_embeddings": 8192, "rope_scaling": None}
# deepseek-ai/DeepSeek-V2-Lite's and DeepSeek-V2's (softmax routing, greedy or within groups)
V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "vocab_size": 102400, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "routed_scaling_factor": 1.0, "norm_topk_prob": False, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
V2 = {**V2_LITE, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
      "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 160,
      "q_lora_rank": 1536, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
      "routed_scaling_factor": 16.0}


@pytest.mark.parametrize("cfg,billions", [(DEEPSEEK_V3, 671.0), (MOONLIGHT, 15.96), (V2_LITE, 15.7), (V2, 235.7)])
def test_the_published_configs_read_as_transformers_reads_them(cfg, billions):
    a = parse_config(cfg)
    v3 = a.architecture == "DeepseekV3ForCausalLM"
    hf = (transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config)(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "moe_layer_freq")})
    modeling = transformers.models.deepseek_v3.modeling_deepseek_v3 if v3 else \
        transformers.models.deepseek_v2.modeling_deepseek_v2
    assert a.mla == (hf.q_lora_rank or 0, hf.kv_lora_rank, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)
    assert (a.head_dim, a.num_kv_heads, a.rotary_dim, a.rope_interleaved) == (    # the pool's one latent head
        hf.kv_lora_rank + hf.qk_rope_head_dim, 1, hf.qk_rope_head_dim, getattr(hf, "rope_interleave", True))
    with torch.device("meta"):
        scaling = (modeling.DeepseekV3Attention if v3 else modeling.DeepseekV2Attention)(hf, 0).scaling
    assert a.attn_scale == pytest.approx(scaling, rel=1e-12)
    assert a.sparse_layers == tuple(range(hf.first_k_dense_replace, hf.num_hidden_layers))
    assert (a.num_experts, a.experts_per_token, a.expert_groups, a.groups_per_token, a.routed_scaling) == (
        hf.n_routed_experts, hf.num_experts_per_tok, hf.n_group, hf.topk_group, hf.routed_scaling_factor)
    assert a.router_float32 and (a.router_sigmoid, a.router_softmax_groups, a.mtp_layers) == (v3, not v3, int(v3))
    assert a.num_parameters == pytest.approx(billions * 1e9, rel=0.002)      # 671B (MTP apart), 15.96B, 15.7B, 236B
    assert a.kv_bytes_per_token == 2 * hf.num_hidden_layers * (hf.kv_lora_rank + hf.qk_rope_head_dim)   # the latent
    few = parse_config({**cfg, "num_hidden_layers": 4, "first_k_dense_replace": 1})
    assert few.num_parameters == sum(p.numel() for p in Transformer(few, 1, torch.bfloat16, "meta").parameters())


def test_v2s_route_is_its_routers():
    """A softmax, the top k within the best groups (a group worth its best score), weights times
    the scale: Hugging Face's DeepseekV2TopkRouter's choice and weights (no ties here); ties to the
    lower expert."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    g = torch.Generator().manual_seed(0)
    for method, groups, chosen in (("greedy", 1, 1), ("group_limited_greedy", 4, 2)):
        cfg = transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16,
                                            num_experts_per_tok=3, topk_method=method, n_group=groups,
                                            topk_group=chosen, routed_scaling_factor=2.5)
        router = DeepseekV2TopkRouter(cfg)
        router.weight.data = torch.randn(16, 16, generator=g)
        x = torch.randn(9, 16, generator=g)
        _, hf_w, hf_ids = router(x)
        ids, w = route_softmax_groups(x @ router.weight.t(), 3, groups, chosen, 2.5)
        order = torch.argsort(hf_ids, dim=1)
        assert torch.equal(ids, hf_ids.gather(1, order)) and torch.allclose(w, hf_w.gather(1, order), atol=1e-7)
    ids, _ = route_softmax_groups(torch.tensor([[1.0, 1.0, 0.0, 1.0]]), 2, 1, 1, 1.0)
    assert ids.tolist() == [[0, 1]]


def test_what_is_refused_names_its_field():
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert parse_config({**DEEPSEEK_V3, "quantization_config": fp8}) == parse_config(DEEPSEEK_V3)   # as published
    for wrong in ({**fp8, "weight_block_size": None}, {**fp8, "fmt": "e5m2"}, {"quant_method": "gptq"}):
        with pytest.raises(ValueError, match="quantization_config"):
            parse_config({**DEEPSEEK_V3, "quantization_config": wrong})
    with pytest.raises(ValueError, match="attention_bias"):
        parse_config({**DEEPSEEK_V3, "attention_bias": True})
    with pytest.raises(ValueError, match="qk_rope_head_dim even"):
        parse_config({**DEEPSEEK_V3, "qk_rope_head_dim": 63})
    with pytest.raises(ValueError, match="topk_method 'noaux_tc'"):
        parse_config({**V2_LITE, "topk_method": "noaux_tc"})
    with pytest.raises(ValueError, match="n_group"):
        parse_config({**V2, "n_group": 7})


def test_the_latent_attentions_fields_are_what_makes_the_logits_hugging_faces(ckpt_dir, monkeypatch):
    """RoPE's pairs not interleaved, RoPE over every dimension, or the scores without YaRN's mscale:
    the logits leave Hugging Face's."""
    assert_fields_make_hf_logits(ckpt_dir("deepseek_v3"), monkeypatch, dict(rope_interleaved=False),
                                 dict(rotary_dim=0), dict(attn_scale=32 ** -0.5))


def test_multi_token_prediction_layers_are_skipped_and_nothing_else(ckpt_dir, tmp_path):
    """A checkpoint's MTP layer (after the model's own, as DeepSeek's checkpoints hold it) loads as
    the model without it; with the config saying there is none, it is a ValueError naming it."""
    path = ckpt_dir("deepseek_v3")
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = LLM(path).generate([[3, 5, 7]], sp)[0].outputs[0].token_ids
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
           "model.layers.2.self_attn.kv_a_layernorm.weight": torch.ones(24)}
    for name, layers in (("mtp", 1), ("none", 0)):
        os.makedirs(tmp_path / name)
        save_file({**load_state_dict(path), **mtp}, str(tmp_path / name / "model.safetensors"))
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        with open(tmp_path / name / "config.json", "w") as f:
            json.dump({**cfg, "num_nextn_predict_layers": layers}, f)
    assert LLM(str(tmp_path / "mtp")).generate([[3, 5, 7]], sp)[0].outputs[0].token_ids == want
    with pytest.raises(ValueError, match="model.layers.2"):
        LLM(str(tmp_path / "none"))
