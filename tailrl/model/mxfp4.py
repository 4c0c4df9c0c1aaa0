"""gpt-oss's MXFP4 checkpoints (OpenAI's published ones): the experts' weights dequantized as
they are read, into the tensors a bfloat16 checkpoint holds.

Such a checkpoint stores each expert tensor as two: ``<name>_blocks`` [E, rows, G, 16] uint8 (32
four-bit codes per block, two a byte, the low nibble first) and ``<name>_scales`` [E, rows, G]
uint8 (a block's power of two, biased by 127). A code is an FP4 (E2M1) value; times its block's
power of two it is exact in bfloat16, float32 and float64 (small integers and halves, times a
power of two within their range), so the weights are the checkpoint's bits whatever the dtype.
The rows are the module's columns: the dequantized [E, rows, G * 32] transposed is the tensor a
bfloat16 checkpoint names ``<name>`` (hf_names._gpt_oss_experts reads it from there).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

BLOCKS, SCALES = "_blocks", "_scales"
# E2M1's sixteen codes: sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def base_name(name: str) -> str | None:
    """The tensor an MXFP4 part of this name makes (None: not such a part)."""
    for suffix in (BLOCKS, SCALES):
        if name.endswith(suffix) and ".experts." in name:
            return name[:-len(suffix)]
    return None


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
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


def shapes(named: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A checkpoint's tensor shapes with each MXFP4 pair as the tensor it makes."""
    out = {}
    for name, shape in named.items():
        base = base_name(name)
        if base is None:
            out[name] = shape
        elif name.endswith(BLOCKS):
            out[base] = (shape[0], shape[2] * shape[3] * 2, shape[1])
        elif base + BLOCKS not in named:         # scales without their blocks: named as they are, refused later
            out[name] = shape
    return out


def dequantized(pairs: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: str | torch.device = "cpu",
                split: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every MXFP4 pair replaced by the tensor it makes, in ``dtype`` on
    ``device``, as soon as both halves have arrived (``split``: applied to that tensor, a rank's
    part of it); other pairs pass as they are. A half whose partner never arrives is a ValueError
    naming it."""
    waiting: dict[str, torch.Tensor] = {}
    for name, tensor in pairs:
        base = base_name(name)
        if base is None:
            yield name, tensor
            continue
        other = base + (SCALES if name.endswith(BLOCKS) else BLOCKS)
        if other not in waiting:
            waiting[name] = tensor
            continue
        partner = waiting.pop(other)
        blocks, scales = (tensor, partner) if name.endswith(BLOCKS) else (partner, tensor)
        whole = dequantize(blocks, scales, dtype, device)
        yield base, whole if split is None else split(base, whole)
    if waiting:
        raise ValueError(f"weights: the MXFP4 tensor {next(iter(waiting))!r} has no partner "
                         f"({BLOCKS} and {SCALES} come in pairs)")
