"""The training prompts, their order, and the reward.

A run trains on a fixed set of prompts in epochs (RL's notion: the same prompts come back,
which is what history drafts and history scheduling feed on). Step s takes prompts
s*B .. s*B+B-1 of the endless sequence epoch 0, epoch 1, ...; epoch e is a permutation drawn
from a generator keyed by (seed, e). The order is a pure function of (seed, step), so a
resumed run sees exactly the prompts the uninterrupted run would have seen.

When B does not divide the number of prompts, a batch spans two epochs: it takes the end of
epoch e and the start of epoch e + 1. A prompt in both parts would form two GRPO groups with
the same uid in one batch, so epoch e + 1's permutation is repaired: each of its first
positions (those in the spanning batch) holding a prompt from epoch e's part is swapped with
the next position after them holding one that is not. Every epoch stays a permutation and no
batch repeats a prompt.
"""
from __future__ import annotations

import functools
import importlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tailrl.rl.config import TrainConfig
from tailrl.tasks import mixture
from tailrl.tasks.datasets import load_prompts
from tailrl.tasks.math_answer import math_reward

# TRL-style: f(prompts, completions, **columns) -> one float per completion
RewardFn = Callable[..., list[float]]


@dataclass
class Prompt:
    uid: str                                  # stable prompt id: the history store's key
    text: str | list[dict[str, str]]          # prompt text or chat messages
    answer: str                               # ground truth
    columns: dict[str, Any] = field(default_factory=dict)   # passed to the reward function


def task_prompts(cfg: TrainConfig) -> list[Prompt]:
    """``train_size`` distinct synthetic problems (the mixture, or one family / difficulty)."""
    if cfg.task_family is None:
        stream = mixture.training_examples(start=0)
    else:
        fam = mixture.family(cfg.task_family)
        if cfg.task_difficulty is not None and cfg.task_difficulty not in fam.difficulties:
            raise ValueError(f"config key 'task_difficulty' must be one of {fam.difficulties} for family "
                             f"{cfg.task_family!r}, got {cfg.task_difficulty!r}")
        levels = mixture.DIFFICULTY_WEIGHTS[fam.name]

        def gen(seed: int = 0):
            while True:
                d = cfg.task_difficulty
                if d is None:
                    d = random.Random(f"rl/{fam.name}/{seed}").choices(list(levels), list(levels.values()))[0]
                yield fam.generate(seed, d)
                seed += 1
        stream = gen()
    out: list[Prompt] = []
    seen: set[str] = set()
    for ex in stream:
        if ex.prompt in seen:
            continue
        seen.add(ex.prompt)
        out.append(Prompt(f"{ex.family}-{ex.difficulty}-{ex.seed}", ex.prompt, ex.answer,
                          {"family": ex.family, "difficulty": ex.difficulty}))
        if len(out) == cfg.train_size:
            return out
    raise ValueError(f"config key 'train_size': only {len(out)} distinct prompts available")  # pragma: no cover


def file_prompts(path: str) -> list[Prompt]:
    stem = Path(path).stem
    return [Prompt(f"{stem}-{i}", r.prompt, r.ground_truth, {"data_source": r.data_source, **r.extra})
            for i, r in enumerate(load_prompts(path))]


def load_dataset(cfg: TrainConfig) -> list[Prompt]:
    return task_prompts(cfg) if cfg.dataset == "tasks" else file_prompts(cfg.dataset)


def batch_indices(step: int, batch_size: int, num_prompts: int, seed: int, shuffle: bool) -> list[int]:
    """Indices into the prompt list for ``step`` (0-based); never the same prompt twice."""
    if not 1 <= batch_size <= num_prompts:
        raise ValueError(f"batch_size ({batch_size}) must be in [1, number of prompts ({num_prompts})]: "
                         "a batch never holds the same prompt twice")
    first, last = divmod(step * batch_size, num_prompts)[0], divmod((step + 1) * batch_size - 1, num_prompts)[0]
    for e in range(last + 1):               # fills the cache epoch by epoch (each repair reads the previous)
        _epoch_order(e, batch_size, num_prompts, seed, shuffle)
    seq = [i for e in range(first, last + 1) for i in _epoch_order(e, batch_size, num_prompts, seed, shuffle)]
    start = step * batch_size - first * num_prompts
    return seq[start:start + batch_size]


@functools.lru_cache(maxsize=4096)
def _epoch_order(epoch: int, batch_size: int, num_prompts: int, seed: int, shuffle: bool) -> tuple[int, ...]:
    """Epoch ``epoch``'s permutation, repaired so that the batch spanning its start repeats no
    prompt of the previous epoch's end (see the module docstring)."""
    order = list(range(num_prompts))
    if shuffle:
        random.Random(f"rl-epoch/{seed}/{epoch}").shuffle(order)
    head = -epoch * num_prompts % batch_size      # this epoch's positions in the spanning batch
    if epoch == 0 or head == 0:
        return tuple(order)
    prev = _epoch_order(epoch - 1, batch_size, num_prompts, seed, shuffle)
    taken = set(prev[num_prompts - (batch_size - head):])       # the previous epoch's part of that batch
    j = head
    for i in range(head):
        if order[i] in taken:
            while order[j] in taken:          # batch_size <= num_prompts: enough free prompts exist
                j += 1
            order[i], order[j] = order[j], order[i]
            j += 1
    return tuple(order)


# ---- rewards ------------------------------------------------------------------------------
def task_reward(prompts: list[str], completions: list[str], answer: list[str], family: list[str],
                **_: Any) -> list[float]:
    return [mixture.reward(f, p, c, a) for p, c, a, f in zip(prompts, completions, answer, family)]


def file_math_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
    return [math_reward(c, a) for c, a in zip(completions, answer)]


def resolve_reward(cfg: TrainConfig) -> RewardFn:
    name = cfg.reward
    if name == "auto":
        name = "task" if cfg.dataset == "tasks" else "math"
    if name == "task":
        if cfg.dataset != "tasks":
            raise ValueError("config key 'reward': 'task' needs dataset 'tasks' (use 'math' or 'module:function')")
        return task_reward
    if name == "math":
        return file_math_reward
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"config key 'reward': cannot import {name!r} ({e})") from None
    if not callable(fn):
        raise ValueError(f"config key 'reward': {name!r} is not callable")
    return fn


def compute_rewards(fn: RewardFn, prompts: list[Prompt], completions: list[list[str]]) -> list[float]:
    """Rewards of every completion, groups contiguous. Reward functions get one row per
    completion: prompt text, completion text, answer and every dataset column."""
    rows = [(p, c) for p, group in zip(prompts, completions) for c in group]
    cols: dict[str, list[Any]] = {"answer": [p.answer for p, _ in rows]}
    for key in dict.fromkeys(k for p, _ in rows for k in p.columns):
        cols[key] = [p.columns.get(key) for p, _ in rows]
    texts = [p.text if isinstance(p.text, str) else "\n".join(m["content"] for m in p.text) for p, _ in rows]
    out = fn(texts, [c for _, c in rows], **cols)
    if len(out) != len(rows):
        raise ValueError(f"reward function returned {len(out)} values for {len(rows)} completions")
    return [float(x) for x in out]
