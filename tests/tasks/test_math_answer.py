"""Math answer extraction (boxed, ####, last number) and matching."""
import pytest

from tailrl.tasks.math_answer import answers_match, extract_answer, math_reward


@pytest.mark.parametrize("text,expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
    ("#### 1,000\n", "1,000"),
    ("we get 3 apples and then 17.5 pears", "17.5"),
    ("the result is -4", "-4"),
    ("\\boxed{x^2+1} and 5", "x^2+1"),
])
def test_extract(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text", [None, 3, "", "no numbers here", "\\boxed{unclosed"])
def test_extract_none_without_raising(text):
    assert extract_answer(text) is None or text == "\\boxed{unclosed"


def test_unbalanced_box_falls_back_to_numbers():
    assert extract_answer("\\boxed{12") == "12"


@pytest.mark.parametrize("pred,truth,ok", [
    ("72", "72", True), ("1,000", "1000", True), ("72.0", 72, True), ("$5$", "5", True),
    ("\\frac{1}{2}", "0.5", True), ("0.5", "\\frac{1}{2}", True), ("\\text{ 7 }", "7", True),
    ("73", "72", False), (None, "72", False), ("", "", False), ("abc", "abd", False),
])
def test_answers_match(pred, truth, ok):
    assert answers_match(pred, truth) is ok


def test_math_reward_reads_gsm8k_ground_truth_and_never_raises():
    truth = "She sold 48 + 24 = 72 clips.\n#### 72"
    assert math_reward("... so \\boxed{72}", truth) == 1.0
    assert math_reward("... #### 71", truth) == 0.0
    assert math_reward(None, truth) == 0.0
    assert math_reward("answer 72", None) == 0.0
    assert math_reward(object(), object()) == 0.0
