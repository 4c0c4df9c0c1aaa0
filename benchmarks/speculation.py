"""Speculation off vs on for one rollout of the workload model, in one run.

Rollout: 64 held-out prompts x 8 samples at temperature 1.0. History = the same prompts'
responses from a previous sampling round (other seeds), as the previous epoch in RL. Reports:
- makespan, tokens/s, tail time, and the makespan over the no-tail bound (total tokens / the
  plain engine's full-batch throughput, measured in the same run); off and on rollouts back to back in ABBA order,
  ``--rollout-pairs`` times; the speedup is the mean of the pairs', the other figures are the
  first pair's); mean accepted length overall, in the tail, and per source; share of
  responses identical with speculation on and off (``--dtype``, bfloat16 by default);
- acceptance vs number of finished sibling references (0, 1, 3, 7), chain vs 4-path tree, by
  exact replay of the rollout's responses (tailrl/speculative/replay.py): the shape of Seer's Table 2;
- tokens/s at fixed batch sizes (EOS ignored so the batch stays full) off vs on: after a
  warm-up run of each, three pairs in ABBA order, the median of the pairs' ratios.
The last line is one JSON object: {"rollout": {...}, "by_references": {...}, "fixed_batch": {...}}.
Usage: python benchmarks/speculation.py [--model small] [--prompts 64] [--n 8] [--quick]
"""
from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import numpy as np

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.speculative.replay import replay


def load_prompts(model_dir: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from tailrl.tasks import mixture
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(ex.prompt) for ex in mixture.heldout_examples(count)]


def rollout(llm: LLM, prompts, n: int, seed0: int, max_tokens: int, **kw):
    params = [SamplingParams(n=n, temperature=1.0, top_k=-1, max_tokens=max_tokens, seed=seed0 + i, **kw)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, prompt_ids=[f"p{i}" for i in range(len(prompts))], use_tqdm=True)
    return [[c.token_ids for c in o.outputs] for o in outs], dict(llm.last_metrics)


