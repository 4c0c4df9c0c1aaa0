"""A trainer's weights, each whole, one at a time, however the trainer shards them: FSDP2's
DTensors (``full_tensor``), FSDP1's flat parameters (``summon_full_params`` on one wrapped module
at a time, for its own parameters, children first, as TRL's vLLM sync walks them), DeepSpeed
ZeRO-3's partitions (``GatheredParameters``, one parameter at a time), or plain tensors; then
the persistent buffers (never sharded: GLM-4.5's score-correction bias is one).

The pairs are made to be streamed into ``LLM.load_weights`` (an iterator: each tensor is checked
and copied before the next is gathered), so a process holds one whole tensor at a time, never
the whole model. Every gather is a collective: every process of the trainer must iterate to the
end, in the same order, whether it loads the tensors or not.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import torch

# what wrappers put in a parameter's name: FSDP1's, activation checkpointing's, torch.compile's
_WRAPPERS = re.compile(r"(_fsdp_wrapped_module|_checkpoint_wrapped_module|_orig_mod)\.")


def clean(name: str) -> str:
    """A parameter's name as the unwrapped model (and its checkpoint) names it."""
    return _WRAPPERS.sub("", name)


def gathered_weights(model: torch.nn.Module, fsdp_version: int | None = None,
                     zero3: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, whole tensor) for every parameter of ``model``, then its persistent buffers.
    ``fsdp_version``: 1 or 2 where the trainer shards with FSDP (``model`` the wrapped root for
    FSDP1); ``zero3``: DeepSpeed ZeRO stage 3. Each gathered tensor is a copy of its own (the
    gathered storage is freed when the next is gathered; a rollout pool keeps every tensor)."""
    if fsdp_version == 1:
        yield from _fsdp1(model, "", set())
    else:
        for name, p in model.named_parameters():
            if zero3:
                import deepspeed
                with deepspeed.zero.GatheredParameters([p]):
                    whole = p.data.clone()
                yield clean(name), whole
            elif hasattr(p, "full_tensor"):             # an FSDP2 (DTensor) shard
                yield clean(name), p.full_tensor().detach()
            else:
                yield clean(name), p.detach()
    yield from persistent_buffers(model)


def _fsdp1(module: torch.nn.Module, prefix: str, seen: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """FSDP1: children first; each wrapped module's parameters whole while it alone is summoned
    (its children's, seen already, skipped)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    for child_name, child in module.named_children():
        yield from _fsdp1(child, f"{prefix}{child_name}.", seen)
    if isinstance(module, FSDP):
        with FSDP.summon_full_params(module, recurse=False, writeback=False):
            for name, p in module.named_parameters():
                full = clean(prefix + name)
                if full not in seen:
                    seen.add(full)
                    yield full, p.detach().clone()


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint of ``model`` holds (``state_dict``'s, without its parameters)."""
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield clean(f"{prefix}.{name}" if prefix else name), buf.detach()
