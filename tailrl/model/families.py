"""What each family of architectures adds to ``ModelArgs``, read from its Hugging Face config (no
transformers import): RoPE's variants, the mixtures of experts' fields, Gemma's, OLMo's, SmolLM3's
and GLM-4's layers. Each reader returns ModelArgs fields as a dict (args.py builds the ModelArgs)
and raises ValueError naming what it does not support; a missing field is a KeyError args.py names."""
from __future__ import annotations

import math

QWEN3_5_MOE = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")
MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "Glm4MoeForCausalLM", *QWEN3_5_MOE,
       "Qwen3NextForCausalLM")
# Gated DeltaNet layers beside attention (qwen3_5_fields): Qwen3.5, its mixtures of experts, and
# Qwen3-Next (the same layers, its DeltaNet projections fused per key head: deltanet_grouped)
QWEN3_5 = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", *QWEN3_5_MOE, "Qwen3NextForCausalLM")
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA = ("Gemma2ForCausalLM", *GEMMA3)
# RoPE on part of a head, as their Hugging Face modules apply it (rope.py); GLM-4's on interleaved pairs
PARTIAL_ROTARY = ("Phi3ForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM", *QWEN3_5)
# GLM-4's config defaults (transformers' Glm4Config) that change what the model computes
GLM4_DEFAULTS = dict(attention_bias=True, rms_norm_eps=1.5625e-07, eos_token_id=[151329, 151336, 151338],
                     max_position_embeddings=131_072)
OLMO = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")
GPT_OSS = ("GptOssForCausalLM",)
DEEPSEEK_V3 = ("DeepseekV3ForCausalLM",)
DEEPSEEK_V2 = ("DeepseekV2ForCausalLM",)
# latent attention (model/mla.py): DeepSeek-V2's and V3's
LATENT = (*DEEPSEEK_V3, *DEEPSEEK_V2)
# DeepSeek-V2's config defaults (transformers' DeepseekV2Config) that change what the model computes
DEEPSEEK_V2_DEFAULTS = dict(vocab_size=102_400, hidden_size=4096, intermediate_size=11_008, num_hidden_layers=32,
                            num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6,
                            first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=1536, n_routed_experts=64,
                            n_shared_experts=2, qk_nope_head_dim=128, qk_rope_head_dim=64, routed_scaling_factor=1.0,
                            topk_method="greedy", v_head_dim=128, moe_intermediate_size=1407, eos_token_id=2)
# DeepSeek-V3's config defaults (transformers' DeepseekV3Config) that change what the model computes
DEEPSEEK_V3_DEFAULTS = dict(vocab_size=129_280, hidden_size=7168, intermediate_size=18_432, moe_intermediate_size=2048,
                            num_hidden_layers=61, num_attention_heads=128, n_shared_experts=1, n_routed_experts=256,
                            routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                            v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                            first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=4096,
                            rms_norm_eps=1e-6, rope_interleave=True, num_nextn_predict_layers=1, eos_token_id=1)
# gpt-oss's config defaults (transformers' GptOssConfig) that change what the model computes
GPT_OSS_DEFAULTS = dict(num_hidden_layers=36, num_local_experts=128, vocab_size=201_088, hidden_size=2880,
                        intermediate_size=2880, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                        sliding_window=128, max_position_embeddings=131_072, rms_norm_eps=1e-5, num_experts_per_tok=4,
                        swiglu_alpha=1.702, swiglu_limit=7.0, attention_bias=True, rope_theta=150_000.0)
GPT_OSS_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)


