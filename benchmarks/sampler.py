"""The sampler's share of a decode step at a real vocabulary (Qwen2.5-0.5B's config: 151,936 tokens).

A random-weight checkpoint with Qwen2.5-0.5B's published config (full depth; built once into
``--cache``, ~1 GB) runs decode steps at batch 1, 16 and 64 (``--batches``): ``--tokens``
tokens per request, EOS ignored, bfloat16, one engine; per sampling setting (greedy, T=1,
top-k 50, top-p 0.95, top-k 50 + top-p 0.95) the engine's own stage timers give the
sampler's seconds (``timing_s/sample``: logits to tokens and log-probabilities) and the
forward's (LM head included), per decode step; the share is sample / (the whole step). The
settings take turns over ``--rounds`` rounds (ABBA); medians. Random weights give nearly flat
distributions, the hard case for top-p (the nucleus holds most of the vocabulary).
Ends with one line of JSON: {"batches": {b: {setting: {"sample_ms", "step_ms", "share"}}}}.

    python benchmarks/sampler.py [--batches 1,16,64] [--tokens 24] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tailrl import LLM, SamplingParams  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "T=1": dict(temperature=1.0),
    "top-k 50": dict(temperature=1.0, top_k=50),
    "top-p 0.95": dict(temperature=1.0, top_p=0.95),
    "top-k 50 + top-p 0.95": dict(temperature=1.0, top_k=50, top_p=0.95),
}


def checkpoint(cache: str) -> str:
    from real_configs import QWEN25_05B, make_real_checkpoint
    path = os.path.join(cache, "qwen2.5-0.5b-config-random")
    if not os.path.isfile(os.path.join(path, "config.json")):
        make_real_checkpoint(path, "qwen2.5-0.5b", num_layers=QWEN25_05B["num_hidden_layers"])
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default="/tmp/tailrl-real-configs")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    llm = LLM(checkpoint(a.cache), max_model_len=1024)
    out: dict = {"batches": {}}
    for b in [int(x) for x in a.batches.split(",")]:
        prompts = [[(7 * i + j) % 90 + 5 for j in range(8)] for i in range(b)]
        runs: dict[str, list[tuple[float, float]]] = {s: [] for s in SETTINGS}
        names = list(SETTINGS)
        for r in range(a.rounds + 1):                                # round 0 warms every shape up
            for s in (names if r % 2 == 0 else names[::-1]):
                sp = SamplingParams(max_tokens=a.tokens, ignore_eos=True, seed=r, **SETTINGS[s])
                llm.generate(prompts, sp, use_tqdm=False)
                m = llm.last_metrics
                steps = m["rollout/num_forward"]
                if r > 0:
                    runs[s].append((m["timing_s/sample"] / steps, m["timing_s/gen"] / steps))
        res = {}
        for s, v in runs.items():
            sample, step = statistics.median(x for x, _ in v), statistics.median(y for _, y in v)
            res[s] = {"sample_ms": round(1e3 * sample, 2), "step_ms": round(1e3 * step, 2),
                      "share": round(sample / step, 3)}
            print(f"batch {b:3d} {s:22s} sampler {res[s]['sample_ms']:7.2f} ms of a {res[s]['step_ms']:7.2f} ms "
                  f"step ({100 * res[s]['share']:.1f}%)", flush=True)
        out["batches"][str(b)] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()
