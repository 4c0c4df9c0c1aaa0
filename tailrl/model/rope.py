"""Rotary position embedding in the "rotate half" layout our kernels apply (Qwen2/Qwen3/Llama/Mistral/
Gemma's): dimension d of a head turns with its partner d + D/2 at the frequency of d mod D/2.

RoPE on part of a head (``partial_rotary_factor``: Phi-3's form, on its first R dimensions) and
RoPE of interleaved pairs (GLM-4's: dimensions 2i and 2i + 1 turn together) are the same
rotation of other pairs of dimensions. A head's dimensions are reordered once, in the query
and key projections' rows as they load (``head_order``), so that every turning pair sits at
(d, d + D/2); the dimensions that do not turn take the remaining places, with cos 1 and sin 0
(``rope_table``): x * 1 + partner * 0 is x exactly. Attention's scores, sums over a head's
dimensions, do not depend on their order (up to rounding); values are not reordered."""
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
               linear: float = 1.0, yarn: tuple | None = None,
               rotary_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each [max_len, head_dim] (the half-dim frequencies repeated twice;
    with YaRN, both times its attention factor). ``rotary_dim`` R (0: the head's): the R / 2
    frequencies of R dimensions at d and d + D/2 for d < R / 2, cos 1 and sin 0 elsewhere."""
    r = rotary_dim or head_dim
    inv_freq = inv_frequencies(r, theta, llama3, linear, yarn)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)  # [T, R/2]
    scale = yarn[4] if yarn is not None else 1.0
    cos, sin = angles.cos() * scale, angles.sin() * scale
    rest = head_dim // 2 - r // 2                                                # dimensions that do not turn
    cos = torch.cat([cos, torch.ones(max_len, rest, dtype=torch.float64)], dim=-1)
    sin = torch.cat([sin, torch.zeros(max_len, rest, dtype=torch.float64)], dim=-1)
    return (torch.cat([cos, cos], dim=-1).to(dtype=dtype, device=device),      # [T, D]
            torch.cat([sin, sin], dim=-1).to(dtype=dtype, device=device))


def head_order(head_dim: int, rotary_dim: int = 0, interleaved: bool = False) -> torch.Tensor | None:
    """Which of a checkpoint's head dimensions each of ours is ([head_dim], int64; None where they
    are the same): the R turning ones (R = ``rotary_dim``, 0: all) as our pairs (d, d + D/2) for
    d < R / 2, from the checkpoint's pairs (d, d + R/2) or (``interleaved``) (2d, 2d + 1); the
    others, in order, in the places left."""
    d, r = head_dim, rotary_dim or head_dim
    if r == d and not interleaved:
        return None
    half, rest = r // 2, (d - r) // 2
    first = torch.arange(half) * 2 if interleaved else torch.arange(half)       # each pair's first, second
    second = first + 1 if interleaved else first + half
    passed = torch.arange(r, d)
    return torch.cat([first, passed[:rest], second, passed[rest:]])

