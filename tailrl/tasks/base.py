"""What every task family shares: the example record, the family protocol, the answer line.

A worked solution is a sequence of lines ending with one ``answer X`` line. Rewards read
only the last ``answer`` line of a completion, so a model that writes its steps freely but
ends with the right answer line scores 1.0; anything else (no answer line, garbage, a wrong
value) scores 0.0. Rewards never raise.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Protocol

ANSWER_PREFIX = "answer "


@dataclass(frozen=True)
class Example:
    """One generated problem with its worked solution."""

    family: str        # task family name, e.g. "add"
    difficulty: int    # family-specific difficulty level (>= 1)
    seed: int          # the seed the generator was called with
    prompt: str        # what the model sees; ends with a newline
    solution: str      # the worked step-by-step solution; ends with the answer line
    answer: str        # the canonical final answer (what follows ANSWER_PREFIX)

    @property
    def text(self) -> str:
        return self.prompt + self.solution


class TaskFamily(Protocol):
    """A family of synthetic reasoning problems with verifiable answers."""

    name: str
    difficulties: tuple[int, ...]   # valid difficulty levels, easiest first

    def generate(self, seed: int, difficulty: int) -> Example: ...

    def reward(self, prompt: str, completion: str, answer: str) -> float: ...


def answer_line(answer: str) -> str:
    return f"{ANSWER_PREFIX}{answer}\n"


def final_answer(completion: object) -> str | None:
    """The text after the last ``answer `` line of a completion, or None if there is none.

    Robust to any input: non-strings and malformed text give None, never an exception."""
    if not isinstance(completion, str):
        return None
    for line in reversed(completion.splitlines()):
        line = line.strip()
        if line.startswith(ANSWER_PREFIX.strip()):
            value = line[len(ANSWER_PREFIX.strip()):].strip()
            return value if value else None
    return None


def exact_reward(completion: object, answer: str, normalize: Callable[[str], str] = str.strip) -> float:
    """1.0 if the final answer line equals ``answer`` after ``normalize``, else 0.0."""
    got = final_answer(completion)
    if got is None:
        return 0.0
    try:
        return 1.0 if normalize(got) == normalize(answer) else 0.0
    except Exception:  # a normalizer choking on garbage is a wrong answer, not a crash
        return 0.0


def rng_for(family: str, seed: int, difficulty: int) -> random.Random:
    """A generator-private RNG: the same (family, seed, difficulty) always gives the same
    problem, independent of any global random state."""
    return random.Random(f"{family}/{seed}/{difficulty}")


def check_difficulty(family: TaskFamily, difficulty: int) -> None:
    if difficulty not in family.difficulties:
        raise ValueError(f"difficulty must be one of {family.difficulties} for family "
                         f"{family.name!r}, got {difficulty!r}")
