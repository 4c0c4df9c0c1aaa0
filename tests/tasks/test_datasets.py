"""Dataset loaders: JSONL / JSON / parquet (verl layout), clear errors on broken rows."""
import json

import pytest

from tailrl.tasks.datasets import DatasetError, load_prompts


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_prompt_answer_and_question_ground_truth(tmp_path):
    rows = [{"prompt": "add 1 2\n", "answer": "3", "family": "add"},
            {"question": "What is 6*7?", "ground_truth": 42},
            {"question": "Q", "answer": "work...\n#### 1,024"}]
    recs = load_prompts(_jsonl(tmp_path / "d.jsonl", rows))
    assert [r.prompt for r in recs] == ["add 1 2\n", "What is 6*7?", "Q"]
    assert [r.ground_truth for r in recs] == ["3", "42", "1,024"]
    assert recs[0].extra == {"family": "add"}


def test_verl_parquet_layout(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "system", "content": "Think."}, {"role": "user", "content": "1+1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": "2"},
             "extra_info": {"split": "train", "index": 0}}] * 3
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    recs = load_prompts(path)
    assert len(recs) == 3
    r = recs[0]
    assert r.data_source == "openai/gsm8k" and r.ground_truth == "2"
    assert r.prompt == [{"role": "system", "content": "Think."}, {"role": "user", "content": "1+1?"}]
    assert r.extra["ability"] == "math" and r.extra["extra_info"]["index"] == 0


def test_json_list(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "p", "answer": "a"}]))
    assert load_prompts(path)[0].answer == "a"


@pytest.mark.parametrize("bad,reason", [
    ("{not json", "invalid JSON"),
    ({"answer": "3"}, "no prompt column"),
    ({"prompt": "p"}, "no answer"),
    ({"prompt": "   ", "answer": "1"}, "non-empty"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, "message 0"),
    ({"prompt": [], "answer": "1"}, "empty message list"),
    ([1, 2], "expected an object"),
])
def test_broken_row_names_file_and_row(tmp_path, bad, reason):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "answer": "1"}, "", bad])
    with pytest.raises(DatasetError, match=reason) as err:
        load_prompts(path)
    assert f"{path}: row 3" in str(err.value)


def test_broken_parquet_row_and_files(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]), path)
    with pytest.raises(DatasetError, match=r"d.parquet: row 2: no answer"):
        load_prompts(path)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable parquet"):
        load_prompts(junk)
    with pytest.raises(DatasetError, match="no such file"):
        load_prompts(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unknown format"):
        load_prompts(tmp_path / "d.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="no rows"):
        load_prompts(tmp_path / "empty.jsonl")
