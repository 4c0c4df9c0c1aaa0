"""Model hyper-parameters read from a Hugging Face ``config.json`` (no transformers import)."""
from __future__ import annotations

from dataclasses import dataclass

from tailrl.model.families import (
    GEMMA,
    GPT_OSS,
    OLMO,
    family_fields,
    moe_fields,
    rope_fields,
    text_model,
)

# architecture name in config.json -> family flags
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=None, qk_norm=True),   # None: read attention_bias
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),   # its sliding window: see parse_config
    # Ministral 3: Mistral's layer, YaRN, queries scaled by position past the original context
    # (families.py); it and Mistral inside Mistral 3's image-text checkpoints (Mistral Small 3.1/3.2,
    # Magistral Small): the language model alone, the vision tower not loaded (families.text_model)
    "Ministral3ForCausalLM": dict(qkv_bias=False, qk_norm=False),
    "Mistral3ForConditionalGeneration": dict(qkv_bias=False, qk_norm=False),
    # Phi-3 / Phi-4: Llama's layer with QKV and gate/up fused in the checkpoint too (hf_names.py)
    "Phi3ForCausalLM": dict(qkv_bias=False, qk_norm=False),
    # mixtures of experts (moe.py): Qwen3-MoE (Qwen3-30B-A3B), Qwen2-MoE (a shared expert beside
    # the routed ones), Mixtral (every layer sparse, routing weights kept in float32)
    "Qwen3MoeForCausalLM": dict(qkv_bias=None, qk_norm=True),
    "Qwen2MoeForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "MixtralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    # Gemma 2 (soft-capped scores and logits) and Gemma 3: its text model alone, or inside the
    # image-text model (whose vision tower is not loaded); families.py
    "Gemma2ForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "Gemma3ForCausalLM": dict(qkv_bias=None, qk_norm=True),
    "Gemma3ForConditionalGeneration": dict(qkv_bias=None, qk_norm=True),
    # OLMo 2 and 3 (AllenAI's): norms after attention and the MLP, q/k norms over all heads
    # (families.py); OLMo 3's sliding windows
    "Olmo2ForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "Olmo3ForCausalLM": dict(qkv_bias=None, qk_norm=False),
    # SmolLM3: Llama's layer, RoPE left out of every fourth (NoPE; families.py)
    "SmolLM3ForCausalLM": dict(qkv_bias=None, qk_norm=False),
    # GLM-4 (GLM-4-0414, GLM-Z1): RoPE on half of each head, on interleaved pairs (rope.py); norms
    # after attention and the MLP too, gate/up fused in the checkpoint (hf_names.py)
    "Glm4ForCausalLM": dict(qkv_bias=None, qk_norm=False),
    # GLM-4.5 / GLM-4.6: Llama's layer (RoPE on half of each head, rotate-half within it), q/k norms
    # where use_qk_norm; DeepSeek-V3's mixture of experts after the first dense layers (moe.py)
    "Glm4MoeForCausalLM": dict(qkv_bias=None, qk_norm=None),        # None: read use_qk_norm
    # Qwen3.5: three layers of four Gated DeltaNet (a recurrent state per request: deltanet.py), the
    # fourth attention with an output gate, q/k norms and RoPE on a quarter of each head; its text
    # model alone or inside the image-text model (the vision tower not loaded). No tree drafts.
    "Qwen3_5ForCausalLM": dict(qkv_bias=None, qk_norm=True),
    "Qwen3_5ForConditionalGeneration": dict(qkv_bias=None, qk_norm=True),
    # Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B): the same, Qwen2-MoE's mixture in every layer
    "Qwen3_5MoeForCausalLM": dict(qkv_bias=None, qk_norm=True),
    "Qwen3_5MoeForConditionalGeneration": dict(qkv_bias=None, qk_norm=True),
    # Qwen3-Next (80B-A3B): Qwen3.5-MoE's layers, its DeltaNet projections fused per key head in the
    # checkpoint, Qwen2-MoE's mixture where decoder_sparse_step and mlp_only_layers put it
    "Qwen3NextForCausalLM": dict(qkv_bias=None, qk_norm=True),
    # gpt-oss (OpenAI's 20B and 120B): attention sinks, every other layer a sliding window, YaRN;
    # a mixture of experts in every layer with biases, a softmax over the top-k logits and a
    # clamped SwiGLU (families.py); MXFP4 checkpoints dequantized at load (quantized.py)
    "GptOssForCausalLM": dict(qkv_bias=None, qk_norm=False),
    # DeepSeek-V3 / R1, Kimi K2, Moonlight: multi-head latent attention (mla.py) and GLM-4.5's
    # mixture (DeepSeek-V3's routing, moe.py) after the first dense layers
    "DeepseekV3ForCausalLM": dict(qkv_bias=False, qk_norm=False),
    # DeepSeek-V2 (-Lite): the same latent attention; its own routing (moe.route_softmax_groups)
    "DeepseekV2ForCausalLM": dict(qkv_bias=False, qk_norm=False),
}
# attention_bias gives the output projection a bias too
O_BIAS = ("LlamaForCausalLM", "SmolLM3ForCausalLM", *OLMO, *GPT_OSS)
# every layer attends over a sliding window of ``sliding_window`` positions where the config sets one
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Ministral3ForCausalLM")


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    # Llama 3.1 rope scaling: (factor, low_freq_factor, high_freq_factor, original context); None: plain
    rope_llama3: tuple[float, float, float, int] | None = None
    # YaRN: (factor, original context, beta_fast, beta_slow, cos/sin factor, truncate); None: none
    rope_yarn: tuple[float, int, float, float, float, bool] | None = None
    # mixture of experts (moe.py); num_experts 0: a dense model
    num_experts: int = 0                    # routed experts of a sparse layer
    experts_per_token: int = 0              # top-k
    moe_intermediate_size: int = 0          # a routed expert's MLP width
    norm_topk_prob: bool = False            # the top-k routing weights renormalised to sum to 1
    sparse_layers: tuple[int, ...] = ()     # the layers whose MLP is the mixture (the others dense)
    shared_expert_size: int = 0             # Qwen2-MoE, GLM-4.5: a shared expert's width (0: none)
    shared_expert_gate: bool = False        # Qwen2-MoE: the shared expert's output gated by a sigmoid
    router_float32: bool = False            # Mixtral, GLM-4.5: routing weights stay float32 in the weighted sum
    # GLM-4.5 (DeepSeek-V3's routing, moe.py): a float32 router's sigmoid scores, a correction bias
    # for the choice among the best groups_per_token of expert_groups groups, weights times routed_scaling
    router_sigmoid: bool = False
    # DeepSeek-V2: a float32 router's softmax, the top k within the best groups_per_token of
    # expert_groups groups (a group worth its best score), weights times routed_scaling
    router_softmax_groups: bool = False
    expert_groups: int = 1
    groups_per_token: int = 1
    routed_scaling: float = 1.0
    mtp_layers: int = 0                     # GLM-4.5: multi-token-prediction layers after the model's (not loaded)
    # sliding windows: layer i's tokens see the keys less than layer_windows[i] positions behind
    # them (0: every key); (): no layer has one
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float = 0.0           # Gemma 3: the RoPE base of its sliding-window layers (0: rope_theta)
    rope_linear: float = 1.0                # linear RoPE scaling (positions divided by it) of the other layers
    hidden_act: str = "silu"                # the MLP's gate activation: "silu" or "gelu_pytorch_tanh" (Gemma)
    norm_plus_one: bool = False             # Gemma: every RMS norm scales by 1 + its weight (loaded as such)
    sandwich_norms: bool = False            # Gemma: attention's and MLP's outputs normed before the residual add
    scale_embeddings: bool = False          # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float = 0.0                 # the attention scores' factor (0: head_dim ** -0.5)
    pre_norms: bool = True                  # the norms before attention and the MLP (OLMo 2/3: none)
    qk_norm_whole: bool = False             # OLMo: q and k each normed over all heads at once
    attn_softcap: float = 0.0               # Gemma 2: scores s become attn_softcap * tanh(s / attn_softcap) (0: none)
    logit_softcap: float = 0.0              # Gemma 2: logits capped the same way before sampling (0: none)
    nope_layers: tuple[int, ...] = ()       # SmolLM3: the layers without RoPE (q and k attend as projected)
    rotary_dim: int = 0                     # RoPE on the first rotary_dim dimensions of a head (0: all; rope.py)
    rope_interleaved: bool = False          # GLM-4: RoPE turns dimensions 2i and 2i + 1 together (rope.py)
    # Ministral 3: (beta, original context): queries times 1 + beta ln(1 + floor(p / original)) at position p
    query_scale: tuple[float, int] | None = None
    # Qwen3.5: the Gated DeltaNet layers (model/deltanet.py) in place of attention, and their shape:
    # (key heads, value heads, key head dim, value head dim, causal conv width)
    linear_layers: tuple[int, ...] = ()
    linear_dims: tuple[int, int, int, int, int] = (0, 0, 0, 0, 0)
    attn_output_gate: bool = False          # Qwen3.5: attention's output times the sigmoid of a gate (q's twin)
    deltanet_grouped: bool = False          # Qwen3-Next: in_proj_qkvz / in_proj_ba, rows grouped per key head
    # gpt-oss: a learned logit per query head in each attention softmax (a sink weighing no value);
    # its experts: routing weights the softmax of the top-k logits, biases on the router and both
    # expert products, and the clamped SwiGLU (alpha, limit) in place of SiLU's
    attn_sinks: bool = False
    router_topk_softmax: bool = False
    expert_bias: bool = False
    swiglu: tuple[float, float] | None = None
    # DeepSeek-V2/V3's multi-head latent attention (mla.py): (q_lora_rank, 0: one query projection;
    # kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim); head_dim is then the pool's one
    # K/V head, kv_lora_rank + qk_rope_head_dim
    mla: tuple[int, int, int, int, int] | None = None

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: none)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend, and so keep K/V (Qwen3.5's DeltaNet layers keep a state instead)."""
        linear = set(self.linear_layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V over all attention layers, in elements (multiply by the dtype size)."""
        return 2 * len(self.attention_layers) * self.num_kv_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """A DeltaNet layer's q, k and v channels (what its causal conv reads)."""
        kh, vh, kd, vd, _ = self.linear_dims
        return 2 * kh * kd + vh * vd

    @property
    def num_parameters(self) -> int:
        """Weights of our module (fused projections, biases and norms included), in elements."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        norms = ((2 if self.pre_norms else 0) + (2 if self.sandwich_norms else 0)) * h
        attention = (h * (q + 2 * kv) + q * h + norms + (q + 2 * kv if self.qkv_bias else 0)
                     + (h if self.o_bias else 0) + (q + kv if self.qk_norm or self.qk_norm_whole else 0)
                     + (self.num_heads if self.attn_sinks else 0)) if self.mla is None else \
            self._latent_attention + norms
        dense = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        biases = 1 + 2 * self.moe_intermediate_size + h if self.expert_bias else 0
        sparse = (self.num_experts * (h + 3 * h * self.moe_intermediate_size + (1 if self.router_sigmoid else 0)
                                      + biases)
                  + 3 * h * self.shared_expert_size + (h if self.shared_expert_gate else 0))
        mlps = (self.num_layers - len(self.sparse_layers)) * dense + len(self.sparse_layers) * sparse
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        gate = q * h if self.attn_output_gate else 0
        kh, vh, kd, vd, width = self.linear_dims
        c = self.conv_channels
        linear = h * (c + vh * vd + 2 * vh) + c * width + 2 * vh + vd + vh * vd * h + norms
        attending = len(self.attention_layers)
        return (self.vocab_size * h + head + h + attending * (attention + gate) + len(self.linear_layers) * linear
                + mlps)

    @property
    def _latent_attention(self) -> int:
        """A multi-head latent attention layer's weights (mla.py)."""
        h, heads = self.hidden_size, self.num_heads
        q_lora, kv_lora, nope, rope, v = self.mla
        q = h * q_lora + q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        return q + h * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v) + heads * v * h

    @property
    def widest_mlp(self) -> int:
        """The most elements a layer's MLP computes per token at once: a dense layer's or the
        shared expert's [gate | up] row, or a token's routed experts' rows (their [gate | up]
        rows, then their outputs before the weighted sum)."""
        dense = self.intermediate_size if len(self.sparse_layers) < self.num_layers else 0
        routed = self.experts_per_token * max(2 * self.moe_intermediate_size, self.hidden_size)
        return max(2 * dense, 2 * self.shared_expert_size, routed)


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _check_quantization(quant: dict, arch: str, source: str) -> None:
    """What a quantized checkpoint may be (model/quantized.py dequantizes it as it is read):
    gpt-oss's MXFP4 experts, or FP8 (E4M3) weights with a factor per block of
    ``weight_block_size`` (DeepSeek-V3's, Kimi K2's, Qwen's -FP8); anything else a ValueError."""
    method = quant.get("quant_method")
    if not method or method == "mxfp4" and arch in GPT_OSS:
        return
    block = quant.get("weight_block_size")
    if method == "fp8" and quant.get("fmt", "e4m3") == "e4m3" and isinstance(block, (list, tuple)) and \
            len(block) == 2 and min(int(b) for b in block) >= 1:
        return
    raise ValueError(f"model: quantization_config {quant!r} in {source} is not supported (weights are dequantized "
                     f"as they are read from gpt-oss's MXFP4 and from FP8 E4M3 with a weight_block_size)")


def parse_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """Validate and convert a Hugging Face config dict. Raises ValueError naming the field."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"model: unsupported architecture {archs!r} in {source}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    flags = SUPPORTED_ARCHITECTURES[arch]
    _check_quantization(cfg.get("quantization_config") or {}, arch, source)
    arch, cfg = text_model(arch, cfg, source)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        if cfg.get("use_sliding_window"):
            raise ValueError(f"model: use_sliding_window=true in {source} is not supported")
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window") if arch in SLIDING_WINDOW_ARCHITECTURES else None
        windows = (int(window),) * layers if window is not None and 0 < int(window) < max_pos else ()
        default_act = "gelu_pytorch_tanh" if arch in GEMMA else "silu"
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or default_act
        if act not in ("silu", "gelu_pytorch_tanh") or (act != "silu") != (arch in GEMMA):
            raise ValueError(f"model: hidden_act {act!r} in {source} is not supported (silu; Gemma's "
                             f"gelu_pytorch_tanh)")
        qkv_bias = flags["qkv_bias"]
        if qkv_bias is None:
            qkv_bias = bool(cfg.get("attention_bias", False))
        fields = {**rope_fields(cfg, source, arch=arch, head_dim=head_dim), "layer_windows": windows,
                  "hidden_act": act, **family_fields(arch, cfg, source, layers)}   # the family's last: they replace
        return ModelArgs(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(qkv_bias),
            o_bias=bool(cfg.get("attention_bias", False)) and arch in O_BIAS,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=flags["qk_norm"] if flags["qk_norm"] is not None else bool(cfg.get("use_qk_norm", False)),
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            **fields,
            **moe_fields(arch, cfg, layers, source),
        )
    except KeyError as e:
        raise ValueError(f"model: {source} is missing the field {e.args[0]!r}") from None
