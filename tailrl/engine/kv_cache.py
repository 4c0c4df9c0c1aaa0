"""Per-row KV cache: one tensor [L, 2, rows, KV, cap * D], one row per running request.

Running requests occupy rows 0..R-1 with no holes (a leaving request's row is filled by the
last row), so every attention call reads plain views of the cache instead of gathering.
Rows and capacity grow by doubling; their product is bounded by a budget in token slots
(capacities are whole blocks of ``attention.BLOCK`` positions).
When a step needs more than the budget allows, `reserve` says no and the scheduler preempts.

Layout (``tailrl.kernels.layout``): a row's keys are key blocks [KV, cap * D], its values
[KV, cap, D]. Both keep position p's data inside the first blocks(p + 1) * D elements of a
row, so growing, copying and moving rows copy flat prefixes. Exports and imports use the plain
[L, 2, KV, n, D] layout.
"""
from __future__ import annotations

import logging

import torch

from tailrl.config import EngineConfig
from tailrl.kernels import BLOCK, blocks, key_index
from tailrl.model.args import ModelArgs

log = logging.getLogger(__name__)

MIN_CAP = 128
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


def size_kv(args: ModelArgs, config: EngineConfig, elem_bytes: int) -> tuple[int, int]:
    """(KV budget in token slots, max_model_len) for an engine. The budget is ``kv_cache_tokens``,
    else ``kv_cache_gib``, else 4 GiB raised to hold one request of the whole context if that
    takes at most half the available memory. A context that still does not fit is capped to
    what fits, with one log line naming both settings, unless the caller asked for that
    ``max_model_len`` or the cap would leave less than ``USEFUL_CONTEXT``: then a ValueError
    says what to pass. The cache itself grows as requests need it; the budget is its bound."""
    ctx = args.max_position_embeddings
    length = min(config.max_model_len or ctx, ctx)
    per_token = args.kv_bytes_per_token * elem_bytes
    gib = lambda tokens: tokens * per_token / 2**30   # noqa: E731
    if config.kv_cache_tokens is not None:
        budget, knob = config.kv_cache_tokens, f"kv_cache_tokens={config.kv_cache_tokens}"
    elif config.kv_cache_gib is not None:
        budget, knob = int(config.kv_cache_gib * 2**30 // per_token), f"kv_cache_gib={config.kv_cache_gib:g}"
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


def _grow(current: int, needed: int, limit: int) -> int:
    size = max(current, 1)
    while size < needed:
        size *= 2
    return min(max(size, needed), limit)


class KVCache:
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: str | torch.device,
                 budget_tokens: int, max_rows: int, max_len: int):
        if budget_tokens < blocks(max_len):
            raise ValueError(f"kv_cache_tokens must be >= max_model_len rounded up to whole blocks of {BLOCK} "
                             f"({blocks(max_len)}) so one request always fits, got {budget_tokens}")
        self.args, self.dtype, self.device = args, dtype, device
        self.budget_tokens, self.max_rows, self.max_len = budget_tokens, max_rows, max_len
        self.shrink()                                  # a few rows, within budget; grows on demand

    def shrink(self) -> None:
        """Back to the initial few rows (the caller makes sure no row is in use): gives the
        memory of a grown cache back while nothing runs (a rollout asleep during training)."""
        cap = blocks(min(MIN_CAP, self.max_len))
        self.data = self._alloc(max(1, min(4, self.max_rows, self.budget_tokens // cap)), cap)

    def _alloc(self, rows: int, cap: int) -> torch.Tensor:
        a = self.args
        self._cap = cap
        return torch.zeros(a.num_layers, 2, rows, a.num_kv_heads, cap * a.head_dim, dtype=self.dtype,
                           device=self.device)

    @property
    def rows(self) -> int:
        return self.data.shape[2]

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def values(self) -> torch.Tensor:
        """[L, rows, KV, cap, D]."""
        l, _, rows, kv, flat = self.data.shape
        return self.data[:, 1].view(l, rows, kv, self.cap, flat // self.cap)

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (key blocks [rows, KV, cap * D], values [rows, KV, cap, D]): what the model
        writes and reads."""
        return list(zip(self.data[:, 0].unbind(0), self.values.unbind(0)))

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.max_rows and length <= self.max_len and rows * blocks(length) <= self.budget_tokens

    def reserve(self, rows: int, length: int) -> bool:
        """Make room for `rows` rows of `length` positions. False (and no change) if over budget."""
        if rows <= self.rows and length <= self.cap:
            return True
        if not self.fits(rows, length):
            return False
        grown_rows = _grow(self.rows, rows, self.max_rows)
        grown_cap = blocks(_grow(self.cap, length, self.max_len))
        # Prefer doubling (amortised copies); fall back to exact sizes near the budget. The caller
        # passes the longest length any occupied row needs, so shrinking to it loses nothing.
        for new_rows, new_cap in ((grown_rows, grown_cap), (rows, grown_cap), (grown_rows, blocks(length)),
                                 (rows, blocks(length))):
            if new_rows * new_cap <= self.budget_tokens:
                break
        old, keep_rows, keep = self.data, min(self.rows, new_rows), min(self.cap, new_cap) * self.args.head_dim
        self.data = self._alloc(new_rows, new_cap)
        self.data[:, :, :keep_rows, :, :keep] = old[:, :, :keep_rows, :, :keep]
        return True

    def move_row(self, src: int, dst: int, length: int) -> None:
        n = min(blocks(length), self.cap) * self.args.head_dim
        self.data[:, :, dst, :, :n] = self.data[:, :, src, :, :n]

    def _key_index(self, positions) -> torch.Tensor:
        """Flat offsets [n * D] of these positions' keys inside a row's key blocks."""
        return key_index(torch.as_tensor(positions, device=self.device), self.args.head_dim).flatten()

    def move_positions(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy K/V of positions src -> dst inside one row (accepted tree-draft nodes)."""
        k = self.data[:, 0, row]
        k[:, :, self._key_index(dst)] = k[:, :, self._key_index(src)]
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        v = self.values
        v[:, row, :, d] = v[:, row, :, s]

    def export_row(self, row: int, length: int) -> torch.Tensor:
        """[L, 2, KV, length, D], a copy on the CPU."""
        a = self.args
        k = self.data[:, 0, row][:, :, self._key_index(range(length))]
        k = k.view(a.num_layers, a.num_kv_heads, length, a.head_dim)
        v = self.values[:, row, :, :length]
        return torch.stack([k, v], dim=1).detach().to("cpu", copy=True)

    def check_shape(self, kv: torch.Tensor) -> None:
        a = self.args
        want = (a.num_layers, 2, a.num_kv_heads, a.head_dim)
        if kv.dim() != 5 or (kv.shape[0], kv.shape[1], kv.shape[2], kv.shape[4]) != want:
            raise ValueError(f"kv: shape {tuple(kv.shape)} does not match this model (L, 2, KV, n, D) = {want}")

    def import_row(self, row: int, kv: torch.Tensor) -> None:
        self.check_shape(kv)
        n = kv.shape[3]
        kv = kv.to(self.data)
        self.data[:, 0, row][:, :, self._key_index(range(n))] = kv[:, 0].flatten(-2)
        self.values[:, row, :, :n] = kv[:, 1]
