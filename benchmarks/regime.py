"""Speculation's gain across model costs: `small` and its cost-faithful stand-ins, one table.

Everything was tuned on `small` (4.8M parameters, weights in the CPU's cache). A stand-in
(docs/standins.md) computes `small`'s tokens at a bigger model's cost per step, so the same
rollout measures how the gain of each speculation setting moves with the cost of a step.
Stand-ins are built on first use into ``--standin-dir`` (tailrl.model.standin) and reused
while their source's weights are unchanged.

Rollout per model: ``--prompts`` held-out task prompts x ``--n`` samples, T=1, ``--max-tokens``,
``--dtype``. Round 1 (plain engine, other seeds) gives the history; every later rollout first
resets each prompt's history to round 1's responses and uses the same seeds, so every timed
rollout does the same work (the same tokens come out: speculation is lossless). Settings:
``plain`` (no speculation), ``fixedK`` (policy "fixed", max_draft_tokens=K, for K in
``--depths``), ``default`` (``SpeculativeConfig()``), ``adaptive`` (policy "adaptive"), and with
``--drafter DIR`` ``drafter`` and ``hybrid`` on every model whose hidden size and vocabulary
match the drafter's and on the stand-ins of `small` given a drafter of `small` (widened for
each: it drafts there exactly what it drafts on `small`, at a drafter's cost for that width).
``--settings`` runs only the settings named (plain always). Each engine first runs one untimed rollout (``--warmup``; its KV cache grows and the
adaptive policy learns its costs; reported as ``first_makespan_s``), then the settings take
turns for ``--rounds`` rounds, the order reversed every other round (ABBA: the machine's speed
drifts over minutes, a fixed order would favour whichever runs first).

Per model and setting: best and median makespan; the makespan ratio to plain per round (plain
/ setting) with mean, standard error and range; accepted tokens per verify step; the tail's
share of the makespan (``rollout/tail_s``: time after 90% of the responses finished); the
share of responses identical to plain's (1.0 in bfloat16); the median makespan over the
no-tail bound (total tokens / the plain engine's full-batch throughput, measured in the same
run with ``--bound-rows`` rows, default prompts x n, the rollout's own full batch). It bounds
plain decoding; where verify steps are nearly free (small batches of a costly model) a
speculative rollout can beat it (a ratio below 1).

The best-depth bound, an estimate. Every timed plain and fixedK rollout records its steps
(batch rows, new tokens, KV tokens read, seconds). One linear step-cost model per model,
t = c0 + c1 rows + c2 tokens + c3 kv (tailrl.sim.step_model.CalibratedStepModel), is fitted
to the decode and verify steps of all of them. Each fixedK run gives, per row-step where the
policy drafts (batch <= max_spec_batch), the draft tokens e_K and the tokens gained g_K
(1 + accepted drafts). For each decode step of the plain run (B rows, kv K, t seconds) depth K
would take t x fit(B, B(1+e_K), K+B e_K) / fit(B, B, K) / g_K to produce the same tokens;
the estimate takes the fastest of plain and every K per step (a K whose step exceeds the
engine's 1024-token budget is not a choice) and keeps the plain run's other time (prefill,
call overhead). Assumptions: every row of a step gains g_K tokens whatever its batch size
and position (acceptance is the rollout's mean, not the tail's); the plain run's batch-size
profile stays (responses are the same, their finish order is assumed to); one depth for the
whole step; only the measured depths; the linear fit's error. ``check`` tests the method on
what was measured: the same computation forcing K wherever the fixed policy drafts, over
fixedK's measured makespan (1.0 = the estimate reproduces that run).

Fixed batch sizes (``--fixed-batches`` on ``--fixed-model``, default the largest model given):
``--fixed-tokens`` tokens per request with EOS ignored, so the batch stays full; plain,
default and each fixedK drafting from the model's round-1 history (as benchmarks/
speculation.py's fixed-batch section); settings in turn for ``--fixed-rounds`` ABBA rounds,
tokens/s median and the median of the per-round ratios to plain. The ridge batch size is
where a plain step's time per row stops falling: the first batch size at which doubling the
batch cuts the time per row by less than 10%, from the plain rollouts' decode steps (batch
sizes binned to powers of two) and from the fixed-batch plain runs.

The last line is one JSON object: {"models": {name: {"model_dir", "total_tokens",
"full_batch_tokens_per_s", "no_tail_bound_s", "settings": {setting: {"makespan_best_s",
"makespan_median_s", "first_makespan_s", "ratio_to_plain": {"mean", "se", "min", "max",
"rounds"}, "accept_length", "drafter_s" (the drafter's calls, mean seconds per rollout), "tail_share",
"identical_to_plain", "bound_ratio"}},
"depth_estimate": {"makespan_s", "ratio_to_plain", "chosen_depth_share", "draft_per_row_step",
"tokens_per_row_step", "fit", "check"}, "ridge_batch" (null: not reached), "per_row_ms", "skipped"
(settings left out: a drafter of another width), "seconds"}},
"fixed_batch": {"model", "sizes": {batch: {setting: {"tok_s", "ratio_to_plain",
"accept_length"}}}, "per_row_ms", "ridge_batch"}, "config": {...}}.

Usage:
  python benchmarks/regime.py --models small,50m,0.5b [--standin-dir /tmp/tailrl-standins]
      [--depths 2,4,8] [--rounds 2] [--drafter DIR] [--bound-rows 128,128,32] [--quick]
      [--settings plain,default,hybrid]
Cost: 1 + (warm-up + rounds) x settings rollouts per model. On this 2-core machine a 16x8,
max-512 rollout takes ~2 s on small, ~8 s on 50m and ~110-120 s on 0.5b, so the full
three-model run (6 settings, 2 rounds) takes about an hour: 0.5b's rollouts ~36 min, its
fixed-batch section ~15 min (``--fixed-tokens 64`` halves it), its bound ~4 min at 128 rows
(``--bound-rows 128,128,32``: ~1.5 min). Peak memory: one engine per setting, ~1.7 GB each
on 0.5b (weights and a 128-row KV cache).
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from drafter import identical_share, spread  # noqa: E402
from speculation import full_batch_throughput, load_prompts, rollout  # noqa: E402

from tailrl import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from tailrl.drafter.standin import build_standin_drafter  # noqa: E402
from tailrl.model.loader import weight_files  # noqa: E402
from tailrl.model.standin import STANDINS, build_standin, get_standin  # noqa: E402
from tailrl.sim.step_model import CalibratedStepModel  # noqa: E402
from tailrl.tasks.models import get_model  # noqa: E402

HISTORY_SEED, TIMED_SEED, FIXED_SEED = 10_000, 20_000, 7
STEP_TOKEN_BUDGET = 1024      # EngineConfig.max_num_batched_tokens's default: no step exceeds it
Run = dict                    # {"out": responses per prompt, "m": last_metrics, "log": step log}


# ---- models and settings ----------------------------------------------------------------------
def model_dir(name: str, standin_dir: Path) -> str:
    """A checkpoint directory for ``name``: a directory as is, a preset, or a stand-in of small
    (built into ``standin_dir/<name>`` unless a build from the same source weights is there)."""
    if Path(name).is_dir():
        return name
    if name not in STANDINS:
        return get_model(name)
    source = Path(get_model("small"))
    digest = hashlib.sha256()
    for f in weight_files(str(source)):
        digest.update(Path(f).read_bytes())
    out, spec = standin_dir / name, get_standin(name)
    info = out / "standin_info.json"
    if info.is_file():
        old = json.loads(info.read_text())
        if old["spec"] == asdict(spec) and old["figures"]["source_sha256"] == digest.hexdigest():
            return str(out)
    standin_dir.mkdir(parents=True, exist_ok=True)
    # build beside it and rename, so a concurrent run never reads half a checkpoint
    tmp = standin_dir / f".{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t = time.perf_counter()
    build_standin(spec, source, tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"built stand-in {name} in {out} ({time.perf_counter() - t:.1f} s)", flush=True)
    return str(out)


def drafter_fits(drafter: str, mdir: str) -> bool:
    """A drafter reads its target's hidden state and shares its vocabulary: widths must match."""
    d = json.loads((Path(drafter) / "drafter.json").read_text())
    c = json.loads((Path(mdir) / "config.json").read_text())
    return d["hidden_size"] == c["hidden_size"] and d["vocab_size"] == c["vocab_size"]


