"""Where an engine step's time goes, next to the floor the bytes it reads allow.

Per dtype and batch size, plain decoding and verification of k = 1, 3, 7 draft tokens per row
(drafts that are always accepted: an oracle source proposes the tokens a plain run sampled, so
every step emits k + 1 tokens per row, as speculation at its best). Each request starts with
``--context`` tokens of output already generated (recomputed by one prefill), so every
measured step reads about that many cached positions. Reports per step: milliseconds split
into schedule / draft / build / forward (attention, the rest) / sample / postprocess, the
ratio to the plain step, tokens per second, and the floor: (weight bytes + K/V bytes read) /
streaming-read bandwidth measured in the same run.

``--baseline DIR`` runs the same measurement with another checkout's tailrl (e.g. a worktree
of an older commit) in a subprocess, interleaved per dtype, and prints the ratios.
The last line is one JSON object: {"floor_gb_s": ..., "runs": {label: {dtype: {batch: {k: {...}}}}}}.
Usage: python benchmarks/step_overhead.py [--quick] [--baseline DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

KS = (0, 1, 3, 7)


class Oracle:
    """Draft source that knows every request's continuation (from a plain run)."""
    name = "oracle"

    def __init__(self, truth: dict[str, list[int]]):
        self.truth = truth

    def propose(self, req, max_tokens: int, max_paths: int):
        from tailrl.speculative.draft import Draft
        fut = self.truth[req.request_id][len(req.output_token_ids):][:max_tokens]
        return Draft.chain(fut, source=self.name) if fut else None

    def start(self, req):
        pass

    def observe(self, req, new_tokens):
        pass

    def finish(self, req):
        pass


def bandwidth_gb_s() -> float:
    x = torch.ones(64 * 2**20)                       # 256 MB: far past the last-level cache
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    return 5 * x.numel() * 4 / (time.perf_counter() - t) / 1e9


def requests(prompts, truth, context: int, batch: int, max_tokens: int):
    from tailrl.config import SamplingParams
    from tailrl.engine.request import Request
    p = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return [Request(f"r{i}", list(prompts[i % len(prompts)]), p, 1000 + i,
                    output_token_ids=list(truth[f"r{i}"][:context]) if truth else [],
                    output_logprobs=[0.0] * context if truth else []) for i in range(batch)]


def engine(model: str, dtype: str, k: int, truth):
    from tailrl.config import EngineConfig
    from tailrl.engine.engine import LLMEngine
    cfg = EngineConfig(model=model, dtype=dtype, max_num_batched_tokens=8192, max_num_seqs=256)
    if k == 0:
        return LLMEngine(cfg)
    from tailrl.speculative.policies.base import FixedPolicy
    from tailrl.speculative.speculator import Speculator
    return LLMEngine(cfg, speculator=Speculator(sources=[Oracle(truth)], policy=FixedPolicy(k)))


