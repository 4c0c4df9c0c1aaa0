"""What Gemma 2's soft cap costs in attention: one layer's ``rope_attend`` (RoPE, the K/V writes,
attention through the pool's block tables) through this device's kernels (the native ones on a
CPU, Triton on a GPU), at Gemma-2-2B's heads (8 query heads, 4 K/V heads, head dim 256),
bfloat16, blocks shuffled, with its scores capped at ``--cap`` (Gemma 2's 50: each score s
becomes cap * tanh(s / cap)) and without: decode steps of ``--rows`` rows at ``--contexts``
positions, and a verify step of 64 rows checking a chain of 6 drafts each. The two are timed in
alternating rounds (ABBA), median of ``--rounds``.

Usage: python benchmarks/soft_cap.py [--rows 1,16,64] [--contexts 1024,4096]
The last line is one JSON object: {"device", "kernels", "cap", "shapes": {"rows x context[ x
chain]": {"plain_us", "capped_us", "ratio"}}} (ratio: capped / plain, the cap's cost).
"""
from __future__ import annotations

import argparse
import json

import torch
from attention_steps import abba_medians, chain_step

from tailrl.kernels import RopeTables, select
from tailrl.model.rope import rope_table

H, KV, D = 8, 4, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--cap", type=float, default=50.0)
    ap.add_argument("--calls", type=int, default=10, help="calls timed together per round")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = select(torch.device(device), torch.bfloat16)
    contexts = [int(c) for c in a.contexts.split(",")]
    cos, sin = rope_table(D, max(contexts) + 8, 1e4, torch.float32)
    tables = RopeTables(cos.to(device, torch.bfloat16), sin.to(device, torch.bfloat16), cos.to(device), sin.to(device))
    shapes = [(r, c, 1) for r in map(int, a.rows.split(",")) for c in contexts] + [(64, c, 7) for c in contexts]
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "kernels": kernels.name,
           "cap": a.cap, "shapes": {}}
    for rows, context, chain in shapes:
        qkv, pos, k, v, meta = chain_step(rows, context, chain, device, H, KV, D, multi=chain > 1)
        ropes = {"plain": kernels.rope(tables, pos), "capped": kernels.rope(tables, pos, softcap=a.cap)}
        med = abba_medians(kernels, qkv, ropes, k, v, meta, H, a.calls, a.rounds)
        name = f"{rows}x{context}" + (f"x{chain}" if chain > 1 else "")
        out["shapes"][name] = {"plain_us": round(med["plain"], 1), "capped_us": round(med["capped"], 1),
                               "ratio": round(med["capped"] / med["plain"], 3)}
        print(name, out["shapes"][name], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