def drafter_for(name: str, mdir: str, drafter: str | None) -> str | None:
    """The drafter to use on model ``name``: ``drafter`` where the widths match; on a stand-in
    of small, ``drafter`` (a drafter of small) widened for it (tailrl.model.standin, written
    into the stand-in's ``drafter/``, drafting exactly what it drafts on small); else None."""
    if drafter is None or drafter_fits(drafter, mdir):
        return drafter
    small = get_model("small")
    if name not in STANDINS or not drafter_fits(drafter, small):
        return None
    out = Path(mdir) / "drafter"
    build_standin_drafter(get_standin(name), small, drafter, out)
    return str(out)


def settings(depths: list[int], drafter: str | None) -> dict[str, SpeculativeConfig | None]:
    out: dict[str, SpeculativeConfig | None] = {"plain": None}
    out.update({f"fixed{k}": SpeculativeConfig(policy="fixed", max_draft_tokens=k) for k in depths})
    out["default"] = SpeculativeConfig()
    out["adaptive"] = SpeculativeConfig(policy="adaptive")
    if drafter is not None:
        out["drafter"] = SpeculativeConfig(method="drafter", drafter=drafter)
        out["hybrid"] = SpeculativeConfig(method="hybrid", drafter=drafter)
    return out


def abba(names: list[str], r: int) -> list[str]:
    return names if r % 2 == 0 else names[::-1]


