"""Loading a checkpoint: ``load_model``'s seconds and the host memory it adds at its peak.

Each load runs in a process of its own (``--worker``) on this checkout's tailrl and, with
``--baseline-ref REF``, on a worktree of REF, in ABBA order over ``--rounds``; reported per tree:
the median seconds of ``load_model(DIR, dtype)`` and the memory it added at its peak, GiB: the
process's own (anonymous) memory, sampled every 2 ms, and its resident set, which also counts
the pages of the weight files it maps (page cache the kernel can take back); and new / base.

Usage: python benchmarks/load.py --model DIR [--dtype bfloat16] [--baseline-ref REF] [--rounds 4]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trees import abba_medians, compared_trees  # noqa: E402

GiB = 2 ** 30


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def worker(model: str, dtype: str) -> None:
    import tailrl
    from tailrl.model.loader import load_model
    before, anon_before = status_bytes("VmRSS"), status_bytes("RssAnon")
    peak_anon, done = [anon_before], threading.Event()

    def sample() -> None:                   # the process's own memory (not the files it maps), every 2 ms
        while not done.wait(0.002):
            peak_anon[0] = max(peak_anon[0], status_bytes("RssAnon"))
    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    m = load_model(model, dtype=dtype)
    seconds = time.perf_counter() - t0
    done.set()
    watcher.join()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    print(json.dumps({"tailrl": str(Path(tailrl.__file__).parent), "load": {
        "seconds": seconds, "added_peak_anon_gib": (max(peak_anon[0], status_bytes("RssAnon")) - anon_before) / GiB,
        "added_peak_rss_gib": (peak - before) / GiB, "weights_gib": weights / GiB}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--baseline-ref", default=None, help="git commit of the tree to compare against")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.model, a.dtype)
        return
    report = abba_medians(compared_trees(a.baseline_ref), a.rounds, Path(__file__).resolve(),
                          ["--model", str(Path(a.model).resolve()), "--dtype", a.dtype], 1800, "load", "")
    print(json.dumps({"model": a.model, "dtype": a.dtype, "rounds": a.rounds, **report}))


if __name__ == "__main__":
    main()
