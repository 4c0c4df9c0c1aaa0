"""The GPU attention kernel's cost by its dots (``TAILRL_ATTENTION_DOTS``) and keys per step of
a lane's walk (``TAILRL_ATTENTION_KEYS``).

One layer's ``rope_attend`` (RoPE and the K/V write, attention through block tables, the lanes'
merge where a step has few tokens) at Qwen2.5-0.5B's heads (14 query heads, 2 K/V heads, head
dim 64), bfloat16, the K/V pool's blocks shuffled: decode steps of ``--rows`` rows at
``--contexts`` positions each, and verify steps of 64 rows each checking a chain of 6 drafts
(7 queries a row). Per shape and per (``--dots``, ``--keys``) pair: microseconds per call,
replayed from a CUDA graph of ``--calls`` calls (as the engine replays its steps), best of
``--reps``; for the verify steps also with query groups (``+groups``: a row's chain walks its
K/V together, as a step with several queries in a row launches it; ``groups_equal``: the same
bits as without); and each pair's largest difference from the first pair's outputs (a check
that the variants compute the same attention: they differ in rounding only; tensor cores
round the softmax weights to bfloat16).

Each pair gives other bits, so an engine process uses one (the backend reads them once); here
the module variables are set per measurement, which only a benchmark may do.

Usage (on a GPU): python benchmarks/attention.py [--dots tensor,ieee] [--keys 16,32,64,128]
A smoke test of the script on a CPU (Triton's interpreter, tiny shapes, two lanes, ~2 minutes;
timings meaningless, and groups_equal reflects numpy's dots, which round a row by its place in
a tile: tests/conftest.py replaces them for the tests):
TRITON_INTERPRET=1 python benchmarks/attention.py --quick
The last line is one JSON object: {"device", "shapes": {shape: {"dots/keys[+groups]": us}}, "best":
{shape: "dots/keys"}, "max_diff": {"dots/keys": float}, "groups_equal"}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch
from attention_steps import chain_step

from tailrl.engine.graph_pool import cuda_capture
from tailrl.kernels import RopeTables
from tailrl.kernels.gpu import backend
from tailrl.kernels.gpu.backend import TRITON
from tailrl.model.rope import rope_table

H, KV, D = 14, 2, 64


def step(rows: int, context: int, chain: int, device: str, seed: int = 0):
    """``rows`` rows of ``context`` committed positions each (shuffled blocks), each with
    ``chain`` new queries at the next positions: what rope_attend takes."""
    qkv, positions, k, v, meta = chain_step(rows, context, chain, device, H, KV, D, seed)
    cos, sin = rope_table(D, context + chain + 1, 1e6, torch.float32)
    tables = RopeTables(cos.to(device, torch.bfloat16), sin.to(device, torch.bfloat16), cos.to(device), sin.to(device))
    return qkv, TRITON.rope(tables, positions), k, v, meta


def timed(fn, calls: int, reps: int, cuda: bool) -> float:
    """Microseconds per call: ``calls`` calls captured into one CUDA graph as the engine captures
    its steps (``cuda_capture``), replayed, best of ``reps``."""
    if not cuda:
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6

    def many():
        for _ in range(calls):
            out = fn()
        return out
    replay, _ = cuda_capture(many)
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / calls * 1e6)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", default="16,32,64,128")
    ap.add_argument("--dots", default="tensor,ieee", help="attention's dots (backend.DOTS) to measure")
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny shapes: checks the script (on a CPU, interpreted)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    keys = [int(x) for x in a.keys.split(",")]
    dots_list = a.dots.split(",")
    shapes = [(r, c, 1) for r in map(int, a.rows.split(",")) for c in map(int, a.contexts.split(","))
              if r * c <= 512 * 1024] + [(64, 512, 7)]
    if a.quick:                         # two lanes: the interpreter runs every lane's program in Python
        keys, shapes, a.calls, a.reps = keys[:2], [(1, 40, 1), (3, 40, 7)], 1, 1
        backend.LANES = 2
    out: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreted: timings meaningless)",
                 "shapes": {}, "best": {}, "max_diff": {f"{d}/{k}": 0.0 for d in dots_list for k in keys}}
    for rows, context, chain in shapes:
        name = f"{rows}x{chain}@{context}"
        qkv, rope, k, v, meta = step(rows, context, chain, device)
        first = None
        res = {}
        metas = {"": meta} if chain == 1 else {"": meta, "+groups": dataclasses.replace(meta, multi=True)}
        for dots, kk in ((dots, kk) for dots in dots_list for kk in keys):
            backend.DOTS, backend.KEYS = dots, kk
            outs = {}
            for tag, mt in metas.items():
                kc, vc = k.clone(), v.clone()
                got = outs[tag] = TRITON.rope_attend(qkv, rope, kc, vc, mt, H)
                first = got if first is None else first
                if tag:                 # the same keys with and without groups: the same bits
                    out["groups_equal"] = out.get("groups_equal", True) and torch.equal(got, outs[""])
                out["max_diff"][f"{dots}/{kk}"] = max(out["max_diff"][f"{dots}/{kk}"],
                                                      (got.float() - first.float()).abs().max().item())
                res[f"{dots}/{kk}{tag}"] = round(timed(lambda: TRITON.rope_attend(qkv, rope, kc, vc, mt, H),
                                                       a.calls, a.reps, cuda), 2)
        out["shapes"][name] = res
        out["best"][name] = min(res, key=res.get)
        print(f"{name}: " + ", ".join(f"{kk} {us:.1f} us" for kk, us in res.items()), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