def timed_rollout(llm: LLM, prompts: list[list[int]], history: list[list[list[int]]], n: int,
                  max_tokens: int) -> Run:
    """One rollout drafting from round 1's history (generate records each call's responses as
    the next history: without the reset a repeat would draft from the tokens it samples)."""
    for i, h in enumerate(history):
        llm.history.record(f"p{i}", h)
    llm.engine.step_log = []
    out, m = rollout(llm, prompts, n, TIMED_SEED, max_tokens)
    log, llm.engine.step_log = llm.engine.step_log, None
    return {"out": out, "m": m, "log": log}


# ---- step logs: the best-depth estimate and the ridge -------------------------------------------
def decode_steps(log: list[dict], depth: int) -> list[dict]:
    """Decode and verify steps of a step log. All prompts arrive at once and prefill in the first
    steps from an empty cache (KV read = tokens computed); a decode step reads more than it
    computes, and computes at most 1 + depth tokens per row."""
    return [s for s in log if s["kv_tokens"] > s["new_tokens"] and s["new_tokens"] <= s["batch"] * (1 + depth)]


def depth_estimate(plain: list[Run], fixed: dict[int, list[Run]], spec_batch: int) -> dict:
    """The rollout with the best measured depth at every step (see the module docstring)."""
    steps = [s for r in plain for s in decode_steps(r["log"], 0)]
    steps += [s for k, runs in fixed.items() for r in runs for s in decode_steps(r["log"], k)]
    fit = CalibratedStepModel.fit(steps)

    def cost(b: float, n: float, kv: float) -> float:
        return max(fit.c0 + fit.c1 * b + fit.c2 * n + fit.c3 * kv, 1e-9)

    per_depth: dict[int, tuple[float, float]] = {}           # depth -> (drafts, tokens) per row-step
    for k, runs in fixed.items():
        rows = sum(s["batch"] for r in runs for s in decode_steps(r["log"], k)
                   if s["batch"] <= spec_batch or s["new_tokens"] > s["batch"])
        drafted = sum(r["m"].get("rollout/spec_draft_tokens", 0.0) for r in runs)
        accepted = sum(r["m"].get("rollout/spec_accepted_tokens", 0.0) for r in runs)
        per_depth[k] = (drafted / max(rows, 1), 1.0 + accepted / max(rows, 1))

    def at_depth(s: dict, k: int) -> float | None:
        """Seconds to produce plain step ``s``'s tokens at depth k (None: over the token budget)."""
        if k == 0:
            return s["seconds"]
        e, g = per_depth[k]
        b, kv = s["batch"], s["kv_tokens"]
        if b * (1 + e) > STEP_TOKEN_BUDGET:
            return None
        return s["seconds"] * cost(b, b * (1 + e), kv + b * e) / cost(b, b, kv) / g

    est, ratios, chosen = [], [], {k: 0 for k in [0, *fixed]}
    check: dict[int, list[float]] = {k: [] for k in fixed}
    for r, run in enumerate(plain):
        dec = decode_steps(run["log"], 0)
        span = run["m"]["timing_s/gen"]
        other = span - sum(s["seconds"] for s in dec)          # prefill, call overhead: unchanged
        best = 0.0
        for s in dec:
            t, k = min((t, k) for k in chosen if (t := at_depth(s, k)) is not None)
            best += t
            chosen[k] += 1
        est.append(other + best)
        ratios.append(span / (other + best))
        for k, runs in fixed.items():          # depth k wherever the fixed policy drafts
            forced = sum(t if s["batch"] <= spec_batch and (t := at_depth(s, k)) is not None else s["seconds"]
                         for s in dec)
            check[k].append((other + forced) / runs[r]["m"]["timing_s/gen"])
    total = max(sum(chosen.values()), 1)
    return {"makespan_s": round(float(np.mean(est)), 3), "ratio_to_plain": round(float(np.mean(ratios)), 3),
            "chosen_depth_share": {str(k): round(v / total, 3) for k, v in chosen.items()},
            "draft_per_row_step": {str(k): round(v[0], 3) for k, v in per_depth.items()},
            "tokens_per_row_step": {str(k): round(v[1], 3) for k, v in per_depth.items()},
            "fit": {f"c{i}": float(f"{c:.4g}") for i, c in enumerate((fit.c0, fit.c1, fit.c2, fit.c3))},
            "check": {str(k): round(float(np.mean(v)), 3) for k, v in check.items()}}


