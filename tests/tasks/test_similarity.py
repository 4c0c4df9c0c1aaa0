"""Group similarity: the share of response tokens a sibling suffix match predicts."""
import pytest

from tailrl.tasks.similarity import group_similarity


def test_identical_siblings_predict_everything_after_the_first_tokens():
    prompt = [1, 5, 6]
    resp = [7, 8, 9, 10, 11, 7, 8, 12]
    sim = group_similarity([prompt], [[resp, resp]])
    # every position has >= 2 tokens of context (prompt included), and the sibling has the
    # same continuation; the repeated "7 8" is disambiguated by the longest match
    assert sim["predicted"] == 1.0 and sim["matched"] == 1.0


def test_unrelated_siblings_predict_nothing():
    sim = group_similarity([[1, 2]], [[[10, 11, 12, 13], [20, 21, 22, 23]]])
    # only the first token of each has a match (the shared prompt), and it is wrong
    assert sim["predicted"] == 0.0 and sim["matched"] == 2 / 8 and sim["tokens"] == 8


def test_hand_computed_case():
    # r0 = a b c d, r1 = a b c e; prompt p q. For r0: positions a (ctx "p q", sibling has a) ok,
    # b ok, c ok, d: ctx "b c" -> sibling says e: wrong. Same for r1 symmetrically.
    p, a, b, c, d, e = 1, 2, 3, 4, 5, 6
    prompt = [9, p]
    sim = group_similarity([prompt], [[[a, b, c, d], [a, b, c, e]]])
    assert sim["predicted"] == pytest.approx(6 / 8)
    assert sim["matched"] == 1.0 and sim["precision"] == pytest.approx(6 / 8)


def test_a_response_never_predicts_itself():
    sim = group_similarity([[1, 2]], [[[5, 6, 5, 6, 5, 6]]])
    assert sim["matched"] == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="same length"):
        group_similarity([[1]], [])
    with pytest.raises(ValueError, match="min_match"):
        group_similarity([[1]], [[[2]]], min_match=0)
