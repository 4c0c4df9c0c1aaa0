"""Admission order for one engine: longest expected first (engine/admission.py) against arrival
order, on the benchmark rollout.

``small`` (or ``--model``), 64 held-out task prompts x 8, T=1, max 512 (the benchmark
rollout, as benchmarks/pool.py loads it), ``max_num_seqs`` 256 (half the requests wait at first), round 2 timed with
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

from pool import load_prompts, params

import tailrl.llm as llm_module
from tailrl import LLM, SpeculativeConfig

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "small"))
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    prompts = load_prompts(a.model, 64)
    pids = [f"p{i}" for i in range(len(prompts))]
    history_order = llm_module.by_history

    engines = [(f"{spec}_{order}", spec, order) for spec in ("plain", "default") for order in ("history", "arrival")]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in engines}
    want = None
    for rnd in range(a.rounds):
        for name, spec, order in (engines if rnd % 2 == 0 else engines[::-1]):
            llm_module.by_history = history_order if order == "history" else (lambda reqs, history: reqs)
            llm = LLM(a.model, speculative=SpeculativeConfig() if spec == "default" else None)
            llm.generate(prompts, params(8, len(prompts), 10_000, 512), prompt_ids=pids)   # round 1: the history
            t = time.perf_counter()
            got = llm.generate(prompts, params(8, len(prompts), 20_000, 512), prompt_ids=pids)
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