def moe_fields(arch: str, cfg: dict, layers: int, source: str) -> dict:
    """A mixture of experts' ModelArgs fields from its config (nothing for a dense model)."""
    if arch in GPT_OSS:
        return gpt_oss_moe_fields(cfg, layers, source)
    if arch in DEEPSEEK_V2:
        return deepseek_v2_moe_fields(cfg, layers, source)
    if arch not in MOE and arch not in DEEPSEEK_V3:
        return {}
    if arch == "Glm4MoeForCausalLM" or arch in DEEPSEEK_V3:
        return glm4_moe_fields(cfg, layers, source)
    if arch in QWEN3_5_MOE:                     # Qwen2-MoE's block in every layer, its top-k renormalised
        cfg = {**cfg, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}
    mixtral = arch == "MixtralForCausalLM"
    # the experts' count: "num_experts" in Qwen's published configs, "num_local_experts" in
    # Mixtral's and in what transformers 5 saves for either
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_local_experts" if mixtral else "num_experts")
    experts = int(experts)
    if mixtral:
        width, normalise, sparse = int(cfg["intermediate_size"]), True, tuple(range(layers))
    else:
        width = int(cfg["moe_intermediate_size"])
        normalise = bool(cfg.get("norm_topk_prob", False))
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
        if step < 1:
            raise ValueError(f"model: decoder_sparse_step must be >= 1 in {source}, got {step}")
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    k = _top_k(cfg, experts, sparse, source)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" or \
        arch in QWEN3_5 else 0
    return dict(num_experts=experts if sparse else 0, experts_per_token=k if sparse else 0,
                moe_intermediate_size=width if sparse else 0, norm_topk_prob=normalise, sparse_layers=sparse,
                shared_expert_size=shared if sparse else 0, shared_expert_gate=bool(shared and sparse),
                router_float32=mixtral)


def _top_k(cfg: dict, experts: int, sparse: tuple[int, ...], source: str, candidates: int = 0) -> int:
    """num_experts_per_tok, checked against the experts a token may be routed to."""
    k = int(cfg["num_experts_per_tok"])
    if sparse and not 1 <= k <= (candidates or experts):
        raise ValueError(f"model: num_experts_per_tok must be in [1, {candidates or experts}] (the experts a token "
                         f"may be routed to) in {source}, got {k}")
    return k


# GLM-4.5's config defaults (transformers' Glm4MoeConfig) that change what the model computes
GLM4_MOE_DEFAULTS = dict(num_experts_per_tok=8, moe_intermediate_size=1408,
                         n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                         routed_scaling_factor=1.0, norm_topk_prob=True)


