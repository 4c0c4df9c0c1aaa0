"""What GLM-4.5's routing costs a step: its route against the softmax route of Qwen3-MoE at the
same shape, and both against the step's routed expert products.

GLM-4.5's router (model/moe.py ``route_groups``, DeepSeek-V3's) runs in float32 whatever the
model's dtype, as Hugging Face's does; on this CPU its product is the native float64 matmul on
the float32 values (``Backend.linear_float32``: PyTorch's float32 product is not row-invariant),
then sigmoid scores through a softmax (row-invariant), groups and stable sorts. The softmax
route (``route``) reads a bfloat16 router through the bfloat16 matmul. At GLM-4.5-Air's shapes
(hidden 4,096, 128 experts of width 1,408, 8 a token), bfloat16, for T = 1 .. 256 tokens a
step, one layer:

- ``route_groups``: the float32 router product and the grouped sigmoid route (``--groups``
  groups, ``--chosen`` of them a token; the published Air: 1 and 1, DeepSeek-V3's: 8 and 4);
- ``route``: the bfloat16 router product and the softmax route;
- ``experts``: the routed experts' products for those tokens (``Backend.experts``), what a
  sparse layer spends besides attention and the shared expert.

One process, the three alternating (ABBA order per round), medians of ``--rounds``.
Usage: python benchmarks/moe_routing.py [--rounds 5] [--groups 8 --chosen 4]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tailrl.kernels import select
from tailrl.model.moe import route, route_groups

HIDDEN, EXPERTS, WIDTH, TOP_K = 4096, 128, 1408, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=1)
    ap.add_argument("--chosen", type=int, default=1)
    ap.add_argument("--tokens", default="1,4,16,64,256")
    a = ap.parse_args()
    torch.manual_seed(0)
    kernels = select("cpu", torch.bfloat16)
    router32 = 0.02 * torch.randn(EXPERTS, HIDDEN)
    router16, bias = router32.bfloat16(), 0.01 * torch.randn(EXPERTS)
    gate_up = torch.empty(EXPERTS, 2 * WIDTH, HIDDEN, dtype=torch.bfloat16).uniform_(-0.02, 0.02)
    down = torch.empty(EXPERTS, HIDDEN, WIDTH, dtype=torch.bfloat16).uniform_(-0.02, 0.02)
    forms = {
        "route_groups": lambda h: route_groups(kernels.linear_float32(h, router32), bias, TOP_K, a.groups, a.chosen,
                                               True, 2.5),
        "route": lambda h: route(kernels.linear(h, router16), TOP_K, True, False),
    }
    out = {"machine": "this CPU", "threads": torch.get_num_threads(), "groups": a.groups, "chosen": a.chosen,
           "rounds": a.rounds, "ms": {}}
    for t in (int(x) for x in a.tokens.split(",")):
        h = torch.randn(t, HIDDEN).bfloat16()
        ids, weights = route(kernels.linear(h, router16), TOP_K, True, False)
        forms["experts"] = lambda h, ids=ids, weights=weights: kernels.experts(h, gate_up, down, ids, weights)
        names, times = list(forms), {name: [] for name in forms}
        calls = max(1, 64 // t)
        for r in range(a.rounds + 1):                       # round 0 warms up
            for name in (names if r % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                for _ in range(calls if name != "experts" else 1):
                    forms[name](h)
                if r:
                    times[name].append((time.perf_counter() - t0) / (calls if name != "experts" else 1) * 1e3)
        ms = {name: round(statistics.median(v), 4) for name, v in times.items()}
        ms["route_groups / route"] = round(ms["route_groups"] / ms["route"], 2)
        ms["route_groups / experts"] = round(ms["route_groups"] / ms["experts"], 4)
        out["ms"][t] = ms
        print(f"T={t:4d}: " + ", ".join(f"{k} {v}" for k, v in ms.items()), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
