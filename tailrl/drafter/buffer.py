"""The spot trainer's data: the rollout's own sequences of target hidden states, per request.

The engine already computes the normed hidden state of every position (the prompt's in the
prefill, the emitted tokens' in verification) and hands them out with
``add_spans(hidden, spans)`` once per step (span: positions start .. start + k - 1 of a
request); no extra target forward. The drafter attends over a request's past, so the buffer keeps whole sequences,
prompt included: one *run* per request, positions in order (the n samples of a prompt
share one prefill: a sample handed no prompt states copies them from an open sibling run,
so every run holds its prompt). Positions already held are
skipped (a preempted request's recomputed prefill); a gap (a request resumed from another
instance with its K/V: the earlier positions were computed there) starts a new run, so a
run never spans positions whose states were not kept. Drafts root at the last prompt
position or later, so only those roots count in the loss (``DrafterData.first``).

Device: states stay where the engine computed them (views of its step tensors, on its
device), and ``data`` lays them out on ``device`` (the drafter's), in float32; tokens and the
runs' table are host metadata (``sample_batch`` reads them per pick).

Bounded: at most ``capacity`` positions in all. Adding past it evicts the oldest runs first
(running or finished), so the buffer holds the most recent data, i.e. the current policy's;
a single run longer than the buffer keeps its newest positions.
``data(unroll)`` lays the runs out as a ``DrafterData`` (cached until the next change).

Persistent: ``save(path)`` writes the runs in eviction order to one safetensors file (states
in the dtype they were handed out in, the target's; tokens; per run its start, first root and
length; the open runs' requests) and ``load(path)`` restores them, so a resumed training run
trains on exactly the data the uninterrupted run would (the spot trainer saves it with every
checkpoint).
"""
from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tailrl.drafter.network import DrafterData

OWN_AT = 32                # chunks after which a run copies its states into one tensor
FORMAT = 1                 # ``save``'s layout version (in the file's metadata)


class _Run:
    __slots__ = ("hidden", "tokens", "start", "first", "group", "prompt")

    def __init__(self, start: int, first: int, group: str, prompt: list[int]) -> None:
        # what ``_borrow`` matches an open run on (a closed run is never borrowed from)
        self.group, self.prompt = group, prompt
        # (states, first row, end row) chunks of step tensors, in order; row i is position start + i
        self.hidden: list[tuple[torch.Tensor, int, int]] = []
        self.tokens: list[int] = []             # the token at each position
        self.start = start                      # position of row 0
        self.first = first                      # first root position that counts (absolute)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def states(self) -> torch.Tensor:
        """The run's states [len, H] in one tensor of its own (kept as its only chunk)."""
        if len(self.hidden) != 1 or self.hidden[0][1:] != (0, self.hidden[0][0].shape[0]):
            h = torch.cat([t[lo:hi] for t, lo, hi in self.hidden])
            self.hidden = [(h, 0, h.shape[0])]
        return self.hidden[0][0]

    def chunks(self) -> list[torch.Tensor]:
        """The run's states as views of the tensors it references, in order (no copy)."""
        return [t[lo:hi] for t, lo, hi in self.hidden]

    def drop_head(self, n: int) -> None:
        h = self.states()[n:]
        self.hidden, self.tokens, self.start = [(h, 0, h.shape[0])], self.tokens[n:], self.start + n


