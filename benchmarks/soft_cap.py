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

from attention_steps import device_names, step_shapes, timed_forms

H, KV, D = 8, 4, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--cap", type=float, default=50.0)
    ap.add_argument("--calls", type=int, default=10, help="calls timed together per round")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    out = {**device_names(), "cap": a.cap, "shapes": {}}

    def forms(kernels, tables, pos):
        return {"plain": kernels.rope(tables, pos), "capped": kernels.rope(tables, pos, softcap=a.cap)}
    for _, name, med in timed_forms(step_shapes(a.rows, a.contexts), H, KV, D, forms, a.calls, a.rounds):
        out["shapes"][name] = {"plain_us": round(med["plain"], 1), "capped_us": round(med["capped"], 1),
                               "ratio": round(med["capped"] / med["plain"], 3)}
        print(name, out["shapes"][name], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
