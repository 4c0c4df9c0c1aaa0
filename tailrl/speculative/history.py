"""Per-prompt history of previous responses: what history drafts and history scheduling read.

``record(prompt_id, responses)`` *replaces* the prompt's history (RhymeRL keeps the last
epoch only: older epochs were sampled from an older policy and rhyme less). Every record
bumps a per-prompt ``version``, so readers holding an index built from older data (the
history draft source's suffix tries) know to rebuild.

``save``/``load`` use JSON: ``{"version": 1, "prompts": {prompt_id: [[token, ...], ...]}}``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)


class HistoryStore:
    def __init__(self) -> None:
        self._responses: dict[str, list[list[int]]] = {}
        self._versions: dict[str, int] = {}
        self._clock = 0

    def record(self, prompt_id: str, responses: list[list[int]]) -> None:
        """Replace ``prompt_id``'s history with ``responses`` (token id lists)."""
        if not isinstance(prompt_id, str) or prompt_id == "":
            raise ValueError(f"prompt_id must be a non-empty string, got {prompt_id!r}")
        rows = []
        for i, r in enumerate(responses):
            if isinstance(r, (str, bytes)) or not hasattr(r, "__iter__"):
                raise ValueError(f"responses[{i}] must be a list of token ids, got {type(r).__name__}")
            rows.append([int(t) for t in r])
        self._responses[prompt_id] = rows
        self._clock += 1
        self._versions[prompt_id] = self._clock

    def get(self, prompt_id: str) -> list[list[int]]:
        return self._responses.get(prompt_id, [])

    def lengths(self, prompt_id: str) -> list[int]:
        return [len(r) for r in self._responses.get(prompt_id, [])]

    def version(self, prompt_id: str) -> int:
        """Changes whenever the prompt's history is replaced; 0 = no history."""
        return self._versions.get(prompt_id, 0)

    def forget(self, prompt_id: str) -> None:
        self._responses.pop(prompt_id, None)
        self._clock += 1
        self._versions.pop(prompt_id, None)

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._responses

    def __len__(self) -> int:
        return len(self._responses)

    def prompt_ids(self) -> list[str]:
        return list(self._responses)

    def save(self, path: str | Path) -> None:
        data = {"version": 1, "prompts": self._responses}
        Path(path).write_text(json.dumps(data, separators=(",", ":")))
        logger.info("saved history of %d prompts to %s", len(self), path)

    def load(self, path: str | Path) -> None:
        """Replace the histories of the prompts found in ``path`` (others are kept)."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("version") != 1 or not isinstance(data.get("prompts"), dict):
            raise ValueError(f"{path} is not a tailrl history file (expected version 1)")
        for pid, responses in data["prompts"].items():
            self.record(pid, responses)
        logger.info("loaded history of %d prompts from %s", len(data["prompts"]), path)
