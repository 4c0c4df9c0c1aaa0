"""Tensor parallelism's arithmetic: the part of each weight a rank holds, and the sum a layer
needs across ranks.

A decoder layer split Megatron's way over ``size`` ranks: rank r holds query heads
[r H/size, (r + 1) H/size) and K/V heads [r KV/size, ...) (the rows of the fused QKV projection
that compute them, and the output projection's columns that read them), and the MLP's
intermediate units [r I/size, ...) (rows of gate/up, columns of down). Norms and the embedding
are whole on every rank; the LM head only where logits are computed (rank 0). A layer's
attention output and its MLP output are then sums over ranks of partial products; a bias of
those products is added by rank 0 alone.

``OrderedSum`` adds the partials: every rank's gathered, then added in rank order in float32
(float64 for a float64 model) and rounded once. An element's sum never depends on how many
rows the step holds (an all-reduce picks its algorithm and chunking by the message's size), so
a token's result is its own under tensor parallelism too, and speculation stays lossless.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch

from tailrl.model.args import ModelArgs


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int


def check_split(args: ModelArgs, size: int) -> None:
    """A ValueError naming ``tensor_parallel_size`` where the model does not split over ``size``."""
    if args.num_experts:
        raise ValueError("tensor_parallel_size: mixtures of experts are not split over devices yet "
                         f"({args.architecture}); use tensor_parallel_size=1")
    for what, n in (("attention heads", args.num_heads), ("K/V heads", args.num_kv_heads),
                    ("MLP intermediate units", args.intermediate_size)):
        if n % size:
            raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {n} {what}")


def shard_args(args: ModelArgs, size: int) -> ModelArgs:
    """The shape one rank's part of the model has (heads, K/V heads and MLP width divided)."""
    check_split(args, size)
    return replace(args, num_heads=args.num_heads // size, num_kv_heads=args.num_kv_heads // size,
                   intermediate_size=args.intermediate_size // size)


_HEADS = re.compile(r"self_attn\.(q|k|v)_proj\.(weight|bias)$")
_MLP_IN = re.compile(r"mlp\.(gate|up)_proj\.(weight|bias)$")
_OUT = re.compile(r"(self_attn\.o_proj|mlp\.down_proj)\.(weight|bias)$")


def _range(name: str, args: ModelArgs, shard: Shard) -> tuple[int, int, int] | None:
    """(dimension, start, length) of a Hugging Face tensor that ``shard`` holds, None: whole.
    An output projection's bias is 'whole' here; ``takes_bias`` says who adds it."""
    d = args.head_dim
    if m := _HEADS.search(name):
        n = (args.num_heads if m.group(1) == "q" else args.num_kv_heads) // shard.size * d
        return 0, shard.rank * n, n
    if _MLP_IN.search(name):
        n = args.intermediate_size // shard.size
        return 0, shard.rank * n, n
    if (m := _OUT.search(name)) and m.group(2) == "weight":
        n = (args.num_heads * d if m.group(1).startswith("self") else args.intermediate_size) // shard.size
        return 1, shard.rank * n, n
    return None


def _zeroed(name: str, shard: Shard) -> bool:
    """An output projection's bias on a rank other than 0 (rank 0 adds it to the sum once)."""
    return shard.rank > 0 and (m := _OUT.search(name)) is not None and m.group(2) == "bias"


def shard_tensor(name: str, tensor: torch.Tensor, args: ModelArgs, shard: Shard) -> torch.Tensor:
    """The part of a whole Hugging Face tensor (``args``: the whole model's) that ``shard``
    holds: a view where it is a slice, zeros for a bias rank 0 adds."""
    if _zeroed(name, shard):
        return torch.zeros_like(tensor)
    at = _range(name, args, shard)
    return tensor if at is None else tensor.narrow(*at)


def read_part(name: str, part, args: ModelArgs, shard: Shard) -> torch.Tensor:
    """``shard``'s part of a tensor read from a safetensors file (``part``: its ``get_slice``),
    reading only those bytes."""
    at = _range(name, args, shard)
    if at is None:
        t = part[:]
        return torch.zeros_like(t) if _zeroed(name, shard) else t
    dim, start, n = at
    return part[start:start + n] if dim == 0 else part[:, start:start + n]


class OrderedSum:
    """Adds one partial tensor from every rank of ``group`` (a torch.distributed process group:
    gloo on CPUs, NCCL on GPUs): gathered, then added in rank order in float32 (float64 for
    float64) and rounded once to the partials' dtype. Every rank gets the same sum."""

    def __init__(self, group, size: int):
        self.group, self.size = group, size

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t]).wait()
        acc = parts[0].to(torch.promote_types(t.dtype, torch.float32))
        for p in parts[1:]:
            acc += p
        return acc.to(t.dtype)
