"""The MLP's gated activations on the CPU: ``_attention.cpp``'s ``act_mul`` (every element by
the same code, so a row's bits are its own on any number of threads) against PyTorch's
``F.silu(gate) * up`` / ``F.gelu(gate, approximate="tanh") * up`` (the CPU backend's before).

[M, 2I] rows [gate | up] at the 0.5b stand-in's width (I = 4,864) and GLM-4-9B's (13,696), for
M = 1, 16, 64 and 256 rows, bfloat16 and float32. Then what it costs a step: greedy decoding of
``--prompts`` one-token prompts x 16 tokens on a random bfloat16 model of Qwen2.5-0.5B's layer
shapes (4 layers), the CPU backend's activations against PyTorch's. One process, the two forms
alternating (ABBA) per round, medians of ``--rounds``; prints ours / PyTorch's.
Usage: python benchmarks/act_mul.py [--rounds 7] [--calls 20] [--prompts 64]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from tailrl import LLM, SamplingParams  # noqa: E402
from tailrl.kernels import select  # noqa: E402
from tailrl.kernels.backend import Backend  # noqa: E402
from tailrl.kernels.cpu import CpuBackend  # noqa: E402

WIDTHS = (4864, 13696)
ROWS = (1, 16, 64, 256)


def timed(f, x: torch.Tensor, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        f(x)
    return (time.perf_counter() - t0) / calls * 1e6


def decode_times(prompts: int, rounds: int) -> dict[str, float]:
    """Median seconds of a greedy decode (``prompts`` x 16 tokens) on a 4-layer bfloat16 model of
    Qwen2.5-0.5B's layer shapes, with the CPU backend's activations ("ours") and PyTorch's."""
    import transformers
    ours = (CpuBackend.silu_mul, CpuBackend.gelu_tanh_mul)
    stock = (Backend.silu_mul, Backend.gelu_tanh_mul)
    with tempfile.TemporaryDirectory() as d:
        cfg = transformers.Qwen2Config(vocab_size=32000, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
                                       num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=4096,
                                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(d)
        llm = LLM(d, dtype="bfloat16")
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        times = {"ours": [], "pytorch": []}
        for r in range(rounds + 1):
            for name in (("ours", "pytorch") if r % 2 == 0 else ("pytorch", "ours")):
                CpuBackend.silu_mul, CpuBackend.gelu_tanh_mul = ours if name == "ours" else stock
                t0 = time.perf_counter()
                llm.generate([[(7 * i + r) % 32000] for i in range(prompts)], sp)
                if r:
                    times[name].append(time.perf_counter() - t0)
        CpuBackend.silu_mul, CpuBackend.gelu_tanh_mul = ours
    return {name: statistics.median(v) for name, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=64)
    a = ap.parse_args()
    torch.manual_seed(0)
    stock = Backend()
    out = {"machine": "this CPU", "threads": torch.get_num_threads(), "rounds": a.rounds, "us": {}}
    for dtype in (torch.bfloat16, torch.float32):
        ours = select("cpu", dtype)
        for kind in ("silu", "gelu"):
            forms = {"ours": getattr(ours, f"{'silu' if kind == 'silu' else 'gelu_tanh'}_mul"),
                     "pytorch": getattr(stock, f"{'silu' if kind == 'silu' else 'gelu_tanh'}_mul")}
            for width in WIDTHS:
                for rows in ROWS:
                    x = torch.randn(rows, 2 * width).to(dtype)
                    times = {name: [] for name in forms}
                    for r in range(a.rounds + 1):                 # round 0 warms up
                        for name in (forms if r % 2 == 0 else list(forms)[::-1]):
                            t = timed(forms[name], x, a.calls)
                            if r:
                                times[name].append(t)
                    med = {name: statistics.median(v) for name, v in times.items()}
                    key = f"{str(dtype).removeprefix('torch.')} {kind} I={width} M={rows}"
                    out["us"][key] = {**{k: round(v, 1) for k, v in med.items()},
                                      "ours / pytorch": round(med["ours"] / med["pytorch"], 2)}
                    print(key, out["us"][key], flush=True)
    dec = decode_times(a.prompts, a.rounds)
    out["decode_s"] = {**{k: round(v, 3) for k, v in dec.items()},
                       "ours / pytorch": round(dec["ours"] / dec["pytorch"], 3)}
    print("decode", out["decode_s"], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
