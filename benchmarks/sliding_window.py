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

from attention_steps import device_names, step_shapes, timed_forms

H, KV, D = 4, 1, 256


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--calls", type=int, default=20, help="calls timed together per round")
    ap.add_argument("--rounds", type=int, default=6)
    a = ap.parse_args()
    out = {**device_names(), "window": a.window, "shapes": {}}

    def forms(kernels, tables, pos):
        return {"full": kernels.rope(tables, pos), "window": kernels.rope(tables, pos, a.window)}
    for (_, context, chain), name, med in timed_forms(step_shapes(a.rows, a.contexts), H, KV, D, forms, a.calls,
                                                      a.rounds):
        out["shapes"][name] = {"full_us": round(med["full"], 1), "window_us": round(med["window"], 1),
                               "ratio": round(med["full"] / med["window"], 2),
                               "bound": round((context + chain) / a.window, 2)}
        print(name, out["shapes"][name], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
