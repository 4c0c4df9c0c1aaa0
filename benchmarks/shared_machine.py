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
- ``grpo``: ``configs/demo.yaml`` steps 2..``--grpo-steps`` (median) of a trainer per setting; quiet,
  the two settings' trainers alternate step by step and their paired ratio is reported.
- ``threads``: the governed rollout from the main thread and from a worker thread (ABBA rounds,
  after one untimed call), in a process of its own (``--threads-only`` runs just this).
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


def _trainer(setting: str, tmp: str):
    from tailrl.rl.config import load_config
    from tailrl.rl.trainer import Trainer
    sets = [f"output_dir={tmp}/{setting}", "checkpoint_every=0", "progress=false", "total_steps=1000",
            "log_tensorboard=false"] + ([f"num_threads={available_cores()}"] if setting == "fixed" else [])
    return Trainer(load_config(str(ROOT / "configs/demo.yaml"), sets))


def grpo(args: argparse.Namespace) -> dict:
    """Two trainers (governed, fixed) take the same steps; quiet, they alternate step by step
    (ABBA); beside neighbours each runs its steps beside its own neighbours (a tailrl
    neighbour has the same thread setting)."""
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("quiet", "python", "tailrl"):
            trainers = {name: _trainer(name, f"{tmp}/{kind}") for name in ("governed", "fixed")}
            rows: dict[str, list[dict]] = {"governed": [], "fixed": []}
            if kind == "quiet":
                for step in range(args.grpo_steps):
                    for name in ("governed", "fixed") if step % 2 == 0 else ("fixed", "governed"):
                        rows[name].append(trainers[name].train_step())
            else:
                for name in ("governed", "fixed"):
                    with Neighbours(kind, available_cores() - 1, args, fixed=name == "fixed"):
                        rows[name] = [trainers[name].train_step() for _ in range(args.grpo_steps)]
            for name, r in rows.items():
                later = r[1:]                              # the first step starts the engine's caches
                res = {k: round(statistics.median(x[f"timing_s/{m}"] for x in later), 3)
                       for k, m in (("step_s", "step"), ("rollout_s", "gen"), ("update_s", "update"))}
                res["slowdown"] = round(res["step_s"] / out["quiet/" + name]["step_s"], 2) if kind != "quiet" else 1.0
                out[f"{kind}/{name}"] = res
                print(f"grpo {kind:6s} {name:8s}: step {res['step_s']:.2f} s ({res['slowdown']:.2f}x quiet), "
                      f"rollout {res['rollout_s']:.2f} s, update {res['update_s']:.2f} s", flush=True)
            if kind == "quiet":
                ratios = [g["timing_s/step"] / f["timing_s/step"] for g, f in zip(rows["governed"][1:], rows["fixed"][1:])]
                out["quiet_governed_over_fixed"] = round(statistics.median(ratios), 3)
                print(f"grpo quiet: governed / fixed step time, median of paired steps "
                      f"{out['quiet_governed_over_fixed']:.3f}", flush=True)
            for t in trainers.values():
                t.llm.close()
    return out


def calling_threads(args: argparse.Namespace) -> dict:
    """The governed rollout from the main thread and from a fresh worker thread, in ABBA
    rounds; the ratio is the median over rounds of (worker sum / main sum)."""
    engine = Rollout(args, fixed=False)
    engine.timed()                                   # untimed: the first timed call ran slower
    out: dict = {}
    for kind in ("quiet", "python"):
        times: dict[str, list[float]] = {"main": [], "worker": []}
        with Neighbours(kind, available_cores() - 1, args, fixed=False):
            for _ in range(args.thread_rounds):
                for where in ("main", "worker", "worker", "main"):
                    if where == "main":
                        times["main"].append(engine.timed()[0])
                    else:
                        t = threading.Thread(target=lambda: times["worker"].append(engine.timed()[0]))
                        t.start()
                        t.join()
        m, w = times["main"], times["worker"]
        ratios = [(w[2 * i] + w[2 * i + 1]) / (m[2 * i] + m[2 * i + 1]) for i in range(args.thread_rounds)]
        out[kind] = {"main": round(statistics.median(m), 3), "worker": round(statistics.median(w), 3),
                     "worker_over_main": round(statistics.median(ratios), 3)}
        print(f"calling thread, {kind}: main {[round(x, 2) for x in m]} s, worker {[round(x, 2) for x in w]} s "
              f"(worker / main per round {[round(x, 3) for x in ratios]})", flush=True)
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
    p.add_argument("--grpo-steps", type=int, default=5, help="GRPO steps per setting (the first is not counted)")
    p.add_argument("--thread-rounds", type=int, default=3, help="ABBA rounds of the main/worker thread comparison")
    p.add_argument("--quick", action="store_true", help="16 prompts, max 512 tokens, one quiet round")
    p.add_argument("--skip-grpo", action="store_true")
    p.add_argument("--threads-only", action="store_true", help="only the main/worker thread comparison")
    p.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fixed", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.quick:
        args.prompts, args.max_tokens, args.quiet_rounds = 16, 512, 1
    if args.neighbour:
        neighbour(args)
        return 0
    if args.threads_only:
        print(json.dumps(calling_threads(args)))
        return 0
    print(f"{available_cores()} cores; neighbours: {available_cores() - 1} per kind", flush=True)
    figures = {"cores": available_cores(), "regions": regions(), "rollout": rollout(args)}
    figures["grpo"] = {} if args.skip_grpo else grpo(args)
    figures["threads"] = threads_in_fresh_process(args)
    print(json.dumps(figures))
    return 0


def threads_in_fresh_process(args: argparse.Namespace) -> dict:
    """``calling_threads`` in a process of its own: in this one, after the sections above (many
    engines and trainers, thread counts set by hand), the main thread ran 10-15% slower than a
    worker thread, which a fresh process does not show."""
    cmd = [sys.executable, __file__, "--threads-only", "--prompts", str(args.prompts), "--max-tokens",
           str(args.max_tokens), "--thread-rounds", str(args.thread_rounds)]
    lines = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=True).stdout.strip().splitlines()
    print("\n".join(lines[:-1]), flush=True)
    return json.loads(lines[-1])


if __name__ == "__main__":
    sys.exit(main())
