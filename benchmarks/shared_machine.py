"""The benchmark rollout and GRPO steps alone and beside busy neighbours, in one invocation.

Neighbours, one per core minus one: ``python`` (a pure-Python busy loop) and ``tailrl`` (a
second tailrl job generating rollouts of the same model in a loop, with the same thread
setting as the measured one). Each is measured with tailrl's default threads (``governed``:
as many as other processes leave free, tailrl/threads.py) and with a fixed count of every core
(``fixed``: what an engine without the governor does). Reports:
- ``regions``: the cause. One OpenMP region (a 16x256x768 bfloat16 matmul) in microseconds and
  the process's CPU use, alone and beside a busy loop, at every core and at one thread.
- ``rollout``: 64 held-out prompts x 8, T=1, max 960, default speculation, bfloat16; each
  timed rollout starts from the same history (a first round's responses) and the same seeds,
  so every run does the same work. Quiet runs alternate governed/fixed (ABBA) for the
  quiet-speed comparison; the no-tail bound (total tokens / full-batch throughput) is printed.
- ``grpo``: ``configs/demo.yaml`` steps 2-3 (median) of a fresh trainer per setting.
- ``threads``: the governed rollout from the main thread and from a worker thread (ABBA).
Ends with one JSON line: {"regions": {...}, "rollout": {...}, "grpo": {...}, "threads": {...}}.
Usage: python benchmarks/shared_machine.py [--quick] [--skip-grpo]
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculation import full_batch_throughput, load_prompts  # noqa: E402

from tailrl import LLM, SamplingParams  # noqa: E402
from tailrl.threads import available_cores, governor  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUSY = "while True: pass"


class Neighbours:
    """``count`` busy processes of one ``kind`` beside us while the block runs."""

    def __init__(self, kind: str, count: int, args: argparse.Namespace, fixed: bool):
        self.kind, self.count, self.args, self.fixed = kind, count, args, fixed
        self.procs: list[subprocess.Popen] = []

    def __enter__(self):
        for _ in range(self.count if self.kind != "quiet" else 0):
            if self.kind == "python":
                self.procs.append(subprocess.Popen([sys.executable, "-c", BUSY]))
            else:
                cmd = [sys.executable, __file__, "--neighbour", "--prompts", str(self.args.prompts),
                       "--max-tokens", str(self.args.max_tokens)] + (["--fixed"] if self.fixed else [])
                p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                p.stdout.readline()                       # "ready": its model is loaded and it is generating
                self.procs.append(p)
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()


def regions() -> dict:
    """Microseconds per 16x256x768 bf16 matmul (one parallel region) and our CPU use."""
    x, w = torch.randn(16, 256, dtype=torch.bfloat16), torch.randn(256, 768, dtype=torch.bfloat16)
    out = {}
    for threads in (available_cores(), 1):
        torch.set_num_threads(threads)
        for kind in ("quiet", "python"):
            with Neighbours(kind, available_cores() - 1, None, True):
                runs = []
                for _ in range(5):
                    cpu, t = time.process_time(), time.perf_counter()
                    for _ in range(2000):
                        torch.mm(x, w)
                    dt = time.perf_counter() - t
                    runs.append((dt / 2000 * 1e6, (time.process_time() - cpu) / dt))
            us = statistics.median(r[0] for r in runs)
            out[f"{threads}t/{kind}"] = {"us": round(us, 1), "cpu_cores": round(statistics.median(r[1] for r in runs), 2)}
            print(f"regions: {threads} threads, {kind:6s}: {us:7.1f} us per matmul, our CPU "
                  f"{out[f'{threads}t/{kind}']['cpu_cores']:.2f} cores", flush=True)
    torch.set_num_threads(available_cores())
    return out


class Rollout:
    """The same rollout again and again: history reset to a first round's responses before each."""

    def __init__(self, args: argparse.Namespace, fixed: bool, first_round: bool = True):
        self.prompts = load_prompts(str(ROOT / "models/small"), args.prompts)
        self.pids = [f"p{i}" for i in range(len(self.prompts))]
        self.max_tokens = args.max_tokens
        self.llm = LLM(str(ROOT / "models/small"), speculative={}, num_threads=available_cores() if fixed else None)
        self.history: dict[str, list[list[int]]] = {}
        if first_round:
            first = self.generate(seed0=10_000)
            self.history = {pid: [c.token_ids for c in o.outputs] for pid, o in zip(self.pids, first)}

    def generate(self, seed0: int = 0):
        params = [SamplingParams(n=8, temperature=1.0, max_tokens=self.max_tokens, seed=seed0 + i)
                  for i in range(len(self.prompts))]
        return self.llm.generate(self.prompts, params, prompt_ids=self.pids, use_tqdm=False)

    def timed(self) -> tuple[float, int]:
        for pid, responses in self.history.items():
            self.llm.history.record(pid, responses)
        before = dict(governor().seconds_at)
        t = time.perf_counter()
        outs = self.generate()
        dt = time.perf_counter() - t
        at = {n: s - before.get(n, 0.0) for n, s in governor().seconds_at.items()}
        self.mean_threads = sum(n * s for n, s in at.items()) / max(sum(at.values()), 1e-9)
        return dt, sum(len(c.token_ids) for o in outs for c in o.outputs)


