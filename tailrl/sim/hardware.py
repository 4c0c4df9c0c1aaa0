"""Named accelerators and model shapes: the inputs of the roofline step-time model.

Figures are vendor datasheet peaks (dense bf16 tensor FLOP/s, HBM bandwidth, memory) and
public model configs. The roofline model (``step_model.RooflineStepModel``) derates them
with an achieved-fraction factor each; calibrate against measured step times when you have
them (``step_model.CalibratedStepModel``).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accelerator:
    name: str
    flops: float        # peak dense bf16 FLOP/s
    mem_bw: float       # HBM bytes/s
    mem_bytes: float    # HBM capacity, bytes


@dataclass(frozen=True)
class ModelShape:
    name: str
    params_total: float      # all weights (MoE: every expert)
    params_active: float     # weights a token passes through (MoE: routed experts only)
    n_layers: int
    d_model: int
    kv_bytes_per_token: int  # KV cache bytes per token, all layers
    weight_bytes_per_param: float = 2.0  # bf16; 1.0 for fp8 serving

    @property
    def weight_bytes(self) -> float:
        return self.params_total * self.weight_bytes_per_param


def _gqa_kv_bytes(n_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    return 2 * n_layers * kv_heads * head_dim * dtype_bytes        # K and V


def _mla_kv_bytes(n_layers: int, latent: int = 512, rope: int = 64, dtype_bytes: int = 2) -> int:
    return n_layers * (latent + rope) * dtype_bytes                  # one compressed latent


ACCELERATORS: dict[str, Accelerator] = {
    "h800": Accelerator("h800", 989e12, 3.35e12, 80e9),
    "h100": Accelerator("h100", 989e12, 3.35e12, 80e9),
    "h20": Accelerator("h20", 148e12, 4.0e12, 96e9),
    "a100": Accelerator("a100", 312e12, 2.0e12, 80e9),
    "l40s": Accelerator("l40s", 362e12, 0.864e12, 48e9),
}

MODELS: dict[str, ModelShape] = {
    # Qwen2-72B (the LLM of Qwen2-VL-72B): 80 layers, d 8192, GQA 8 KV heads x 128
    "qwen2-72b": ModelShape("qwen2-72b", 72.7e9, 72.7e9, 80, 8192, _gqa_kv_bytes(80, 8, 128)),
    # Qwen2-7B: 28 layers, d 3584, 4 KV heads x 128
    "qwen2-7b": ModelShape("qwen2-7b", 7.6e9, 7.6e9, 28, 3584, _gqa_kv_bytes(28, 4, 128)),
    # Moonlight-16B-A3B (DeepSeek-V3 style MoE with MLA): 27 layers, d 2048
    "moonlight-16b-a3b": ModelShape("moonlight-16b-a3b", 16e9, 3e9, 27, 2048, _mla_kv_bytes(27)),
    # Kimi-K2 (1T total, 32B active, MLA), served in fp8
    "kimi-k2": ModelShape("kimi-k2", 1.04e12, 32e9, 61, 7168, _mla_kv_bytes(61), 1.0),
}


def get_accelerator(name: str) -> Accelerator:
    if name not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {sorted(ACCELERATORS)}, got {name!r}")
    return ACCELERATORS[name]


def get_model(name: str) -> ModelShape:
    if name not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}, got {name!r}")
    return MODELS[name]
