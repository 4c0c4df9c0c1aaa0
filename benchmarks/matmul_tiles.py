"""Tiles for the batch-invariant matmul (tailrl/kernels/gpu/matmul.py), measured on a GPU.

For each candidate (BM, BN, BK, warps, stages), on one forward's matmuls of ``--model`` (the
0.5b stand-in of `small` by default: per layer qkv, o, gate/up, down, and the LM head;
bfloat16, each layer its own weights, replayed from a CUDA graph): milliseconds at M = 1, 64,
512 and 2048 rows through cuBLAS (``F.linear``) and through the invariant kernel with those
tiles, best of ``--reps``; and the invariance itself, bitwise, on operands that show any change
in a sum's order (``stock.probe_operands``): every weight shape's product of 512 rows against
each of rows 0, 1, 63, 64, 200 and 511 alone and against its first 65 rows. A candidate that
is not invariant is out, whatever its speed. The best is the lowest mean ratio (Triton /
cuBLAS) over the four M. Candidates that split K as the default does (same BN and BK) are
also compared with it bitwise (``same_as_default``): whether the tile height alone changes
any bit.

Prints a line per candidate and one JSON line {"candidates": [...], "best": "BM,BN,BK,W,S"};
``--out FILE`` also writes the best as ``TAILRL_MATMUL_TILES`` takes it.
Usage (on the GPU machine): python benchmarks/matmul_tiles.py [--out /tmp/tiles]
"""
from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu import layer_shapes, matmul_cost  # noqa: E402
from regime import model_dir  # noqa: E402

from tailrl.kernels.gpu import matmul, stock  # noqa: E402
from tailrl.kernels.gpu.matmul import Tiles  # noqa: E402
from tailrl.model.loader import read_args  # noqa: E402

CANDIDATES = [Tiles(16, 64, 64, 4, 3), Tiles(32, 64, 64, 4, 3), Tiles(64, 64, 64, 4, 3), Tiles(64, 128, 64, 4, 3),
              Tiles(128, 128, 64, 8, 3), Tiles(64, 64, 128, 4, 3), Tiles(128, 64, 128, 8, 3), Tiles(32, 64, 128, 4, 3)]


def same_as_default(args, tiles: Tiles, device: str) -> bool | None:
    """Whether ``tiles`` computes the default tiles' bits (None unless both split K alike: the
    same BN and BK). If tiles of other heights give the same bits, the height could follow M
    (tall tiles for big steps) without breaking batch invariance: measured here, not assumed."""
    base = matmul.TILES
    if (tiles.bn, tiles.bk) != (base.bn, base.bk) or tiles == base:
        return None
    for n, k in layer_shapes(args)[2:] + [(args.vocab_size, args.hidden_size)]:      # gate/up, down, LM head
        x, w = operands(300, n, k, device, seed=1)
        if not torch.equal(matmul.linear(x, w, tiles=tiles), matmul.linear(x, w, tiles=base)):
            return False
    return True


def operands(rows: int, n: int, k: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """bfloat16 x [rows, k] and w [n, k] that show any change in a sum's order (stock.py)."""
    return stock.probe_operands(rows, torch.empty(n, k, dtype=torch.bfloat16, device=device), seed)


def invariant(args, tiles: Tiles, device: str) -> bool:
    """Each weight shape: rows alone, and the first 65 rows, equal the rows of a 512-row product."""
    for n, k in layer_shapes(args) + [(args.vocab_size, args.hidden_size)]:
        x, w = operands(512, n, k, device)
        y = matmul.linear(x, w, tiles=tiles)
        for i in (0, 1, 63, 64, 200, 511):
            if not torch.equal(matmul.linear(x[i:i + 1], w, tiles=tiles), y[i:i + 1]):
                return False
        if not torch.equal(matmul.linear(x[:65], w, tiles=tiles), y[:65]):
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--standin-dir", default="/tmp/tailrl-standins")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    args = read_args(model_dir(a.model, Path(a.standin_dir)))
    ms = (1, 64, 512, 2048)
    rows = []
    for t in CANDIDATES:
        name = f"{t.bm},{t.bn},{t.bk},{t.warps},{t.stages}"
        try:
            ok = invariant(args, t, a.device)
            cost = matmul_cost(args, a.device, a.reps, ms, triton=partial(matmul.linear, tiles=t))
        except Exception as exc:                      # a config that does not compile or run: out
            print(f"{name}: failed ({type(exc).__name__}: {str(exc)[:200]})", flush=True)
            rows.append({"tiles": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        ratios = [c["triton_ratio"] for c in cost.values() if isinstance(c, dict) and "triton_ratio" in c]
        mean = sum(ratios) / len(ratios) if len(ratios) == len(ms) else float("inf")
        same = same_as_default(args, t, a.device)
        rows.append({"tiles": name, "invariant": ok, "same_as_default": same, "mean_ratio": round(mean, 3),
                     "cost": cost})
        print(f"{name}: invariant {ok}, same bits as the default {same}, mean ratio {mean:.3f}, "
              + ", ".join(f"M={m}: {cost[m].get('triton_ms')} vs {cost[m].get('stock_ms')} ms" for m in ms),
              flush=True)
    fit = [r for r in rows if r.get("invariant")]
    best = min(fit, key=lambda r: r["mean_ratio"])["tiles"] if fit else None
    if best and a.out:
        Path(a.out).write_text(best + "\n")
    print(json.dumps({"device": torch.cuda.get_device_name(), "candidates": rows, "best": best}))


if __name__ == "__main__":
    main()