def glm4_moe_fields(cfg: dict, layers: int, source: str) -> dict:
    """GLM-4.5's / GLM-4.6's mixture, DeepSeek-V3's own: the first ``first_k_dense_replace``
    layers dense; a float32 router's sigmoid scores, a token's experts chosen among the best
    ``topk_group`` of ``n_group`` groups by score plus a correction bias, weighted by their
    scores (renormalised, times ``routed_scaling_factor``); an ungated shared expert. The
    checkpoint's multi-token-prediction layers, after the model's own, are not loaded."""
    cfg = {**GLM4_MOE_DEFAULTS, **cfg}
    experts = int(cfg.get("n_routed_experts", cfg.get("num_local_experts", 128)))
    groups, chosen = int(cfg["n_group"]), int(cfg["topk_group"])
    if groups < 1 or experts % groups or experts // groups < 2:
        raise ValueError(f"model: n_group {groups} in {source} must divide the {experts} routed experts into "
                         f"groups of at least 2")
    if not 1 <= chosen <= groups:
        raise ValueError(f"model: topk_group must be in [1, {groups}] (n_group) in {source}, got {chosen}")
    first_dense = int(cfg["first_k_dense_replace"])
    sparse = tuple(range(max(first_dense, 0), layers))
    k = _top_k(cfg, experts, sparse, source, chosen * (experts // groups))
    width = int(cfg["moe_intermediate_size"])
    mtp = int(cfg.get("num_nextn_predict_layers", cfg.get("num_mtp_layers", 1)) or 0)
    return dict(num_experts=experts if sparse else 0, experts_per_token=k if sparse else 0,
                moe_intermediate_size=width if sparse else 0, norm_topk_prob=bool(cfg["norm_topk_prob"]),
                sparse_layers=sparse, shared_expert_size=width * int(cfg["n_shared_experts"] or 0) if sparse else 0,
                router_float32=True, router_sigmoid=True, expert_groups=groups, groups_per_token=chosen,
                routed_scaling=float(cfg["routed_scaling_factor"]), mtp_layers=max(mtp, 0))


def gpt_oss_moe_fields(cfg: dict, layers: int, source: str) -> dict:
    """gpt-oss's mixture in every layer: ``num_local_experts`` experts of ``intermediate_size``
    units, a token's k weighted by the softmax of their router logits (the router has a bias), each
    expert's products with biases and its clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``)."""
    experts, sparse = int(cfg["num_local_experts"]), tuple(range(layers))
    limit, alpha = float(cfg["swiglu_limit"]), float(cfg["swiglu_alpha"])
    if limit <= 0:
        raise ValueError(f"model: swiglu_limit must be positive in {source}, got {limit}")
    return dict(num_experts=experts, experts_per_token=_top_k(cfg, experts, sparse, source),
                moe_intermediate_size=int(cfg["intermediate_size"]), sparse_layers=sparse, router_topk_softmax=True,
                expert_bias=True, swiglu=(alpha, limit))


def deepseek_v2_moe_fields(cfg: dict, layers: int, source: str) -> dict:
    """DeepSeek-V2's mixture after the first ``first_k_dense_replace`` layers: a float32 router's
    softmax, a token's top k (``topk_method`` greedy), or its top k within its best ``topk_group``
    of ``n_group`` groups, a group worth its best score (group_limited_greedy); their scores times
    ``routed_scaling_factor`` as weights (not renormalised: Hugging Face's router ignores
    ``norm_topk_prob``); ``n_shared_experts`` shared experts' width, ungated."""
    method, experts = cfg.get("topk_method") or "greedy", int(cfg["n_routed_experts"])
    if method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"model: topk_method {method!r} in {source} is not supported (greedy, group_limited_greedy)")
    groups, chosen = (int(cfg["n_group"]), int(cfg["topk_group"])) if method != "greedy" else (1, 1)
    if groups < 1 or experts % groups or not 1 <= chosen <= groups:
        raise ValueError(f"model: n_group {groups} and topk_group {chosen} in {source} must divide the {experts} "
                         f"routed experts into groups and choose among them")
    sparse = tuple(range(max(int(cfg["first_k_dense_replace"]), 0), layers))
    width = int(cfg["moe_intermediate_size"])
    k = _top_k(cfg, experts, sparse, source, chosen * (experts // groups))
    return dict(num_experts=experts if sparse else 0, experts_per_token=k if sparse else 0,
                moe_intermediate_size=width if sparse else 0, sparse_layers=sparse, router_float32=True,
                router_softmax_groups=True, expert_groups=groups, groups_per_token=chosen,
                routed_scaling=float(cfg["routed_scaling_factor"]),
                shared_expert_size=width * int(cfg["n_shared_experts"] or 0) if sparse else 0)


def gpt_oss_config(cfg: dict) -> dict:
    """A gpt-oss config with transformers' defaults (its YaRN where it names no RoPE)."""
    out = {**GPT_OSS_DEFAULTS, **cfg}
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        out["rope_parameters"] = dict(GPT_OSS_ROPE, rope_theta=out["rope_theta"])
    return out


def _yarn(rope: dict, max_pos: int) -> tuple[float, int, float, float, float, bool]:
    """YaRN's parameters as transformers reads them: (factor, original context, beta_fast,
    beta_slow, the cos/sin factor, truncate); the factor defaults to the context's growth, the
    cos/sin factor to 0.1 ln(factor) + 1 (DeepSeek's mscale / mscale_all_dim ratio where given)."""
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope["factor"]) if rope.get("factor") is not None else max_pos / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return (factor, original, float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
            float(attention), bool(rope.get("truncate", True)))


def rope_fields(cfg: dict, source: str, rope: dict | None = None, arch: str = "", head_dim: int = 0) -> dict:
    """RoPE's ModelArgs fields of a config (``rope``: its RoPE parameters where they are not the
    config's own): rope_theta, and Llama 3.1's, linear or YaRN scaling, and (Phi-3's, GLM-4's
    ``arch``, heads of ``head_dim``) the dimensions it turns; other rope types, and RoPE on part
    of a head elsewhere, are refused naming them."""
    if rope is None:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None, "llama3", "linear", "yarn"):
        raise ValueError(f"model: rope type {rope_type!r} in {source} is not supported (only 'default', "
                         f"'linear', 'llama3' and 'yarn')")
    llama3 = None
    if rope_type == "llama3":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                  int(rope["original_max_position_embeddings"]))
    yarn = _yarn(rope, int(cfg.get("max_position_embeddings", 2048))) if rope_type == "yarn" else None
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    # transformers' defaults: GLM-4's (top level or rope_parameters), Qwen3.5's and Qwen3-Next's
    default = 0.5 if arch.startswith("Glm4") else 0.25 if arch in QWEN3_5 else 1.0
    partial = float(cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", default)) or 1.0)
    rotary = int(head_dim * partial) if partial != 1.0 else 0              # as transformers counts them
    if partial != 1.0 and (arch not in PARTIAL_ROTARY or rotary % 2 or not 0 < rotary < head_dim):
        raise ValueError(f"model: partial_rotary_factor {partial} in {source} is not supported (RoPE on part of a "
                         f"head: {', '.join(PARTIAL_ROTARY)}, on an even number of dimensions)")
    linear = float(rope["factor"]) if rope_type == "linear" else 1.0
    return dict(rope_theta=float(theta), rope_llama3=llama3, rope_yarn=yarn, rope_linear=linear, rotary_dim=rotary,
                rope_interleaved=arch == "Glm4ForCausalLM")


def _layer_types(cfg: dict, source: str, layers: int, pattern: int) -> list[str]:
    """Each layer's kind (sliding_attention or full_attention): the config's, or every
    pattern-th layer full."""
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"model: layer_types in {source} must name sliding_attention or full_attention for each "
                         f"of its {layers} layers")
    return types


