"""The paged K/V pool against the per-row cache it replaced, in one invocation.

Per model (``--models``: presets, stand-ins of small such as ``0.5b-kv``, the K/V-heavy one,
or checkpoint directories) and tree (this checkout, and with ``--baseline-ref REF`` the tree
at that git commit, checked out into a worktree and built once): a worker process loads the
model, runs round 1 of the rollout (``--prompts`` held-out task prompts x ``--n``, T=1,
``--max-tokens``, bfloat16; untimed: it fills the history and warms the engine, its cache
included) and then the timed round 2 with round 1 as history, for each setting (``plain``,
``default``: ``SpeculativeConfig()``), each in its own engine. The trees alternate in ABBA
order over ``--rounds`` rounds (a worker per tree and round).

Per timed rollout: the makespan, minor and major page faults and system time of the worker
process during it (``getrusage``), the pool's figures (``kv/*`` metrics: blocks, peak blocks
used and shared, pool allocations during the rollout), and a digest of the responses: both
trees compute the same bfloat16 bits, so equal digests say the pool changed no token.

The last line is one JSON object: {"models": {name: {"trees": {tree: {setting: {"makespan_s":
[per round], "median_s", "minflt", "majflt", "stime_s", "kv", "digest", "tokens"}}},
"ratios": {"plain_new_over_base", "default_new_over_base", "default_speedup_new",
"default_speedup_base", "minflt_new_over_base"}, "same_tokens"}}, "config": {...}}.

Usage:
  python benchmarks/kv_pool.py --models small,0.5b,0.5b-kv --baseline-ref 3fc8144 [--rounds 2]
Cost on this 2-core machine: a 16 x 8, max-512 rollout takes ~2 s on small, ~25 s on 0.5b;
on 0.5b-kv the per-row cache took ~90-100 s (mostly page faults), the pool ~25 s.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import resource
import statistics
import sys
import time
from pathlib import Path

from trees import abba, compared_trees, run_in_tree

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
HISTORY_SEED, TIMED_SEED = 10_000, 20_000


# ---- the worker: one model, one tree --------------------------------------------------------
def worker(a: argparse.Namespace) -> None:
    from transformers import AutoTokenizer

    import tailrl
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.tasks import mixture

    tok = AutoTokenizer.from_pretrained(a.model)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(a.prompts)]
    out = {"tailrl": str(Path(tailrl.__file__).parent), "settings": {}}
    for name in a.settings.split(","):
        spec = None if name == "plain" else SpeculativeConfig()
        llm = LLM(a.model, dtype=a.dtype, seed=0, speculative=spec)

        def rollout(llm: LLM, seed: int) -> list:
            params = [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=seed + i)
                      for i in range(len(prompts))]
            return llm.generate(prompts, params, prompt_ids=[f"p{i}" for i in range(len(prompts))])

        rollout(llm, HISTORY_SEED)                             # round 1: the history, a warm engine
        before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        outs = rollout(llm, TIMED_SEED)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        m = llm.last_metrics
        tokens = [c.token_ids for o in outs for c in o.outputs]
        out["settings"][name] = {
            "makespan_s": m["timing_s/gen"], "wall_s": wall,
            "minflt": after.ru_minflt - before.ru_minflt, "majflt": after.ru_majflt - before.ru_majflt,
            "stime_s": after.ru_stime - before.ru_stime, "utime_s": after.ru_utime - before.ru_utime,
            "kv": {k: v for k, v in m.items() if k.startswith("kv/")},
            "accept_length": m.get("rollout/spec_accept_length", 0.0),
            "tokens": sum(map(len, tokens)),
            "digest": hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16]}
        del llm
    print(json.dumps(out), flush=True)


# ---- the driver -----------------------------------------------------------------------------
def run_worker(tree: Path, model: str, a: argparse.Namespace) -> dict:
    return run_in_tree(tree, HERE / "kv_pool.py", ["--model", model, "--settings", a.settings, "--prompts",
                       str(a.prompts), "--n", str(a.n), "--max-tokens", str(a.max_tokens), "--dtype", a.dtype],
                       a.timeout)["settings"]


def summarise(runs: list[dict]) -> dict:
    out = {}
    for name in runs[0]:
        rs = [r[name] for r in runs]
        out[name] = {"makespan_s": [round(r["makespan_s"], 3) for r in rs],
                     "median_s": round(statistics.median(r["makespan_s"] for r in rs), 3),
                     "minflt": int(statistics.median(r["minflt"] for r in rs)),
                     "majflt": int(statistics.median(r["majflt"] for r in rs)),
                     "stime_s": round(statistics.median(r["stime_s"] for r in rs), 2),
                     "kv": rs[-1]["kv"], "accept_length": round(rs[-1]["accept_length"], 2),
                     "tokens": rs[-1]["tokens"], "digest": rs[-1]["digest"],
                     "digests_agree": len({r["digest"] for r in rs}) == 1}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="small,0.5b,0.5b-kv")
    ap.add_argument("--baseline-ref", default=None, help="git commit of the tree to compare against")
    ap.add_argument("--standin-dir", default="/tmp/tailrl-standins")
    ap.add_argument("--settings", default="plain,default")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per worker")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    sys.path.insert(0, str(HERE))
    from regime import model_dir  # builds stand-ins of small on first use

    trees = compared_trees(a.baseline_ref)
    report: dict = {"models": {}, "config": {k: v for k, v in vars(a).items() if k not in ("worker", "model")}}
    for name in a.models.split(","):
        mdir = model_dir(name, Path(a.standin_dir))
        runs: dict[str, list] = {t: [] for t in trees}
        for r, t in abba(trees, a.rounds):
            runs[t].append(run_worker(trees[t], mdir, a))
            s = runs[t][-1]
            print(f"{name:8s} round {r} {t:4s} " + "  ".join(
                f"{k} {v['makespan_s']:7.2f} s ({v['minflt'] / 1e3:8.1f}k faults, sys {v['stime_s']:5.1f} s)"
                for k, v in s.items()), flush=True)
        res = {"trees": {t: summarise(v) for t, v in runs.items()}}
        new = res["trees"]["new"]
        ratios = {}
        if "default" in new and "plain" in new:
            ratios["default_speedup_new"] = round(new["plain"]["median_s"] / new["default"]["median_s"], 3)
        if "base" in trees:
            base = res["trees"]["base"]
            for k in new:
                ratios[f"{k}_new_over_base"] = round(new[k]["median_s"] / base[k]["median_s"], 3)
                ratios[f"{k}_minflt_new_over_base"] = round(new[k]["minflt"] / max(base[k]["minflt"], 1), 5)
            if "default" in base and "plain" in base:
                ratios["default_speedup_base"] = round(base["plain"]["median_s"] / base["default"]["median_s"], 3)
            res["same_tokens"] = all(new[k]["digest"] == base[k]["digest"] for k in new)
        res["ratios"] = ratios
        report["models"][name] = res
        print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in ratios.items())
              + (f", same tokens in both trees: {res['same_tokens']}" if "same_tokens" in res else ""), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
