"""What vLLM's logit processing (engine/logits_process.py) costs a rollout.

`small`'s rollout (``--prompts`` held-out task prompts x ``--n``, T=1, ``--max-tokens``), plain
and with the default speculation (drafting from the round before), for each setting: none,
a repetition penalty, presence and frequency penalties, min_p, min_tokens. Every setting's
rollouts run in one process, the settings rotated between rounds (the first of a round goes
last in the next), the median of ``--rounds`` per setting; reported: seconds, the tokens
generated (the settings change the responses, min_tokens lengthens them), tokens a second
against no processing's, the host's sampling stage per step (``timing_s/sample``, ms), and
whether the speculative engine gave the plain engine's tokens and log-probabilities (it must).

Usage: python benchmarks/logits_process.py [--prompts 16 --n 8 --max-tokens 256 --rounds 3]
The last line is one JSON object.
"""
from __future__ import annotations

import json
import statistics
import time

from rollout_setup import rollout_args, task_prompts

SETTINGS = {"none": {}, "repetition_penalty": {"repetition_penalty": 1.1},
            "presence_frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.2},
            "min_p": {"min_p": 0.05}, "min_tokens": {"min_tokens": 64}}


def main() -> None:
    a = rollout_args(__doc__)
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    prompts, pids = task_prompts(a.model, a.prompts)
    engines = {"plain": LLM(a.model), "default": LLM(a.model, speculative=SpeculativeConfig())}

    def params(kw: dict, seed: int) -> list:
        return [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=seed + i, **kw)
                for i in range(len(prompts))]

    def rollout(llm, kw: dict, seed: int):
        t = time.perf_counter()
        outs = llm.generate(prompts, params(kw, seed), prompt_ids=pids)
        seconds = time.perf_counter() - t
        m = llm.last_metrics
        sample_ms = 1e3 * m.get("timing_s/sample", 0.0) / max(m.get("rollout/num_forward", 1.0), 1.0)
        return seconds, sample_ms, [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs]

    def tokens(outs) -> int:
        return sum(len(ids) for group in outs for ids, _ in group)

    for name, kw in SETTINGS.items():                  # warm-up, and the speculative engine's history
        for llm in engines.values():
            rollout(llm, kw, 10_000)
    times: dict = {(e, s): [] for e in engines for s in SETTINGS}
    samples: dict = {(e, s): [] for e in engines for s in SETTINGS}
    generated: dict = {}
    same: dict = {}
    order = list(SETTINGS)
    for r in range(a.rounds):
        for s in order:
            outs = {}
            for e, llm in engines.items():
                sec, ms, outs[e] = rollout(llm, SETTINGS[s], 20_000)
                times[(e, s)].append(sec)
                samples[(e, s)].append(ms)
                generated[(e, s)] = tokens(outs[e])
            same[s] = same.get(s, True) and outs["plain"] == outs["default"]
        order = order[1:] + order[:1]
    result: dict = {"prompts": a.prompts, "n": a.n, "max_tokens": a.max_tokens, "rounds": a.rounds, "runs": {}}
    for e in engines:
        base = generated[(e, "none")] / statistics.median(times[(e, "none")])
        for s in SETTINGS:
            sec = statistics.median(times[(e, s)])
            ms = statistics.median(samples[(e, s)])
            rate = generated[(e, s)] / sec / base
            result["runs"][f"{e}/{s}"] = {"seconds": round(sec, 3), "tokens": generated[(e, s)],
                                          "tokens_per_s_ratio": round(rate, 3), "sample_ms_per_step": round(ms, 3)}
            print(f"{e:8s} {s:20s} {sec:7.3f} s  {generated[(e, s)]:6d} tokens  tokens/s x{rate:5.3f}  "
                  f"sample {ms:6.3f} ms/step", flush=True)
    result["identical_with_speculation"] = same
    print(json.dumps(result))


if __name__ == "__main__":
    main()