def _windowed(cfg: dict, source: str, layers: int, pattern: int, full: dict, local: dict) -> dict:
    """The fields of a model whose layers alternate sliding windows (RoPE ``local``, unscaled) and
    full attention (RoPE ``full``)."""
    fields = rope_fields(cfg, source, full)
    local = rope_fields(cfg, source, local)
    if local["rope_llama3"] or local["rope_yarn"] or local["rope_linear"] != 1.0:
        raise ValueError(f"model: a scaled RoPE of the sliding-window layers in {source} is not supported")
    window = int(cfg["sliding_window"])
    types = _layer_types(cfg, source, layers, pattern)
    return dict(fields, local_rope_theta=local["rope_theta"],
                layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types))


def _per_kind(cfg: dict, default_theta: float, local_theta_key: str | None) -> tuple[dict, dict]:
    """(full layers', sliding layers') RoPE parameters: transformers 5's per kind of layer, or the
    published configs' top-level ones (the sliding layers' base under ``local_theta_key``, or
    the default, as transformers reads them)."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        return params["full_attention"] or {}, params.get("sliding_attention") or {"rope_theta": default_theta}
    full = {**(cfg.get("rope_scaling") or params), "rope_theta": cfg.get("rope_theta", default_theta)}
    return full, {"rope_theta": cfg.get(local_theta_key, 1e4) if local_theta_key else default_theta}


# Gemma 3's text config defaults (transformers' Gemma3TextConfig): the published image-text
# checkpoints' text_config leaves most of them out
GEMMA3_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096, eos_token_id=1)


def _with_own_eos(text: dict, cfg: dict) -> dict:
    """An image-text checkpoint's language-model config ``text`` with the checkpoint's own
    (top-level) EOS ids in place of the text config's, where it names them."""
    return text if cfg.get("eos_token_id") is None else {**text, "eos_token_id": cfg["eos_token_id"]}


def gemma3_config(cfg: dict, arch: str) -> dict:
    """A Gemma 3 config's text model fields, its defaults filled in (the image-text model's from
    its ``text_config``, its own EOS ids first)."""
    if arch != "Gemma3ForConditionalGeneration":
        return {**GEMMA3_DEFAULTS, **cfg}
    return _with_own_eos({**GEMMA3_DEFAULTS, **(cfg.get("text_config") or {})}, cfg)