def ridge(per_row: dict[int, float]) -> int | None:
    """The first batch size at which doubling the batch cuts the time per row by less than 10%
    (between measured sizes a factor f apart, by less than 0.9 ** log2(f)); None: it kept falling."""
    sizes = sorted(per_row)
    for b, nxt in zip(sizes, sizes[1:]):
        if per_row[nxt] > per_row[b] * 0.9 ** np.log2(nxt / b):
            return b
    return None


def per_row_curve(plain: list[Run]) -> dict[int, float]:
    """Median ms per row of the plain rollouts' decode steps, batch sizes binned to powers of two."""
    bins: dict[int, list[float]] = {}
    for run in plain:
        for s in decode_steps(run["log"], 0):
            bins.setdefault(1 << (s["batch"].bit_length() - 1), []).append(1e3 * s["seconds"] / s["batch"])
    return {b: round(float(np.median(v)), 4) for b, v in sorted(bins.items()) if len(v) >= 3}


# ---- one model ---------------------------------------------------------------------------------
def run_model(name: str, mdir: str, a: argparse.Namespace, depths: list[int], bound_rows: int,
              drafter: str | None) -> tuple[dict, dict[str, LLM], list, list]:
    """The rollout table of one model; also returns its engines, prompts and round-1 history."""
    t0 = time.perf_counter()
    prompts = load_prompts(mdir, a.prompts)
    skipped = []
    given, drafter = drafter, drafter_for(name, mdir, drafter)
    if given is not None and drafter is None:
        skipped = ["drafter", "hybrid"]
        print(f"{name}: drafter {given} does not fit this model's width; drafter and hybrid skipped")
    elif drafter != given:
        print(f"{name}: drafter {given} widened into {drafter}", flush=True)
    cfgs = {s: c for s, c in settings(depths, drafter).items() if not a.settings or s in a.settings}
    llms = {s: LLM(mdir, dtype=a.dtype, seed=0, speculative=c) for s, c in cfgs.items()}
    history, _ = rollout(llms["plain"], prompts, a.n, HISTORY_SEED, a.max_tokens)      # round 1
    names = list(cfgs)
    runs: dict[str, list[Run]] = {s: [] for s in names}
    first: dict[str, float] = {}
    for r in range(-1 if a.warmup else 0, a.rounds):
        for s in abba(names, r):
            run = timed_rollout(llms[s], prompts, history, a.n, a.max_tokens)
            m = run["m"]
            if r < 0:
                first[s] = m["timing_s/gen"]
            else:
                runs[s].append(run)
            acc = f" | accept {m['rollout/spec_accept_length']:.2f}" if "rollout/spec_accept_length" in m else ""
            print(f"{name:6s} {'warm-up' if r < 0 else f'round {r}':8s} {s:9s} makespan {m['timing_s/gen']:7.2f} s "
                  f"| tail {m.get('rollout/tail_s', 0.0):6.2f} s{acc}", flush=True)
    plain_spans = [x["m"]["timing_s/gen"] for x in runs["plain"]]
    total = int(sum(len(c) for g in runs["plain"][0]["out"] for c in g))
    full = full_batch_throughput(mdir, prompts, a.dtype, rows=bound_rows, tokens=a.bound_tokens)
    bound = total / full
    table: dict[str, dict] = {}
    for s in names:
        spans = [x["m"]["timing_s/gen"] for x in runs[s]]
        mean = lambda key: round(float(np.mean([x["m"].get(key, 0.0) for x in runs[s]])), 3)  # noqa: E731
        table[s] = {"makespan_best_s": round(min(spans), 3), "makespan_median_s": round(float(np.median(spans)), 3),
                    "first_makespan_s": round(first[s], 3) if s in first else None,
                    "ratio_to_plain": spread([p / x for p, x in zip(plain_spans, spans)]),
                    "accept_length": mean("rollout/spec_accept_length"),
                    "drafter_s": mean("timing_s/drafter"),
                    "tail_share": round(float(np.mean([x["m"].get("rollout/tail_s", 0.0) / x["m"]["timing_s/gen"]
                                                       for x in runs[s]])), 3),
                    "identical_to_plain": round(float(np.mean([identical_share(runs["plain"][0]["out"], x["out"])
                                                               for x in runs[s]])), 4),
                    "bound_ratio": round(float(np.median(spans)) / bound, 3)}
    fixed = {k: runs[f"fixed{k}"] for k in depths}
    est = depth_estimate(runs["plain"], fixed, SpeculativeConfig(policy="fixed").max_spec_batch)   # where fixedK drafts
    curve = per_row_curve(runs["plain"])
    res = {"model_dir": mdir, "total_tokens": total, "full_batch_tokens_per_s": round(full, 1),
           "no_tail_bound_s": round(bound, 3), "settings": table, "depth_estimate": est,
           "ridge_batch": ridge(curve), "per_row_ms": {str(b): v for b, v in curve.items()}, "skipped": skipped,
           "seconds": round(time.perf_counter() - t0, 1)}
    print(summary(name, res), flush=True)
    return res, llms, prompts, history


