"""The hot operations of a step, one implementation per device behind one interface.

``select(device, dtype)`` is the one place that picks a backend (``backend.Backend``):

- ``cpu`` (``cpu.py``): the native C++ kernels, on a CPU tensor of a dtype they support,
  when the extension is built;
- ``triton`` (``gpu/``): Triton kernels on a CUDA tensor of bfloat16, float16 or float32;
- ``reference`` (``reference.py``): plain PyTorch, everywhere else (and the tests' oracle).

``TAILRL_KERNELS=cpu|triton|reference`` forces one (tests run the Triton kernels on CPU
tensors under ``TRITON_INTERPRET=1`` this way).

The model calls the backend it was given and never branches on the device. What all backends
share, the K/V cache layout and the per-query visibility of a step, is in ``layout.py``.
"""
from __future__ import annotations

import logging
import os

import torch

from tailrl.kernels import cpu
from tailrl.kernels.backend import Backend, Rope, RopeTables
from tailrl.kernels.host import host_to_device
from tailrl.kernels.layout import BLOCK, AttentionMeta, blocks, key_index, pack_keys, unpack_keys
from tailrl.kernels.reference import REFERENCE

__all__ = ["BLOCK", "AttentionMeta", "Backend", "Rope", "RopeTables", "blocks", "host_to_device", "key_index",
           "pack_keys", "select", "unpack_keys"]


TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _triton() -> Backend:
    try:
        from tailrl.kernels.gpu.backend import TRITON  # imports triton: only where it is used
    except ImportError as exc:                         # a CUDA build of torch without triton
        logging.getLogger(__name__).warning("tailrl.kernels: Triton unavailable (%s); using the PyTorch reference", exc)
        return REFERENCE
    return TRITON


def select(device: torch.device | str, dtype: torch.dtype) -> Backend:
    """The backend for tensors of ``dtype`` on ``device``."""
    forced = os.environ.get("TAILRL_KERNELS")
    if forced:
        if forced == "cpu" and cpu.supports(dtype):
            return cpu.CPU
        if forced == "triton" and dtype in TRITON_DTYPES:
            return _triton()
        if forced not in ("cpu", "triton", "reference"):
            raise ValueError(f"TAILRL_KERNELS must be cpu, triton or reference, got {forced!r}")
        return REFERENCE
    kind = torch.device(device).type
    if kind == "cpu" and cpu.supports(dtype):
        return cpu.CPU
    if kind == "cuda" and dtype in TRITON_DTYPES:
        return _triton()
    return REFERENCE