class DrafterBuffer:
    def __init__(self, capacity: int, device: str | torch.device = "cpu") -> None:
        if not isinstance(capacity, int) or capacity < 2:
            raise ValueError(f"drafter buffer capacity must be an integer >= 2, got {capacity!r}")
        self.capacity = capacity
        self.device = torch.device(device)
        self._runs: OrderedDict[int, _Run] = OrderedDict()   # oldest first
        self._open: dict[str, int] = {}                      # request id -> its current run's key
        self._next_key = 0
        self.size = 0                                        # positions held
        self.added = 0                                       # positions ever added
        self._cache: tuple[int, int, DrafterData | None] | None = None   # (added, unroll, data)

    def __len__(self) -> int:
        return self.size

    def add(self, req: Any, start: int, hidden: torch.Tensor) -> None:
        """``hidden`` [k, H]: the target's states at positions start .. start + k - 1 of ``req`` (copied)."""
        self.add_spans(hidden.to(self.device, torch.float32, copy=True), [(req, start, 0, hidden.shape[0])])

    def add_spans(self, hidden: torch.Tensor, spans: list[tuple[Any, int, int, int]]) -> None:
        """A step's states: ``hidden`` [P, H] in the target's dtype, never modified after (the
        engine hands out a fresh tensor per step); span (req, start, row, k): rows row .. row +
        k - 1 are positions start .. start + k - 1 of ``req``. Runs keep references to row
        ranges; a run copies its chunks into one tensor every ``OWN_AT`` chunks, so a long run
        does not keep many steps' tensors alive."""
        added = 0
        runs, opened = self._runs, self._open
        for req, start, row, k in spans:             # every row of every step: kept lean
            if k == 0:
                continue
            n = len(req.prompt_token_ids) + len(req.output_token_ids)
            if start < 0 or start + k > n:
                raise ValueError(f"drafter buffer: positions {start} .. {start + k - 1} outside request "
                                 f"{req.request_id!r} ({n} tokens)")
            key = opened.get(req.request_id)
            run = runs.get(key) if key is not None else None
            end = run.start + len(run.tokens) if run is not None else -1
            if run is None or start > end:
                key, run = self._next_key, _Run(start, max(start, req.num_prompt_tokens - 1), req.group_id,
                                                req.prompt_token_ids)
                self._next_key += 1
                if 0 < start < req.num_prompt_tokens:
                    self._borrow(run)
                runs[key] = run
                opened[req.request_id] = key
                end = run.end
            skip = end - start
            if skip >= k:
                continue
            chunks = run.hidden
            chunks.append((hidden, row + skip, row + k))
            if len(chunks) >= OWN_AT:
                run.states()
            run.tokens += req.tokens(start + skip, start + k)
            added += k - skip
        self.size += added
        self.added += added
        self._evict()

    def _borrow(self, run: _Run) -> None:
        """A sample that copied its group's prompt K/V (the engine computes a prompt once for
        its n samples) was handed no prompt states: copy them from an open sibling run."""
        for key in self._open.values():
            d = self._runs.get(key)
            if (d is not None and d.group == run.group and d.start == 0 and d.end >= run.start
                    and d.prompt == run.prompt):
                h = d.states()[:run.start]
                run.hidden = [(h, 0, h.shape[0])]
                run.tokens = d.tokens[:run.start]
                self.size += run.start
                self.added += run.start
                run.start = 0
                return

    def finish(self, req: Any) -> None:
        """``req`` left the engine: its run is closed (it stays in the buffer)."""
        self._open.pop(req.request_id, None)

    def _evict(self) -> None:
        while self.size > self.capacity:
            key, run = next(iter(self._runs.items()))
            over = self.size - self.capacity
            if len(run) > over and len(self._runs) == 1:      # one run larger than the buffer: keep its tail
                run.drop_head(over)
                self.size -= over
                return
            del self._runs[key]
            self.size -= len(run)

    def data(self, unroll: int) -> DrafterData | None:
        """All runs with at least one root that trains ``unroll`` steps, as ``DrafterData``;
        None when there is none."""
        if self._cache is not None and self._cache[:2] == (self.added, unroll):
            return self._cache[2]
        hidden, tokens, lengths, first = [], [], [], []
        for run in self._runs.values():
            rel = max(0, run.first - run.start)
            if len(run) - unroll - rel > 0:
                hidden.append(run.states())                   # consolidated once
                tokens.append(torch.tensor(run.tokens, device="cpu"))
                lengths.append(len(run))
                first.append(rel)
        data = None
        if hidden:
            offsets = torch.tensor([0] + lengths, device="cpu").cumsum(0)
            # float32: the drafter trains in it (hand-outs come in the target's dtype)
            data = DrafterData(torch.cat(hidden).to(self.device, torch.float32), torch.cat(tokens), offsets,
                               torch.tensor(first, device="cpu"))
        self._cache = (self.added, unroll, data)
        return data

    # ---- checkpoint ---------------------------------------------------------------------
    def save(self, path: str) -> None:
        """All runs, oldest first, to the safetensors file ``path``: ``hidden`` [size, H] (the
        handed-out dtype; runs of different dtypes are promoted, losslessly, as ``data``
        does before training), ``tokens`` [size] int32, ``runs`` [R, 3] (start, first root,
        length) int64; metadata: the open runs (request id -> run index, group, prompt) and
        the ``added`` counter."""
        runs = list(self._runs.items())
        index = {key: i for i, (key, _) in enumerate(runs)}
        chunks = [c for _, run in runs for c in run.chunks()]
        hidden = torch.cat(chunks).cpu() if chunks else torch.zeros(0, 0, device="cpu")
        tokens = torch.tensor([t for _, run in runs for t in run.tokens], dtype=torch.int32, device="cpu")
        table = torch.tensor([[run.start, run.first, len(run)] for _, run in runs], dtype=torch.int64,
                             device="cpu").reshape(-1, 3)
        opened = {rid: [index[key], self._runs[key].group, list(self._runs[key].prompt)]
                  for rid, key in self._open.items() if key in index}
        meta = {"format": str(FORMAT), "added": str(self.added), "open": json.dumps(opened)}
        save_file({"hidden": hidden.contiguous(), "tokens": tokens, "runs": table}, path, metadata=meta)

    def load(self, path: str) -> None:
        """Replace the buffer's contents with what ``save`` wrote to ``path``; a capacity
        smaller than the saved size evicts the oldest runs at once (as adding would)."""
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != str(FORMAT):
            raise ValueError(f"drafter buffer: {path} has format {meta.get('format')!r}, expected {FORMAT}")
        t = load_file(path)
        hidden, tokens, table = t["hidden"], t["tokens"].tolist(), t["runs"].tolist()
        if sum(n for _, _, n in table) != len(tokens) or (table and hidden.shape[0] != len(tokens)):
            raise ValueError(f"drafter buffer: {path} is inconsistent (runs, tokens and states disagree in length)")
        opened = {i: (rid, group, prompt) for rid, (i, group, prompt) in json.loads(meta["open"]).items()}
        self._runs.clear()
        self._open.clear()
        self.size, row = 0, 0
        for i, (start, first, n) in enumerate(table):
            rid, group, prompt = opened.get(i, (None, "", []))
            run = self._runs[i] = _Run(start, first, group, prompt)
            h = hidden[row:row + n].to(self.device, copy=True)   # each run owns its states (eviction frees them)
            run.hidden, run.tokens = [(h, 0, n)], tokens[row:row + n]
            row += n
            if rid is not None:
                self._open[rid] = i
            self.size += n
        self._next_key = len(table)
        self.added = int(meta["added"])
        self._cache = None
        self._evict()
