"""Host data onto a step's device without waiting for it."""
from __future__ import annotations

import torch


def host_to_device(device, data, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (a list, a numpy array or a CPU tensor) as a tensor on ``device``; on a GPU
    through pinned memory, without waiting: a plain copy from pageable memory would wait for
    every kernel queued on the stream (a step's forward, a rollout step beside the spot
    trainer), and what is launched after it could not queue behind them."""
    t = torch.as_tensor(data, dtype=dtype, device="cpu")
    if torch.device(device).type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