def full_batch_throughput(model_dir: str, prompts, dtype: str, rows: int = 256, tokens: int = 200,
                          device: str = "cpu") -> float:
    """Best of two runs: tokens/s of the plain engine with a full batch (EOS ignored). Total
    tokens / this is the rollout's no-tail bound: no schedule or draft beats it on this machine."""
    llm = LLM(model_dir, seed=0, dtype=dtype, device=device)
    sel = [prompts[i % len(prompts)] for i in range(rows // 8)]
    best = 0.0
    for _ in range(2):
        llm.generate(sel, SamplingParams(n=8, max_tokens=tokens, ignore_eos=True, seed=3), use_tqdm=False)
        best = max(best, llm.last_metrics["perf/tokens_per_s"])
    return best


def by_references(prompts, groups, ks=(0, 1, 3, 7), depth: int = 8) -> dict:
    """Mean tokens per verify step when drafting from k finished siblings (+ self), chain vs tree."""
    out = {}
    for k in ks:
        for shape, paths in (("chain", 1), ("tree4", 4)):
            steps = []
            for prompt, group in zip(prompts, groups):
                for i, resp in enumerate(group):
                    refs = [r for j, r in enumerate(group) if j != i][:k]
                    steps += replay(prompt, resp, refs, max_tokens=depth, max_paths=paths)
            out[f"k{k}/{shape}"] = float(np.mean(steps)) if steps else 1.0
    return out


def fixed_batch(model_dir: str, prompts, history, sizes, tokens: int, spec_cfg: dict, dtype: str,
                pairs: int = 3) -> dict:
    """Per batch size: one unmeasured run of each engine (warm-up; the policy learns this
    batch size as it would over an RL run), then ``pairs`` alternating off/on runs; the
    ratio is the median of the pairs' ratios (absolute speeds drift by +-30% between minutes
    on this machine, a pair's two runs are seconds apart)."""
    res = {}
    plain = LLM(model_dir, seed=0, dtype=dtype)
    spec = LLM(model_dir, seed=0, dtype=dtype, speculative=SpeculativeConfig(**spec_cfg))
    for b in sizes:
        n = min(b, 8)
        sel = [prompts[i % len(prompts)] for i in range(max(b // n, 1))]
        pids = [f"p{i % len(prompts)}" for i in range(len(sel))]
        sp = SamplingParams(n=n, temperature=1.0, top_k=-1, max_tokens=tokens, ignore_eos=True, seed=7)

        def run(llm: LLM) -> float:
            # every run drafts from the previous sampling round; `generate` records its own
            # responses as the next history, and a repeat (same seed) would then draft from
            # the very tokens it is about to sample
            for i, pid in enumerate(pids):
                spec.history.record(pid, history[i % len(prompts)])
            t = time.perf_counter()
            outs = llm.generate(sel, sp, prompt_ids=pids, use_tqdm=False)
            return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t)

        run(plain), run(spec)
        rates = []
        for k in range(pairs):       # ABBA order: the machine drifts (measured: 15-20% slower
            if k % 2 == 0:           # after a minute of back-to-back runs), a fixed order would
                off = run(plain)     # favour whichever engine runs first
                rates.append((off, run(spec)))
            else:
                on = run(spec)
                rates.append((run(plain), on))
        ratio = float(np.median([on / off for off, on in rates]))
        off, on = float(np.median([r[0] for r in rates])), float(np.median([r[1] for r in rates]))
        res[str(b)] = {"off_tok_s": round(off, 1), "on_tok_s": round(on, 1), "ratio": round(ratio, 3),
                       "pair_ratios": [round(y / x, 3) for x, y in rates],
                       "accept_length": round(spec.last_metrics.get("rollout/spec_accept_length", 0.0), 2)}
        print(f"batch {b:>4}: off {off:8.0f} tok/s, on {on:8.0f} tok/s, ratio {ratio:.3f} "
              f"(pairs {', '.join(f'{y / x:.2f}' for x, y in rates)})", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small", help="checkpoint directory or preset name")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=960)
    ap.add_argument("--batch-sizes", default="1,4,16,64,256")
    ap.add_argument("--fixed-tokens", type=int, default=128)
    ap.add_argument("--rollout-pairs", type=int, default=2, help="off/on rollout pairs (speedup: their mean)")
    ap.add_argument("--quick", action="store_true", help="16 prompts, batch sizes 1,16")
    ap.add_argument("--dtype", default="bfloat16", help="engine dtype (float32 responses may differ by near-ties)")
    ap.add_argument("--spec", default="{}", help='SpeculativeConfig fields as JSON, e.g. \'{"max_spec_batch": 8}\'')
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if a.quick:
        a.prompts, a.batch_sizes = 16, "1,16"
    model_dir = a.model
    if not Path(model_dir).is_dir():
        from tailrl.tasks.models import get_model
        model_dir = get_model(a.model)
    prompts = load_prompts(model_dir, a.prompts)

    plain = LLM(model_dir, seed=0, dtype=a.dtype)
    history, _ = rollout(plain, prompts, a.n, 10_000, a.max_tokens)          # the "previous epoch"
    spec_cfg = {"method": "suffix", **json.loads(a.spec)}
    spec = LLM(model_dir, seed=0, dtype=a.dtype, speculative=SpeculativeConfig(**spec_cfg))
    pairs = []                 # (off, on) rollouts back to back; the first "on" meets a fresh policy
    for k in range(a.rollout_pairs):                 # ABBA order (see fixed_batch)
        if k % 2 == 0:
            off_out, off = rollout(plain, prompts, a.n, 20_000, a.max_tokens)
        for i, h in enumerate(history):              # generate() recorded the last call's responses
            spec.history.record(f"p{i}", h)
        on_out, on = rollout(spec, prompts, a.n, 20_000, a.max_tokens)
        if k % 2 == 1:
            off_out, off = rollout(plain, prompts, a.n, 20_000, a.max_tokens)
        pairs.append((off_out, off, on_out, on))
    full = full_batch_throughput(model_dir, prompts, a.dtype)
    off_out, off, on_out, on = pairs[0]
    total = sum(len(x) for g in off_out for x in g)
    bound = total / full
    speedups = [p[1]["timing_s/gen"] / p[3]["timing_s/gen"] for p in pairs]
    same = np.mean([x == y for gx, gy in zip(off_out, on_out) for x, y in zip(gx, gy)])
    sources = sorted({k.split("/")[-1] for k in on if k.startswith("rollout/spec_accept_length/")})
    r = {
        "makespan_off_s": off["timing_s/gen"], "makespan_on_s": on["timing_s/gen"],
        "speedup": float(np.mean(speedups)), "pair_speedups": [round(x, 3) for x in speedups],
        "tokens_per_s_off": off["perf/tokens_per_s"], "tokens_per_s_on": on["perf/tokens_per_s"],
        "tail_s_off": off.get("rollout/tail_s", 0.0), "tail_s_on": on.get("rollout/tail_s", 0.0),
        "accept_length": on.get("rollout/spec_accept_length", 0.0),
        "accept_length_tail": on.get("rollout/spec_accept_length_tail", 0.0),
        "identical_responses": float(same), "dtype": a.dtype,
        "total_tokens": total, "full_batch_tokens_per_s": full, "no_tail_bound_s": bound,
        "bound_ratio_off": off["timing_s/gen"] / bound, "bound_ratio_on": on["timing_s/gen"] / bound,
        "draft_s": on.get("timing_s/draft", 0.0) + on.get("timing_s/draft_index", 0.0),
        "forward_s_off": off["timing_s/forward"], "forward_s_on": on["timing_s/forward"],
        "num_forward_off": off["rollout/num_forward"], "num_forward_on": on["rollout/num_forward"],
        **{f"accept_length/{s}": on[f"rollout/spec_accept_length/{s}"] for s in sources},
        **{f"accepted_tokens/{s}": on[f"rollout/spec_accepted_tokens/{s}"] for s in sources},
    }
    print(f"rollout {a.prompts}x{a.n}: makespan off {r['makespan_off_s']:.1f}s, on {r['makespan_on_s']:.1f}s "
          f"({speedups[0]:.2f}x; pairs {', '.join(f'{x:.2f}' for x in speedups)}, mean {r['speedup']:.2f}x); tokens/s {r['tokens_per_s_off']:.0f} -> {r['tokens_per_s_on']:.0f}; "
          f"tail {r['tail_s_off']:.1f}s -> {r['tail_s_on']:.1f}s")
    print(f"accepted length per verify step: {r['accept_length']:.2f} overall, {r['accept_length_tail']:.2f} in "
          f"the tail; " + ", ".join(f"{s} {r[f'accept_length/{s}']:.2f}" for s in sources))
    print(f"identical responses with speculation on/off ({a.dtype}): {same:.1%}; drafting {r['draft_s']:.2f}s "
          f"vs forward {r['forward_s_on']:.1f}s")
    print(f"no-tail bound: {total} tokens / {full:.0f} tok/s (full batch) = {bound:.2f}s; makespan / bound: "
          f"off {r['bound_ratio_off']:.2f}, on {r['bound_ratio_on']:.2f}")
    refs = by_references(prompts, off_out)
    print("tokens per verify step vs finished sibling references (replay): " +
          ", ".join(f"{k} {v:.2f}" for k, v in refs.items()))
    sizes = [int(s) for s in a.batch_sizes.split(",")]
    fixed = fixed_batch(model_dir, prompts, history, sizes, a.fixed_tokens, spec_cfg, a.dtype)
    print(json.dumps({"model": model_dir, "spec": spec_cfg, "rollout": r, "by_references": refs, "fixed_batch": fixed}))


if __name__ == "__main__":
    main()
