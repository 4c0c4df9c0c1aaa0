"""The native suffix index's costs over a request's life: appending tokens, proposing drafts,
and freeing the index when the request (or its group) finishes.

A group's index is what `GroupSource` keeps (``--seqs`` sequences of ``--tokens`` tokens,
each grown a few tokens at a time as verify steps commit them, a chain proposed for every
sequence after each growth, as the engine asks); a request's own index (`SelfSource`) is
the same with one sequence. Tokens: a random walk over ``--vocab`` ids that repeats a phrase
of the sequence's own past with probability ``--repeat`` (what drafts find). The engine
drops an index the moment its request or group finishes, inside a rollout step: that free
is on the rollout's critical path. Per tree (this checkout; with ``--baseline-ref REF`` a
worktree of REF too), each in its own process, ABBA rounds; reported: microseconds per
token for each phase, the median over rounds, and new / base.

Usage: python benchmarks/suffix_index.py [--baseline-ref REF] [--rounds 4]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from trees import abba_medians, compared_trees

HERE = Path(__file__).resolve().parent
PHASES = ("extend", "propose", "free")


def walk(rng: random.Random, n: int, vocab: int, repeat: float) -> list[int]:
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < repeat:
            a = rng.randrange(len(out))
            out += out[a:a + rng.randrange(4, 32)]
        else:
            out.append(rng.randrange(vocab))
    return out[:n]


def worker(a: argparse.Namespace) -> None:
    import tailrl
    from tailrl.speculative.sources.suffix_index import NATIVE, SuffixIndex
    assert NATIVE, "the native suffix index is not built"
    rng = random.Random(0)
    groups = [[walk(rng, a.tokens, a.vocab, a.repeat) for _ in range(a.seqs)] for _ in range(a.groups)]
    spent = dict.fromkeys(PHASES, 0.0)
    for seqs in groups:
        index = SuffixIndex()
        sids = [index.add([]) for _ in seqs]
        at = [0] * len(seqs)
        while any(p < a.tokens for p in at):
            for i, seq in enumerate(seqs):
                if at[i] >= a.tokens:
                    continue
                step = rng.randrange(1, 6)
                t = time.perf_counter()
                index.extend(sids[i], seq[at[i]:at[i] + step])
                spent["extend"] += time.perf_counter() - t
                at[i] += step
                t = time.perf_counter()
                index.propose(seq[max(0, at[i] - 16):at[i]], 16, 1, exclude=sids[i])
                spent["propose"] += time.perf_counter() - t
        t = time.perf_counter()
        del index
        spent["free"] += time.perf_counter() - t
    tokens = a.groups * a.seqs * a.tokens
    print(json.dumps({"tailrl": str(Path(tailrl.__file__).resolve().parent),
                      "us_per_token": {k: v / tokens * 1e6 for k, v in spent.items()}}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline-ref", default=None)
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=2000)
    ap.add_argument("--repeat", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    args = [f"--{k}={getattr(a, k)}" for k in ("groups", "seqs", "tokens", "vocab", "repeat")]
    report = {"tokens_per_index": a.seqs * a.tokens,
              **abba_medians(compared_trees(a.baseline_ref), a.rounds, HERE / "suffix_index.py", args, 600,
                             "us_per_token", "us/token", digits=4)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
