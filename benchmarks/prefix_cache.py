"""What automatic prefix caching (engine/kv/prefix.py) saves: a multi-turn rollout.

``--prompts`` held-out task prompts of `small`, ``--turns`` turns: each turn samples ``--n``
responses (T=1, ``--max-tokens``) per conversation, and the next turn's prompt is the last
prompt, its first response and a short follow-up (an agent loop's or a chat's shape: every turn
sends the whole conversation again). Two engines in one process, with and without the cache
(``enable_prefix_caching``), the same conversations (same seeds: the same tokens, checked),
alternating ABBA over ``--rounds``; reported per engine: the median seconds, the host's
scheduling and commit time per step (``timing_s/schedule`` + ``postprocess``: where the cache's
bookkeeping runs), the prompt tokens computed (prefill) and, with the cache, the share found
cached; the ratio. ``--turns 1`` measures what the cache costs where it finds nothing (the task
prompts are shorter than a block).

Usage: python benchmarks/prefix_cache.py [--model DIR] [--prompts 32 --n 4 --turns 4 --max-tokens 128 --rounds 2]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / "models" / "small"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()

    from transformers import AutoTokenizer

    from tailrl import LLM, SamplingParams
    from tailrl.tasks import mixture
    tok = AutoTokenizer.from_pretrained(a.model)
    # each round's conversations start from their own prompts (the warm-up's too): nothing of a
    # round is cached before it starts
    pool = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(a.prompts * (a.rounds + 1))]
    follow = tok.encode(" Check it again.")
    engines = {"cache": LLM(a.model, enable_prefix_caching=True), "no_cache": LLM(a.model, enable_prefix_caching=False)}

    def conversation(llm, r: int) -> tuple[float, float, int, int, int, list]:
        prompts = [p[:] for p in pool[r * a.prompts:(r + 1) * a.prompts]]
        outs, seconds, prefill, queried, hits, host, steps = [], 0.0, 0, 0, 0, 0.0, 0
        for t in range(a.turns):
            sp = [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=10_000 * r + 1000 * t + i)
                  for i in range(len(prompts))]
            start = time.perf_counter()
            got = llm.generate(prompts, sp)
            seconds += time.perf_counter() - start
            m = llm.last_metrics
            queried += int(m["kv/prefix_query_tokens"])
            host += m["timing_s/schedule"] + m["timing_s/postprocess"]
            steps += int(m["rollout/num_forward"])
            hits += int(m["kv/prefix_hit_tokens"])
            # prompt tokens computed: batched tokens less the decode and draft tokens
            prefill += int(m["rollout/batched_tokens"]) - sum(len(c.token_ids) for o in got for c in o.outputs)
            outs.append([[c.token_ids for c in o.outputs] for o in got])
            prompts = [p + list(o.outputs[0].token_ids) + follow for p, o in zip(prompts, got)]
        return seconds, 1e3 * host / max(steps, 1), prefill, queried, hits, outs

    for llm in engines.values():                         # warm-up
        conversation(llm, a.rounds)
    times: dict = {e: [] for e in engines}
    host_ms: dict = {e: [] for e in engines}
    figures: dict = {}
    outs: dict = {}
    order = list(engines)
    same = True
    for r in range(a.rounds):
        for e in order:
            seconds, ms, prefill, queried, hits, outs[e] = conversation(engines[e], r)
            times[e].append(seconds)
            host_ms[e].append(ms)
            figures[e] = (prefill, queried, hits)
        same = same and outs["cache"] == outs["no_cache"]
        order.reverse()
    result = {"model": a.model, "prompts": a.prompts, "n": a.n, "turns": a.turns, "max_tokens": a.max_tokens,
              "identical": same, "engines": {}}
    for e in engines:
        prefill, queried, hits = figures[e]
        sec, ms = statistics.median(times[e]), statistics.median(host_ms[e])
        result["engines"][e] = {"seconds": round(sec, 3), "host_ms_per_step": round(ms, 3), "prefill_tokens": prefill,
                                "hit_share": round(hits / queried, 3) if queried else 0.0}
        print(f"{e:9s} {sec:7.3f} s  schedule+commit {ms:.3f} ms/step  prompt tokens computed {prefill:7d}  "
              f"cached share of lookups {result['engines'][e]['hit_share']:.3f}", flush=True)
    result["speedup"] = round(statistics.median(times["no_cache"]) / statistics.median(times["cache"]), 3)
    print(f"with the cache: {result['speedup']:.3f}x  identical: {result['identical']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
