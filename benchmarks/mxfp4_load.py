"""What loading gpt-oss's MXFP4 experts costs: our dequantization (model/quantized.py) against
transformers' own (``convert_moe_packed_tensors``, what ``from_pretrained`` runs where it does not
keep them quantized), on gpt-oss-20b's and -120b's expert shapes.

A gate/up tensor's experts are [5,760 rows, 90 blocks of 32] (2 x 2,880 units over a hidden size
of 2,880) and a down tensor's [2,880, 90]; random codes and powers of two. Both give the same
bits (checked here). One process, the two alternating (ABBA order per round), medians of
``--rounds``, ``--experts`` experts a call; the seconds per expert, and a whole checkpoint's
dequantization extrapolated from them (20b: 24 layers of 32 experts, 120b: 36 of 128).
Usage: python benchmarks/mxfp4_load.py [--rounds 4] [--experts 4] [--dtype bfloat16] [--device cpu]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from tailrl.model import quantized

SHAPES = {"gate_up": (5760, 90), "down": (2880, 90)}
CHECKPOINTS = {"gpt-oss-20b": 24 * 32, "gpt-oss-120b": 36 * 128}       # experts of each kind


def timed(fn, device: str) -> float:
    if device != "cpu":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--experts", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(0)
    per_expert = {}
    for kind, (rows, groups) in SHAPES.items():
        blocks = torch.randint(0, 256, (args.experts, rows, groups, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(110, 135, (args.experts, rows, groups), generator=g, dtype=torch.uint8)
        ours = lambda: quantized.dequantize_mxfp4(blocks, scales, dtype, args.device)              # noqa: E731
        theirs = lambda: convert_moe_packed_tensors(blocks.to(args.device), scales.to(args.device),  # noqa: E731
                                                    dtype=dtype)
        assert torch.equal(ours(), theirs())
        times = {"ours": [], "transformers": []}
        for r in range(args.rounds):
            for name in (("ours", "transformers") if r % 2 == 0 else ("transformers", "ours")):
                times[name].append(timed(ours if name == "ours" else theirs, args.device) / args.experts)
        t = per_expert[kind] = {k: statistics.median(v) for k, v in times.items()}
        print(f"{kind}: ours {t['ours'] * 1e3:.1f} ms an expert, transformers {t['transformers'] * 1e3:.1f} ms "
              f"({t['ours'] / t['transformers']:.2f}x)")
    whole = {name: {k: n * sum(per_expert[kind][k] for kind in SHAPES) for k in ("ours", "transformers")}
             for name, n in CHECKPOINTS.items()}
    for name, t in whole.items():
        print(f"{name}: every expert dequantized in {t['ours']:.0f} s (transformers {t['transformers']:.0f} s)")
    print(json.dumps({"dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(),
                      "seconds_per_expert": per_expert, "checkpoint_seconds": whole}))


if __name__ == "__main__":
    main()