def _gemma(cfg: dict, source: str) -> dict:
    """What Gemma 2 and 3 share: norms scaling by 1 + weight, before and after attention and the
    MLP, embeddings times sqrt(hidden), the scores' scale, the soft caps of scores and logits
    (where set: Gemma 2's)."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(f"model: use_bidirectional_attention {cfg['use_bidirectional_attention']!r} in {source} "
                         f"is not supported")
    caps = {}
    for key, field in (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "logit_softcap")):
        cap = float(cfg.get(key) or 0.0)
        if cap < 0:
            raise ValueError(f"model: {key} in {source} must be positive or null, got {cap}")
        caps[field] = cap
    return dict(norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
                attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5, **caps)


def gemma3_fields(cfg: dict, source: str, layers: int) -> dict:
    """Gemma 3's ModelArgs fields: every pattern-th layer full attention, the others a sliding
    window with a RoPE of their own base; its norms, embeddings, activation and scores' scale."""
    full, local = _per_kind(cfg, 1e6, "rope_local_base_freq")
    return dict(_windowed(cfg, source, layers, int(cfg.get("sliding_window_pattern", 6)), full, local),
                **_gemma(cfg, source))


# Gemma 2's config defaults (transformers' Gemma2Config) that change what the model computes
GEMMA2_DEFAULTS = dict(query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0)


def gemma2_fields(cfg: dict, source: str, layers: int) -> dict:
    """Gemma 2's ModelArgs fields: every other layer (the first among them) a sliding window,
    one RoPE for all; Gemma 3's norms, embeddings and scale, and scores and logits soft-capped
    (the defaults where the config leaves them out, as transformers fills them in)."""
    cfg = {**GEMMA2_DEFAULTS, **cfg}                       # a null in the config: none (no window, no cap)
    window = int(cfg["sliding_window"] or 0)
    types = _layer_types(cfg, source, layers, 2)
    return dict(layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types), **_gemma(cfg, source))


def olmo_fields(arch: str, cfg: dict, source: str, layers: int) -> dict:
    """OLMo 2's and OLMo 3's ModelArgs fields: no norm before attention or the MLP, their outputs
    normed before the residual add, q and k normed over all heads at once; OLMo 3's sliding
    windows on three layers of four (their RoPE unscaled, at the default base unless given)."""
    fields = dict(pre_norms=False, sandwich_norms=True, qk_norm_whole=True)
    if arch == "Olmo3ForCausalLM":
        full, local = _per_kind(cfg, 500_000.0, None)
        fields.update(_windowed(cfg, source, layers, 4, full, local))
    return fields


def smollm3_fields(cfg: dict, source: str, layers: int) -> dict:
    """SmolLM3's ModelArgs field: the layers without RoPE, where ``no_rope_layers`` has a 0 (or,
    without that list, every ``no_rope_layer_interval``-th layer, as transformers fills it in)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        if interval < 1:
            raise ValueError(f"model: no_rope_layer_interval must be >= 1 in {source}, got {interval}")
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"model: no_rope_layers in {source} must hold one flag for each of its {layers} layers, "
                         f"got {len(flags)}")
    return dict(nope_layers=tuple(i for i, use_rope in enumerate(flags) if not use_rope))


# Mistral 3's image-text checkpoints (Mistral Small 3.1/3.2, Magistral Small, Ministral 3): the
# language model's architecture by its text config's model_type, and each one's config defaults
# (transformers' Mistral3Config text defaults, Ministral3Config's) that change what it computes
MISTRAL3_TEXT = {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM"}
MISTRAL3_TEXT_DEFAULTS = dict(head_dim=128, hidden_size=5120, intermediate_size=32768, max_position_embeddings=131072,
                              num_attention_heads=32, num_hidden_layers=40, num_key_value_heads=8, rms_norm_eps=1e-5,
                              rope_theta=1e9, sliding_window=None, vocab_size=131072)
MINISTRAL3_DEFAULTS = dict(vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                           rms_norm_eps=1e-5, eos_token_id=2)
MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=16384,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)


def _ministral3(cfg: dict) -> dict:
    """A Ministral 3 config with transformers' defaults (its RoPE's where it names none)."""
    out = {**MINISTRAL3_DEFAULTS, **cfg}
    if not (cfg.get("rope_parameters") or cfg.get("rope_scaling")):
        out["rope_parameters"] = dict(MINISTRAL3_ROPE)
    return out


def text_model(arch: str, cfg: dict, source: str) -> tuple[str, dict]:
    """(the architecture our module computes, its config with the family's defaults filled in):
    an image-text checkpoint's language model (Mistral 3's by its text config's model_type;
    Gemma 3's: ``gemma3_config``; the checkpoint's own EOS ids first), or the checkpoint's own."""
    if arch == "Mistral3ForConditionalGeneration":
        text = cfg.get("text_config") or {}
        kind = text.get("model_type", "mistral")
        if kind not in MISTRAL3_TEXT:
            raise ValueError(f"model: text_config.model_type {kind!r} in {source} is not supported "
                             f"(Mistral 3's language models: {sorted(MISTRAL3_TEXT)})")
        arch = MISTRAL3_TEXT[kind]
        return arch, _with_own_eos(_ministral3(text) if kind == "ministral3" else {**MISTRAL3_TEXT_DEFAULTS, **text},
                                   cfg)
    if arch == "Ministral3ForCausalLM":
        return arch, _ministral3(cfg)
    if arch in GEMMA3:
        return arch, gemma3_config(cfg, arch)
    if arch == "Glm4ForCausalLM":
        return arch, {**GLM4_DEFAULTS, **cfg}
    if arch in GPT_OSS:
        return arch, gpt_oss_config(cfg)
    if arch in LATENT:                          # the pool's one K/V head: the latent and the rotary key
        cfg = {**(DEEPSEEK_V3_DEFAULTS if arch in DEEPSEEK_V3 else DEEPSEEK_V2_DEFAULTS), **cfg}
        return arch, {**cfg, "head_dim": int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"]),
                      "num_key_value_heads": 1}
    if arch in QWEN3_5:
        defaults = {"Qwen3NextForCausalLM": QWEN3_NEXT_DEFAULTS}.get(
            arch, QWEN3_5_MOE_DEFAULTS if arch in QWEN3_5_MOE else QWEN3_5_DEFAULTS)
        if arch.endswith("ConditionalGeneration"):
            return arch, _with_own_eos({**defaults, **(cfg.get("text_config") or {})}, cfg)
        return arch, {**defaults, **cfg}
    return arch, cfg


