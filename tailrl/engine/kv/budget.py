"""How much K/V an engine may hold: its budget in token slots and the context that fits it,
decided before any weight is read (``size_kv``). The pool (cache.py) is allocated once at
this size."""
from __future__ import annotations

import logging

import torch

from tailrl.config import EngineConfig
from tailrl.engine.kv.states import RecurrentStates
from tailrl.kernels import BLOCK, blocks
from tailrl.model.args import ModelArgs

log = logging.getLogger(__name__)

DEFAULT_KV_GIB = 4.0       # the budget when neither kv_cache_gib nor kv_cache_tokens is given ...
MEMORY_SHARE = 0.5         # ... raised up to this share of available memory for one full-context request
USEFUL_CONTEXT = 2048      # a context capped to fit must keep at least min(this, the checkpoint's)


def available_memory() -> int | None:
    """Bytes the OS can give without swapping (``MemAvailable``; None where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def device_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a CUDA device (None for other devices); memory this process's
    allocator holds but does not use counts as free."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(dev)
    return free + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev), total


def step_activation_bytes(args: ModelArgs, config: EngineConfig, elem_bytes: int) -> int:
    """A generous bound on one step's activations: per token of ``max_num_batched_tokens``, the
    float32 logits row and eight of the widest hidden rows in the model's dtype."""
    widest = max(args.hidden_size, args.widest_mlp, (args.num_heads + 2 * args.num_kv_heads) * args.head_dim)
    return config.max_num_batched_tokens * (4 * args.vocab_size + 8 * widest * elem_bytes)


def size_kv(args: ModelArgs, config: EngineConfig, elem_bytes: int) -> tuple[int, int]:
    """(KV budget in token slots, max_model_len) for an engine. The budget is ``kv_cache_tokens``,
    else ``kv_cache_gib``; else on a GPU ``gpu_memory_utilization`` of its memory (which must be
    free) less the weights, a step's activations and the CUDA graphs' budget (as vLLM sizes its
    cache); else 4 GiB raised to hold one request of the whole context if that takes at most half the
    available memory. A context that still does not fit is capped to what fits, with one log
    line naming both settings, unless the caller asked for that ``max_model_len`` or the cap
    would leave less than ``USEFUL_CONTEXT``: then a ValueError says what to pass. The pool is
    allocated once at this size (cache.py)."""
    ctx = args.max_position_embeddings
    length = min(config.max_model_len or ctx, ctx)
    per_token = args.kv_bytes_per_token * elem_bytes
    gib = lambda tokens: tokens * per_token / 2**30   # noqa: E731
    if config.kv_cache_tokens is not None:
        budget, knob = config.kv_cache_tokens, f"kv_cache_tokens={config.kv_cache_tokens}"
    elif config.kv_cache_gib is not None:
        budget, knob = int(config.kv_cache_gib * 2**30 // per_token), f"kv_cache_gib={config.kv_cache_gib:g}"
    elif (memory := device_memory(config.device)) is not None:
        free, total = memory
        frac = config.gpu_memory_utilization
        if total * frac > free:         # as vLLM: the share is of the whole device, and must be free now
            raise ValueError(f"gpu_memory_utilization: {frac:g} of the device's {total / 2**30:.1f} GiB is "
                             f"{total * frac / 2**30:.1f} GiB, but {free / 2**30:.1f} GiB are free (other engines "
                             f"or processes hold the rest); lower it, or set kv_cache_gib")
        graphs = config.cuda_graph_gib * 2**30 if config.cuda_graphs else 0
        states = config.max_num_seqs * RecurrentStates.row_bytes(args, elem_bytes) if args.linear_layers else 0
        spare = (total * frac - args.num_parameters * elem_bytes - step_activation_bytes(args, config, elem_bytes)
                 - graphs - states)
        budget, knob = max(0, int(spare // per_token)), f"gpu_memory_utilization={frac:g}"
        if budget < blocks(min(length, USEFUL_CONTEXT)):
            raise ValueError(f"gpu_memory_utilization: {frac:g} of the device's {total / 2**30:.1f} GiB leaves "
                             f"{max(spare, 0) / 2**30:.2f} GiB for the KV cache after the weights, a step's "
                             f"activations, the CUDA graphs (cuda_graph_gib) and recurrent states "
                             f"({states / 2**30:.2f} GiB for max_num_seqs rows); raise it, lower "
                             f"max_num_batched_tokens, cuda_graph_gib or max_num_seqs, or set kv_cache_gib")
    else:
        budget, knob = int(DEFAULT_KV_GIB * 2**30 // per_token), f"kv_cache_gib={DEFAULT_KV_GIB:g} (default)"
        avail = available_memory()
        if blocks(length) > budget and avail is not None and gib(blocks(length)) * 2**30 <= MEMORY_SHARE * avail:
            log.warning("KV cache budget raised from %g to %.1f GiB so that one %d-token request fits (%.1f GiB "
                        "available); set kv_cache_gib, or max_model_len, to choose", DEFAULT_KV_GIB,
                        gib(blocks(length)), length, avail / 2**30)
            budget = blocks(length)
    if blocks(length) <= budget:
        return budget, length
    fit = budget // BLOCK * BLOCK
    if config.max_model_len is not None or fit < min(ctx, USEFUL_CONTEXT):
        raise ValueError(f"max_model_len: {length} tokens need {gib(blocks(length)):.2f} GiB of KV cache per request, "
                         f"but {knob} holds {fit} tokens; pass a smaller max_model_len or a larger kv_cache_gib")
    log.warning("max_model_len capped from the checkpoint's %d to %d tokens: that is what %s holds (%.2f GiB); "
                "set max_model_len or kv_cache_gib to choose", ctx, fit, knob, gib(budget))
    return budget, fit
