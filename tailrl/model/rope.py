"""Rotary position embedding (the "rotate half" layout used by Qwen2/Qwen3/Llama/Mistral/Gemma)."""
from __future__ import annotations

import math

import torch


def _yarn(inv_freq: torch.Tensor, head_dim: int, theta: float, yarn: tuple) -> torch.Tensor:
    """YaRN's frequencies (transformers' rule): the dimensions that turn fewer than beta_slow
    times over the original context interpolated (divided by the factor), those that turn more
    than beta_fast times kept, a linear ramp between."""
    factor, original, beta_fast, beta_slow, _, truncate = yarn

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    kept = 1 - ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * (1 - kept) + inv_freq * kept


def inv_frequencies(head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None,
                    linear: float = 1.0, yarn: tuple | None = None) -> torch.Tensor:
    """The rotary frequencies [head_dim / 2] (float64). ``linear``: every frequency divided by it
    (linear scaling: positions divided by ``linear``). ``llama3``: Llama 3.1's long-context
    scaling (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings):
    wavelengths longer than original / low_freq_factor are stretched by ``factor``, those
    shorter than original / high_freq_factor kept, and those between blended linearly in
    original / wavelength between the two factors. ``yarn``: YaRN's (``_yarn``; ModelArgs.rope_yarn)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)) / linear
    if yarn is not None:
        return _yarn(inv_freq, head_dim, theta, yarn)
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelength = 2 * math.pi / inv_freq
    blend = ((original / wavelength - low) / (high - low)).clamp(0.0, 1.0)   # 0: long waves, 1: short
    return inv_freq / factor * (1 - blend) + inv_freq * blend


def rope_table(head_dim: int, max_len: int, theta: float, dtype: torch.dtype,
               device: str | torch.device = "cpu", llama3: tuple[float, float, float, int] | None = None,
               linear: float = 1.0, yarn: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_len, head_dim] (the half-dim frequencies repeated twice;
    with YaRN, both times its attention factor)."""
    inv_freq = inv_frequencies(head_dim, theta, llama3, linear, yarn)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)                                 # [T, D]
    scale = yarn[4] if yarn is not None else 1.0
    return ((angles.cos() * scale).to(dtype=dtype, device=device),
            (angles.sin() * scale).to(dtype=dtype, device=device))

