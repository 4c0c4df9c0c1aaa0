"""Sorting a list by repeated bubble-sort passes.

Each ``pass`` line is the list after one left-to-right bubble pass (swap neighbours that are
out of order). The solution stops after the first pass that changes nothing, so the number
of passes is a property of the list (how far its smallest misplaced element must travel
left), not of a counter: an almost sorted list takes two passes, a reversed one n.

    sort 42 7 19 3
    pass 7 19 3 42
    pass 7 3 19 42
    pass 3 7 19 42
    pass 3 7 19 42
    answer 3 7 19 42

Difficulty d = list length (3..8); the length grows like d * passes.
"""
from __future__ import annotations

from tailrl.tasks.base import Example, answer_line, check_difficulty, exact_reward, rng_for


def _normalize_list(text: str) -> str:
    return " ".join(str(int(x)) for x in text.split())


def bubble_pass(values: list[int]) -> list[int]:
    out = list(values)
    for i in range(len(out) - 1):
        if out[i] > out[i + 1]:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


class Sorting:
    name = "sort"
    difficulties = (3, 4, 5, 6, 7, 8)

    def generate(self, seed: int, difficulty: int) -> Example:
        check_difficulty(self, difficulty)
        rng = rng_for(self.name, seed, difficulty)
        values = rng.sample(range(1, 100), difficulty)
        prompt = "sort " + " ".join(map(str, values)) + "\n"
        answer = " ".join(map(str, sorted(values)))
        return Example(self.name, difficulty, seed, prompt, self.solve(values), answer)

    @staticmethod
    def solve(values: list[int]) -> str:
        lines, current = [], list(values)
        while True:
            nxt = bubble_pass(current)
            lines.append("pass " + " ".join(map(str, nxt)))
            if nxt == current:
                break
            current = nxt
        return "\n".join(lines) + "\n" + answer_line(" ".join(map(str, current)))

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        return exact_reward(completion, answer, _normalize_list)