class AttentionClock:
    """Times the model's attention calls (whichever function this tailrl version uses)."""

    def __init__(self):
        import tailrl.model.transformer as tr
        self.seconds, self.mod = 0.0, tr
        for name in ("rope_attend", "attend"):
            fn = getattr(tr, name, None)
            if fn is not None:
                setattr(tr, name, self._wrap(fn))

    def _wrap(self, fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            self.seconds += time.perf_counter() - t
            return out
        return timed


def measure(model: str, dtype: str, sizes, context: int, steps: int, repeat: int = 2) -> dict:
    """{batch: {k: {...}}} for one dtype; each point is the fastest of ``repeat`` windows of
    ``steps`` steps (a shared machine's load spikes only ever slow a window down)."""
    from tailrl.model.loader import read_args
    prompts = [[1, 5 + i % 7, 9, 4 + i % 5, 12, 3] for i in range(64)]
    need = context + repeat * steps * (max(KS) + 1) + max(KS) + 2
    eng = engine(model, dtype, 0, None)
    for r in requests(prompts, None, 0, max(sizes), need):
        eng.add_request(r)
    while eng.has_unfinished():
        eng.step()
    truth = {rid: list(r.output_token_ids) for rid, r in eng.requests.items()}
    a = read_args(model)
    weights = sum(p.numel() * p.element_size() for p in eng.model.parameters())
    elem = torch.tensor([], dtype=eng.kv.dtype).element_size()
    clock = AttentionClock()
    m = attention = None
    out: dict = {}
    for b in sizes:
        out[b] = {}
        for k in KS:
            e = engine(model, dtype, k, truth)
            for r in requests(prompts, truth, context, b, need):
                e.add_request(r)
            while any(not r.is_decoding for r in e.requests.values()):
                e.step()
            e.step()
            wall = float("inf")
            for _ in range(repeat):
                before, seconds = e.metrics.snapshot(), clock.seconds
                t = time.perf_counter()
                for _ in range(steps):
                    e.step()
                w = (time.perf_counter() - t) / steps
                if w < wall:
                    wall, m, attention = w, e.metrics.since(before), clock.seconds - seconds
            ms = {name: getattr(m, name, 0.0) / steps * 1e3 for name in
                  ("schedule_s", "draft_s", "build_s", "forward_s", "sample_s", "postprocess_s", "observe_s")}
            reads = b * (context + repeat * steps * (k + 1) / 2) * a.num_layers * 2 * a.num_kv_heads * a.head_dim * elem
            out[b][k] = {"step_ms": wall * 1e3, "attention_ms": attention / steps * 1e3,
                         "tokens_per_s": b * (k + 1) / wall, "bytes_mb": (weights + reads) / 1e6,
                         "accepted_per_row": m.num_accepted_tokens / max(m.num_verify_rows, 1),
                         **{n[:-2] + "_ms": v for n, v in ms.items()}}
            print(f"  {dtype:>8} batch {b:>3} k={k}: {wall * 1e3:7.2f} ms/step, "
                  f"{out[b][k]['tokens_per_s']:8.0f} tok/s", file=sys.stderr, flush=True)
    return out


def run_baseline(directory: str, dtype: str, args) -> dict:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(directory)}
    cmd = [sys.executable, os.path.abspath(__file__), "--measure-only", "--dtypes", dtype, "--model", args.model,
           "--batch-sizes", args.batch_sizes, "--context", str(args.context), "--steps", str(args.steps),
           "--repeat", str(args.repeat)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])[dtype]


def table(label: str, dtype: str, res: dict, gb_s: float, base: dict | None) -> None:
    print(f"\n{label} {dtype}: ms per step (ratio to the plain step){' | vs baseline' if base else ''}")
    print(f"{'batch':>5} {'k':>2} {'step':>7} {'ratio':>6} {'floor':>6} {'sched':>6} {'draft':>6} {'build':>6} "
          f"{'attn':>6} {'rest':>6} {'sample':>6} {'post':>6} {'tok/s':>8}" + ("  base  speedup" if base else ""))
    for b, by_k in res.items():
        plain = by_k["0"]["step_ms"]
        for k, r in by_k.items():
            floor = r["bytes_mb"] / 1e3 / gb_s * 1e3
            line = (f"{b:>5} {k:>2} {r['step_ms']:7.2f} {r['step_ms'] / plain:6.2f} {floor:6.2f} {r['schedule_ms']:6.2f} "
                    f"{r['draft_ms']:6.2f} {r['build_ms']:6.2f} {r['attention_ms']:6.2f} "
                    f"{r['forward_ms'] - r['attention_ms']:6.2f} {r['sample_ms']:6.2f} {r['postprocess_ms']:6.2f} "
                    f"{r['tokens_per_s']:8.0f}")
            if base:
                old = base[b][k]["step_ms"]
                line += f" {old:6.2f} {old / r['step_ms']:6.2f}x"
            print(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/small")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch-sizes", default="1,4,16,64,256")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2, help="windows per point; the fastest counts")
    ap.add_argument("--baseline", help="another checkout's root: measure its tailrl too, in a subprocess")
    ap.add_argument("--quick", action="store_true", help="batch sizes 1,16; 10 steps")
    ap.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.quick:
        a.batch_sizes, a.steps = "1,16", 10
    sizes = [int(s) for s in a.batch_sizes.split(",")]
    dtypes = a.dtypes.split(",")
    if a.measure_only:
        print(json.dumps({d: measure(a.model, d, sizes, a.context, a.steps, a.repeat) for d in dtypes}))
        return
    gb_s = bandwidth_gb_s()
    print(f"streaming read: {gb_s:.1f} GB/s (floor = bytes read per step / this)")
    runs: dict = {"current": {}, "baseline": {}}
    for d in dtypes:
        runs["current"][d] = json.loads(json.dumps(measure(a.model, d, sizes, a.context, a.steps, a.repeat)))
        if a.baseline:
            runs["baseline"][d] = run_baseline(a.baseline, d, a)
    for d in dtypes:
        table("current", d, runs["current"][d], gb_s, runs["baseline"].get(d))
    print(json.dumps({"floor_gb_s": gb_s, "context": a.context, "runs": runs}))


if __name__ == "__main__":
    main()