def summary(name: str, res: dict) -> str:
    lines = [f"== {name}: {res['total_tokens']} tokens, no-tail bound {res['no_tail_bound_s']:.2f} s "
             f"({res['full_batch_tokens_per_s']:.0f} tok/s at full batch)",
             f"{'setting':9s} {'best s':>8s} {'median s':>9s} {'x plain (mean, range)':>24s} {'acc/verify':>10s} "
             f"{'tail share':>10s} {'/ bound':>8s} identical"]
    for s, r in res["settings"].items():
        q = r["ratio_to_plain"]
        lines.append(f"{s:9s} {r['makespan_best_s']:8.2f} {r['makespan_median_s']:9.2f} "
                     f"{q['mean']:9.3f} [{q['min']:.2f}, {q['max']:.2f}] {r['accept_length']:10.2f} "
                     f"{r['tail_share']:10.2f} {r['bound_ratio']:8.2f} {r['identical_to_plain']:.4f}")
    plain = res["settings"]["plain"]["makespan_median_s"]
    for s, r in res["settings"].items():
        if r["drafter_s"] > 0:          # the learned drafter's calls: what drafting for free would give
            free = r["makespan_median_s"] - r["drafter_s"]
            lines.append(f"{s}: the drafter's calls took {r['drafter_s']:.2f} s of the rollout; without them "
                         f"{free:.2f} s ({plain / free:.3f}x plain)")
    e = res["depth_estimate"]
    lines.append(f"best depth per step (estimate): {e['makespan_s']:.2f} s, {e['ratio_to_plain']:.3f}x plain; "
                 f"depth chosen on steps {e['chosen_depth_share']}; tokens per row-step {e['tokens_per_row_step']}; "
                 f"check (predicted / measured fixedK) {e['check']}")
    lines.append(f"plain ms per row by batch {res['per_row_ms']}; ridge batch size {ridge_text(res)}")
    return "\n".join(lines)


