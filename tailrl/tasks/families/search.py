"""Trial-and-error search: reach a target by combining two of the given numbers.

The solution tries candidate expressions in a fixed depth-first order (pairs i < j in list
order; for each pair the sum, then the larger minus the smaller) and writes one line per
attempt, repeating the target so the check is local to the line:

    reach 23 with 7 12 5 16
    7+12=19 vs 23 no
    12-7=5 vs 23 no
    7+5=12 vs 23 no
    7-5=2 vs 23 no
    7+16=23 vs 23 yes
    answer 7+16

The number of failed attempts is where the first solution falls in that order, a property
of the problem: the target is the value of a random candidate, so most problems end after a
few attempts and some only after dozens. That is the honest source of the workload's long
tail. Difficulty d = how many numbers are given (3..8): up to d(d-1) attempts.
"""
from __future__ import annotations

import re

from tailrl.tasks.base import Example, answer_line, check_difficulty, final_answer, rng_for

_PROMPT = re.compile(r"^reach (\d+) with ((?:\d+ )*\d+)\s*$")
_EXPR = re.compile(r"^(\d+)\s*([+-])\s*(\d+)$")


def candidates(numbers: list[int]) -> list[tuple[int, str, int, int]]:
    """Every expression in search order, as (left, op, right, value)."""
    out = []
    for i in range(len(numbers)):
        for j in range(i + 1, len(numbers)):
            a, b = numbers[i], numbers[j]
            out.append((a, "+", b, a + b))
            hi, lo = max(a, b), min(a, b)
            out.append((hi, "-", lo, hi - lo))
    return out


def parse_prompt(prompt: str) -> tuple[int, list[int]] | None:
    m = _PROMPT.match(prompt.strip()) if isinstance(prompt, str) else None
    if m is None:
        return None
    return int(m.group(1)), [int(x) for x in m.group(2).split()]


class Search:
    name = "search"
    difficulties = (3, 4, 5, 6, 7, 8)

    def generate(self, seed: int, difficulty: int) -> Example:
        check_difficulty(self, difficulty)
        rng = rng_for(self.name, seed, difficulty)
        numbers = rng.sample(range(1, 50), difficulty)
        target = rng.choice(candidates(numbers))[3]
        prompt = f"reach {target} with " + " ".join(map(str, numbers)) + "\n"
        solution, answer = self.solve(target, numbers)
        return Example(self.name, difficulty, seed, prompt, solution, answer)

    @staticmethod
    def solve(target: int, numbers: list[int]) -> tuple[str, str]:
        lines = []
        for a, op, b, value in candidates(numbers):
            hit = value == target
            lines.append(f"{a}{op}{b}={value} vs {target} {'yes' if hit else 'no'}")
            if hit:
                answer = f"{a}{op}{b}"
                return "\n".join(lines) + "\n" + answer_line(answer), answer
        raise ValueError(f"target {target} is not reachable from {numbers}")

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        """1.0 for any valid expression (two distinct given numbers, value = target),
        not only the one the search order finds first."""
        parsed, got = parse_prompt(prompt), final_answer(completion)
        if parsed is None or got is None:
            return 0.0
        m = _EXPR.match(got)
        if m is None:
            return 0.0
        target, numbers = parsed
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        pool = list(numbers)
        for x in (a, b):
            if x not in pool:
                return 0.0
            pool.remove(x)
        value = a + b if op == "+" else a - b
        return 1.0 if value == target else 0.0
