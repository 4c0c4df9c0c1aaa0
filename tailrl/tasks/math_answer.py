"""Final-answer extraction and checking for math datasets (GSM8K, MATH, DAPO-style data).

Extraction order, the conventions of the common datasets:
1. the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched, so ``\\boxed{\\frac{1}{2}}`` works;
2. the text after the last ``#### `` (GSM8K);
3. the last number in the text.
Comparison normalizes whitespace, ``$``, thousands separators, trailing ``.0`` and simple
fractions, then falls back to numeric equality. Nothing here raises on malformed input.
"""
from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_HASHES = re.compile(r"####\s*(.+)")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def _last_boxed(text: str) -> str | None:
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1: i].strip()
    return None   # unbalanced: no usable box


def extract_answer(text: object) -> str | None:
    """The final answer of a solution text, or None if it has none."""
    if not isinstance(text, str) or not text:
        return None
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    s = answer.strip().strip("$").strip()
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = s.replace("\\!", "").replace("\\left", "").replace("\\right", "")
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _as_number(s: str) -> Fraction | None:
    m = _FRAC.match(s)
    try:
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, truth: object) -> bool:
    """Whether a predicted answer equals the ground truth (string or number)."""
    if predicted is None or truth is None:
        return False
    p, t = normalize(str(predicted)), normalize(str(truth))
    if not p or not t:
        return False
    if p == t:
        return True
    a, b = _as_number(p), _as_number(t)
    return a is not None and b is not None and a == b


def math_reward(completion: object, ground_truth: object) -> float:
    """1.0 if the completion's extracted final answer matches the ground truth, else 0.0."""
    try:
        truth = ground_truth if not isinstance(ground_truth, str) else (extract_answer(ground_truth)
                                                                       if "####" in ground_truth
                                                                       or "\\boxed" in ground_truth
                                                                       else ground_truth)
        return 1.0 if answers_match(extract_answer(completion), truth) else 0.0
    except Exception:  # malformed model output is a wrong answer, never a crash
        return 0.0
