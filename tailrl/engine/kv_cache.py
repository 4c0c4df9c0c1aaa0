"""Per-row KV cache: one tensor [L, 2, rows, KV, cap * D], one row per running request.

Running requests occupy rows 0..R-1 with no holes (a leaving request's row is filled by the
last row), so every attention call reads plain views of the cache instead of gathering.
Rows and capacity grow by doubling; their product is bounded by a budget in token slots.
When a step needs more than the budget allows, `reserve` says no and the scheduler preempts.

Layout: a row's keys are stored transposed, [KV, D, cap] (``keys``), its values [KV, cap, D]
(``values``): attention scores a block of consecutive positions against a query with one
contiguous read per head dimension, and weighs values with one contiguous read per position.
Exports and imports use the plain [L, 2, KV, n, D] layout.
"""
from __future__ import annotations

import torch

from tailrl.model.args import ModelArgs

MIN_CAP = 128


def _grow(current: int, needed: int, limit: int) -> int:
    size = max(current, 1)
    while size < needed:
        size *= 2
    return min(max(size, needed), limit)


class KVCache:
    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: str | torch.device,
                 budget_tokens: int, max_rows: int, max_len: int):
        if budget_tokens < max_len:
            raise ValueError(f"kv_cache_tokens must be >= max_model_len ({max_len}) so one request always fits, "
                             f"got {budget_tokens}")
        self.args, self.dtype, self.device = args, dtype, device
        self.budget_tokens, self.max_rows, self.max_len = budget_tokens, max_rows, max_len
        cap = min(MIN_CAP, max_len)
        self.data = self._alloc(max(1, min(4, max_rows, budget_tokens // cap)), cap)   # within budget

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

    @staticmethod
    def _views(data: torch.Tensor, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys [L, rows, KV, D, cap], values [L, rows, KV, cap, D]) of a data tensor."""
        l, _, rows, kv, flat = data.shape
        d = flat // cap
        return data[:, 0].view(l, rows, kv, d, cap), data[:, 1].view(l, rows, kv, cap, d)

    @property
    def keys(self) -> torch.Tensor:
        return self._views(self.data, self.cap)[0]

    @property
    def values(self) -> torch.Tensor:
        return self._views(self.data, self.cap)[1]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys [rows, KV, D, cap], values [rows, KV, cap, D]): what the model writes and reads."""
        k, v = self._views(self.data, self.cap)
        return list(zip(k.unbind(0), v.unbind(0)))

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.max_rows and length <= self.max_len and rows * length <= self.budget_tokens

    def reserve(self, rows: int, length: int) -> bool:
        """Make room for `rows` rows of `length` positions. False (and no change) if over budget."""
        if rows <= self.rows and length <= self.cap:
            return True
        if not self.fits(rows, length):
            return False
        grown_rows = _grow(self.rows, rows, self.max_rows)
        grown_cap = _grow(self.cap, length, self.max_len)
        # Prefer doubling (amortised copies); fall back to exact sizes near the budget. The caller
        # passes the longest length any occupied row needs, so shrinking to it loses nothing.
        for new_rows, new_cap in ((grown_rows, grown_cap), (rows, grown_cap), (grown_rows, length), (rows, length)):
            if new_rows * new_cap <= self.budget_tokens:
                break
        old_k, old_v = self.keys, self.values
        keep_rows, keep_cap = min(self.rows, new_rows), min(self.cap, new_cap)
        self.data = self._alloc(new_rows, new_cap)
        k, v = self.keys, self.values
        k[:, :keep_rows, :, :, :keep_cap] = old_k[:, :keep_rows, :, :, :keep_cap]
        v[:, :keep_rows, :, :keep_cap] = old_v[:, :keep_rows, :, :keep_cap]
        return True

    def move_row(self, src: int, dst: int, length: int) -> None:
        k, v = self.keys, self.values
        k[:, dst, :, :, :length] = k[:, src, :, :, :length]
        v[:, dst, :, :length] = v[:, src, :, :length]

    def move_positions(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy K/V of positions src -> dst inside one row (accepted tree-draft nodes)."""
        s = torch.tensor(src, device=self.device)
        d = torch.tensor(dst, device=self.device)
        k, v = self.keys, self.values
        k[:, row, :, :, d] = k[:, row, :, :, s]
        v[:, row, :, d] = v[:, row, :, s]

    def export_row(self, row: int, length: int) -> torch.Tensor:
        """[L, 2, KV, length, D], a copy on the CPU."""
        k = self.keys[:, row, :, :, :length].transpose(-1, -2)
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
        self.keys[:, row, :, :, :n] = kv[:, 0].transpose(-1, -2)
        self.values[:, row, :, :n] = kv[:, 1]
