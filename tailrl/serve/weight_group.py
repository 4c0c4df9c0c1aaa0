"""The server's end of a trainer's weight-update process group (SGLang's
``/init_weights_update_group`` and ``/update_weights_from_distributed``, what slime's
non-colocated weight sync and OpenRLHF's engines use).

The trainer is rank 0 of a ``torch.distributed`` group it creates with the rollout servers
(``world_size`` = 1 + the servers' ranks; this server, one engine, is rank ``rank_offset``). For
every bucket it sends the names, dtypes and shapes over HTTP and broadcasts the tensors, one
``broadcast`` each, in that order; this end receives them into tensors of those shapes on the
engine's device (NCCL: the GPU's; gloo: the CPU's) and hands the bucket to the engine loop.
The group is this process's default ``torch.distributed`` group: a server joins one at a time.
"""
from __future__ import annotations

from datetime import timedelta

import torch

BACKENDS = ("nccl", "gloo")
TIMEOUT_S = 600.0


def _field(body: dict, name: str, kind, check=lambda v: True, what: str = ""):
    value = body.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) or not check(value):
        raise ValueError(f"field '{name}' must be {what}, got {value!r}")
    return value


def dtype_of(name) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> torch.bfloat16: floating point types only."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"field 'dtypes' holds {name!r}, not a floating point torch dtype")
    return dtype


class WeightGroup:
    """One trainer's group, joined at construction (blocks until every rank has joined)."""

    def __init__(self, body: dict, device: torch.device) -> None:
        import torch.distributed as dist
        address = _field(body, "master_address", str, bool, "a host name or address")
        port = _field(body, "master_port", int, lambda v: 0 < v < 65536, "a port number")
        world = _field(body, "world_size", int, lambda v: v >= 2, "an integer >= 2 (the trainer and this server)")
        self.rank = _field(body, "rank_offset", int, lambda v: 1 <= v < world, "this server's rank, in [1, world_size)")
        self.name = _field(body, "group_name", str, bool, "a non-empty string")
        self.backend = body.get("backend", "nccl")
        if self.backend not in BACKENDS:
            raise ValueError(f"field 'backend' must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "nccl" and device.type != "cuda":
            raise ValueError("field 'backend': 'nccl' needs the engine on a GPU; a CPU engine takes 'gloo'")
        if dist.is_initialized():
            raise ValueError("this server already belongs to a weights update group: destroy it first")
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        host = f"[{address}]" if ":" in address else address
        dist.init_process_group(self.backend, init_method=f"tcp://{host}:{port}", world_size=world, rank=self.rank,
                                timeout=timedelta(seconds=TIMEOUT_S))

    @staticmethod
    def bucket_spec(body: dict) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, dtype, shape) of each tensor a bucket's body announces, checked before any is received."""
        names, dtypes, shapes = (body.get(k) for k in ("names", "dtypes", "shapes"))
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ValueError("field 'names' must be a non-empty list of tensor names")
        if not isinstance(dtypes, list) or len(dtypes) != len(names):
            raise ValueError("field 'dtypes' must list one dtype per name")
        if not isinstance(shapes, list) or len(shapes) != len(names) or not all(
                isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes):
            raise ValueError("field 'shapes' must list one shape (a list of sizes) per name")
        return [(n, dtype_of(d), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]

    def receive(self, spec: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors, broadcast by rank 0 in this order (blocks until they arrived)."""
        import torch.distributed as dist
        out = []
        for name, dtype, shape in spec:
            t = torch.empty(shape, dtype=dtype, device=self.device)
            dist.broadcast(t, src=0)
            out.append((name, t))
        return out

    def close(self) -> None:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
