"""The scheduling-policy ladder on the Qwen2-VL-72B-like workload at Seer's scale.

    PYTHONPATH=. python benchmarks/simulate_ladder.py [--quick]

1. The ladder: static, divided, context, history, oracle, group-oracle on 9,600 requests
   (groups of 16, max 40,960, mean ~7,615 tokens) on 16 instances of 8 x H800, next to
   Seer's published ablation (divided 1.42x, +context 1.56x, oracle 1.63x over veRL; tail
   time 0.79 / 0.11 / 0.00 of veRL's), on `--seeds` workload draws (the static baseline
   varies a lot from draw to draw: it depends on which shares the longest groups land in),
   plus two bounds: `group-mean` (group-oracle knowing each group's mean length) and
   `ctx+known` (context that learns a request's true length once it has started).
2. Sensitivity to the within-group length correlation `rho`.
3. `history` under across-epoch rank churn (`rank_corr` 1.0 = the previous epoch ranks
   prompts exactly as this one; 0 = history is noise).
4. If `--trace` exists (by default the trace `--measure-rho` writes): the policies on our
   own rollouts' lengths, every length scaled so the limit becomes 40,960 tokens.

    PYTHONPATH=. python benchmarks/simulate_ladder.py --measure-rho [--rollouts RUN/rollouts.jsonl ...]

measures instead the within-group correlation of log response lengths (`tailrl.sim.fit`)
on our own rollouts: it samples `--prompts` x `--n` responses of held-out task prompts
from the shipped `small` model (temperature 1, one torch thread), writes them as a JSONL
trace (`sim_out/small_rollouts.jsonl`, the simulator's trace format) and prints rho
overall and per task family; `--rollouts` adds the rollouts that `tailrl train` recorded
(`rollouts.jsonl`: every step's groups, during RL training).

Prints tables; the last line is one JSON object with every figure. Ratios only: wall time
is reported, never asserted.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

from tailrl.rollout.buffer import BufferEntry
from tailrl.rollout.policies import ContextPolicy, GroupOraclePolicy, PolicyConfig
from tailrl.sim.fit import group_correlation, tail_clustering
from tailrl.sim.metrics import table
from tailrl.sim.scenario import Scenario, run_policies
from tailrl.sim.simulator import simulate
from tailrl.sim.workload import Trace, WorkloadConfig, generate, read_jsonl

SEER = {"divided": (1.42, 0.79), "context": (1.56, 0.11), "oracle": (1.63, 0.00)}  # speedup, tail vs veRL
LADDER = ["static", "divided", "context", "history", "oracle", "group-oracle"]


class _KnownOnceStarted(ContextPolicy):
    """A bound, not a policy: `context` that learns a request's true length as soon as it
    has started (perfect attained-length evidence); unstarted requests are ranked by the
    Seer group estimate as in `context`."""

    name = "ctx+known"

    def __init__(self, true_lengths: dict[int, int], config: PolicyConfig) -> None:
        super().__init__(config)
        self.true_lengths = true_lengths

    def estimate(self, r: BufferEntry) -> int:
        return self.true_lengths[r.request_id] if r.chunks > 0 else super().estimate(r)


def _bounds(sc: Scenario, trace: Trace) -> list:
    """What more length knowledge would buy: group-oracle by the mean, ctx+known."""
    step, cfg = sc.deployment()
    truth = dict(enumerate(trace.length.tolist()))
    pc = PolicyConfig(chunk_tokens=sc.chunk_tokens)
    mean = GroupOraclePolicy(truth, pc, stat="mean")
    mean.name = "group-mean"
    return [simulate(trace, pol, cfg, step) for pol in (mean, _KnownOnceStarted(truth, pc))]


def _stats(xs: list[float]) -> str:
    return f"{sum(xs) / len(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def ladder(scale: dict, seeds: list[int], rho: float | None) -> dict:
    """Every ladder policy on `seeds` workload draws: per-seed figures and their mean."""
    runs: dict[str, dict[str, list[float]]] = {}
    for seed in seeds:
        sc = Scenario(seed=seed, rho=rho, **scale)
        trace = sc.trace()
        text, fig = table(run_policies(sc, LADDER, trace) + _bounds(sc, trace))
        print(f"-- seed {seed}\n{text}")
        for name, f in fig.items():
            r = runs.setdefault(name, {"speedup": [], "tail": [], "makespan": [], "idle": [], "migrated_tb": []})
            r["speedup"].append(f["speedup_vs_static"])
            r["tail"].append(f["tail_vs_static"])
            r["makespan"].append(f["makespan_s"])
            r["idle"].append(f["idle_frac"])
            r["migrated_tb"].append(f["migrated_gb"] / 1e3)
    print(f"\nmean [min, max] over seeds {seeds}")
    print(f"{'policy':<13} {'speedup':>20} {'Seer':>6} {'tail/static':>20} {'Seer':>6} {'makespan_s':>10}")
    for name, r in runs.items():
        sp, tail = SEER.get(name, (None, None))
        print(f"{name:<13} {_stats(r['speedup']):>20} {'' if sp is None else f'{sp:.2f}':>6} "
              f"{_stats(r['tail']):>20} {'' if tail is None else f'{tail:.2f}':>6} "
              f"{sum(r['makespan']) / len(seeds):>10.0f}")
    ratio = [o / c for o, c in zip(runs["oracle"]["makespan"], runs["context"]["makespan"])]
    print(f"context / oracle throughput: {_stats(ratio)} (Seer: ~95%; target >= 92%)")
    return {"seeds": seeds, "policies": runs, "context_over_oracle": ratio}


def sweep(scale: dict, seeds: list[int], knob: str, values: list[float], policies: list[str]) -> dict:
    """Speedup and tail vs static of `policies` as one workload knob varies (mean over seeds)."""
    out = {}
    for v in values:
        acc: dict[str, list[tuple[float, float]]] = {}
        for seed in seeds:
            _, fig = table(run_policies(Scenario(seed=seed, **{knob: v}, **scale), ["static"] + policies))
            for name in policies:
                acc.setdefault(name, []).append((fig[name]["speedup_vs_static"], fig[name]["tail_vs_static"]))
        out[str(v)] = {n: {"speedup_vs_static": round(sum(a for a, _ in xs) / len(xs), 3),
                           "tail_vs_static": round(sum(b for _, b in xs) / len(xs), 3)} for n, xs in acc.items()}
        print(f"{knob} {v}: " + " | ".join(f"{n} {f['speedup_vs_static']:.2f}x tail {f['tail_vs_static']:.2f}"
                                            for n, f in out[str(v)].items()))
    return out


def stretched(path: str | Path, max_tokens: int = 40960) -> Trace:
    """A recorded trace with every length scaled by one factor so that its length limit
    becomes `max_tokens`: its group structure (who is long, with whom) is kept."""
    tr = read_jsonl(path)
    f = max_tokens / int(tr.max_tokens.max())
    up = lambda a: np.maximum(1, np.round(a * f)).astype(np.int64)
    return Trace(tr.group_id, tr.prompt_id, up(tr.prompt_len), up(tr.max_tokens),
                 np.minimum(up(tr.length), up(tr.max_tokens)))


def real_structure(path: str | Path) -> dict:
    """The policies on our own rollouts' lengths, stretched to the Qwen2-VL max length, on
    as many instances as keep Seer's 600 requests per instance."""
    trace = stretched(path)
    sc = Scenario(instances=max(1, round(len(trace) / 600)))
    L = trace.length
    print(f"{path}: {len(L)} requests, {sc.instances} instances, lengths x{40960 / 960:.1f}: mean {L.mean():.0f}, "
          f"p50 {np.median(L):.0f}, p90 {np.percentile(L, 90):.0f}, rho {group_correlation(L, trace.group_id).rho:.2f}")
    text, fig = table(run_policies(sc, ["static", "divided", "context", "oracle", "group-oracle"], trace))
    print(text)
    print(f"context / oracle throughput: {fig['oracle']['makespan_s'] / fig['context']['makespan_s']:.1%}")
    return fig


