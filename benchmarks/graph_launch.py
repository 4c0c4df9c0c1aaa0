"""What launching a CUDA graph costs the host, by the graph's number of kernels.

The question behind a GPU step's host time: at stop 68 on an H200, a batch-1 step of the 0.5b
stand-in (~290 kernels, one graph) spent 0.25 ms of host time in ``cudaGraphLaunch`` (0.49 ms
a step under the profiler in a rollout), an eager launch took 9-10 us and an eager step 10 ms,
while the tail's plain steps launched ahead took ~1.3 ms against ~0.9 ms of device time. If a
graph's launch grows with its kernels, fewer kernels a layer (fusions) cut the host's time a
step; if it is flat, they do not.

For graphs of N kernels (each adds 1 to a one-element tensor: no device work to speak of), per
N, medians of ``--reps`` with an idle GPU before each: the host's time in ``replay()`` (the
launch alone; its work queued), the time from that call to the device finishing (``wall``),
and N eager launches of the same kernel (the host's time, then the wall time). Run on the GPU
machine: ``python benchmarks/graph_launch.py`` (~10 s).

Usage: python benchmarks/graph_launch.py [--kernels 1,16,64,256,512] [--reps 50]
The last line is one JSON object: {"device", "kernels": {N: {"replay_host_us", "replay_wall_us",
"eager_host_us", "eager_wall_us", "host_us_per_kernel"}}}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def _timed(fn, reps: int) -> tuple[float, float]:
    """Medians over ``reps`` of (the host's time in fn(), the time until the device is done), in us."""
    host, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wall.append(t2 - t0)
    return statistics.median(host) * 1e6, statistics.median(wall) * 1e6


def _graph(x: torch.Tensor, n: int) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):               # the kernel loaded before the capture
        x.add_(1)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            x.add_(1)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default="1,16,64,256,512")
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("graph_launch.py measures CUDA graphs: run it on a machine with a CUDA device")
    out: dict = {"device": torch.cuda.get_device_name(), "kernels": {}}
    x = torch.zeros(1, device="cuda")
    for n in (int(k) for k in a.kernels.split(",")):
        g = _graph(x, n)
        g.replay()
        rh, rw = _timed(g.replay, a.reps)

        def eager(n=n) -> None:
            for _ in range(n):
                x.add_(1)
        eh, ew = _timed(eager, a.reps)
        out["kernels"][n] = {"replay_host_us": round(rh, 1), "replay_wall_us": round(rw, 1),
                             "eager_host_us": round(eh, 1), "eager_wall_us": round(ew, 1),
                             "host_us_per_kernel": round(rh / n, 2)}
        print(n, out["kernels"][n], flush=True)
        del g
    print(json.dumps(out))


if __name__ == "__main__":
    main()
