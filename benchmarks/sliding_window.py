"""What a sliding window saves in attention: one layer's ``rope_attend`` (RoPE, the K/V writes,
attention through the pool's block tables) through this device's kernels (the native ones on a
CPU, Triton on a GPU), at Gemma-3-1B's heads (4 query heads, 1 K/V head, head dim 256), bfloat16,
blocks shuffled: decode steps of ``--rows`` rows at ``--contexts`` positions, and a verify step
of 64 rows checking a chain of 6 drafts each, with a window of ``--window`` positions (Gemma 3
1B's 512) and without one (a full-attention layer). The two are timed in alternating rounds
(ABBA), median of ``--rounds``; a window layer should cost about what a full one costs at a
context of the window (its reads: min(context, window) positions a row).

Usage: python benchmarks/sliding_window.py [--rows 1,16,64] [--contexts 1024,4096,8192]
The last line is one JSON object: {"device", "window", "shapes": {"rows x context[ x chain]":
{"full_us", "window_us", "ratio", "bound"}}} (ratio: full / window; bound: context / window, the
K/V read's ratio).
"""
from __future__ import annotations

import argparse
import json

import torch
from attention_steps import abba_medians, chain_step

from tailrl.kernels import RopeTables, select
from tailrl.model.rope import rope_table

H, KV, D = 4, 1, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calls", type=int, default=20, help="calls timed together per round")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = select(torch.device(device), torch.bfloat16)
    contexts = [int(c) for c in a.contexts.split(",")]
    cos, sin = rope_table(D, max(contexts) + 8, 1e4, torch.float32)
    tables = RopeTables(cos.to(device, torch.bfloat16), sin.to(device, torch.bfloat16), cos.to(device), sin.to(device))
    shapes = [(r, c, 1) for r in map(int, a.rows.split(",")) for c in contexts] + [(64, c, 7) for c in contexts]
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "kernels": kernels.name,
           "window": a.window, "shapes": {}}
    for rows, context, chain in shapes:
        qkv, pos, k, v, meta = chain_step(rows, context, chain, device, H, KV, D, multi=chain > 1)
        ropes = {"full": kernels.rope(tables, pos), "window": kernels.rope(tables, pos, a.window)}
        med = abba_medians(kernels, qkv, ropes, k, v, meta, H, a.calls, a.rounds)
        full, window = med["full"], med["window"]
        name = f"{rows}x{context}" + (f"x{chain}" if chain > 1 else "")
        out["shapes"][name] = {"full_us": round(full, 1), "window_us": round(window, 1),
                               "ratio": round(full / window, 2), "bound": round((context + chain) / a.window, 2)}
        print(name, out["shapes"][name], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
