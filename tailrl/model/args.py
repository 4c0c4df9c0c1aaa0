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
}
SLIDING_WINDOW_ARCHITECTURES = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")


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

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V over all layers, in elements (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Weights of our module (fused projections, biases and norms included), in elements."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        attention = (h * (q + 2 * kv) + q * h + 2 * h + (q + 2 * kv if self.qkv_bias else 0)
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


def _rope(cfg: dict, source: str) -> tuple[float, tuple | None]:
    """(rope_theta, Llama 3.1's scaling or None) of a config; other rope types and RoPE on part of a
    head are refused naming them."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None, "llama3"):
        raise ValueError(f"model: rope type {rope_type!r} in {source} is not supported (only 'default' "
                         f"and 'llama3')")
    llama3 = None
    if rope_type == "llama3":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                  int(rope["original_max_position_embeddings"]))
    theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"model: partial_rotary_factor {partial} in {source} is not supported (RoPE on every "
                         f"dimension of a head only)")
    return float(theta), llama3


def parse_config(cfg: dict, source: str = "config.json") -> ModelArgs:
    """Validate and convert a Hugging Face config dict. Raises ValueError naming the field."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"model: unsupported architecture {archs!r} in {source}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    flags = SUPPORTED_ARCHITECTURES[arch]
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, llama3 = _rope(cfg, source)
        if cfg.get("use_sliding_window"):
            raise ValueError(f"model: use_sliding_window=true in {source} is not supported")
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window") if arch in SLIDING_WINDOW_ARCHITECTURES else None
        if window is not None and 0 < int(window) < max_pos:
            # Mistral attends over its last ``sliding_window`` positions; within that many
            # positions that is full causal attention, so the context is capped there (exact)
            max_pos = int(window)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"model: hidden_act {cfg.get('hidden_act')!r} in {source} is not supported (only silu)")
        qkv_bias = flags["qkv_bias"]
        if qkv_bias is None:
            qkv_bias = bool(cfg.get("attention_bias", False))
        return ModelArgs(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(qkv_bias),
            o_bias=bool(cfg.get("attention_bias", False)) and arch == "LlamaForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=flags["qk_norm"],
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            rope_llama3=llama3,
            **_moe_fields(arch, cfg, int(cfg["num_hidden_layers"]), source),
        )
    except KeyError as e:
        raise ValueError(f"model: {source} is missing the field {e.args[0]!r}") from None
