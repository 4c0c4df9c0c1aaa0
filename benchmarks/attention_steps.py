"""The attention steps the attention benchmarks time (attention.py, sliding_window.py,
soft_cap.py): rows of committed K/V in a pool of shuffled blocks, each row with a chain of new
queries; and two forms of one step timed in alternating rounds."""
from __future__ import annotations

import random
import statistics
import time

import torch

from tailrl.kernels.layout import BLOCK, AttentionMeta


def chain_step(rows: int, context: int, chain: int, device: str, heads: int, kv_heads: int, dim: int,
               seed: int = 0, multi: bool = False):
    """``rows`` rows of ``context`` committed positions each (shuffled blocks), each with
    ``chain`` new queries at the next positions, bfloat16: (qkv, positions, keys, values, meta)
    as ``rope_attend`` takes them (``multi``: the meta's flag that a row has several queries)."""
    rng = random.Random(seed)
    per_row = (context + chain) // BLOCK + 1
    n_blocks = rows * per_row + 1
    order = list(range(n_blocks))
    rng.shuffle(order)
    table = torch.tensor(order[:rows * per_row], dtype=torch.int32).view(rows, per_row)
    q_row, prefix, slots, positions = [], [], [], []
    for r in range(rows):
        for p in range(context, context + chain):            # sees [0, p] (itself written this step)
            q_row.append(r)
            prefix.append(p + 1)
            slots.append(int(table[r, p // BLOCK]) * BLOCK + p % BLOCK)
            positions.append(p)
    n = len(q_row)
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMeta(torch.tensor(slots, device=device), torch.tensor(q_row, **i32), torch.tensor(prefix, **i32),
                         torch.zeros(n, **i32), torch.zeros(n, **i32), torch.zeros(1, **i32), table.to(device),
                         context + chain, rows * (context + chain), n * (context + chain), multi=multi)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_blocks, kv_heads, BLOCK * dim, generator=g).to(device, torch.bfloat16)
    v = torch.randn(n_blocks, kv_heads, BLOCK, dim, generator=g).to(device, torch.bfloat16)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=g).to(device, torch.bfloat16)
    return qkv, torch.tensor(positions, device=device), k, v, meta


def step_shapes(rows: str, contexts: str) -> list[tuple[int, int, int]]:
    """(rows, context, chain) of the benchmarks' steps: decode steps of each of ``rows`` rows at
    each of ``contexts`` positions (comma-separated), and verify steps of 64 rows checking a
    chain of 6 drafts at each context."""
    cs = [int(c) for c in contexts.split(",")]
    return [(r, c, 1) for r in map(int, rows.split(",")) for c in cs] + [(64, c, 7) for c in cs]


def timed_forms(shapes, heads: int, kv_heads: int, dim: int, forms, calls: int, rounds: int):
    """For each (rows, context, chain) of ``shapes``: (it, its name, the median microseconds of
    each of two forms of one layer's ``rope_attend``: ``abba_medians``), bfloat16 through this
    device's kernels; ``forms(kernels, tables, positions)``: name -> Rope."""
    from tailrl.kernels import RopeTables, select
    from tailrl.model.rope import rope_table
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = select(torch.device(device), torch.bfloat16)
    cos, sin = rope_table(dim, max(c + chain for _, c, chain in shapes) + 8, 1e4, torch.float32)
    tables = RopeTables(cos.to(device, torch.bfloat16), sin.to(device, torch.bfloat16), cos.to(device), sin.to(device))
    for rows, context, chain in shapes:
        qkv, pos, k, v, meta = chain_step(rows, context, chain, device, heads, kv_heads, dim, multi=chain > 1)
        medians = abba_medians(kernels, qkv, forms(kernels, tables, pos), k, v, meta, heads, calls, rounds)
        yield (rows, context, chain), f"{rows}x{context}" + (f"x{chain}" if chain > 1 else ""), medians


def device_names() -> dict[str, str]:
    """The device and kernels the benchmarks' lines name."""
    from tailrl.kernels import select
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "kernels": select(torch.device(device), torch.bfloat16).name}


def abba_medians(kernels, qkv, ropes: dict, k, v, meta, heads: int, calls: int, rounds: int) -> dict[str, float]:
    """Microseconds a ``rope_attend`` call of each of two forms (``ropes``: name -> Rope) takes,
    ``calls`` calls timed together, in ``rounds`` rounds alternating the two (ABBA) after a
    warm-up (and Triton's compiles): the median per form."""
    sync = torch.cuda.synchronize if qkv.is_cuda else (lambda: None)
    a, b = ropes

    def timed(kind: str) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            kernels.rope_attend(qkv, ropes[kind], k, v, meta, heads)
        sync()
        return (time.perf_counter() - t0) / calls * 1e6
    times = {a: [], b: []}
    for kind in (a, b):
        timed(kind)
    for i in range(rounds):
        for kind in ((a, b) if i % 2 == 0 else (b, a)):
            times[kind].append(timed(kind))
    return {kind: statistics.median(t) for kind, t in times.items()}
