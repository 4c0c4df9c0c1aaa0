"""Task families: deterministic generators, correct worked solutions, robust rewards."""
import re

import pytest

from tailrl.tasks.base import final_answer
from tailrl.tasks.families.addition import Addition
from tailrl.tasks.families.search import Search, candidates
from tailrl.tasks.families.sorting import Sorting, bubble_pass

FAMILIES = [Addition(), Sorting(), Search()]
MALFORMED = [None, 17, b"answer 3", "", "\n\n", "answer", "answer \n", "no answer line here",
             "answer \x00\xff", "answer " + "9" * 5000, "answer 1 2 x", "answer -", "answer +"]


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_generator_is_deterministic_and_seed_dependent(fam):
    for d in fam.difficulties:
        assert fam.generate(7, d) == fam.generate(7, d)
    prompts = {fam.generate(s, fam.difficulties[-1]).prompt for s in range(20)}
    assert len(prompts) > 15


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_reference_solution_scores_one_and_wrong_answer_zero(fam):
    for seed in range(40):
        ex = fam.generate(seed, fam.difficulties[seed % len(fam.difficulties)])
        assert ex.prompt.endswith("\n") and ex.solution.endswith("\n")
        assert final_answer(ex.solution) == ex.answer
        assert fam.reward(ex.prompt, ex.solution, ex.answer) == 1.0
        wrong = ex.solution.rsplit("answer ", 1)[0] + "answer 99999\n"
        assert fam.reward(ex.prompt, wrong, ex.answer) == 0.0


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_reward_never_raises_on_malformed_output(fam):
    ex = fam.generate(3, fam.difficulties[0])
    for bad in MALFORMED:
        assert fam.reward(ex.prompt, bad, ex.answer) == 0.0
    assert fam.reward("garbage prompt", ex.solution, ex.answer) in (0.0, 1.0)


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_bad_difficulty_is_rejected(fam):
    with pytest.raises(ValueError, match="difficulty"):
        fam.generate(0, 99)


@pytest.mark.parametrize("fam", FAMILIES, ids=lambda f: f.name)
def test_solutions_grow_with_difficulty(fam):
    def mean_len(d):
        return sum(len(fam.generate(s, d).solution) for s in range(60)) / 60
    lo, hi = fam.difficulties[0], fam.difficulties[-1]
    assert mean_len(hi) > 1.8 * mean_len(lo)


def test_addition_steps_are_right():
    ex = Addition().generate(11, 6)
    a, b = map(int, ex.prompt.split()[1:])
    assert int(ex.answer) == a + b
    lines = ex.solution.splitlines()
    carry = 0
    for line in lines[1:-2]:
        x, y, c, s = map(int, re.match(r"(\d)\+(\d)\+(\d)=(\d+)$", line).groups())
        assert c == carry and s == x + y + c
        carry = s // 10
    assert Addition().reward(ex.prompt, "answer " + f"{a + b:,}".replace(",", ""), ex.answer) == 1.0


def test_sorting_passes_are_bubble_passes_and_stop_when_stable():
    ex = Sorting().generate(5, 8)
    values = [int(x) for x in ex.prompt.split()[1:]]
    passes = [[int(x) for x in line.split()[1:]] for line in ex.solution.splitlines()[:-1]]
    for before, after in zip([values] + passes, passes):
        assert after == bubble_pass(before)
    assert len(passes) >= 2 and passes[-1] == passes[-2] == sorted(values)


def test_search_attempts_follow_the_order_and_stop_at_first_hit():
    fam = Search()
    counts = set()
    for seed in range(50):
        ex = fam.generate(seed, 6)
        target = int(ex.prompt.split()[1])
        numbers = [int(x) for x in ex.prompt.split()[3:]]
        attempts = ex.solution.splitlines()[:-1]
        order = candidates(numbers)
        first_hit = next(i for i, c in enumerate(order) if c[3] == target)
        assert len(attempts) == first_hit + 1
        assert all(f"vs {target} " in line for line in attempts)
        assert attempts[-1].endswith("yes") and all(a.endswith("no") for a in attempts[:-1])
        counts.add(len(attempts))
    assert len(counts) > 8   # the attempt count is a property of each problem


def test_search_reward_accepts_any_valid_expression_only():
    fam = Search()
    prompt = "reach 23 with 7 12 5 16\n"
    assert fam.reward(prompt, "answer 7+16", "7+16") == 1.0
    assert fam.reward(prompt, "answer 16+7", "7+16") == 1.0
    assert fam.reward(prompt, "answer 12-5", "7+16") == 0.0    # valid numbers, wrong value
    assert fam.reward(prompt, "answer 20+3", "7+16") == 0.0    # numbers not given
    assert fam.reward("reach 14 with 7 3\n", "answer 7+7", "x") == 0.0  # a number used twice
