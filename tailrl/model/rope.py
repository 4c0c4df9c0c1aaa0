"""Rotary position embedding (the "rotate half" layout used by Qwen2/Qwen3/Llama)."""
from __future__ import annotations

import torch


def rope_table(head_dim: int, max_len: int, theta: float, dtype: torch.dtype,
               device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_len, head_dim] (the half-dim frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [T, D/2]
    angles = torch.cat([angles, angles], dim=-1)                                 # [T, D]
    return angles.cos().to(dtype=dtype, device=device), angles.sin().to(dtype=dtype, device=device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, D]; cos/sin: [N, 1, D] (already gathered at each token's position)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
