"""Model hyper-parameters read from a Hugging Face ``config.json`` (no transformers import)."""
from __future__ import annotations

from dataclasses import dataclass

# architecture name in config.json -> family flags
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=None, qk_norm=True),   # None: read attention_bias
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),   # its sliding window: see parse_config
    # Phi-3 / Phi-4: Llama's layer with QKV and gate/up fused in the checkpoint too (hf_names.py)
    "Phi3ForCausalLM": dict(qkv_bias=False, qk_norm=False),
    # mixtures of experts (moe.py): Qwen3-MoE (Qwen3-30B-A3B), Qwen2-MoE (a shared expert beside
    # the routed ones), Mixtral (every layer sparse, routing weights kept in float32)
    "Qwen3MoeForCausalLM": dict(qkv_bias=None, qk_norm=True),
    "Qwen2MoeForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "MixtralForCausalLM": dict(qkv_bias=False, qk_norm=False),
    # Gemma 3 (gemma.py): its text model alone, or inside the image-text model (whose vision
    # tower is not loaded)
    "Gemma3ForCausalLM": dict(qkv_bias=None, qk_norm=True),
    "Gemma3ForConditionalGeneration": dict(qkv_bias=None, qk_norm=True),
}
# every layer attends over a sliding window of ``sliding_window`` positions where the config sets one
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")


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
    # mixture of experts (moe.py); num_experts 0: a dense model
    num_experts: int = 0                    # routed experts of a sparse layer
    experts_per_token: int = 0              # top-k
    moe_intermediate_size: int = 0          # a routed expert's MLP width
    norm_topk_prob: bool = False            # the top-k routing weights renormalised to sum to 1
    sparse_layers: tuple[int, ...] = ()     # the layers whose MLP is the mixture (the others dense)
    shared_expert_size: int = 0             # Qwen2-MoE: a shared expert's width, gated by a sigmoid (0: none)
    router_float32: bool = False            # Mixtral: routing weights stay float32 in the weighted sum
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

    def window(self, layer: int) -> int:
        """Layer ``layer``'s sliding window (0: none)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V over all layers, in elements (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Weights of our module (fused projections, biases and norms included), in elements."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        norms = (4 if self.sandwich_norms else 2) * h
        attention = (h * (q + 2 * kv) + q * h + norms + (q + 2 * kv if self.qkv_bias else 0)
                     + (h if self.o_bias else 0) + (q + kv if self.qk_norm else 0))
        dense = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        sparse = (self.num_experts * (h + 3 * h * self.moe_intermediate_size)
                  + (3 * h * self.shared_expert_size + h if self.shared_expert_size else 0))
        mlps = (self.num_layers - len(self.sparse_layers)) * dense + len(self.sparse_layers) * sparse
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + h + self.num_layers * attention + mlps

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


def _moe_fields(arch: str, cfg: dict, layers: int, source: str) -> dict:
    """A mixture of experts' ModelArgs fields from its config (nothing for a dense model)."""
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        return {}
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
    k = int(cfg["num_experts_per_tok"])
    if sparse and not 1 <= k <= experts:
        raise ValueError(f"model: num_experts_per_tok must be in [1, {experts}] (the experts) in {source}, got {k}")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
    return dict(num_experts=experts if sparse else 0, experts_per_token=k if sparse else 0,
                moe_intermediate_size=width if sparse else 0, norm_topk_prob=normalise, sparse_layers=sparse,
                shared_expert_size=shared if sparse else 0, router_float32=mixtral)


def _rope(cfg: dict, source: str, rope: dict | None = None) -> tuple[float, tuple | None, float]:
    """(rope_theta, Llama 3.1's scaling or None, linear scaling factor) of a config (``rope``: its
    RoPE parameters where they are not the config's own); other rope types and RoPE on part of a
    head are refused naming them."""
    if rope is None:
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None, "llama3", "linear"):
        raise ValueError(f"model: rope type {rope_type!r} in {source} is not supported (only 'default', "
                         f"'linear' and 'llama3')")
    llama3 = None
    if rope_type == "llama3":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                  int(rope["original_max_position_embeddings"]))
    linear = float(rope["factor"]) if rope_type == "linear" else 1.0
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"model: partial_rotary_factor {partial} in {source} is not supported (RoPE on every "
                         f"dimension of a head only)")
    return float(theta), llama3, linear


