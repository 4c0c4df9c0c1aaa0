"""Comparing checkouts: a worktree of a baseline commit, and a benchmark's worker run in a tree.

``baseline_tree(ref)`` makes (once, in /tmp) a worktree of ``ref`` with its native parts built;
``run_in_tree(tree, script, args)`` runs ``script --worker args`` with that tree's tailrl
first on the path and returns the JSON object of its last output line, after checking that
the worker imported the tree's tailrl (its ``"tailrl"`` key) and not another one;
``compared_trees(ref)`` is this checkout ("new") and, given a ref, its baseline ("base");
``abba(trees, rounds)`` the order to run them in; ``abba_medians`` runs a worker that way and
reports each tree's medians and new / base.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def baseline_tree(ref: str) -> Path:
    """A worktree of ``ref`` with its native parts built (made once, reused)."""
    sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", ref], capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = Path(f"/tmp/tailrl-baseline-{sha[:12]}")
    if not (tree / ".built").is_file():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--force", "--detach", str(tree), sha],
                       check=True, capture_output=True)
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, check=True,
                       capture_output=True)
        (tree / ".built").write_text(sha + "\n")
    return tree


def compared_trees(baseline_ref: str | None) -> dict[str, Path]:
    """{"new": this checkout} and, with ``baseline_ref``, {"base": its worktree}."""
    trees = {"new": REPO}
    if baseline_ref:
        trees["base"] = baseline_tree(baseline_ref)
    return trees


def abba(trees: dict[str, Path], rounds: int):
    """(round, tree name) pairs: every tree once per round, the order reversed every other
    round (ABBA), so that drift over the run falls on both alike."""
    for r in range(rounds):
        for t in (list(trees) if r % 2 == 0 else list(reversed(trees))):
            yield r, t


def run_in_tree(tree: Path, script: Path, args: list[str], timeout: float) -> dict:
    """``script --worker *args`` on ``tree``'s tailrl: the JSON object it printed last."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    res = subprocess.run([sys.executable, str(script), "--worker", *args], env=env, cwd=tree, capture_output=True,
                         text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"worker ({tree}, {' '.join(args)}) failed:\n{res.stderr[-3000:]}")
    got = json.loads(res.stdout.strip().splitlines()[-1])
    if Path(got["tailrl"]).resolve() != (tree / "tailrl").resolve():
        raise RuntimeError(f"worker for {tree} imported tailrl from {got['tailrl']}")
    return got


def abba_medians(trees: dict[str, Path], rounds: int, script: Path, args: list[str], timeout: float, field: str,
                 unit: str, digits: int = 3) -> dict:
    """``script``'s worker in each tree, ``rounds`` ABBA rounds (each round's ``field`` of its
    JSON printed, in ``unit``): {"trees": {tree: {key: median}}, "new_over_base": {key: new / base}}
    (the ratio where a baseline tree ran)."""
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for r, t in abba(trees, rounds):
        got = run_in_tree(trees[t], script, args, timeout)[field]
        runs[t].append(got)
        print(f"round {r} {t:4s} " + "  ".join(f"{k} {v:.3f}" for k, v in got.items()) + f" {unit}", flush=True)
    report: dict = {"trees": {t: {k: round(statistics.median(x[k] for x in rs), digits) for k in rs[0]}
                              for t, rs in runs.items()}}
    if "base" in report["trees"]:
        new, base = report["trees"]["new"], report["trees"]["base"]
        report["new_over_base"] = {k: round(new[k] / base[k], 3) for k in new if base.get(k, 0) > 0}
    return report
