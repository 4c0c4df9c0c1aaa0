"""The last of a group of programs finishes their work in the same launch (split-K's reduce,
attention's merge of lanes), instead of a second kernel: one launch fewer where a step's
launches, not its arithmetic, set its time (a decode step of a few rows).

Each program of a group stores its partial result, then counts itself in at the group's
counter (``arrive``: a barrier, so that every thread's stores precede the count, then one
atomic add at GPU scope with acquire-release ordering, cumulative over the block's stores).
The program that counts last sees every partial result, combines them in their fixed order,
as the second kernel did (the same bits), and sets the counter back to zero for the next
launch. Launches on one stream run one after another, so one set of counters per device
serves every kernel (``counters``), CUDA graphs included: it is allocated once, zeroed, and
never freed. The partial results are read at L2 (``.cg``), never from a block's L1."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_counters: dict[torch.device, torch.Tensor] = {}
MIN_COUNTERS = 1024                # a decode step's groups are fewer than an H100's 132 SMs


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` zeroed int32 counters on ``device``, the same tensor for every launch
    (grown, never shrunk: each launch leaves its counters at zero)."""
    have = _counters.get(device)
    if have is None or have.numel() < n:            # never inside a capture: the graph's pool would hold them
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("arrivals: counters first needed inside a CUDA graph capture (a capture follows "
                               "an eager run of the same step, which makes them)")
        have = _counters[device] = torch.zeros(max(n, MIN_COUNTERS), dtype=torch.int32, device=device)
    return have


@triton.jit
def arrive(counter_ptr, count):
    """True in the last of the ``count`` programs that call this on ``counter_ptr`` (which
    it resets); its loads after this see the others' stores made before it (read them with
    ``cache_modifier=".cg"``)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == count - 1
    if last:
        tl.store(counter_ptr, 0)
    return last
