"""Run comparison and summaries on hand-written run directories."""
import json

import pytest

from tailrl.rl.report import compare_runs, summarize


def write_run(path, rollouts):
    path.mkdir()
    (path / "rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rollouts))
    return path


def test_compare_runs_counts_identical_responses_and_reward_gaps(tmp_path):
    step1 = {"step": 1, "uids": ["p"], "responses": [[[1, 2], [3]]], "rewards": [1.0, 0.0]}
    a = write_run(tmp_path / "a", [step1, {"step": 2, "uids": ["p"], "responses": [[[1], [2]]], "rewards": [0.0, 1.0]}])
    b = write_run(tmp_path / "b", [step1, {"step": 2, "uids": ["p"], "responses": [[[1], [2, 5]]], "rewards": [0.0, 0.25]}])
    eq = compare_runs(a, b)
    assert eq["equiv/identical_share"] == pytest.approx(3 / 4)
    assert eq["equiv/max_reward_diff"] == pytest.approx(0.75)
    assert eq["equiv/first_differing_step"] == 2 and eq["equiv/steps"] == 2
    assert compare_runs(a, a)["equiv/identical_share"] == 1.0


def test_compare_runs_refuses_different_prompts(tmp_path):
    a = write_run(tmp_path / "a", [{"step": 1, "uids": ["p"], "responses": [[[1]]], "rewards": [0.0]}])
    b = write_run(tmp_path / "b", [{"step": 1, "uids": ["q"], "responses": [[[1]]], "rewards": [0.0]}])
    with pytest.raises(ValueError, match="different prompts"):
        compare_runs(a, b)
    with pytest.raises(ValueError, match="no common steps"):
        compare_runs(a, write_run(tmp_path / "c", []))


def test_summarize_means_and_shares():
    rows = [{"step": 1, "timing_s/gen": 2.0, "timing_s/step": 4.0, "timing_s/update": 1.0, "rollout/tail_s": 0.5,
             "critic/score/mean": 0.1, "rollout/spec_accept_length": 2.0},
            {"step": 2, "timing_s/gen": 4.0, "timing_s/step": 6.0, "timing_s/update": 1.0, "rollout/tail_s": 1.5,
             "critic/score/mean": 0.3, "rollout/spec_accept_length": 3.0}]
    s = summarize(rows)
    assert s["rollout_s_per_step"] == 3.0 and s["step_s"] == 5.0 and s["rollout_share"] == pytest.approx(0.6)
    assert s["steps_per_s"] == pytest.approx(0.2) and s["tail_s_per_step"] == 1.0
    assert (s["score_first"], s["score_last"], s["spec_accept_length"]) == (0.1, 0.3, 2.5)