def ministral3_fields(cfg: dict, source: str) -> dict:
    """Ministral 3's ModelArgs field: the queries scaled by position, 1 + beta ln(1 + floor(p /
    original)) at position p (``llama_4_scaling_beta`` and the YaRN's original context, in its
    RoPE parameters; 1 inside the original context)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta = float(rope.get("llama_4_scaling_beta") or 0.0)
    if not beta:
        return {}
    original = int(rope.get("original_max_position_embeddings") or 0)
    if original < 1:
        raise ValueError(f"model: llama_4_scaling_beta in {source} needs original_max_position_embeddings >= 1 in "
                         f"its rope_parameters, got {original}")
    return dict(query_scale=(beta, original))


def family_fields(arch: str, cfg: dict, source: str, layers: int) -> dict:
    """The ModelArgs fields ``arch``'s family sets beyond the common ones and RoPE's (which they
    may replace: Gemma's and OLMo 3's per kind of layer)."""
    if arch in GEMMA3:
        return gemma3_fields(cfg, source, layers)
    if arch == "Gemma2ForCausalLM":
        return gemma2_fields(cfg, source, layers)
    if arch in OLMO:
        return olmo_fields(arch, cfg, source, layers)
    if arch == "SmolLM3ForCausalLM":
        return smollm3_fields(cfg, source, layers)
    if arch == "Glm4ForCausalLM":               # norms after attention and the MLP too (hf_names.py)
        return dict(sandwich_norms=True)
    if arch == "Ministral3ForCausalLM":
        return ministral3_fields(cfg, source)
    if arch in QWEN3_5:
        return qwen3_5_fields(cfg, source, layers, grouped=arch == "Qwen3NextForCausalLM")
    if arch in LATENT:
        return latent_fields(cfg, source)
    if arch in GPT_OSS:                         # every other layer (the first among them) a sliding window
        window = int(cfg["sliding_window"] or 0)
        types = _layer_types(cfg, source, layers, 2)
        return dict(attn_sinks=True, layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types))
    return {}


# Qwen3.5's text config defaults (transformers' Qwen3_5TextConfig, Qwen3_5MoeTextConfig: no dense
# MLP) that change what it computes
QWEN3_5_DEFAULTS = dict(vocab_size=248_320, hidden_size=4096, intermediate_size=12_288, num_hidden_layers=32,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=256, max_position_embeddings=32_768,
                        rms_norm_eps=1e-6, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32)
QWEN3_5_MOE_DEFAULTS = {**QWEN3_5_DEFAULTS, "hidden_size": 2048, "intermediate_size": 0, "num_hidden_layers": 40,
                        "num_key_value_heads": 2, "moe_intermediate_size": 512,
                        "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256}
# Qwen3-Next's (transformers' Qwen3NextConfig)
QWEN3_NEXT_DEFAULTS = {**QWEN3_5_MOE_DEFAULTS, "vocab_size": 151_936, "intermediate_size": 5632,
                       "num_hidden_layers": 48, "num_experts_per_tok": 10, "num_experts": 512, "norm_topk_prob": True}


def qwen3_5_fields(cfg: dict, source: str, layers: int, grouped: bool = False) -> dict:
    """Qwen3.5's (and Qwen3.5-MoE's) ModelArgs fields: its Gated DeltaNet layers (``layer_types``' linear_attention,
    or three of every ``full_attention_interval``) and their shape (model/deltanet.py); the
    attention layers' output gate; norms scaling by 1 + weight (the DeltaNet's own gated norm
    excepted). Its multimodal RoPE turns text positions as plain RoPE does (every section
    reads the same position), on the first quarter of each head. ``grouped``: Qwen3-Next's
    checkpoints fuse the DeltaNet's projections per key head (hf_names.py)."""
    interval = int(cfg.get("full_attention_interval", 4))
    types = cfg.get("layer_types") or ["linear_attention" if (i + 1) % max(interval, 1) else "full_attention"
                                       for i in range(layers)]
    if len(types) != layers or not set(types) <= {"linear_attention", "full_attention"}:
        raise ValueError(f"model: layer_types in {source} must name linear_attention or full_attention for each "
                         f"of its {layers} layers")
    dims = tuple(int(cfg[k]) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim", "linear_conv_kernel_dim"))
    if cfg.get("attention_bias"):
        raise ValueError(f"model: attention_bias true in {source} is not supported for Qwen3.5 (its published "
                         f"models have none)")
    if not 2 <= dims[4] <= 17:
        raise ValueError(f"model: linear_conv_kernel_dim must be in [2, 17] in {source} (Qwen3.5's: 4), got {dims[4]}")
    if min(dims) < 1 or dims[1] % dims[0]:
        raise ValueError(f"model: linear_num_value_heads {dims[1]} in {source} must be a multiple of "
                         f"linear_num_key_heads {dims[0]} (each key head serves as many value heads)")
    return dict(linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"), linear_dims=dims,
                attn_output_gate=True, norm_plus_one=True, deltanet_grouped=grouped)


def latent_fields(cfg: dict, source: str) -> dict:
    """DeepSeek-V2's and V3's attention (model/mla.py): its latent ranks and head widths, RoPE on each
    head's ``qk_rope_head_dim`` rotary dimensions (interleaved pairs where ``rope_interleave``),
    scores scaled by the key width (nope + rope) ** -0.5, times YaRN's mscale(factor,
    mscale_all_dim) squared."""
    q_lora = int(cfg.get("q_lora_rank") or 0)
    dims = tuple(int(cfg[k]) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
    kv_lora, nope, rope, v = dims
    if cfg.get("attention_bias"):
        raise ValueError(f"model: attention_bias true in {source} is not supported for latent attention (DeepSeek's "
                         f"models have none)")
    if min(dims) < 1 or rope % 2:
        raise ValueError(f"model: kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim and v_head_dim in {source} must "
                         f"be positive and qk_rope_head_dim even, got {dims}")
    scale = (nope + rope) ** -0.5
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type", "default")) not in ("default", None) and params.get("mscale_all_dim"):
        m = 0.1 * float(params["mscale_all_dim"]) * math.log(float(params["factor"])) + 1.0 \
            if float(params["factor"]) > 1 else 1.0
        scale *= m * m
    return dict(mla=(q_lora, *dims), rotary_dim=rope, rope_interleaved=bool(cfg.get("rope_interleave", True)),
                attn_scale=scale)
