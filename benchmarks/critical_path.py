"""Critical-path drafting: where speculation is off by batch size, the requests expected to run
longest still draft (`SpeculativeConfig.critical_rows`). Makespan and tail per setting.

Workload as benchmarks/pool.py: 64 held-out prompts x 8 samples of `models/small`, T = 1, max
960 tokens, a history round with other seeds (what `history` estimates from), the reference
run's lengths for `oracle`. One engine (the pool's in-process instance, all cores,
max_num_seqs 256; `fifo`: the plain engine, which has no estimates, so its critical_rows
change nothing: a baseline) per scheduler and `critical_rows` value, `--rounds` rounds; every run is
checked against plain decoding. The last line is one JSON object.
Usage: python benchmarks/critical_path.py [--rows 0 8 32] [--schedulers fifo history oracle] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json

from pool import load_prompts, params, run

from tailrl import LLM, SpeculativeConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/small")
    p.add_argument("--rows", type=int, nargs="+", default=[0, 8, 32], help="critical_rows values")
    p.add_argument("--schedulers", nargs="+", default=["history", "oracle"])
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args()
    prompts = load_prompts(a.model, 64)
    pids = [f"p{i}" for i in range(len(prompts))]
    hist, _ = run(LLM(a.model), prompts, params(8, len(prompts), 5000, 960), pids)
    sp = params(8, len(prompts), 1000, 960)
    ref, _ = run(LLM(a.model), prompts, sp, pids)
    lengths = [[len(t) for t in g] for g in ref]
    out: dict = {}
    for _ in range(a.rounds):
        for sched in a.schedulers:
            for rows in a.rows:
                spec = SpeculativeConfig(critical_rows=rows)
                llm = (LLM(a.model, speculative=spec) if sched == "fifo" else
                       LLM(a.model, scheduler=sched, pool={"processes": False}, speculative=spec))
                for pid, g in zip(pids, hist):
                    llm.history.record(pid, g)
                toks, m = run(llm, prompts, sp, pids, lengths if sched == "oracle" else None)
                res = {"makespan_s": round(m["timing_s/gen"], 2), "tail_s": round(m["rollout/tail_s"], 2),
                       "identical": toks == ref}
                out.setdefault(sched, {}).setdefault(str(rows), []).append(res)
                print(f"{sched:<8} critical_rows {rows:>3}: makespan {res['makespan_s']:5.2f} s  "
                      f"tail {res['tail_s']:5.2f} s  identical {res['identical']}", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
