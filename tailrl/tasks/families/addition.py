"""Multi-digit addition written out digit by digit with carries.

The solution first rewrites both operands reversed (least significant digit first) and
zero-padded to the same length, so that digit i of each operand sits at position i of its
word: the model then copies aligned digits instead of counting from the right (the probe's
addition failed on misaligned digits). Each following line adds one column plus the carry
from the line above; the carry is visible locally as the tens digit of the previous sum.

    add 4821 937
    rev 1284 7390
    1+7+0=8
    2+3+0=5
    8+9+0=17
    4+0+1=5
    digits 8575
    answer 5758

Difficulty d = number of digits of the longer operand (2..7); length grows linearly in d.
"""
from __future__ import annotations

from tailrl.tasks.base import Example, answer_line, check_difficulty, exact_reward, rng_for


def _normalize_int(text: str) -> str:
    return str(int(text.replace(" ", "")))


class Addition:
    name = "add"
    difficulties = (2, 3, 4, 5, 6, 7)

    def generate(self, seed: int, difficulty: int) -> Example:
        check_difficulty(self, difficulty)
        rng = rng_for(self.name, seed, difficulty)
        a = rng.randint(10 ** (difficulty - 1), 10 ** difficulty - 1)
        b_digits = rng.randint(1, difficulty)
        b = rng.randint(0 if b_digits == 1 else 10 ** (b_digits - 1), 10 ** b_digits - 1)
        if rng.random() < 0.5:
            a, b = b, a
        prompt = f"add {a} {b}\n"
        return Example(self.name, difficulty, seed, prompt, self.solve(a, b), str(a + b))

    @staticmethod
    def solve(a: int, b: int) -> str:
        width = max(len(str(a)), len(str(b)))
        ra, rb = str(a)[::-1].ljust(width, "0"), str(b)[::-1].ljust(width, "0")
        lines = [f"rev {ra} {rb}"]
        carry, digits = 0, []
        for da, db in zip(ra, rb):
            s = int(da) + int(db) + carry
            lines.append(f"{da}+{db}+{carry}={s}")
            digits.append(str(s % 10))
            carry = s // 10
        if carry:
            lines.append(f"0+0+{carry}={carry}")
            digits.append(str(carry))
        lines.append(f"digits {''.join(digits)}")
        return "\n".join(lines) + "\n" + answer_line(str(a + b))

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        return exact_reward(completion, answer, _normalize_int)
