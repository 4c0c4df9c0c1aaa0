"""Admission order for one engine: longest expected first (engine/admission.py) against arrival
order, on the benchmark rollout.

``small`` (or ``--model``), ``--prompts`` held-out task prompts x ``--n``, T=1, max
``--max-tokens``, ``max_num_seqs`` 256 (half the requests wait at first), round 2 timed with
round 1 (other seeds) as the history the estimates come from; plain decoding and the default
speculation, each with the history's order and with arrival order (``LLM.generate``'s
estimates switched off in this process: the engine as it was before them). Per engine: its
steps, the longest response (the bound on a GPU, whose step costs about the same whatever the
rows: steps over longest response + 1), its makespan (this CPU computes every row, so there
the order changes little), and whether every response equals plain decoding's with the
history's order. Engines in turn, every other round reversed; each engine's median round.
The last line is one JSON object.

Usage: python benchmarks/admission.py [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "small"))
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    import tailrl.llm as llm_module
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.tasks import mixture
    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(a.prompts)]
    pids = [f"p{i}" for i in range(len(prompts))]
    history_order = llm_module.by_history

    def params(seed: int) -> list:
        return [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=seed + i)
                for i in range(len(prompts))]

    engines = [(f"{spec}_{order}", spec, order) for spec in ("plain", "default") for order in ("history", "arrival")]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in engines}
    want = None
    for rnd in range(a.rounds):
        for name, spec, order in (engines if rnd % 2 == 0 else engines[::-1]):
            llm_module.by_history = history_order if order == "history" else (lambda reqs, history: reqs)
            llm = LLM(a.model, speculative=SpeculativeConfig() if spec == "default" else None)
            llm.generate(prompts, params(10_000), prompt_ids=pids)             # round 1: the history
            t = time.perf_counter()
            got = llm.generate(prompts, params(20_000), prompt_ids=pids)
            wall = time.perf_counter() - t
            responses = [(c.token_ids, c.logprobs) for o in got for c in o.outputs]
            want = responses if want is None and name == "plain_history" else want
            longest = max(len(r[0]) for r in responses)
            steps = int(llm.last_metrics["rollout/num_forward"])
            res = {"steps": steps, "longest": longest, "steps_over_bound": round(steps / (longest + 1), 3),
                   "makespan_s": round(wall, 3),
                   "identical": responses == want if want is not None else None}
            runs[name].append(res)
            print(f"round {rnd}", name, json.dumps(res), flush=True)
    llm_module.by_history = history_order
    out: dict = {"engines": {}}
    for name, rs in runs.items():
        res = dict(sorted(rs, key=lambda x: x["makespan_s"])[len(rs) // 2])
        res["makespans_s"] = [x["makespan_s"] for x in rs]
        out["engines"][name] = res
    e = out["engines"]
    for spec in ("plain", "default"):
        arrival, history = e[f"{spec}_arrival"]["steps"], e[f"{spec}_history"]["steps"]
        out[f"{spec}_steps_arrival_over_history"] = round(arrival / history, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
