"""Tensor parallelism's arithmetic: the part of each weight a rank holds, and the sum a layer
needs across ranks.

A decoder layer split Megatron's way over ``size`` ranks: rank r holds query heads
[r H/size, (r + 1) H/size) and K/V heads [r KV/size, ...) (the rows of the fused QKV projection
that compute them, and the output projection's columns that read them), and the MLP's
intermediate units [r I/size, ...) (rows of gate/up, columns of down): in a mixture of experts
every expert's and the shared expert's, the router whole (every rank routes a token alike). A
Gated DeltaNet layer (Qwen3.5) splits by heads too: a rank holds key heads [r KH/size, ...) and
value heads [r VH/size, ...) (their conv channels, gates, decays and recurrent states), its
output projection's columns that read them. DeepSeek-V3's latent attention splits by heads as
well; its latent, the one K/V head every query head reads, is whole on every rank (each rank
computes and keeps the same latent).
Norms and the embedding are whole on every rank; the LM head only where logits are computed
(rank 0). OLMo's q/k norms over all heads at once read every rank's heads: they are gathered
(``OrderedSum.gather``), normed whole with the whole norm's weight, each rank keeping its own.
A layer's attention output and its MLP output are then sums over ranks of partial products; a
bias of those products is added by rank 0 alone.

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
    widths = [("attention heads", args.num_heads)] + ([("K/V heads", args.num_kv_heads)] if args.mla is None else [])
    if len(args.sparse_layers) < args.num_layers:
        widths.append(("MLP intermediate units", args.intermediate_size))
    if args.num_experts:
        widths.append(("experts' intermediate units", args.moe_intermediate_size))
    if args.shared_expert_size:
        widths.append(("shared expert's intermediate units", args.shared_expert_size))
    if args.linear_layers:
        widths += [("DeltaNet key heads", args.linear_dims[0]), ("DeltaNet value heads", args.linear_dims[1])]
    for what, n in widths:
        if n % size:
            raise ValueError(f"tensor_parallel_size: {size} does not divide the model's {n} {what}")


def shard_args(args: ModelArgs, size: int) -> ModelArgs:
    """The shape one rank's part of the model has (heads, K/V heads and MLP widths divided)."""
    check_split(args, size)
    kh, vh, kd, vd, width = args.linear_dims
    kv = args.num_kv_heads if args.mla is not None else args.num_kv_heads // size    # a latent: on every rank
    return replace(args, num_heads=args.num_heads // size, num_kv_heads=kv,
                   intermediate_size=args.intermediate_size // size,
                   moe_intermediate_size=args.moe_intermediate_size // size,
                   shared_expert_size=args.shared_expert_size // size,
                   linear_dims=(kh // size, vh // size, kd, vd, width))


# a Hugging Face name's part along one dimension (rows 0, columns 1; a trainer's fused experts' 2):
# its pattern, the dimension, and the ModelArgs width it divides (heads times the head dimension)
_SPLITS = [
    # (Qwen3.5: each head's rows [q | gate] side by side)
    (re.compile(r"self_attn\.q_proj\.(weight|bias)$"), 0,
     lambda a: a.num_heads * a.head_dim * (1 + a.attn_output_gate)),
    (re.compile(r"self_attn\.(k|v)_proj\.(weight|bias)$"), 0, lambda a: a.num_kv_heads * a.head_dim),
    (re.compile(r"self_attn\.o_proj\.weight$"), 1, lambda a: a.num_heads * a.head_dim),
    (re.compile(r"mlp\.(gate|up)_proj\.(weight|bias)$"), 0, lambda a: a.intermediate_size),
    (re.compile(r"mlp\.down_proj\.weight$"), 1, lambda a: a.intermediate_size),
    (re.compile(r"experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$"), 0, lambda a: a.moe_intermediate_size),
    (re.compile(r"experts\.\d+\.(down_proj|w2)\.weight$"), 1, lambda a: a.moe_intermediate_size),
    (re.compile(r"shared_experts?\.(gate|up)_proj\.weight$"), 0, lambda a: a.shared_expert_size),
    (re.compile(r"shared_experts?\.down_proj\.weight$"), 1, lambda a: a.shared_expert_size),
    (re.compile(r"experts\.down_proj$"), 2, lambda a: a.moe_intermediate_size),    # a trainer's [E, H, I]
    # Qwen3.5's Gated DeltaNet (model/deltanet.py): a rank's value heads (their key heads' q and k
    # channels: _DELTA_CHANNELS), their gates and decays; the output projection's columns
    (re.compile(r"linear_attn\.in_proj_z\.weight$"), 0, lambda a: a.linear_dims[1] * a.linear_dims[3]),
    (re.compile(r"linear_attn\.(in_proj_b\.weight|in_proj_a\.weight|dt_bias|A_log)$"), 0,
     lambda a: a.linear_dims[1]),
    (re.compile(r"linear_attn\.out_proj\.weight$"), 1, lambda a: a.linear_dims[1] * a.linear_dims[3]),
    # Qwen3-Next's projections fused per key head: a rank's key heads' rows are adjacent
    (re.compile(r"linear_attn\.in_proj_qkvz\.weight$"), 0,
     lambda a: 2 * a.linear_dims[0] * a.linear_dims[2] + 2 * a.linear_dims[1] * a.linear_dims[3]),
    (re.compile(r"linear_attn\.in_proj_ba\.weight$"), 0, lambda a: 2 * a.linear_dims[1]),
]
_DELTA_CHANNELS = re.compile(r"linear_attn\.(in_proj_qkv|conv1d)\.weight$")         # rows [q; k; v] channels
_FUSED_GATE_UP = re.compile(r"experts\.gate_up_proj$")                               # a trainer's [E, 2I, H]
_FUSED_MLP = re.compile(r"mlp\.gate_up_proj\.weight$")                               # Phi-3's [2I, H]
_FUSED_QKV = re.compile(r"self_attn\.qkv_proj\.weight$")                             # Phi-3's [(H + 2KV) D, H]
_OUT_BIAS = re.compile(r"(self_attn\.o_proj|mlp\.down_proj)\.bias$|experts\.down_proj_bias$")
# gpt-oss's experts as its module holds them (hf_names._gpt_oss_experts): a rank's units are
# adjacent columns of [gate, up] pairs ([E, H, 2I], the bias [E, 2I]) and rows of down [E, I, H];
# its sinks, one per query head
_GPT_OSS_SPLITS = [
    (re.compile(r"experts\.gate_up_proj$"), 2, lambda a: 2 * a.moe_intermediate_size),
    (re.compile(r"experts\.gate_up_proj_bias$"), 1, lambda a: 2 * a.moe_intermediate_size),
    (re.compile(r"experts\.down_proj$"), 1, lambda a: a.moe_intermediate_size),
    (re.compile(r"self_attn\.sinks$"), 0, lambda a: a.num_heads),
]
# DeepSeek-V3's latent attention (mla.py): a rank's heads' query rows and [key nope | value] rows
# of the latent's up-projection, the output projection's columns that read their values; the
# latent's own projection and norms whole (every head reads them)
_MLA_SPLITS = [
    (re.compile(r"self_attn\.(q_proj|q_b_proj)\.weight$"), 0, lambda a: a.num_heads * (a.mla[2] + a.mla[3])),
    (re.compile(r"self_attn\.kv_b_proj\.weight$"), 0, lambda a: a.num_heads * (a.mla[2] + a.mla[4])),
    (re.compile(r"self_attn\.o_proj\.weight$"), 1, lambda a: a.num_heads * a.mla[4]),
]


def _pieces(name: str, args: ModelArgs, shard: Shard) -> tuple[int, list[tuple[int, int]]] | None:
    """(dimension, [(start, length)]) of a Hugging Face tensor (``args``: the whole model's) that
    ``shard`` holds, its pieces put side by side along that dimension; None: the whole tensor.
    An output projection's bias is 'whole' here (``_zeroed`` says who adds it)."""
    for pattern, dim, width in _GPT_OSS_SPLITS if args.expert_bias else _MLA_SPLITS if args.mla else ():
        if pattern.search(name):
            n = width(args) // shard.size
            return dim, [(shard.rank * n, n)]
    if _FUSED_GATE_UP.search(name):                 # the gate's rows of the rank's units, then the up's
        n = args.moe_intermediate_size // shard.size
        return 1, [(shard.rank * n, n), (args.moe_intermediate_size + shard.rank * n, n)]
    if _FUSED_MLP.search(name):                     # Phi-3's [gate; up]: the same, in rows
        n = args.intermediate_size // shard.size
        return 0, [(shard.rank * n, n), (args.intermediate_size + shard.rank * n, n)]
    if _DELTA_CHANNELS.search(name):                # a DeltaNet's [q; k; v] channels: the rank's heads of each
        kh, vh, kd, vd, _ = args.linear_dims
        nk, nv = kh * kd // shard.size, vh * vd // shard.size
        return 0, [(shard.rank * nk, nk), (kh * kd + shard.rank * nk, nk), (2 * kh * kd + shard.rank * nv, nv)]
    if _FUSED_QKV.search(name):                     # Phi-3's [q; k; v]: the rank's heads of each
        q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        nq, nkv = q // shard.size, kv // shard.size
        return 0, [(shard.rank * nq, nq), (q + shard.rank * nkv, nkv), (q + kv + shard.rank * nkv, nkv)]
    for pattern, dim, width in _SPLITS:
        if pattern.search(name):
            n = width(args) // shard.size
            return dim, [(shard.rank * n, n)]
    return None


def _zeroed(name: str, shard: Shard) -> bool:
    """An output projection's bias on a rank other than 0 (rank 0 adds it to the sum once)."""
    return shard.rank > 0 and _OUT_BIAS.search(name) is not None


def shard_tensor(name: str, tensor: torch.Tensor, args: ModelArgs, shard: Shard) -> torch.Tensor:
    """The part of a whole Hugging Face tensor (``args``: the whole model's) that ``shard``
    holds: a view where it is one slice, zeros for a bias rank 0 adds."""
    if _zeroed(name, shard):
        return torch.zeros_like(tensor)
    at = _pieces(name, args, shard)
    if at is None:
        return tensor
    dim, pieces = at
    parts = [tensor.narrow(dim, start, n) for start, n in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def read_part(name: str, part, args: ModelArgs, shard: Shard) -> torch.Tensor:
    """``shard``'s part of a tensor read from a safetensors file (``part``: its ``get_slice``),
    reading only those bytes."""
    at = _pieces(name, args, shard)
    if at is None:
        t = part[:]
        return torch.zeros_like(t) if _zeroed(name, shard) else t
    dim, pieces = at
    parts = [part[(slice(None),) * dim + (slice(start, start + n),)] for start, n in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


class OrderedSum:
    """Adds one partial tensor from every rank of ``group`` (a torch.distributed process group:
    gloo on CPUs, NCCL on GPUs): gathered, then added in rank order in float32 (float64 for
    float64) and rounded once to the partials' dtype. Every rank gets the same sum."""

    def __init__(self, group, size: int):
        self.group, self.size, self.rank = group, size, group.rank()

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` [N, C] side by side in rank order, [N, size * C], on every rank
        (OLMo's q/k norms over all heads: each rank's heads gathered, normed whole)."""
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t]).wait()
        return torch.cat(parts, dim=1)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t]).wait()
        acc = parts[0].to(torch.promote_types(t.dtype, torch.float32))
        for p in parts[1:]:
            acc += p
        return acc.to(t.dtype)
