"""PyTorch operations the host dispatches per engine step, outside the step's graph.

On a GPU the forward of a decode or verify step replays a CUDA graph: one launch. Everything
else the step does with tensors (static inputs' copy, LM head, the sampler, getting tokens
back) is launched one operation at a time from Python, and on the H100 machine's host each
costs some microseconds. This counts those operations on the CPU, where the count is the same
and exact (no timing noise): a tiny model (2 layers, hidden 64) with Qwen2.5's vocabulary
(151,936, the sampler's row size), steps through the CUDA-graph input path (``StepGraphs``
with the capture replaced by an eager call, whose operations are not counted), T=1, EOS
ignored, at each of ``--rows``; plain, and with ``--speculative fixed`` verifying 6-token
chains drafted from the history of the same rollout.

Counted as a GPU would dispatch them (``--device-rule gpu``, the default): rows go whole
through the sampler where the tree's rule sends a GPU's rows whole (``_in_chunks`` reads
``logits.device``; on this CPU it cuts rows into chunks of 13 at this vocabulary), else in the
CPU's chunks, as such a tree did on a GPU. Not counted: getting the tokens back (on a GPU a
copy through pinned memory and one wait per step, ``_to_host``; the baseline waited twice
per chunk).

Per tree (this checkout; with ``--baseline-ref REF`` also a worktree of REF), one process each.
Usage: python benchmarks/step_ops.py [--baseline-ref REF] [--rows 1,64,256]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
from pathlib import Path

from trees import compared_trees, run_in_tree

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def worker(a: argparse.Namespace) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from checkpoints import make_checkpoint
    from torch.utils._python_dispatch import TorchDispatchMode

    import tailrl
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.engine import graphs as graphs_mod
    from tailrl.engine import sampler
    from tailrl.engine.batch import ModelRunner
    from tailrl.engine.graph_pool import GraphPool, eager_capture

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.paused = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += self.paused == 0
            return func(*args, **(kwargs or {}))

    counter = Count()
    replay = graphs_mod.StepGraphs.run

    def run_uncounted(self, key):            # the graph: one launch on a GPU, counted as one
        counter.ops += 1
        counter.paused += 1
        try:
            return replay(self, key)
        finally:
            counter.paused -= 1
    graphs_mod.StepGraphs.run = run_uncounted
    # a GPU's rows go whole through the sampler in a tree whose rule says so (read from its source:
    # the baseline's rule cut a GPU's rows into chunks as a CPU's)
    whole = a.device_rule == "gpu" and "device.type" in inspect.getsource(sampler._in_chunks)
    if whole:
        sampler.CHUNK_ELEMENTS = 1 << 62
    path = make_checkpoint(tempfile.mkdtemp(prefix="tailrl-ops-"), "qwen2", vocab_size=151936, max_pos=1024)
    report = {"tailrl": str(Path(tailrl.__file__).resolve().parent), "rows_whole": whole, "ops_per_step": {}}
    for rows in a.rows:
        spec = SpeculativeConfig(policy="fixed") if a.speculative == "fixed" else None
        llm = LLM(path, dtype="bfloat16", max_num_seqs=rows, max_num_batched_tokens=max(2048, 8 * rows),
                  speculative=spec)
        e = llm.engine
        e.runner = ModelRunner(e.model, e.kv, graphs_mod.StepGraphs(e.model, e.kv, GraphPool(1 << 40, eager_capture),
                                                                     8 * rows))
        sp = SamplingParams(n=1, temperature=1.0, max_tokens=a.max_tokens, ignore_eos=True, seed=1)
        prompts = [[1, 2, 3 + i] for i in range(rows)]
        pids = [f"p{i}" for i in range(rows)]
        llm.generate(prompts, sp, prompt_ids=pids)        # the history the drafts read
        counts = []
        step = e._step

        def counted(step=step, counts=counts):
            counter.ops = 0
            with counter:
                out = step()
            counts.append(counter.ops)
            return out
        e._step = counted
        llm.generate(prompts, sp, prompt_ids=pids)
        steady = sorted(counts[1:])[len(counts[1:]) // 2]   # the first step is the prefill (eager)
        report["ops_per_step"][str(rows)] = steady
        print(f"rows {rows}: {steady} operations per step (median of {len(counts) - 1} steps)", file=sys.stderr)
    print(json.dumps(report))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-ref", default=None)
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--speculative", choices=("none", "fixed"), default="none")
    ap.add_argument("--device-rule", choices=("cpu", "gpu"), default="gpu")
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.rows = [int(x) for x in a.rows.split(",")]
        return worker(a)
    args = ["--rows", a.rows, "--max-tokens", str(a.max_tokens), "--speculative", a.speculative,
            "--device-rule", a.device_rule]
    report: dict = {"rows": a.rows, "speculative": a.speculative, "device_rule": a.device_rule, "trees": {}}
    for name, tree in compared_trees(a.baseline_ref).items():
        report["trees"][name] = run_in_tree(tree, HERE / "step_ops.py", args, a.timeout)["ops_per_step"]
        print(f"{name}: {report['trees'][name]}", flush=True)
    if "base" in report["trees"]:
        new, base = report["trees"]["new"], report["trees"]["base"]
        report["new_over_base"] = {k: round(new[k] / base[k], 3) for k in new}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
