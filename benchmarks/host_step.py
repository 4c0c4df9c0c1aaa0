"""The engine's host work per step at a full batch: what a GPU waits on between its forwards.

On a GPU a step's forward at a few hundred rows takes a few milliseconds, replayed from a CUDA
graph, and the host's work around it (scheduling, building the step's inputs, sampling's
bookkeeping, committing tokens) grows with the rows, in Python. This measures that work with
a model whose forward is negligible (a tiny random checkpoint, 2 layers, hidden 64), steps
going through the CUDA-graph input path (``StepGraphs`` with the capture replaced by an eager
call, as on a CPU), ``--prompts`` x ``--n`` rows at T=1 for ``--max-tokens`` tokens (EOS
ignored: every step has all rows): per step, the milliseconds of each host stage
(``timing_s/schedule``, ``build``, ``sample``, ``postprocess``; with ``--speculative``, also
the speculator's ``draft`` and ``observe``) and of the whole step. ``--ahead`` launches plain
steps ahead (``async_scheduling``: the plain path on a GPU; the stages are then each step's
own host work, the step's wait in ``sample``). ``--speculative fixed`` verifies drafts from
the history of the same rollout at every step (every row drafts good chains, up to
``max_draft_tokens``: the verify path's host work at its heaviest); ``--speculative default``
lets the priced policy decide (on this tiny model at hundreds of rows it does not draft, so
that measures the host cost of deciding not to). ``--speculative ahead_drafts --ahead``: every
row drafts inside steps launched ahead (``SpeculativeConfig(ahead_drafts=rows, ahead_above=1,
ahead_drafts_gate="always")``, engine/ahead_drafts.py), its chains right (the history is this
rollout's), each verification followed up in the next step: a GPU's tail, where every row left
drafts and the host's work per drafting row is what the device waits on. ``--speculative
collect --ahead``: every step launched ahead, none drafting, an online drafter's buffer
(``DrafterBuffer``) collecting every position's hidden state: the host's work of handing them
out as each step settles (in ``observe``; a tree from before steps launched ahead handed out
states, e.g. ``--baseline-ref 6c50c7d``, hands out nothing there: the comparison is that work's
cost).

Per tree (this checkout; with ``--baseline-ref REF`` also a worktree of REF), each
measurement in its own process, trees alternating per round, the order reversed every other
round (ABBA); reported: the median of rounds per tree, and each stage's ratio new / base;
also the whole step and, inside the stages, the cyclic garbage collector's ms per step
(``timing_s/gc``; trees before it was measured report 0).

Usage: python benchmarks/host_step.py [--baseline-ref REF] [--rounds 4]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from trees import abba_medians, compared_trees

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
STAGES = ("schedule", "build", "sample", "postprocess", "draft", "observe")


def worker(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from checkpoints import make_checkpoint

    import tailrl
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.engine.batch import ModelRunner
    from tailrl.engine.graph_pool import GraphPool, eager_capture
    from tailrl.engine.graphs import StepGraphs
    path = make_checkpoint(tempfile.mkdtemp(prefix="tailrl-host-"), "qwen2", init_std=3.0, max_pos=1024)
    rows = a.prompts * a.n
    # "fixed" drafts at every batch size (max_spec_batch=0); the priced default decides itself
    spec = {"none": None, "fixed": SpeculativeConfig(policy="fixed", max_spec_batch=0),
            "default": SpeculativeConfig(),
            "ahead_drafts": SpeculativeConfig(ahead_drafts=rows, ahead_above=1, ahead_drafts_gate="always"),
            "collect": SpeculativeConfig(policy="fixed", ahead_above=1, tail="speculate"),
            }[a.speculative]
    llm = LLM(path, dtype="bfloat16", max_num_seqs=rows, max_num_batched_tokens=max(2048, 8 * rows), speculative=spec,
              async_scheduling=a.ahead or None)
    e = llm.engine
    if a.speculative == "collect":
        from tailrl.drafter.buffer import DrafterBuffer
        e.speculator.collector = DrafterBuffer(1 << 20)
    tokens = rows if spec is None else 17 * rows                # a step's tokens at most: every row and its drafts
    e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, eager_capture), tokens,
                                                     grouped=spec is not None))
    sp = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, ignore_eos=True, seed=1)
    prompts = [[1, 2, 3 + i] for i in range(a.prompts)]
    pids = [f"p{i}" for i in range(a.prompts)]
    llm.generate(prompts, sp, prompt_ids=pids)              # warm-up, and the history of this very rollout
    best: dict[str, float] = {}
    for _ in range(a.repeat):
        t = time.perf_counter()
        llm.generate(prompts, sp, prompt_ids=pids)
        wall = time.perf_counter() - t
        m = llm.last_metrics
        steps = m["rollout/num_forward"]
        got = {s: m.get(f"timing_s/{s}", 0.0) / steps * 1e3 for s in STAGES}
        got.update(step=wall / steps * 1e3, forward=m["timing_s/forward"] / steps * 1e3,
                   gc=m.get("timing_s/gc", 0.0) / steps * 1e3)         # inside the stages, not beside them
        best = {k: min(v, best.get(k, v)) for k, v in got.items()}
    print(json.dumps({"tailrl": str(Path(tailrl.__file__).resolve().parent), "rows": rows, "ms": best}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-ref", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeat", type=int, default=2, help="rollouts per process (each figure: the fastest)")
    ap.add_argument("--speculative", choices=("none", "fixed", "default", "ahead_drafts", "collect"), default="none")
    ap.add_argument("--ahead", action="store_true", help="plain steps launched ahead (a GPU's plain path)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    args = ["--prompts", str(a.prompts), "--n", str(a.n), "--max-tokens", str(a.max_tokens), "--repeat", str(a.repeat),
            "--speculative", a.speculative] + (["--ahead"] if a.ahead else [])
    report = {"rows": a.prompts * a.n, **abba_medians(compared_trees(a.baseline_ref), a.rounds, HERE / "host_step.py",
                                                      args, a.timeout, "ms", "ms/step")}
    if "base" in report["trees"]:
        new, base = report["trees"]["new"], report["trees"]["base"]
        host = lambda x: sum(x[s] for s in STAGES)   # noqa: E731
        report["host_new_over_base"] = round(host(new) / host(base), 3)
        print(f"host ms per step ({report['rows']} rows): new {host(new):.3f}, base {host(base):.3f} "
              f"({report['host_new_over_base']}x)", flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
