"""The critical path's estimate: expected tokens left, conditioned on how far a request got."""
import pytest
from spec_fakes import FakeRequest

from tailrl.speculative.critical import critical_requests, expected_remaining, known_lengths


def test_expected_remaining_is_conditioned_on_survival():
    lengths = [40, 40, 40, 900]
    assert expected_remaining(lengths, 0, 4096) == pytest.approx(255.0)     # the mean
    assert expected_remaining(lengths, 41, 4096) == pytest.approx(859.0)    # outlived the three short ones
    assert expected_remaining([300] * 4, 41, 4096) == pytest.approx(259.0)
    assert expected_remaining(lengths, 1000, 4096) == pytest.approx(1000.0)  # outran them all: as long again
    assert expected_remaining(lengths, 1000, 1500) == pytest.approx(500.0)   # capped by max_tokens
    assert expected_remaining([], 7, 4096) == pytest.approx(7.0)


def test_known_lengths_prefer_the_prior_to_the_priority():
    r = FakeRequest("r", [1], priority=50.0)
    assert known_lengths(r) == [50]
    r.length_prior = (70, 20)
    assert known_lengths(r) == [20, 70]
    assert known_lengths(FakeRequest("t", [1])) == []


def test_siblings_part_as_they_outlive_short_lengths():
    """One prior for the whole group: the sibling that outlived the short lengths is critical,
    its younger siblings are not; a request with no estimate never is."""
    rs = [FakeRequest(f"r{i}", [1], length_prior=(40, 40, 40, 900)) for i in range(4)]
    for r, g in zip(rs, (10, 45, 20, 5)):
        r.output_token_ids.extend([0] * g)
    unknown = FakeRequest("u", [1])
    unknown.output_token_ids.extend([0] * 500)
    assert [r.request_id for r in critical_requests(rs + [unknown], 1)] == ["r1"]
    assert critical_requests(rs, 0) == []
    assert {r.request_id for r in critical_requests(rs + [unknown], 10)} == {"r0", "r1", "r2", "r3"}


def test_only_eligible_requests_are_critical_and_only_those_with_lengths_are_asked():
    rs = [FakeRequest(f"r{i}", [1], length_prior=(40, 40, 40, 900)) for i in range(3)]
    for r, g in zip(rs, (45, 44, 5)):
        r.output_token_ids.extend([0] * g)
    unknown = FakeRequest("u", [1])
    asked = []

    def eligible(r) -> bool:
        asked.append(r.request_id)
        return r.request_id != "r0"                # e.g. r0 is at its length limit
    assert [r.request_id for r in critical_requests(rs + [unknown], 1, eligible)] == ["r1"]
    assert sorted(asked) == ["r0", "r1", "r2"]