def _print_fit(name: str, lengths: list[int], groups: list) -> dict:
    fit, tail = group_correlation(lengths, groups), tail_clustering(lengths, groups)
    print(f"{name:<34} rho {fit.rho:.2f}  sd within {fit.sd_within:.2f}  between {fit.sd_between:.2f}  "
          f"top-10% with a top-10% sibling {tail:.2f}  ({fit.groups} groups, {fit.responses} responses)")
    return {"rho": round(fit.rho, 3), "sd_within": round(fit.sd_within, 3), "sd_between": round(fit.sd_between, 3),
            "tail_clustering": round(tail, 3), "groups": fit.groups, "responses": fit.responses}


def measure_rho(prompts: int, n: int, seed: int, rollouts: list[str]) -> dict:
    """rho of our own rollouts: fresh samples of the small model, and recorded RL runs."""
    import torch
    from transformers import AutoTokenizer

    from tailrl.cli.workload_sampling import sample
    from tailrl.tasks import mixture
    from tailrl.tasks.models import get_model

    torch.set_num_threads(1)
    model_dir = get_model("small")
    tok = AutoTokenizer.from_pretrained(model_dir)
    examples = mixture.heldout_examples(prompts)
    ids = [tok.encode(ex.prompt) for ex in examples]
    responses = sample("tailrl", model_dir, ids, n, 1.0, 960, seed)
    rows = [dict(prompt_id=k, group_id=k, family=ex.family, prompt_len=len(p), max_tokens=960,
                 response_len=max(1, len(r))) for k, (ex, p, group) in enumerate(zip(examples, ids, responses))
            for r, _ in group]
    out_path = Path("sim_out/small_rollouts.jsonl")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {out_path} ({len(rows)} responses of {prompts} prompts)")
    out = {"small": _print_fit(f"small model, {prompts} x {n}", [r["response_len"] for r in rows],
                               [r["group_id"] for r in rows])}
    for fam in sorted({r["family"] for r in rows}):
        sel = [r for r in rows if r["family"] == fam]
        if len({r["group_id"] for r in sel}) >= 2:
            out[f"small/{fam}"] = _print_fit(f"  {fam}", [r["response_len"] for r in sel],
                                             [r["group_id"] for r in sel])
    for path in rollouts:   # tailrl train's rollouts.jsonl: {"step", "uids", "responses": [[ids...]...]}
        lengths, groups = [], []
        for line in Path(path).read_text().splitlines():
            row = json.loads(line)
            for uid, group in zip(row["uids"], row["responses"]):
                lengths += [max(1, len(r)) for r in group]
                groups += [f"{row['step']}/{uid}"] * len(group)
        out[path] = _print_fit(f"RL run {path}", lengths, groups)
    for size, rho in itertools.product((8, 16), (0.4, 0.6, 0.8)):   # what the synthetic workload gives
        tr = generate(WorkloadConfig(requests=9600, group_size=size, rho=rho))
        out[f"synthetic/{size}/{rho}"] = _print_fit(f"synthetic, groups of {size}, rho {rho}", tr.length.tolist(),
                                                    tr.group_id.tolist())
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/4 of the requests and instances")
    ap.add_argument("--measure-rho", action="store_true", help="measure rho on our rollouts instead")
    ap.add_argument("--prompts", type=int, default=128, help="--measure-rho: held-out prompts")
    ap.add_argument("--n", type=int, default=16, help="--measure-rho: responses per prompt")
    ap.add_argument("--seed", type=int, default=0, help="--measure-rho: sampling seed")
    ap.add_argument("--seeds", type=int, default=3, help="workload draws per setting (seeds 0..N-1)")
    ap.add_argument("--rho", type=float, default=None, help="ladder rho (default: the preset's)")
    ap.add_argument("--trace", default="sim_out/small_rollouts.jsonl",
                    help="a recorded trace to run stretched to max 40,960 tokens (skipped if absent)")
    ap.add_argument("--rollouts", nargs="*", default=[], help="--measure-rho: recorded RL rollouts.jsonl")
    args = ap.parse_args(argv)
    if args.measure_rho:
        print(json.dumps({"rho_measured": measure_rho(args.prompts, args.n, args.seed, args.rollouts)}))
        return 0
    scale = dict(requests=2400, instances=4) if args.quick else dict(requests=9600, instances=16)
    seeds = list(range(args.seeds))
    out: dict = {"scale": scale}

    print(f"== ladder: qwen2vl-72b, {scale['requests']} requests, {scale['instances']} instances, "
          f"rho {args.rho if args.rho is not None else 'preset'}")
    out["ladder"] = ladder(scale, seeds, args.rho)

    print("\n== context vs within-group correlation rho (mean over seeds)")
    out["rho"] = sweep(scale, seeds, "rho", [0.4, 0.6, 0.8, 0.9], ["context", "group-oracle", "oracle"])

    print("\n== history vs across-epoch rank churn (mean over seeds)")
    out["rank_corr"] = sweep(scale, seeds, "rank_corr", [1.0, 0.9, 0.7, 0.0], ["history"])

    if Path(args.trace).exists():
        print("\n== our own rollouts' length structure (--measure-rho's trace), stretched")
        out["real_structure"] = real_structure(args.trace)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
