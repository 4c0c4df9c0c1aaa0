"""Scheduling ladder on real engines: admission order in one engine, placement across two.

Workload: held-out prompts of the workload model (64 x 8 samples, T = 1, max_tokens 960,
the engine's default dtype). Runs, all with the same per-prompt seeds, so every run samples
the same responses (the benchmark checks it):
- a history round with other seeds (the previous epoch: what `history` reads);
- the reference: one plain engine at the largest batch; its lengths are the oracle's
  (realisable because sampling is counter-based; evaluation only);
(a) one engine (`--threads`, default 1) at each `max_num_seqs`: FIFO (plain engine) and the context /
    history / oracle policies ordering admissions (the pool with one in-process instance);
    with `--speculative` their estimates also choose the critical rows that draft;
(b) two instances (worker processes, one thread each): static / divided / context / history
    / group-oracle / oracle placement, divided rollout in chunks of `--chunk` tokens; `--rounds`
    rounds in alternating order (per placement the median round is reported, with every
    round's makespan: the machine's speed drifts between runs).
Per run: makespan, tail time (`rollout/tail_s`: after 90% of responses finished) and
makespan / no-tail bound, the bound being T* = max(total tokens / the best full-batch
throughput measured in this run (a batch that never shrinks: EOS ignored), longest response
/ the single-stream rate measured in this run): no schedule beats it. The last line is one JSON
object: {"workload": {...}, "single": {...}, "pool": {...}, "targets": {...}}.
Usage: python benchmarks/pool.py [--model models/small] [--quick] [--rounds 3] [--speculative]
(run under `flock /tmp/tailrl_bench.lock` on a shared machine)
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import time

from tailrl import LLM, SamplingParams, SpeculativeConfig

log = logging.getLogger("benchmarks.pool")


def load_prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tailrl.tasks import mixture
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(ex.prompt) for ex in mixture.heldout_examples(count)]


def params(n: int, count: int, seed0: int, max_tokens: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=seed0 + i, **kw) for i in range(count)]


def run(llm: LLM, prompts, sp, pids, true_lengths=None) -> tuple[list[list[list[int]]], dict]:
    gc.collect()        # earlier runs' engines (KV caches of GBs) must not be freed during this one
    outs = llm.generate(prompts, sp, prompt_ids=pids, use_tqdm=False, true_lengths=true_lengths)
    return [[c.token_ids for c in o.outputs] for o in outs], dict(llm.last_metrics)


def full_batch_rate(llm: LLM, prompts, batch: int, tokens: int) -> float:
    """Tokens/s of a batch that stays full (EOS ignored): the throughput a tail-free rollout gets."""
    n = 8
    sel = [prompts[i % len(prompts)] for i in range(max(batch // n, 1))]
    llm.generate(sel[:1], SamplingParams(max_tokens=4, seed=3), use_tqdm=False)   # warm-up
    outs = llm.generate(sel, SamplingParams(n=n, temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=3),
                        use_tqdm=False)
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / llm.last_metrics["timing_s/gen"]


def single_stream_rate(llm: LLM, prompts, tokens: int) -> float:
    """Tokens/s of one request alone: how fast the longest response can possibly go."""
    outs = llm.generate(prompts[:1], SamplingParams(max_tokens=tokens, ignore_eos=True, seed=4), use_tqdm=False)
    return len(outs[0].outputs[0].token_ids) / llm.last_metrics["timing_s/gen"]


def no_tail_bound(total: int, longest: int, full_rate: float, single_rate: float, label: str) -> float:
    """T* = max(total tokens / saturated throughput, longest response / single-stream rate)."""
    bound = max(total / full_rate, longest / single_rate)
    print(f"{label}: full-batch {full_rate:.0f} tok/s, single stream {single_rate:.0f} tok/s: bound "
          f"max({total / full_rate:.1f}, {longest / single_rate:.1f}) = {bound:.1f} s", flush=True)
    return bound


def row(name: str, m: dict, bound: float, same: bool) -> dict:
    r = {"makespan_s": round(m["timing_s/gen"], 2), "tail_s": round(m["rollout/tail_s"], 2),
         "vs_bound": round(m["timing_s/gen"] / bound, 2), "identical": same}
    for k in ("pool/migrations", "pool/local_resumes", "pool/chunks", "pool/kv_bytes_moved", "rollout/num_forward",
              "rollout/mean_batch_size", "timing_s/forward", "rollout/preemptions"):
        if k in m:
            r[k.split("/")[1]] = m[k]
    busy = [v for k, v in m.items() if k.startswith("pool/busy_s/")]
    if busy:
        r["busy_s"] = [round(b, 1) for b in busy]
    print(f"  {name:<12} makespan {r['makespan_s']:7.1f} s  tail {r['tail_s']:6.1f} s  "
          f"makespan/bound {r['vs_bound']:5.2f}  identical {same}", flush=True)
    return r


def single_engine(a, prompts, sp, pids, ref, lengths, total: int) -> dict:
    """(a) one engine, all cores: admission order at each max_num_seqs."""
    out: dict = {}
    rates = {s: full_batch_rate(LLM(a.model, max_num_seqs=s, num_threads=a.threads), prompts, s, a.rate_tokens)
             for s in a.seqs}
    single = single_stream_rate(LLM(a.model, num_threads=a.threads), prompts, 256)
    print(f"one engine: full-batch tok/s by max_num_seqs {({s: round(r) for s, r in rates.items()})}", flush=True)
    bound = no_tail_bound(total, a.longest, max(rates.values()), single, "one engine")
    for seqs in a.seqs:
        print(f"one engine, max_num_seqs {seqs}:", flush=True)
        plain = LLM(a.model, max_num_seqs=seqs, num_threads=a.threads, speculative=a.speculative)
        res = {"full_batch_tok_s": round(rates[seqs], 1)}
        toks, m = run(plain, prompts, sp, pids)
        res["fifo"] = row("fifo", m, bound, toks == ref)
        for sched in ("context", "history", "oracle"):
            llm = LLM(a.model, max_num_seqs=seqs, num_threads=a.threads, scheduler=sched, pool={"processes": False},
                      speculative=a.speculative)
            for pid, g in a.history.items():
                llm.history.record(pid, g)
            toks, m = run(llm, prompts, sp, pids, lengths if sched == "oracle" else None)
            res[sched] = row(sched, m, bound, toks == ref)
        out[str(seqs)] = res
    return out


def two_instances(a, prompts, sp, pids, ref, lengths, total: int) -> dict:
    """(b) two worker processes, one thread each: placement policies, `--rounds` rounds in
    alternating order; per placement the round of median makespan is reported (and its steps
    kept for the simulator), with every round's makespan."""
    runs: dict[str, list] = {s: [] for s in a.placements}
    rate = bound = 0.0
    for rnd in range(a.rounds):
        for sched in (a.placements if rnd % 2 == 0 else a.placements[::-1]):
            llm = LLM(a.model, max_num_seqs=a.pool_seqs, scheduler=sched, speculative=a.speculative,
                      pool={"instances": 2, "threads_per_instance": 1, "chunk_tokens": a.chunk})
            try:
                if not rate:                             # both instances' batches full: the pool's best rate
                    rate = full_batch_rate(llm, prompts, 2 * a.pool_seqs, a.rate_tokens)
                    bound = no_tail_bound(total, a.longest, rate, single_stream_rate(llm, prompts, 256),
                                          "two instances")
                for pid, g in a.history.items():
                    llm.history.record(pid, g)
                llm.pool.step_log(True)
                toks, m = run(llm, prompts, sp, pids, lengths if "oracle" in sched else None)
                r = row(sched, m, bound, toks == ref)
                runs[sched].append((r, llm.pool.step_log(False)))      # steps per instance
                a.kv_bytes_per_token = llm.pool.info.kv_bytes_per_token
            finally:
                llm.close()
    out: dict = {}
    for sched, rs in runs.items():
        rs = sorted(rs, key=lambda x: x[0]["makespan_s"])
        r, a.step_logs[sched] = rs[(len(rs) - 1) // 2]
        out[sched] = {**r, "rounds_makespan_s": [x[0]["makespan_s"] for x in rs]}
    out["full_batch_tok_s"], out["bound_s"] = round(rate, 1), round(bound, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="models/small")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=960)
    p.add_argument("--seqs", type=int, nargs="+", default=[32, 64, 256], help="(a) max_num_seqs values")
    p.add_argument("--pool-seqs", type=int, default=256, help="(b) max_num_seqs per instance")
    p.add_argument("--chunk", type=int, default=240, help="(b) divided rollout chunk tokens")
    p.add_argument("--rate-tokens", type=int, default=64, help="tokens per request of the full-batch runs")
    p.add_argument("--quick", action="store_true", help="16 prompts x 4, max_tokens 480, max_num_seqs 16 / 64")
    p.add_argument("--threads", type=int, default=1,
                   help="(a) torch threads of the one engine (1: robust on a shared machine, where "
                        "spinning OpenMP threads of an oversubscribed engine make timings meaningless)")
    p.add_argument("--skip-single", action="store_true", help="only (b)")
    p.add_argument("--placements", nargs="+",
                   default=["static", "divided", "context", "history", "group-oracle", "oracle"],
                   help="(b) policies (static first: it measures the full-batch rate)")
    p.add_argument("--rounds", type=int, default=1, help="(b) rounds of every placement, in alternating order")
    p.add_argument("--no-sim", action="store_true", help="skip the simulator's predictions of (b)")
    p.add_argument("--speculative", action="store_true",
                   help="(a) and (b) with the default SpeculativeConfig() (its critical rows steered by "
                        "each scheduler's estimates)")
    p.add_argument("--step-log", help="(b): write every run's engine steps to this JSON file "
                   "({placement: [[steps of instance 0], [instance 1]]}; `tailrl simulate --step-times` "
                   "reads a list of steps as {\"steps\": [...]})")
    a = p.parse_args()
    a.speculative = SpeculativeConfig() if a.speculative else None
    a.step_logs = {}                                    # (b): each run's engine steps, both instances
    if a.quick:
        a.prompts, a.n, a.max_tokens, a.seqs, a.pool_seqs, a.chunk, a.rate_tokens = 16, 4, 480, [16, 64], 64, 120, 32
    logging.basicConfig(level=logging.WARNING)
    t0 = time.perf_counter()
    prompts = load_prompts(a.model, a.prompts)
    pids = [f"p{i}" for i in range(len(prompts))]
    sp = params(a.n, len(prompts), 1000, a.max_tokens)
    hist, _ = run(LLM(a.model, num_threads=a.threads), prompts, params(a.n, len(prompts), 5000, a.max_tokens), pids)
    a.history = dict(zip(pids, hist))                   # the previous epoch's responses
    ref, _ = run(LLM(a.model, max_num_seqs=max(a.seqs), num_threads=a.threads), prompts, sp, pids)
    lengths = [[len(t) for t in g] for g in ref]
    total = sum(map(sum, lengths))
    a.longest = max(map(max, lengths))
    print(f"workload: {len(prompts)} prompts x {a.n}, max_tokens {a.max_tokens}: {total} tokens, "
          f"mean {total / (len(prompts) * a.n):.0f}, max {max(map(max, lengths))}", flush=True)
    single = {} if a.skip_single else single_engine(a, prompts, sp, pids, ref, lengths, total)
    pool = two_instances(a, prompts, sp, pids, ref, lengths, total)
    ms = {k: v["makespan_s"] for k, v in pool.items() if isinstance(v, dict)}
    targets = {}
    if {"static", "context", "divided", "oracle"} <= set(ms):
        targets = {"context_speedup_vs_static": round(ms["static"] / ms["context"], 3),
                   "divided_speedup_vs_static": round(ms["static"] / ms["divided"], 3),
                   "context_vs_oracle": round(ms["context"] / ms["oracle"], 3)}
        targets["oracle_speedup_vs_static"] = round(ms["static"] / ms["oracle"], 3)
        print(f"two instances: context {targets['context_speedup_vs_static']:.2f}x over static (target >= 1.25; "
              f"the oracle's placement: {targets['oracle_speedup_vs_static']:.2f}x), "
              f"{(targets['context_vs_oracle'] - 1) * 100:+.0f}% vs oracle (target within 15%)", flush=True)
    print(f"{time.perf_counter() - t0:.0f} s in all", flush=True)
    workload = {"prompts": len(prompts), "n": a.n, "max_tokens": a.max_tokens, "total_tokens": total,
                "max_length": max(map(max, lengths)), "chunk_tokens": a.chunk}
    if a.step_log:
        with open(a.step_log, "w") as f:
            json.dump(a.step_logs, f)
    if a.speculative and not a.no_sim:
        print("simulator: skipped with --speculative (its step model does not play drafts, critical rows "
              "or max_spec_batch)", flush=True)
    sim = {} if a.no_sim or a.speculative else simulated(a, prompts, lengths, pool)
    print(json.dumps({"workload": workload, "single": single, "pool": pool, "targets": targets, "sim": sim}))


