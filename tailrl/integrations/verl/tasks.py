"""tailrl's synthetic reasoning tasks in verl's layout: parquet files and a reward function.

``python -m tailrl.integrations.verl.tasks DIR`` writes ``DIR/train.parquet`` and
``DIR/test.parquet`` with verl's columns (``data_source`` = ``tailrl/<family>``, ``prompt`` as
chat messages, ``ability``, ``reward_model.ground_truth``, ``extra_info``) from the same example
stream ``tailrl train`` uses (the test split is its held-out set). ``compute_score`` is the
reward for ``custom_reward_function.path=<this file>``, ``name=compute_score``.

The workload models have no chat template: a run gives them
``actor_rollout_ref.model.custom_chat_template=PLAIN_TEMPLATE``, under which a one-message chat
tokenizes exactly as the raw prompt does in ``tailrl train``.
"""
from __future__ import annotations

import argparse
from itertools import islice
from pathlib import Path

from tailrl.tasks.mixture import heldout_examples, reward, training_examples

SOURCE_PREFIX = "tailrl/"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"      # no quotes: a hydra override


def rows(examples, split: str) -> list[dict]:
    return [{"data_source": SOURCE_PREFIX + ex.family,
             "prompt": [{"role": "user", "content": ex.prompt}],
             "ability": "reasoning",
             "reward_model": {"style": "rule", "ground_truth": ex.answer},
             "extra_info": {"split": split, "index": i, "difficulty": ex.difficulty, "seed": ex.seed,
                            "question": ex.prompt}}
            for i, ex in enumerate(examples)]


def write(out_dir: str | Path, train_size: int = 16, test_size: int = 32) -> tuple[Path, Path]:
    """``train.parquet`` (the first ``train_size`` training prompts) and ``test.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "test.parquet"
    for path, split, examples in ((paths[0], "train", islice(training_examples(), train_size)),
                                  (paths[1], "test", heldout_examples(test_size))):
        pq.write_table(pa.Table.from_pylist(rows(examples, split)), path)
    return paths


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info=None, **unused) -> float:
    """verl's custom reward: the task family's own verifier (1.0 for the right answer line)."""
    family = data_source[len(SOURCE_PREFIX):] if data_source.startswith(SOURCE_PREFIX) else data_source
    question = (extra_info or {}).get("question", "")       # the search family checks the given numbers
    return reward(family, question, solution_str, ground_truth)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--train-size", type=int, default=16)
    ap.add_argument("--test-size", type=int, default=32)
    a = ap.parse_args()
    for p in write(a.out_dir, a.train_size, a.test_size):
        print(p)


if __name__ == "__main__":
    main()
