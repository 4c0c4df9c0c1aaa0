"""Rotary position embedding (the "rotate half" layout used by Qwen2/Qwen3/Llama/Mistral/Gemma)."""
from __future__ import annotations

import math

import torch


def inv_frequencies(head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None,
                    linear: float = 1.0) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2] (float64). ``linear``: every frequency divided by it
    (linear scaling: positions divided by ``linear``). ``llama3``: Llama 3.1's long-context
    scaling (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    wavelengths longer than original / low_freq_factor are stretched by ``factor``, those
    shorter than original / high_freq_factor kept, and those between blended linearly in
    original / wavelength between the two factors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)) / linear
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)   # 0: long waves, 1: short
    return inv_freq / factor * (1 - blend) + inv_freq * blend


def rope_table(head_dim: int, max_len: int, theta: float, dtype: torch.dtype,
               device: str | torch.device = "cpu", llama3: tuple[float, float, float, int] | None = None,
               linear: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_len, head_dim] (the half-dim frequencies repeated twice)."""
    inv_freq = inv_frequencies(head_dim, theta, llama3, linear)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)                                 # [T, D]
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)