def simulated(a, prompts, lengths, pool: dict) -> dict:
    """The simulator predicting (b)'s makespans on the same trace, with two calibrations of its
    step model: a grid of engine steps measured apart from the rollouts (two processes at once,
    one thread each), and the steps the first placement's run made (then its prediction is a
    fit, the others' are predictions)."""
    from pool_sim import calibrate, predict, trace_of

    from tailrl.sim.step_model import CalibratedStepModel
    grid, samples = calibrate(a.model, threads=1, instances=2)
    names = [k for k, v in pool.items() if isinstance(v, dict)]
    first = names[0]
    steps = [s for inst in a.step_logs[first] for s in inst]
    models = {"grid": grid, f"{first} steps": CalibratedStepModel.fit(steps)}
    hist = [[len(t) for t in a.history[f"p{i}"]] for i in range(len(prompts))]
    trace = trace_of(prompts, lengths, hist, a.max_tokens)
    out: dict = {}
    for label, model in models.items():
        pred = predict(trace, model, names, 2, a.pool_seqs, a.chunk, a.kv_bytes_per_token)
        res = out[label] = {"step_model": {k: float(f"{getattr(model, k):.3g}") for k in ("c0", "c1", "c2", "c3")}}
        n = len(samples) if label == "grid" else len(steps)
        print(f"simulator calibrated on {label} ({n} measured steps) vs the real pool:", flush=True)
        for name in names:
            real = pool[name]["makespan_s"]
            res[name] = {"sim_s": round(pred[name], 2), "real_s": real, "sim_over_real": round(pred[name] / real, 3)}
            print(f"  {name:<12} sim {pred[name]:7.1f} s  real {real:7.1f} s  sim/real {pred[name] / real:5.2f}",
                  flush=True)
    return out


if __name__ == "__main__":
    main()
