"""workload-report figures from known responses (no sampling), and the CLI end to end."""
import json

import pytest

from tailrl.cli.workload_report import main, summarize
from tailrl.tasks import mixture


def test_summarize_counts_right_and_wrong_answers():
    examples = mixture.heldout_examples(4)
    prompt_ids = [[1, 5 + i] for i in range(4)]
    texts, responses = [], []
    for k, ex in enumerate(examples):
        right, wrong = ex.solution, ex.solution.rsplit("answer", 1)[0] + "answer 123456789\n"
        group_texts = [right, wrong] if k < 2 else [right, right]
        texts.append(group_texts)
        responses.append([(list(range(10 * (j + 1))), "stop") for j in range(2)])
    fig = summarize(examples, prompt_ids, responses, texts)
    assert fig["accuracy"] == pytest.approx(6 / 8)
    assert fig["pass_at_n"] == 1.0 and fig["mixed_groups"] == 0.5
    assert fig["length/median"] == 15 and fig["length/max"] == 20 and fig["length/capped"] == 0.0
    assert 0.0 <= fig["group_similarity"] <= 1.0


def test_cli_ends_with_json(capsys, tmp_path):
    from tailrl.tasks.models import get_model

    rc = main(["--model", get_model("test"), "--prompts", "3", "--n", "2", "--max-tokens", "16",
               "--plot", str(tmp_path / "h.png")])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fig = json.loads(last)
    for key in ("accuracy", "length/median", "length/p90", "length/p99", "length/max", "group_similarity"):
        assert key in fig
    assert fig["prompts"] == 3 and (tmp_path / "h.png").stat().st_size > 0