# Gemma 3's text config defaults (transformers' Gemma3TextConfig): the published image-text
# checkpoints' text_config leaves most of them out
GEMMA3_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                       hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131_072, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096, eos_token_id=1)


def _gemma3_config(cfg: dict, arch: str) -> dict:
    """A Gemma 3 config's text model fields, its defaults filled in (the image-text model's from
    its ``text_config``, its own EOS ids first)."""
    text = (cfg.get("text_config") or {}) if arch == "Gemma3ForConditionalGeneration" else cfg
    out = {**GEMMA3_DEFAULTS, **text}
    if text is not cfg and cfg.get("eos_token_id") is not None:
        out["eos_token_id"] = cfg["eos_token_id"]
    return out


def _gemma3_fields(cfg: dict, source: str, layers: int) -> dict:
    """Gemma 3's ModelArgs fields: every pattern-th layer full attention, the others a sliding
    window with a RoPE of their own base; its norms, embeddings, activation and scores' scale."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise ValueError(f"model: {key} {cfg[key]!r} in {source} is not supported")
    pattern = int(cfg.get("sliding_window_pattern", 6))
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(layers)]
    if len(types) != layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"model: layer_types in {source} must name sliding_attention or full_attention for each "
                         f"of its {layers} layers")
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:                      # transformers 5: RoPE parameters per kind of layer
        full, local = params["full_attention"] or {}, params.get("sliding_attention") or {}
    else:                                               # the published configs
        full = {**(cfg.get("rope_scaling") or {}), "rope_theta": cfg.get("rope_theta", 1e6)}
        local = {"rope_theta": cfg.get("rope_local_base_freq", 1e4)}
    theta, llama3, linear = _rope(cfg, source, {"rope_theta": 1e6, **full})
    local_theta, local_llama3, local_linear = _rope(cfg, source, {"rope_theta": 1e4, **local})
    if local_llama3 or local_linear != 1.0:
        raise ValueError(f"model: a scaled RoPE of the sliding-window layers in {source} is not supported")
    window = int(cfg["sliding_window"])
    return dict(rope_theta=theta, rope_llama3=llama3, rope_linear=linear, local_rope_theta=local_theta,
                layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                norm_plus_one=True, sandwich_norms=True, scale_embeddings=True,
                attn_scale=float(cfg["query_pre_attn_scalar"]) ** -0.5)


def parse_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """Validate and convert a Hugging Face config dict. Raises ValueError naming the field."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"model: unsupported architecture {archs!r} in {source}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    flags = SUPPORTED_ARCHITECTURES[arch]
    if arch in GEMMA3:
        cfg = _gemma3_config(cfg, arch)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        layers = int(cfg["num_hidden_layers"])
        theta, llama3, linear = _rope(cfg, source)
        if cfg.get("use_sliding_window"):
            raise ValueError(f"model: use_sliding_window=true in {source} is not supported")
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window") if arch in SLIDING_WINDOW_ARCHITECTURES else None
        windows = (int(window),) * layers if window is not None and 0 < int(window) < max_pos else ()
        act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
        if act not in ("silu", "gelu_pytorch_tanh") or (act != "silu") != (arch in GEMMA3):
            raise ValueError(f"model: hidden_act {act!r} in {source} is not supported (silu; Gemma's "
                             f"gelu_pytorch_tanh)")
        qkv_bias = flags["qkv_bias"]
        if qkv_bias is None:
            qkv_bias = bool(cfg.get("attention_bias", False))
        fields = dict(rope_theta=theta, rope_llama3=llama3, rope_linear=linear, layer_windows=windows, hidden_act=act)
        if arch in GEMMA3:
            fields.update(_gemma3_fields(cfg, source, layers))
        return ModelArgs(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(qkv_bias),
            o_bias=bool(cfg.get("attention_bias", False)) and arch == "LlamaForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=flags["qk_norm"],
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            **fields,
            **_moe_fields(arch, cfg, layers, source),
        )
    except KeyError as e:
        raise ValueError(f"model: {source} is missing the field {e.args[0]!r}") from None
