"""Rows drafting inside steps launched ahead (``SpeculativeConfig.ahead_drafts``) against plain
steps launched ahead, on the benchmark rollout.

``small`` (or ``--model``), ``--prompts`` held-out task prompts x ``--n``, T=1, max
``--max-tokens``, round 2 timed with round 1 (other seeds) as the history: plain decoding with
steps launched ahead, then for each of ``--rows`` an engine whose steps are all launched ahead
(``ahead_above=1``) with that many rows drafting in them (engine/ahead_drafts.py), once per
``--gates`` value (``always``: they draft whenever their drafts are expected to pay;
``measured``: where the rollout measures drafting faster, engine/drafts_gate.py). Per engine:
its steps, its makespan, the host's milliseconds per step by stage (``timing_s/...``), verify
steps and tokens accepted per verify, the follow-ups' queries and hits (rows that verified
and had the accept length they got followed up: engine/ahead_drafts.py), and whether every
response (tokens and log-probabilities) equals plain decoding's. On a CPU no step overlaps the host's work (the
host computes the forward), so there the makespan is not what a GPU sees: the steps are, a
GPU's step launched ahead costing about the same from 1 to a few hundred tokens (#33), and
each stage is host time a GPU's step must cover. ``--device cuda`` runs it on a GPU, where
the makespan is the figure. ``--rounds`` repeats every engine (in turn, every other round in
reverse order) and reports each engine's median round. ``--graphs`` takes a CPU's steps through the CUDA graphs' input
path (static inputs, the sampler in the graph; the capture an eager call), whose host work is
a GPU's. The last line is one JSON object.

Usage: python benchmarks/ahead_drafts.py [--rows 16,64] [--gates always,measured] [--rounds 1] [--graphs]
       [--device cpu]
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
    ap.add_argument("--rows", default="16,64")
    ap.add_argument("--gates", default="always,measured", help="ahead_drafts_gate values, an engine each")
    ap.add_argument("--rounds", type=int, default=1,
                    help="rounds of every engine, each a new engine, in turn, every other round in reverse order; "
                         "reported: each engine's median round by makespan")
    ap.add_argument("--graphs", action="store_true",
                    help="on a CPU, steps through the CUDA graphs' input path (capture: an eager call), "
                         "whose host work is a GPU's")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.engine.batch import ModelRunner
    from tailrl.engine.graph_pool import GraphPool, eager_capture
    from tailrl.engine.graphs import StepGraphs
    from tailrl.tasks import mixture
    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(a.prompts)]
    pids = [f"p{i}" for i in range(len(prompts))]

    def params(seed: int) -> list:
        return [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=seed + i)
                for i in range(len(prompts))]

    out: dict = {"device": a.device, "engines": {}}
    plain = None
    engines = [("plain", None)]
    for r in a.rows.split(","):
        for gate in a.gates.split(","):
            name = f"ahead_drafts_{r}" + ("" if gate == "always" else f"_{gate}")
            engines.append((name, SpeculativeConfig(ahead_drafts=int(r), ahead_above=1, ahead_drafts_gate=gate)))
    runs: dict[str, list[dict]] = {name: [] for name, _ in engines}
    for rnd in range(a.rounds):                     # each round the engines in turn, every other round reversed
        for name, spec in (engines if rnd % 2 == 0 else engines[::-1]):
            llm = LLM(a.model, device=a.device, speculative=spec, async_scheduling=True)
            if a.graphs:
                e = llm.engine
                e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture),
                                                                  1024, grouped=spec is not None))
            llm.generate(prompts, params(10_000), prompt_ids=pids)             # round 1: the history
            t = time.perf_counter()
            got = llm.generate(prompts, params(20_000), prompt_ids=pids)
            wall = time.perf_counter() - t
            m = llm.last_metrics
            steps = m["rollout/num_forward"]
            responses = [(c.token_ids, c.logprobs) for o in got for c in o.outputs]
            plain = responses if plain is None and spec is None else plain
            res = {"steps": int(steps), "makespan_s": round(wall, 3),
                   "identical_share": sum(x == y for x, y in zip(plain, responses)) / len(responses) if plain else None,
                   "verify_steps": int(m.get("rollout/spec_verify_steps", 0)),
                   "accept_length": round(m.get("rollout/spec_accept_length", 0.0), 2),
                   "gate_steps": {w: int(m[f"rollout/ahead_{w}_steps"]) for w in ("draft", "plain")
                                  if f"rollout/ahead_{w}_steps" in m},
                   "follow_ups": {k: int(m.get(f"rollout/ahead_follow_{k}", 0)) for k in ("ups", "hits")},
                   "host_ms_per_step": {k.split("/")[1]: round(v / steps * 1e3, 3) for k, v in m.items()
                                        if k.startswith("timing_s/") and k not in ("timing_s/gen", "timing_s/forward")}}
            runs[name].append(res)
            print(f"round {rnd}", name, json.dumps(res), flush=True)
            del llm
    for name, rs in runs.items():                   # the median round of each engine, by makespan
        res = dict(sorted(rs, key=lambda x: x["makespan_s"])[len(rs) // 2])
        res["makespans_s"] = [x["makespan_s"] for x in rs]
        if name != "plain":
            base = out["engines"]["plain"]
            res.update(steps_over_plain=round(res["steps"] / base["steps"], 3),
                       plain_over_makespan=round(base["makespan_s"] / res["makespan_s"], 3))
        out["engines"][name] = res
        print(name, json.dumps(res), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