def ridge_text(res: dict) -> str:
    sizes = [int(b) for b in res["per_row_ms"]]
    if res["ridge_batch"] is not None:
        return str(res["ridge_batch"])
    return f"not reached up to {max(sizes)} (time per row still falling)" if sizes else "unknown (too few steps)"


# ---- fixed batch sizes ---------------------------------------------------------------------------
def fixed_batches(llms: dict[str, LLM], names: list[str], prompts: list[list[int]], history: list,
                  sizes: list[int], tokens: int, rounds: int) -> dict:
    """Tokens/s with the batch held full (EOS ignored), the settings in ABBA turns per size."""
    res: dict = {"sizes": {}}
    for b in sizes:
        n = min(b, 8)                                 # as benchmarks/speculation.py's fixed_batch
        sel = [prompts[i % len(prompts)] for i in range(max(b // n, 1))]
        pids = [f"p{i % len(prompts)}" for i in range(len(sel))]
        sp = SamplingParams(n=n, temperature=1.0, top_k=-1, max_tokens=tokens, ignore_eos=True, seed=FIXED_SEED)
        rates: dict[str, list[float]] = {s: [] for s in names}
        acc: dict[str, float] = {}
        for r in range(rounds):
            for s in abba(names, r):
                llm = llms[s]
                for i, pid in enumerate(pids):        # draft from round 1 (see timed_rollout)
                    llm.history.record(pid, history[i % len(prompts)])
                llm.generate(sel, sp, prompt_ids=pids, use_tqdm=False)
                rates[s].append(llm.last_metrics["perf/tokens_per_s"])
                acc[s] = llm.last_metrics.get("rollout/spec_accept_length", 0.0)
        row = {s: {"tok_s": round(float(np.median(v)), 1),
                   "ratio_to_plain": round(float(np.median([x / p for p, x in zip(rates["plain"], v)])), 3),
                   "accept_length": round(acc[s], 2)} for s, v in rates.items()}
        res["sizes"][str(b)] = row
        print(f"batch {b:>4}: plain {row['plain']['tok_s']:8.1f} tok/s; " +
              ", ".join(f"{s} {x['ratio_to_plain']:.2f}x (acc {x['accept_length']:.2f})"
                        for s, x in row.items() if s != "plain"), flush=True)
    # ms per row of a plain step = batch / (tokens/s)
    res["per_row_ms"] = {str(b): round(1e3 / res["sizes"][str(b)]["plain"]["tok_s"], 4) for b in sizes}
    res["ridge_batch"] = ridge({b: 1e3 / res["sizes"][str(b)]["plain"]["tok_s"] for b in sizes})
    return res


# ---- main ----------------------------------------------------------------------------------------
def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small,50m,0.5b", help="presets, stand-in names or checkpoint directories")
    ap.add_argument("--standin-dir", default="/tmp/tailrl-standins", help="where stand-ins are built and reused")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--depths", default="2,4,8", help="fixed draft depths")
    ap.add_argument("--rounds", type=int, default=2, help="timed ABBA rounds of every setting")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="one untimed rollout per engine first")
    ap.add_argument("--drafter", default=None,
                    help="learned drafter directory: models of its width, and stand-ins of small (widened)")
    ap.add_argument("--settings", default="", help="only these settings (comma-separated; plain is always run)")
    ap.add_argument("--bound-rows", default=None,
                    help="full-batch rows of the no-tail bound, one value or one per model (default prompts x n)")
    ap.add_argument("--bound-tokens", type=int, default=200)
    ap.add_argument("--fixed-model", default=None, help="model of the fixed-batch section (default the largest)")
    ap.add_argument("--fixed-batches", default="1,4,16,64", help="batch sizes ('' to skip the section)")
    ap.add_argument("--fixed-tokens", type=int, default=128)
    ap.add_argument("--fixed-rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="small only, 4 prompts x 4, max 64: validates in ~1 min")
    a = ap.parse_args()
    if a.quick:
        a.models, a.prompts, a.n, a.max_tokens, a.depths = "small", 4, 4, 64, "2,4"
        a.bound_tokens, a.fixed_batches, a.fixed_tokens = 32, "1,4", 32
    names = a.models.split(",")
    depths = ints(a.depths)
    a.settings = {s for s in a.settings.split(",") if s} | {"plain"} if a.settings else set()
    if a.settings:
        depths = [k for k in depths if f"fixed{k}" in a.settings]
    rows = ints(a.bound_rows) if a.bound_rows else [a.prompts * a.n]
    if len(rows) not in (1, len(names)):
        ap.error(f"--bound-rows: one value or one per model ({len(names)}), got {a.bound_rows!r}")
    rows = rows * len(names) if len(rows) == 1 else rows
    dirs = {m: model_dir(m, Path(a.standin_dir)) for m in names}
    sizes = ints(a.fixed_batches)
    fixed_model = a.fixed_model or max(names, key=lambda m: sum(os.path.getsize(f) for f in weight_files(dirs[m])))
    if sizes and fixed_model not in dirs:
        ap.error(f"--fixed-model must be one of --models {names}, got {fixed_model!r}")
    t0 = time.perf_counter()
    out: dict = {"models": {}, "fixed_batch": None}
    for m, r in zip(names, rows):
        res, llms, prompts, history = run_model(m, dirs[m], a, depths, r, a.drafter)
        out["models"][m] = res
        if sizes and m == fixed_model:
            keep = [s for s in ("plain", "default", *(f"fixed{k}" for k in depths)) if s in llms]
            print(f"fixed batch sizes on {m}: {a.fixed_tokens} tokens per request, EOS ignored", flush=True)
            fb = fixed_batches(llms, keep, prompts, history, sizes, a.fixed_tokens, a.fixed_rounds)
            out["fixed_batch"] = {"model": m, **fb}
            print(f"plain ms per row by batch {fb['per_row_ms']}; ridge batch size {ridge_text(fb)}", flush=True)
        del llms
        gc.collect()                 # free this model's engines before the next model loads
    out["config"] = {"prompts": a.prompts, "n": a.n, "max_tokens": a.max_tokens, "dtype": a.dtype,
                     "depths": depths, "rounds": a.rounds, "warmup": a.warmup, "drafter": a.drafter,
                     "bound_rows": dict(zip(names, rows)), "bound_tokens": a.bound_tokens,
                     "fixed_tokens": a.fixed_tokens, "fixed_rounds": a.fixed_rounds,
                     "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
