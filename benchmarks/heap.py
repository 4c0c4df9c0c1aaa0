"""The cyclic garbage collector inside rollouts, with and without full collections held off (engine/heap.py).

A full collection walks every tracked object of the process; ``LLM.generate`` holds them off
for the rollout (``held_collections``). This measures both in one process, alternating per
round (A B B A): the baseline replaces ``held_collections`` with ``timed_collections`` (the
same timing, nothing held off). Rollouts:

- ``tiny``: a random 2-layer checkpoint, ``--prompts`` x ``--n`` rows at T=1 for
  ``--tiny-tokens`` tokens (EOS ignored), drafts from the same rollout verified at every step
  (``policy="fixed"``): the host work of a GPU's verify steps, where the forward is cheap;
- ``small``: the repository's ``small`` model, held-out task prompts x ``--n``, T=1, max
  ``--max-tokens``, the default speculation (round 1 is its history).

Reported per rollout and variant: median wall seconds, the collector's milliseconds and full
collections per rollout, the tracked objects a full collection would walk, and held / not
(the wall's ratio). ``--heavy`` imports what a GPU run's process holds
(transformers' model classes, triton) first: a bigger heap, longer full collections.

Usage: python benchmarks/heap.py [--rounds 4] [--heavy] [--skip-small]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tiny-tokens", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--heavy", action="store_true", help="import transformers' models and triton first")
    ap.add_argument("--skip-small", action="store_true")
    a = ap.parse_args()
    if a.heavy:
        import transformers.models.qwen2.modeling_qwen2  # noqa: F401
        import triton  # noqa: F401
    from checkpoints import make_checkpoint
    from transformers import AutoTokenizer

    import tailrl.llm
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.engine.heap import held_collections, timed_collections
    from tailrl.tasks import mixture

    rollouts = {}
    tiny = make_checkpoint(tempfile.mkdtemp(prefix="tailrl-heap-"), "qwen2", init_std=3.0, max_pos=1024)
    rows = a.prompts * a.n
    llm_t = LLM(tiny, max_num_seqs=rows, max_num_batched_tokens=8 * rows,
                speculative=SpeculativeConfig(policy="fixed", max_spec_batch=0))
    sp = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.tiny_tokens, ignore_eos=True, seed=1)
    tp = [[1, 2, 3 + i] for i in range(a.prompts)]
    tids = [f"p{i}" for i in range(a.prompts)]
    llm_t.generate(tp, sp, prompt_ids=tids)                      # warm-up and the history
    rollouts["tiny"] = (llm_t, lambda: llm_t.generate(tp, sp, prompt_ids=tids))
    if not a.skip_small:
        model = str(REPO / "models" / "small")
        tok = AutoTokenizer.from_pretrained(model)
        prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(a.prompts)]
        pids = [f"p{i}" for i in range(len(prompts))]
        params = [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=20_000 + i)
                  for i in range(len(prompts))]
        llm_s = LLM(model, speculative=SpeculativeConfig())
        llm_s.generate(prompts, [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=10_000 + i)
                                 for i in range(len(prompts))], prompt_ids=pids)
        rollouts["small"] = (llm_s, lambda: llm_s.generate(prompts, params, prompt_ids=pids))
    variants = {"held": held_collections, "not": timed_collections}     # the baseline: timed, nothing held off
    got: dict = {r: {v: [] for v in variants} for r in rollouts}
    for i in range(a.rounds):
        order = list(variants) if i % 2 == 0 else list(variants)[::-1]
        for name, (llm, run) in rollouts.items():
            for v in order:
                tailrl.llm.held_collections = variants[v]
                objects = len(gc.get_objects())
                t = time.perf_counter()
                run()
                wall = time.perf_counter() - t
                m = llm.last_metrics
                got[name][v].append({"wall_s": wall, "gc_ms": m["timing_s/gc"] * 1e3,
                                     "full": m["rollout/gc_full_collections"], "objects": objects})
                print(f"round {i} {name:5s} {v:6s} {wall:7.3f} s  gc {m['timing_s/gc'] * 1e3:7.1f} ms  "
                      f"full collections {m['rollout/gc_full_collections']:.0f}  tracked objects {objects}", flush=True)
    tailrl.llm.held_collections = held_collections
    report: dict = {"rounds": a.rounds, "heavy": a.heavy, "rollouts": {}}
    for name, per in got.items():
        med = {v: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]} for v, rs in per.items()}
        med["held_over_not"] = round(med["not"]["wall_s"] / med["held"]["wall_s"], 3)
        report["rollouts"][name] = med
        print(f"{name}: held {med['held']['wall_s']} s (gc {med['held']['gc_ms']} ms), not "
              f"{med['not']['wall_s']} s (gc {med['not']['gc_ms']} ms): {med['held_over_not']}x", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
