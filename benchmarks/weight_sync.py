"""A trainer's weight update through the server's engine loop: whole, or in buckets.

The same new weights (``--model``'s tensors, scaled) are loaded into a served engine
(``SampleServer.update_weights`` over the ``EngineLoop``, what verl's server and SGLang's routes
use) as one mapping, and as buckets of ``--bucket-mb`` (verl's
``update_weights_bucket_megabytes``; one list of (name, tensor) pairs each, the last ``done``),
alternating over ``--rounds`` (ABBA). Reported: the median seconds of each, their ratio, and
that both leave the engine with the same weights (its greedy tokens after each update).

Usage: python benchmarks/weight_sync.py --model DIR [--bucket-mb 64 256] [--rounds 4]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from tailrl import LLM, SamplingParams
from tailrl.model.loader import load_state_dict
from tailrl.serve.samples import SampleServer


def buckets(items: list, mb: int) -> list[list]:
    out, size, limit = [[]], 0, mb << 20
    for name, t in items:
        if out[-1] and size + t.numel() * t.element_size() > limit:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += t.numel() * t.element_size()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bucket-mb", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    sd = {k: (v.float() * 1.01).to(v.dtype) for k, v in load_state_dict(a.model).items()}
    items = list(sd.items())
    llm = LLM(a.model, dtype="bfloat16")
    samples = SampleServer(llm)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ways = {"whole": None, **{f"buckets_{mb}mb": buckets(items, mb) for mb in a.bucket_mb}}

    async def update(way: str) -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        if ways[way] is None:
            await samples.update_weights(sd)
        else:
            for i, b in enumerate(ways[way]):
                await samples.update_weights(b, done=i == len(ways[way]) - 1)
        seconds = time.perf_counter() - t0
        out = await samples.generate(way, [5, 9, 14], greedy)
        return seconds, out.token_ids

    times: dict[str, list[float]] = {w: [] for w in ways}
    tokens: dict[str, list[int]] = {}
    order = list(ways)

    async def rounds() -> None:
        for r in range(a.rounds):
            for way in (order if r % 2 == 0 else order[::-1]):
                seconds, tokens[way] = await update(way)
                times[way].append(seconds)
                print(f"round {r} {way:14s} {seconds:.3f} s", flush=True)
    try:
        asyncio.run(rounds())
    finally:
        samples.loop.stop()
    med = {w: round(statistics.median(t), 3) for w, t in times.items()}
    print(json.dumps({"model": a.model, "weights_gib": round(sum(t.numel() * t.element_size() for t in sd.values())
                                                             / 2 ** 30, 3),
                      "buckets": {w: len(b) for w, b in ways.items() if b is not None}, "median_s": med,
                      "over_whole": {w: round(s / med["whole"], 3) for w, s in med.items()},
                      "same_weights": len({tuple(t) for t in tokens.values()}) == 1,
                      "torch_threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