def rollout(args: argparse.Namespace) -> dict:
    engines = {"governed": Rollout(args, fixed=False), "fixed": Rollout(args, fixed=True)}
    out: dict = {}
    quiet = {"governed": [], "fixed": []}
    threads = []
    for name in ("governed", "fixed", "fixed", "governed") * args.quiet_rounds:
        quiet[name].append(engines[name].timed()[0])
        if name == "governed":
            threads.append(round(engines[name].mean_threads, 2))
    for name, times in quiet.items():
        out[f"quiet/{name}"] = round(min(times), 3)
    tokens = engines["governed"].timed()[1]
    bound = tokens / full_batch_throughput(str(ROOT / "models/small"), engines["governed"].prompts, "bfloat16")
    out["tokens"], out["no_tail_bound_s"] = tokens, round(bound, 3)
    print(f"rollout quiet: governed {out['quiet/governed']:.2f} s, fixed {out['quiet/fixed']:.2f} s "
          f"(runs { {k: [round(x, 2) for x in v] for k, v in quiet.items()} }; governed mean threads {threads}); {tokens} tokens, no-tail bound {bound:.2f} s", flush=True)
    for kind in ("python", "tailrl"):
        for name in ("governed", "fixed"):
            with Neighbours(kind, available_cores() - 1, args, fixed=name == "fixed"):
                dt = engines[name].timed()[0]
            out[f"{kind}/{name}"] = round(dt, 3)
            out[f"{kind}/{name}_slowdown"] = round(dt / out[f"quiet/{name}"], 2)
            threads = f", mean threads {engines[name].mean_threads:.2f}" if name == "governed" else ""
            print(f"rollout beside {kind}: {name} {dt:.2f} s = {dt / out[f'quiet/{name}']:.2f}x its quiet time"
                  f"{threads}", flush=True)
    out["quiet_governed_over_fixed"] = round(out["quiet/governed"] / out["quiet/fixed"], 3)
    for e in engines.values():
        e.llm.close()
    return out


def grpo(args: argparse.Namespace) -> dict:
    from tailrl.rl.config import load_config
    from tailrl.rl.trainer import Trainer
    out: dict = {}
    for kind in ("quiet", "python", "tailrl"):
        for name in ("governed", "fixed"):
            with tempfile.TemporaryDirectory() as tmp:
                sets = [f"output_dir={tmp}", "checkpoint_every=0", "progress=false", "total_steps=3",
                        "log_tensorboard=false"] + ([f"num_threads={available_cores()}"] if name == "fixed" else [])
                with Neighbours(kind, available_cores() - 1, args, fixed=name == "fixed"):
                    rows = Trainer(load_config(str(ROOT / "configs/demo.yaml"), sets)).train()
            later = rows[1:]
            step = statistics.median(r["timing_s/step"] for r in later)
            out[f"{kind}/{name}"] = {"step_s": round(step, 3),
                                     "rollout_s": round(statistics.median(r["timing_s/gen"] for r in later), 3),
                                     "update_s": round(statistics.median(r["timing_s/update"] for r in later), 3)}
            quiet = out[f"quiet/{name}"]["step_s"]
            print(f"grpo {kind:6s} {name:8s}: step {step:.2f} s ({step / quiet:.2f}x quiet), "
                  f"rollout {out[f'{kind}/{name}']['rollout_s']:.2f} s, update {out[f'{kind}/{name}']['update_s']:.2f} s",
                  flush=True)
            out[f"{kind}/{name}"]["slowdown"] = round(step / quiet, 2)
    return out


def calling_threads(args: argparse.Namespace) -> dict:
    engine = Rollout(args, fixed=False)
    out: dict = {}
    for kind in ("quiet", "python"):
        times: dict[str, list[float]] = {"main": [], "worker": []}
        with Neighbours(kind, available_cores() - 1, args, fixed=False):
            for where in ("main", "worker", "worker", "main"):
                if where == "main":
                    times["main"].append(engine.timed()[0])
                else:
                    t = threading.Thread(target=lambda: times["worker"].append(engine.timed()[0]))
                    t.start()
                    t.join()
        out[kind] = {k: round(min(v), 3) for k, v in times.items()}
        out[kind]["worker_over_main"] = round(out[kind]["worker"] / out[kind]["main"], 3)
        print(f"calling thread, {kind}: main {out[kind]['main']:.2f} s, worker {out[kind]['worker']:.2f} s "
              f"(ratio {out[kind]['worker_over_main']:.3f})", flush=True)
    return out


def neighbour(args: argparse.Namespace) -> None:
    """A second tailrl job: rollouts in a loop until killed."""
    engine = Rollout(args, fixed=args.fixed, first_round=False)
    print("ready", flush=True)
    while True:
        engine.timed()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=960)
    p.add_argument("--quiet-rounds", type=int, default=2, help="ABBA rounds of the quiet rollout")
    p.add_argument("--quick", action="store_true", help="16 prompts, max 512 tokens, one quiet round")
    p.add_argument("--skip-grpo", action="store_true")
    p.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fixed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.prompts, args.max_tokens, args.quiet_rounds = 16, 512, 1
    if args.neighbour:
        neighbour(args)
        return 0
    print(f"{available_cores()} cores; neighbours: {available_cores() - 1} per kind", flush=True)
    figures = {"cores": available_cores(), "regions": regions(), "rollout": rollout(args)}
    figures["grpo"] = {} if args.skip_grpo else grpo(args)
    figures["threads"] = calling_threads(args)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
