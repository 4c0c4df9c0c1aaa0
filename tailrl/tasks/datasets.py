"""Loaders for RL prompt datasets in the layouts RL users have (JSONL, JSON, parquet).

Accepted columns, first match wins:
- prompt: ``prompt`` or ``question`` (or ``problem``): a string, or chat messages
  (a list of ``{"role", "content"}``, verl's layout);
- answer: ``reward_model.ground_truth`` (verl), ``ground_truth``, ``answer`` or ``solution``;
- ``data_source`` (optional; verl uses it to pick the reward function); every other column
  is kept in ``extra`` and reaches TRL-style reward functions as keyword arguments.

A row that cannot be used raises ``DatasetError`` naming the file and the row number
(1-based; for JSONL the line number), before anything is returned.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailrl.tasks.math_answer import extract_answer

PROMPT_KEYS = ("prompt", "question", "problem")
ANSWER_KEYS = ("ground_truth", "answer", "solution")


class DatasetError(ValueError):
    """A dataset file or row that cannot be read."""


@dataclass
class PromptRecord:
    prompt: str | list[dict[str, str]]   # text, or chat messages as in the file
    answer: str                          # the ground truth as written in the file
    data_source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ground_truth(self) -> str:
        """The final answer: ``#### x`` / ``\\boxed{x}`` solutions reduced to ``x``."""
        if "####" in self.answer or "\\boxed" in self.answer:
            return extract_answer(self.answer) or self.answer
        return self.answer


def _check_messages(value: list, where: str) -> list[dict[str, str]]:
    if not value:
        raise DatasetError(f"{where}: prompt is an empty message list")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or "role" not in m:
            raise DatasetError(f"{where}: prompt message {i} is not a {{'role', 'content'}} object")
    return [{"role": str(m["role"]), "content": m["content"]} for m in value]


def parse_row(row: object, where: str) -> PromptRecord:
    """One row (a dict) -> PromptRecord; ``where`` ("file: row n") prefixes any error."""
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected an object with prompt and answer, got {type(row).__name__}")
    key = next((k for k in PROMPT_KEYS if row.get(k) is not None), None)
    if key is None:
        raise DatasetError(f"{where}: no prompt column (one of {PROMPT_KEYS})")
    prompt = row[key]
    if hasattr(prompt, "tolist"):   # numpy arrays from pandas-written parquet
        prompt = prompt.tolist()
    if isinstance(prompt, list):
        prompt = _check_messages(prompt, where)
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{where}: prompt must be non-empty text or chat messages")
    answer, used = None, {key}
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and reward_model.get("ground_truth") is not None:
        answer, used = reward_model["ground_truth"], used | {"reward_model"}
    else:
        akey = next((k for k in ANSWER_KEYS if row.get(k) is not None), None)
        if akey is not None:
            answer, used = row[akey], used | {akey}
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
        raise DatasetError(f"{where}: no answer (reward_model.ground_truth or one of {ANSWER_KEYS})")
    source = row.get("data_source") or ""
    extra = {k: v for k, v in row.items() if k not in used and k != "data_source"}
    return PromptRecord(prompt, answer.strip(), str(source), extra)


def _rows_jsonl(path: Path) -> list[PromptRecord]:
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}: row {n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: invalid JSON ({e.msg})") from None
            out.append(parse_row(row, where))
    return out


def _rows_json(path: Path) -> list[PromptRecord]:
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: invalid JSON at line {e.lineno} ({e.msg})") from None
    if not isinstance(rows, list):
        raise DatasetError(f"{path}: expected a JSON list of rows")
    return [parse_row(row, f"{path}: row {n}") for n, row in enumerate(rows, start=1)]


def _rows_parquet(path: Path) -> list[PromptRecord]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError("reading parquet needs pyarrow: pip install 'tailrl[parquet]'") from e
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DatasetError(f"{path}: not a readable parquet file ({e})") from None
    return [parse_row(row, f"{path}: row {n}") for n, row in enumerate(table.to_pylist(), start=1)]


def load_prompts(path: str | Path) -> list[PromptRecord]:
    """All rows of a ``.jsonl``, ``.json`` or ``.parquet`` prompt file."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such file")
    readers = {".jsonl": _rows_jsonl, ".json": _rows_json, ".parquet": _rows_parquet}
    reader = readers.get(path.suffix.lower())
    if reader is None:
        raise DatasetError(f"{path}: unknown format {path.suffix!r} (use one of {sorted(readers)})")
    records = reader(path)
    if not records:
        raise DatasetError(f"{path}: no rows")
    return records
