"""Model hyper-parameters read from a Hugging Face ``config.json`` (no transformers import)."""
from __future__ import annotations

from dataclasses import dataclass

# architecture name in config.json -> family flags
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": dict(qkv_bias=True, qk_norm=False),
    "Qwen3ForCausalLM": dict(qkv_bias=None, qk_norm=True),   # None: read attention_bias
    "LlamaForCausalLM": dict(qkv_bias=None, qk_norm=False),
    "MistralForCausalLM": dict(qkv_bias=False, qk_norm=False),   # its sliding window: see parse_config
}


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

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V over all layers, in elements (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Weights of our module (fused projections, biases and norms included), in elements."""
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_heads * d, self.num_kv_heads * d
        layer = (h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size + 2 * h
                 + (q + 2 * kv if self.qkv_bias else 0) + (h if self.o_bias else 0)
                 + (2 * self.intermediate_size + h if self.mlp_bias else 0) + (q + kv if self.qk_norm else 0))
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + head + h + self.num_layers * layer


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


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
        if cfg.get("use_sliding_window"):
            raise ValueError(f"model: use_sliding_window=true in {source} is not supported")
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
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
            rope_theta=float(theta),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(qkv_bias),
            o_bias=bool(cfg.get("attention_bias", False)) and arch == "LlamaForCausalLM",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=flags["qk_norm"],
            eos_token_ids=_eos_ids(cfg.get("eos_token_id")),
            rope_llama3=llama3,
        )
    except KeyError as e:
        raise ValueError(f"model: {source} is missing the field {e.args[0]!r}") from None
