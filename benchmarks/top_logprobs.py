"""What vLLM's ``logprobs = N`` (engine/top_logprobs.py) costs a rollout.

`small`'s rollout (``--prompts`` held-out task prompts x ``--n``, T=1, ``--max-tokens``), plain
and with the default speculation (drafting from the round before), with ``logprobs`` None
(the sampled token's log-probability only), 1, 5 and 20. The responses are the same in every
setting (asking changes no token), so the rollouts compare directly. Every setting runs in one
process, the settings rotated between rounds, the median of ``--rounds`` each; reported:
seconds, that time against ``logprobs`` None's, and whether every engine gave the plain
engine's tokens, log-probabilities and alternatives (it must).

A request that asks is stepped one step at a time, its step sampled outside CUDA graphs, and
each token it keeps gets a pass over its row of logits (top N, ranks): the host's work.

Usage: python benchmarks/top_logprobs.py [--prompts 16 --n 8 --max-tokens 256 --rounds 3]
The last line is one JSON object.
"""
from __future__ import annotations

import json
import statistics
import time

from rollout_setup import rollout_args, task_prompts

SETTINGS = {"none": None, "top1": 1, "top5": 5, "top20": 20}


def main() -> None:
    a = rollout_args(__doc__)
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    prompts, pids = task_prompts(a.model, a.prompts)
    engines = {"plain": LLM(a.model), "default": LLM(a.model, speculative=SpeculativeConfig())}

    def rollout(llm, n: int | None, seed: int):
        params = [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=seed + i, logprobs=n)
                  for i in range(len(prompts))]
        t = time.perf_counter()
        outs = llm.generate(prompts, params, prompt_ids=pids)
        return time.perf_counter() - t, [[(c.token_ids, c.logprobs, c.top_logprobs) for c in o.outputs]
                                         for o in outs]

    for llm in engines.values():                       # warm-up, and the speculative engine's history
        rollout(llm, None, 10_000)
    times: dict = {(e, s): [] for e in engines for s in SETTINGS}
    same = True
    tokens = 0
    order = list(SETTINGS)
    for _ in range(a.rounds):
        for s in order:
            outs = {}
            for e, llm in engines.items():
                sec, outs[e] = rollout(llm, SETTINGS[s], 20_000)
                times[(e, s)].append(sec)
            same = same and outs["plain"] == outs["default"]
            tokens = sum(len(ids) for g in outs["plain"] for ids, _, _ in g)
        order = order[1:] + order[:1]
    result: dict = {"prompts": a.prompts, "n": a.n, "max_tokens": a.max_tokens, "rounds": a.rounds,
                    "tokens": tokens, "identical": same, "runs": {}}
    for e in engines:
        base = statistics.median(times[(e, "none")])
        for s in SETTINGS:
            med = statistics.median(times[(e, s)])
            result["runs"][f"{e}/{s}"] = {"seconds": round(med, 3), "time_vs_none": round(med / base, 3)}
            print(f"{e:8s} logprobs={str(SETTINGS[s]):5s} {med:7.3f} s  {med / base:5.2f}x the time without")
    print(f"{tokens} tokens a rollout; speculation gave the plain engine's outputs: {same}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
