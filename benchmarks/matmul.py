"""The bfloat16 matmul of the CPU backend (tailrl/kernels/_gemm.cpp) against PyTorch's (oneDNN).

For each weight shape of Qwen2.5-0.5B's layers (qkv, gate/up, down, LM head) and row counts
``--rows``: milliseconds per call of both (alternating A B B A for ``--rounds`` rounds, best
of each), their ratio, and whether each is row-invariant at that shape (every row of an
M-row product bitwise equal to the same row computed alone, for M in ``INVARIANCE_ROWS``).
The weights are random; the times do not depend on the values.

The last line is one JSON object: {"shapes": {"KxN": {"invariant": {"ours", "stock"},
"rows": {M: {"ours_ms", "stock_ms", "ratio"}}}}, "threads"}.

Usage: python benchmarks/matmul.py [--rows 1,4,16,64,256] [--rounds 3] [--no-head]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from tailrl.kernels import cpu

SHAPES = {"qkv": (896, 1152), "gate_up": (896, 9728), "down": (4864, 896), "lm_head": (896, 151936)}
INVARIANCE_ROWS = (2, 3, 4, 5, 8, 16, 17, 33, 64, 65)


def invariant(fn, w: torch.Tensor) -> bool:
    x = torch.randn(max(INVARIANCE_ROWS), w.shape[1]).bfloat16()
    alone = torch.cat([fn(x[i:i + 1], w) for i in range(x.shape[0])])
    return all(torch.equal(fn(x[:m], w), alone[:m]) for m in INVARIANCE_ROWS)


def per_call(fn, x: torch.Tensor, w: torch.Tensor, reps: int) -> float:
    fn(x, w)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(x, w)
    return (time.perf_counter() - t0) / reps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-head", action="store_true", help="skip the LM head (the slowest shape)")
    a = ap.parse_args()
    if not cpu.NATIVE_GEMM:
        raise SystemExit("tailrl.kernels._gemm is not built (pip install -e . with g++)")
    torch.manual_seed(0)
    ours, stock = cpu.CPU.linear, F.linear
    out: dict = {"shapes": {}, "threads": torch.get_num_threads()}
    for name, (k, n) in SHAPES.items():
        if a.no_head and name == "lm_head":
            continue
        w = torch.randn(n, k).bfloat16()
        inv = {"ours": invariant(ours, w), "stock": invariant(stock, w)}
        entry = {"invariant": inv, "rows": {}}
        for m in map(int, a.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            reps = max(2, int(2e8 / max(1, 2 * m * n * k)))
            best = {"ours": float("inf"), "stock": float("inf")}
            for r in range(a.rounds):
                order = ("ours", "stock") if r % 2 == 0 else ("stock", "ours")
                for which in order:
                    best[which] = min(best[which], per_call(ours if which == "ours" else stock, x, w, reps))
            entry["rows"][m] = {"ours_ms": round(best["ours"], 4), "stock_ms": round(best["stock"], 4),
                                "ratio": round(best["ours"] / best["stock"], 3)}
            print(f"{name:8s} K={k:5d} N={n:6d} M={m:4d}: ours {best['ours']:8.3f} ms  stock {best['stock']:8.3f} ms"
                  f"  ours/stock {best['ours'] / best['stock']:.2f}", flush=True)
        print(f"{name:8s} row-invariant: ours {inv['ours']}, stock {inv['stock']}", flush=True)
        out["shapes"][f"{k}x{n}"] = entry
    print(json.dumps(out))


if __name__ == "__main__":
    main()
