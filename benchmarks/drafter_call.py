"""One batched call of the learned drafter (``DrafterSource.grow``), against another checkout.

A call is what the speculator pays for the drafter's drafts of a step: its committed K/V
caught up (nothing queued here: measured once the pasts are computed), then one drafter
step per depth for all rows. Settings: chains and trees of 3 paths, ``--depth`` nodes deep
(8), at 1, 8 and 64 rows, over pasts of 100-550 positions; the drafter in bfloat16 as with a
bfloat16 target (a random one over ``--model``'s target: with ``min_path_prob`` 0 and no
pricing every call grows to its full depth, whatever the weights), every call's first
ones not timed (kernels built, step times measured). Reported: the median milliseconds of a
call per setting, each tree measured in its own process (``trees.run_in_tree``), the trees
alternating per round, the order reversed every other round; with ``--baseline-ref REF`` each
setting's ratio base / new (> 1: this checkout's calls are faster).

``--model`` takes a directory, a preset or a stand-in name (``0.5b``: `small`'s tokens at
Qwen2.5-0.5B's cost, built into ``--standin-dir`` on first use): its drafter is sized from it.
``--device cuda``: the drafter on the GPU, chain depths replayed from CUDA graphs as a GPU
engine drafts, and chains also from one graph of a call's every depth (``/whole``:
``TAILRL_DRAFTER_WHOLE_CHAINS=1``'s way), every call synchronised (without ``--baseline-ref``:
this checkout alone).

Usage: python benchmarks/drafter_call.py [--baseline-ref REF] [--rounds 4] [--model 0.5b] [--device cuda]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from trees import abba, compared_trees, run_in_tree  # noqa: E402

ROWS = (1, 8, 64)
PATHS = (1, 3)


def worker(a: argparse.Namespace) -> None:
    import torch

    import tailrl
    from tailrl import SamplingParams
    from tailrl.drafter.network import Drafter
    from tailrl.engine.request import Request
    from tailrl.model.loader import load_model
    from tailrl.speculative.sources.drafter_source import DrafterSource
    dev = torch.device(a.device)
    target = load_model(a.model, "float32", a.device)
    hidden = target.args.hidden_size
    torch.manual_seed(0)
    drafter = Drafter.for_target(target)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out = {"tailrl": str(Path(tailrl.__file__).parent), "calls_ms": {}}
    # on a GPU chains also from one graph of a call's every depth (``whole``: TAILRL_DRAFTER_WHOLE_CHAINS)
    settings = [(p, r, w) for p in PATHS for r in ROWS for w in ((False, True) if p == 1 and dev.type == "cuda"
                                                                 else (False,))]
    for paths, rows, whole in settings:
        src = DrafterSource(drafter, fast_dtype=torch.bfloat16)
        src.whole_chains = whole
        if dev.type == "cuda":                   # as a GPU engine drafts: chain depths from graphs
            from tailrl.engine.graph_pool import GraphPool, cuda_capture
            src.use_graphs(GraphPool(1 << 30, cuda_capture))
        g = torch.Generator().manual_seed(rows)
        reqs = []
        for i in range(rows):
            n = 100 + (7 * i) % 450
            r = Request(f"r{i}", [(5 * i + j) % 80 + 3 for j in range(n + 1)], SamplingParams(), 0)
            r.output_token_ids.append(7)
            src.observe_hidden(torch.randn(n + 1, hidden, generator=g).bfloat16().to(dev), [(r, 0, 0, n + 1)])
            r.keep_hidden(torch.randn(hidden, generator=g).bfloat16().to(dev))
            reqs.append(r)
        for _ in range(6):                       # pasts computed, kernels built, step times measured
            src.grow(reqs, a.depth, paths)
        times = []
        for _ in range(a.calls):
            sync()
            t0 = time.perf_counter()
            src.grow(reqs, a.depth, paths)
            sync()
            times.append(time.perf_counter() - t0)
        out["calls_ms"][f"paths{paths}/rows{rows}" + ("/whole" if whole else "")] = statistics.median(times) * 1e3
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-ref", default=None, help="git commit of the tree to compare against")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--standin-dir", default="/tmp/tailrl-standins")
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--device", default="cpu", help="cuda: the drafter there, chain depths from graphs")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    from regime import model_dir
    a.model = str(Path(model_dir(a.model, Path(a.standin_dir))).resolve())
    trees = compared_trees(a.baseline_ref)
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for r, t in abba(trees, a.rounds):
        got = run_in_tree(trees[t], HERE / "drafter_call.py", ["--model", a.model, "--depth", str(a.depth),
                          "--calls", str(a.calls), "--device", a.device], a.timeout)["calls_ms"]
        runs[t].append(got)
        print(f"round {r} {t:4s} " + "  ".join(f"{k} {v:.2f} ms" for k, v in got.items()), flush=True)
    med = {t: {k: round(statistics.median(x[k] for x in rs), 3) for k in rs[0]} for t, rs in runs.items()}
    res = {"model": a.model, "device": a.device, "depth": a.depth, "calls_ms": med}
    if "base" in med:
        res["base_over_new"] = {k: round(med["base"][k] / med["new"][k], 2) for k in med["new"]}
        for k, v in res["base_over_new"].items():
            print(f"{k:14s} base {med['base'][k]:8.2f} ms  new {med['new'][k]:8.2f} ms  base / new {v:5.2f}x")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
