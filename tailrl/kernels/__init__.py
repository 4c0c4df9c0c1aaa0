"""The hot operations of a step, one implementation per device behind one interface.

``select(device, dtype)`` is the one place that picks a backend (``backend.Backend``):

- ``cpu`` (``cpu.py``): the native C++ kernels, on a CPU tensor of a dtype they support,
  when the extension is built;
- ``reference`` (``reference.py``): plain PyTorch, everywhere else (and the tests' oracle).

The model calls the backend it was given and never branches on the device. What all backends
share, the K/V cache layout and the per-query visibility of a step, is in ``layout.py``.
"""
from __future__ import annotations

import torch

from tailrl.kernels import cpu
from tailrl.kernels.backend import Backend, Rope, RopeTables
from tailrl.kernels.layout import BLOCK, AttentionMeta, blocks, key_index, pack_keys, unpack_keys
from tailrl.kernels.reference import REFERENCE

__all__ = ["BLOCK", "AttentionMeta", "Backend", "Rope", "RopeTables", "blocks", "key_index", "pack_keys",
           "select", "unpack_keys"]


def select(device: torch.device | str, dtype: torch.dtype) -> Backend:
    """The backend for tensors of ``dtype`` on ``device``."""
    if torch.device(device).type == "cpu" and cpu.supports(dtype):
        return cpu.CPU
    return REFERENCE
