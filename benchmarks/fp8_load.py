"""What loading a block-scaled FP8 checkpoint costs: our dequantization (model/quantized.py
``dequantize_fp8``) against transformers' own (``Fp8Dequantize``, what ``from_pretrained`` runs
with ``dequantize=True``), on DeepSeek-V3's shapes: an expert's gate projection [2,048, 7,168], its
down projection [7,168, 2,048] and the query's up-projection [24,576, 1,536], blocks of 128 x 128.
Both give the same bits (checked here). One process, the two alternating (ABBA order per round),
medians of ``--rounds``; the seconds per billion weights, and DeepSeek-V3's 671B extrapolated.
Usage: python benchmarks/fp8_load.py [--rounds 4] [--dtype bfloat16] [--device cpu]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize

from tailrl.model import quantized

SHAPES = {"expert_gate": (2048, 7168), "expert_down": (7168, 2048), "q_b": (24576, 1536)}
BLOCK = (128, 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    sync = torch.cuda.synchronize if args.device != "cpu" else (lambda: None)
    g = torch.Generator().manual_seed(0)
    out = {"dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(), "shapes": {}}
    theirs_op = Fp8Dequantize(None)
    for name, (rows, cols) in SHAPES.items():
        w = (torch.randn(rows, cols, generator=g) * 100).to(torch.float8_e4m3fn).to(args.device)
        scale = (torch.rand(rows // BLOCK[0], cols // BLOCK[1], generator=g) + 0.01).to(args.device)
        forms = {"ours": lambda: quantized.dequantize_fp8(w, scale, BLOCK, dtype, args.device),
                 "transformers": lambda: theirs_op._dequantize_one(w, scale, output_dtype=dtype)}
        assert torch.equal(forms["ours"](), forms["transformers"]())
        times = {k: [] for k in forms}
        for r in range(args.rounds):
            for k in (("ours", "transformers") if r % 2 == 0 else ("transformers", "ours")):
                sync()
                t0 = time.perf_counter()
                forms[k]()
                sync()
                times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        per_b = {k: v / (rows * cols) * 1e9 for k, v in med.items()}
        out["shapes"][name] = {"ours_ms": round(med["ours"] * 1e3, 1),
                               "transformers_ms": round(med["transformers"] * 1e3, 1),
                               "ratio": round(med["ours"] / med["transformers"], 3),
                               "ours_s_per_billion": round(per_b["ours"], 2)}
        print(name, out["shapes"][name], flush=True)
    per_b = statistics.median(v["ours_s_per_billion"] for v in out["shapes"].values())
    out["deepseek_v3_minutes"] = round(671 * per_b / 60, 1)
    print(f"DeepSeek-V3's 671B weights dequantized in ~{out['deepseek_v3_minutes']} min at that rate")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
