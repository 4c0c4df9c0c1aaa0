"""Quantized checkpoints' weights dequantized as they are read, into the tensors a bfloat16
checkpoint holds: gpt-oss's MXFP4 experts (OpenAI's published checkpoints) and block-scaled FP8
weights (DeepSeek-V3 / R1's and Kimi K2's published checkpoints, Qwen's -FP8 ones). The engine
computes in its own dtype on the dequantized weights: Hugging Face's ``dequantize=True`` model.

MXFP4: ``<name>_blocks`` [E, rows, G, 16] uint8 (32 four-bit codes per block, two a byte, the low
nibble first) and ``<name>_scales`` [E, rows, G] uint8 (a block's power of two, biased by 127). A
code is an FP4 (E2M1) value; times its block's power of two it is exact in bfloat16, float32 and
float64, so the weights are the checkpoint's bits whatever the dtype. The rows are the module's
columns: the dequantized [E, rows, G * 32] transposed is the tensor a bfloat16 checkpoint names
``<name>`` (hf_names._gpt_oss_experts reads it from there).

FP8: ``<name>`` in float8 (E4M3) [rows, cols] and ``<name>_scale_inv`` float32 [ceil(rows / b0),
ceil(cols / b1)], one factor per block of the config's ``weight_block_size`` (b0, b1): the weight
in float32 times its block's factor, rounded to the dtype (transformers' own order, so its bits).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

BLOCKS, SCALES, SCALE_INV = "_blocks", "_scales", "_scale_inv"
# E2M1's sixteen codes: sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8 = (torch.float8_e4m3fn,)


def base_name(name: str) -> str | None:
    """The tensor an MXFP4 part or an FP8 weight's scales of this name make (None: not such a
    part; an FP8 weight itself is known by its dtype)."""
    for suffix in (BLOCKS, SCALES):
        if name.endswith(suffix) and ".experts." in name:
            return name[:-len(suffix)]
    return name[:-len(SCALE_INV)] if name.endswith(SCALE_INV) else None


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     device: str | torch.device = "cpu") -> torch.Tensor:
    """blocks [E, rows, G, 16] and scales [E, rows, G] -> [E, G * 32, rows] in ``dtype`` (the
    module's layout: transposed) on ``device``, one expert at a time: each byte's two values
    looked up in ``dtype``, times its block's power of two (exact while the products stay normal
    numbers: a block's power of two at least 2^-125). On a GPU the quarter-size codes cross
    from the host, not the weights."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or \
            tuple(blocks.shape[:3]) != tuple(scales.shape) or blocks.shape[3] != 16:
        raise ValueError(f"weights: MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype} do not fit ([E, rows, G, 16] and [E, rows, G] uint8)")
    e, rows, g, _ = blocks.shape
    lut = torch.tensor(FP4, dtype=torch.float64)
    byte = torch.arange(256)
    pairs = torch.stack([lut[byte & 0x0F], lut[byte >> 4]], dim=-1).to(dtype=dtype, device=device)  # [256, 2]
    out = torch.empty(e, g * 32, rows, dtype=dtype, device=device)
    for x in range(e):
        codes = F.embedding(blocks[x].to(device).int(), pairs).view(rows, g, 32)
        powers = torch.exp2(scales[x].to(device).double() - 127).to(dtype)[..., None]   # exact: powers of two
        out[x].copy_((codes * powers).view(rows, g * 32).t())                     # exact: 2 bits times a power of 2
    return out


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """An FP8 weight [rows, cols] times its blocks' factors ``scale_inv`` [ceil(rows / block[0]),
    ceil(cols / block[1])], in float32, rounded to ``dtype``, on ``device``."""
    rows, cols = weight.shape if weight.dim() == 2 else (0, 0)
    b0, b1 = block
    if weight.dim() != 2 or tuple(scale_inv.shape) != (-(-rows // b0), -(-cols // b1)):
        raise ValueError(f"weights: an FP8 weight {tuple(weight.shape)} needs scales of shape "
                         f"({-(-rows // b0)}, {-(-cols // b1)}) for blocks of {block}, got {tuple(scale_inv.shape)}")
    scale = scale_inv.to(device=device, dtype=torch.float32)
    w = weight.to(device).to(torch.float32)
    if rows % b0 == 0 and cols % b1 == 0:                   # whole blocks: the factors broadcast over them
        return (w.view(rows // b0, b0, cols // b1, b1) * scale[:, None, :, None]).view(rows, cols).to(dtype)
    scale = scale.repeat_interleave(b0, dim=0)[:rows].repeat_interleave(b1, dim=1)[:, :cols]
    return (w * scale).to(dtype)


def shapes(named: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A checkpoint's tensor shapes with each quantized pair as the tensor it makes (MXFP4's
    blocks and scales as one; an FP8 weight's scales not a tensor of their own)."""
    out = {}
    for name, shape in named.items():
        base = base_name(name)
        if base is None:
            out[name] = shape
        elif name.endswith(BLOCKS):
            out[base] = (shape[0], shape[2] * shape[3] * 2, shape[1])
        elif name.endswith(SCALES) and base + BLOCKS not in named or name.endswith(SCALE_INV) and base not in named:
            out[name] = shape                    # a scale without its tensor: named as it is, refused later
    return out


def dequantized(pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: str | torch.device = "cpu",
                split: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                block: tuple[int, int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every quantized pair replaced by the tensor it makes, in
    ``dtype`` on ``device``, as soon as both halves have arrived (``split``: applied to that
    tensor, a rank's part of it; ``block``: the FP8 blocks, the config's ``weight_block_size``);
    other pairs pass as they are. A half whose partner never arrives is a ValueError naming it."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in pairs:
        base = base_name(name)
        if base is None and tensor.dtype not in FP8:
            yield name, tensor
            continue
        mine, other = _halves(name, base)
        if other not in waiting:
            waiting[mine] = tensor
            continue
        partner = waiting.pop(other)
        target = base if base is not None else name
        whole = _made(name, tensor, partner, dtype, device, block)
        yield target, whole if split is None else split(target, whole)
    if waiting:
        raise ValueError(f"weights: the quantized tensor {next(iter(waiting))!r} has no partner "
                         f"({BLOCKS} and {SCALES}, or a float8 weight and its {SCALE_INV}, come in pairs)")


def _halves(name: str, base: str | None) -> tuple[str, str]:
    """(this half's name, its partner's)."""
    if base is None:                             # an FP8 weight
        return name, name + SCALE_INV
    if name.endswith(SCALE_INV):
        return name, base
    return name, base + (SCALES if name.endswith(BLOCKS) else BLOCKS)


def _made(name: str, tensor: torch.Tensor, partner: torch.Tensor, dtype: torch.dtype, device, block) -> torch.Tensor:
    """The tensor a pair makes (``tensor``: the half named ``name``, ``partner`` the other)."""
    if name.endswith(BLOCKS) or name.endswith(SCALES):
        blocks, scales = (tensor, partner) if name.endswith(BLOCKS) else (partner, tensor)
        return dequantize_mxfp4(blocks, scales, dtype, device)
    if block is None:
        raise ValueError("weights: FP8 weights need the config's quantization_config.weight_block_size")
    weight, scale_inv = (partner, tensor) if name.endswith(SCALE_INV) else (tensor, partner)
    return dequantize_fp8(weight, scale_inv, block, dtype, device)
