"""The mixed workload: which family and difficulty each example gets, and the held-out split.

Example k of a split is drawn from its own RNG keyed by (split, k), so any example can be
regenerated alone and the training stream never depends on how much was generated before.
Held-out prompts use a disjoint seed range, and training skips any example whose prompt
text collides with a held-out prompt (short problems repeat), so evaluation is on unseen
prompts.
"""
from __future__ import annotations

import random
from collections.abc import Iterator

from tailrl.tasks.base import Example, TaskFamily
from tailrl.tasks.families.addition import Addition
from tailrl.tasks.families.search import Search
from tailrl.tasks.families.sorting import Sorting

FAMILIES: dict[str, TaskFamily] = {f.name: f for f in (Addition(), Sorting(), Search())}

# Share of each family in the mix, and the weight of each difficulty inside a family.
# Most problems are short; the search family's harder levels give the long tail.
FAMILY_WEIGHTS: dict[str, float] = {"add": 0.3, "sort": 0.3, "search": 0.4}
DIFFICULTY_WEIGHTS: dict[str, dict[int, float]] = {
    "add": {2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1},
    "sort": {3: 3, 4: 3, 5: 2, 6: 1, 7: 1, 8: 1},
    "search": {3: 4, 4: 3, 5: 2, 6: 1, 7: 1, 8: 1},
}

HELDOUT_SEED_BASE = 1_000_000_000   # held-out example k uses seed HELDOUT_SEED_BASE + k


def family(name: str) -> TaskFamily:
    if name not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {name!r}")
    return FAMILIES[name]


def mixed_example(seed: int) -> Example:
    """The example the mixture assigns to ``seed`` (family and difficulty drawn from it)."""
    rng = random.Random(f"mix/{seed}")
    name = rng.choices(list(FAMILY_WEIGHTS), weights=list(FAMILY_WEIGHTS.values()))[0]
    levels = DIFFICULTY_WEIGHTS[name]
    difficulty = rng.choices(list(levels), weights=list(levels.values()))[0]
    return FAMILIES[name].generate(seed, difficulty)


def heldout_examples(count: int) -> list[Example]:
    """The first ``count`` held-out examples (distinct prompts)."""
    out, seen, k = [], set(), 0
    while len(out) < count:
        ex = mixed_example(HELDOUT_SEED_BASE + k)
        k += 1
        if ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
    return out


def training_examples(start: int = 0, heldout: int = 1024) -> Iterator[Example]:
    """An endless deterministic stream of training examples from seed ``start`` on, never
    repeating a prompt of the first ``heldout`` held-out examples."""
    banned = {ex.prompt for ex in heldout_examples(heldout)}
    seed = start
    while True:
        ex = mixed_example(seed)
        seed += 1
        if ex.prompt not in banned:
            yield ex


def reward(example_family: str, prompt: str, completion: str, answer: str) -> float:
    """Reward of a completion for a problem of the named family; 0.0 for unknown families."""
    fam = FAMILIES.get(example_family)
    if fam is None:
        return 0.0
    try:
        return fam.reward(prompt, completion, answer)
    except Exception:  # rewards never raise, whatever the model wrote
        return 0.0
