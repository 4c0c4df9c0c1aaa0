"""Random-weight Hugging Face checkpoints for tests, saved with save_pretrained."""
from __future__ import annotations

import os

import torch

ARCH_CONFIGS = {
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=16, attention_bias=False)),
    "llama": ("LlamaConfig", dict(attention_bias=False, mlp_bias=False)),
    "llama_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),     # every projection's bias
    "phi3": ("Phi3Config", dict()),                                               # fused QKV and gate/up
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=None)),
    "mistral_window": ("MistralConfig", dict(head_dim=16, sliding_window=32)),   # Mistral-7B-v0.1's kind
    # mixtures of experts: 8 experts, 3 a token; Qwen3-MoE's second layer dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, attention_bias=False, num_experts=8, num_experts_per_tok=3,
                                         moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                         shared_expert_intermediate_size=80, norm_topk_prob=False)),
    # GLM-4.5: the first layer dense, then 8 routed experts in 2 groups (a token's 3 from the best
    # group), sigmoid scores with a correction bias, weights times 2.5, an ungated shared expert;
    # RoPE on half of each head, q/k norms, q/k/v biases
    "glm4_moe": ("Glm4MoeConfig", dict(head_dim=16, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                                       n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=1,
                                       routed_scaling_factor=2.5, use_qk_norm=True, attention_bias=True)),
    # Ministral 3: YaRN (4x an original context of 8 positions) and queries scaled by position
    # past it (1 + 0.1 ln(1 + floor(p / 8))): inside any test's context
    "ministral3": ("Ministral3Config", dict(head_dim=16, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
        beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1))),
    "mixtral": ("MixtralConfig", dict(head_dim=16, sliding_window=None, num_local_experts=8, num_experts_per_tok=2)),
    # Gemma 3: a sliding-window layer (8 positions, its own RoPE base) and a full one (linear RoPE
    # scaling), the scores scaled by query_pre_attn_scalar ** -0.5 (not head_dim's)
    "gemma3": ("Gemma3TextConfig", dict(
        head_dim=16, sliding_window=8, query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    # Gemma 2: every other layer a sliding window (8 positions here), scores and logits soft-capped
    # (caps low enough that a random model's scores and logits reach them)
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # SmolLM3: RoPE left out of every second layer here (every fourth in the published model)
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),
    # GLM-4: RoPE on half of each head, on interleaved pairs; norms after attention and the MLP
    "glm4": ("Glm4Config", dict(head_dim=16)),
    # Phi-3's RoPE on part of a head (Phi-4-mini's 3/4), rotate-half within it
    "phi3_partial": ("Phi3Config", dict(partial_rotary_factor=0.75)),
    # YaRN's RoPE (Qwen2.5's long-context setting): 4x an original context of 32 positions
    "qwen2_yarn": ("Qwen2Config", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                        "original_max_position_embeddings": 32})),
    # OLMo 2 (no norm before attention or the MLP, norms after them, q/k norms over all heads) and
    # OLMo 3 (also a sliding window of 8 positions, its full layer's RoPE YaRN's)
    "olmo2": ("Olmo2Config", dict(attention_bias=False)),
    "olmo3": ("Olmo3Config", dict(
        attention_bias=False, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                            "original_max_position_embeddings": 32},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Qwen3.5: a Gated DeltaNet layer (2 key heads, 4 value heads of 8 dimensions, a conv of width
    # 4), then attention with its output gate, q/k norms and RoPE on a quarter of each head
    "qwen3_5": ("Qwen3_5TextConfig", dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                          linear_key_head_dim=8, linear_value_head_dim=8,
                                          layer_types=["linear_attention", "full_attention", "linear_attention",
                                                       "full_attention"])),
    # Qwen3.5-MoE: the same layers, Qwen2-MoE's mixture (8 experts, 3 a token, a gated shared expert) in each
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                                 linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
                                                 num_experts_per_tok=3, moe_intermediate_size=48,
                                                 shared_expert_intermediate_size=80,
                                                 layer_types=["linear_attention", "full_attention"])),
    # Qwen3-Next: the same layers, the DeltaNet's projections fused per key head; the second layer's MLP
    # dense (mlp_only_layers)
    "qwen3_next": ("Qwen3NextConfig", dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
                                           num_experts_per_tok=3, moe_intermediate_size=48,
                                           shared_expert_intermediate_size=80, mlp_only_layers=[1],
                                           layer_types=["linear_attention", "full_attention"])),
    # gpt-oss: attention sinks, a sliding window of 8 positions then a full layer, YaRN (4x an
    # original context of 128), 8 experts (3 a token) with biases and a SwiGLU clamped at 1.5
    # (low enough that a random model's gates and ups reach it)
    "gpt_oss": ("GptOssConfig", dict(head_dim=16, num_local_experts=8, num_experts_per_tok=3, sliding_window=8,
                                     swiglu_limit=1.5, layer_types=["sliding_attention", "full_attention"],
                                     rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                          truncate=False, original_max_position_embeddings=128,
                                                          rope_theta=10000.0))),
    # DeepSeek-V3: latent attention (a low-rank query of 24, a latent of 24, heads of 24 + 8 key
    # dimensions with RoPE's 8 interleaved, values of 16; YaRN 4x an original context of 128 with
    # its mscale on the scores), the first layer dense, then GLM-4.5's routing (8 experts in 2
    # groups, 3 a token from the better one, weights x 2.5, a shared expert)
    "deepseek_v3": ("DeepseekV3Config", dict(
        q_lora_rank=24, kv_lora_rank=24, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=48, n_shared_experts=1, n_group=2, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, rope_interleave=True,
        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128, beta_fast=32.0,
                             beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, rope_theta=10000.0))),
    # Moonlight's kind: one query projection (no low rank), RoPE's pairs rotate-half, no YaRN
    "deepseek_v3_plain": ("DeepseekV3Config", dict(
        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, routed_scaling_factor=2.0, rope_interleave=False)),
    # DeepSeek-V2: the same latent attention (one query projection: V2-Lite's kind), its own routing:
    # a softmax, a token's 3 within the better of 2 groups (a group worth its best), weights x 2
    "deepseek_v2": ("DeepseekV2Config", dict(
        q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=3, moe_intermediate_size=48, n_shared_experts=2, first_k_dense_replace=1,
        topk_method="group_limited_greedy", n_group=2, topk_group=1, routed_scaling_factor=2.0)),
}


def make_checkpoint(path: str, arch: str = "qwen2", vocab_size: int = 97, hidden_size: int = 64,
                    num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, tie: bool = False,
                    max_pos: int = 512, seed: int = 0, eos_token_id: int | None = None, init_std: float = 0.2,
                    dtype: torch.dtype = torch.float32) -> str:
    """Save a random model; init_std > HF's default makes logits peaked enough to be interesting."""
    import transformers
    cls_name, extra = ARCH_CONFIGS[arch]
    if "layer_types" in extra:                  # the first num_layers kinds of layer
        extra = {**extra, "layer_types": extra["layer_types"][:num_layers]}
    dense = {} if cls_name == "Qwen3_5MoeTextConfig" else dict(intermediate_size=2 * hidden_size)
    if cls_name in ("DeepseekV3Config", "DeepseekV2Config"):     # latent attention: as many K/V heads as heads
        num_kv_heads = num_heads
    cfg = getattr(transformers, cls_name)(
        vocab_size=vocab_size, hidden_size=hidden_size, **dense,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_pos, rope_theta=10000.0, tie_word_embeddings=tie, rms_norm_eps=1e-6,
        initializer_range=init_std, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=None, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    with torch.no_grad():                       # make norms and biases non-trivial too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    return path
