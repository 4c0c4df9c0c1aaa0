"""vLLM's logit processing: repetition, presence and frequency penalties, ``min_p`` and ``min_tokens``.

What a ``SamplingParams`` asks (config.py), in vLLM's order, on the logits of one sampled
position whose output so far (its history) is the request's committed output tokens, then, at
a draft node, the draft's tokens on its path:

1. ``repetition_penalty`` r: the logit x of every token in the prompt or the history becomes
   x / r where x > 0, else x * r;
2. ``frequency_penalty`` f and ``presence_penalty`` q: x - f * c - q * [c > 0], c the token's
   count in the history;
3. the temperature, as the sampler scales every row (x * (1 / T));
4. ``min_tokens`` m: while the history holds fewer than m tokens, EOS (unless ``ignore_eos``)
   and the stop tokens are masked (and stop strings do not end the output: verify.py);
5. ``min_p`` p: tokens whose probability is under p times the top token's are masked, tested
   as x - max(x) < log(p) (a subtraction and a comparison: the same bits on every device and
   in every batch, where exp's vector and scalar forms may differ in the last bit);

then top-k and top-p, and the draw at the position's uniform (sampler.py). A token is drawn
from the processed logits; the log-probability reported is still log_softmax(logits / T) of
the drawn token, as for top-k and top-p: what a trainer recomputes (vLLM's default reports
logits before any processing too). Every step is a function of the position's own logits and
history, so a token is the same alone or in any batch, and with or without speculation: a
draft node's history is its path, as plain decoding's would be had it emitted those tokens
(tests/engine/test_logits_process.py).

The history is read on the host, but for one token: in a step launched ahead (engine/ahead.py)
a decode row's last token is sampled by the step still in flight, a placeholder on the host;
its id is on the device, in the row's input (fed there), and the penalties count it there:
the value of the logit at that token is computed again with its count one higher, and written
over the host's (``Position.pending``). Such steps sample outside their CUDA graphs; an engine
drafting inside steps launched ahead (``ahead_drafts``) steps one step at a time instead while
a request processes its logits (engine.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tailrl.config import SamplingParams
from tailrl.kernels import host_to_device

if TYPE_CHECKING:
    from tailrl.engine.batch import RowPlan
    from tailrl.engine.request import Request


@dataclass(slots=True)
class Position:
    """One sampled position's processing: its params, the penalised columns (prompt and history
    tokens with a repetition penalty, history tokens else) with their counts in the history, and
    the columns ``min_tokens`` masks there."""
    params: SamplingParams
    cols: np.ndarray          # int64
    counts: np.ndarray        # float64, aligned with cols
    banned: tuple[int, ...]
    pending: torch.Tensor | None = None   # the last history token, on the device (a step in flight sampled it)


_EMPTY = np.zeros(0, dtype=np.int64)


def positions(plans: "list[RowPlan]", m: int, eos_token_ids: tuple[int, ...],
              pending: dict[int, torch.Tensor] | None = None) -> list[Position | None] | None:
    """Per sampled position of a step (``m`` of them), its ``Position`` where its request
    processes its logits, else None; None where no position does. Reads each request's
    committed output on the host (``plans``: the step's rows, before commit); ``pending``:
    id(request) -> its last token on the device, for the rows whose last token a step in
    flight samples (a placeholder on the host: plain decode rows only)."""
    out: list[Position | None] = [None] * m
    found = False
    for plan in plans:
        p = plan.req.params
        if not p.processes:
            continue
        hist = plan.req.output_token_ids
        in_flight = bool(hist) and hist[-1] < 0
        ahead = pending.get(id(plan.req)) if in_flight and pending else None
        if in_flight and (ahead is None or plan.draft_tokens or plan.follow is not None):
            raise RuntimeError("logits_process: a row whose last token is in flight, not a plain decode row "
                               "fed on the device")
        penalised = p.repetition_penalty != 1 or p.presence_penalty != 0 or p.frequency_penalty != 0
        cols, counts = _history_counts(plan.req) if penalised else (_EMPTY, _EMPTY)
        stops = tuple(() if p.ignore_eos else eos_token_ids) + tuple(p.stop_token_ids or ())
        by_p = p.min_p > 0 and p.temperature != 0
        pend = ahead if penalised else None
        for k, path in enumerate(_paths(plan.parents, plan.draft_tokens)):
            c, n = _merged(cols, counts, path) if penalised and path else (cols, counts)
            banned = stops if len(hist) + len(path) < p.min_tokens else ()
            if len(c) or banned or by_p or pend is not None:   # else nothing to do here (min_tokens reached)
                out[plan.entry + k] = Position(p, c, n, banned, pend)
                found = True
    return out if found else None


def _paths(parents: list[int], tokens: list[int]) -> list[list[int]]:
    """The draft tokens each sampled position of a row has after its committed output: none at
    its root, then node j's path (its ancestors and itself, root first)."""
    paths: list[list[int]] = [[]]
    for par, tok in zip(parents, tokens):
        paths.append(paths[par + 1] + [tok])
    return paths


def _history_counts(req: "Request") -> tuple[np.ndarray, np.ndarray]:
    """The distinct tokens of a request's output (with its prompt's, counted 0, under a
    repetition penalty) and their counts: kept on the request (``penalty_counts``) and brought up
    to date with the tokens it gained since (one or a few a step: each found by bisection),
    counted afresh where its output is shorter than what was counted (cut by a stop string)."""
    hist = req.output_token_ids
    if hist and hist[-1] < 0:                          # a placeholder: counted on the device (Position.pending)
        hist = hist[:-1]
    state = req.penalty_counts
    if state is None or state[0] > len(hist):
        cols, inv = np.unique(np.asarray(hist, dtype=np.int64), return_inverse=True)
        counts = np.bincount(inv, minlength=len(cols)).astype(np.float64)
        if req.params.repetition_penalty != 1:
            cols, counts = _merged(cols, counts, np.unique(np.asarray(req.prompt_token_ids, dtype=np.int64)), 0.0)
    else:
        seen, cols, counts = state
        for tok in hist[seen:]:
            at = int(np.searchsorted(cols, tok))
            if at < len(cols) and cols[at] == tok:
                counts = counts.copy() if counts is state[2] else counts
                counts[at] += 1
            else:                                      # (np.insert's own overhead is ~10 us a call)
                cols = np.concatenate((cols[:at], (tok,), cols[at:]))
                counts = np.concatenate((counts[:at], (1.0,), counts[at:]))
    req.penalty_counts = (len(hist), cols, counts)
    return cols, counts


def _merged(cols: np.ndarray, counts: np.ndarray, more, weight: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """``cols`` with ``counts``, and the tokens ``more`` counted ``weight`` each."""
    extra = np.asarray(more, dtype=np.int64)
    c, inv = np.unique(np.concatenate([cols, extra]), return_inverse=True)
    return c, np.bincount(inv, weights=np.concatenate([counts, np.full(len(extra), weight)]), minlength=len(c))


def apply(logits: torch.Tensor, scaled: torch.Tensor, temperature: list[float],
          procs: list[Position | None]) -> torch.Tensor:
    """The logits a token is drawn from: ``scaled`` (logits x 1/T per row, sampler._scale) with
    the rows of ``procs`` processed as the module docstring says (a new tensor; ``scaled`` is
    left as it is, for the reported log-probabilities)."""
    rows = [i for i, q in enumerate(procs) if q is not None]
    if not rows:
        return scaled
    dev, dtype = logits.device, logits.dtype
    draw = scaled.clone()
    pen = [i for i in rows if len(procs[i].cols)]
    ri = ci = cnt = None
    if pen:                                            # 1-3: penalties on the raw logits, then 1/T
        sizes = [len(procs[i].cols) for i in pen]
        ri = host_to_device(dev, np.repeat(np.asarray(pen, dtype=np.int64), sizes))
        ci = host_to_device(dev, np.concatenate([procs[i].cols for i in pen]))
        cnt = host_to_device(dev, np.concatenate([procs[i].counts for i in pen]), dtype)
        draw[ri, ci] = _penalised(logits[ri, ci], cnt, *_settings(procs, temperature, pen, sizes, logits))
    ahead = [i for i in rows if procs[i].pending is not None]
    if ahead:                                          # the in-flight token's logit, counted once more
        _pending(logits, draw, procs, temperature, ahead, ri, ci, cnt)
    banned = [(i, c) for i in rows for c in procs[i].banned]
    if banned:                                         # 4: min_tokens
        at = host_to_device(dev, np.asarray(banned, dtype=np.int64).T.copy())
        draw[at[0], at[1]] = float("-inf")
    by_p = [i for i in rows if procs[i].params.min_p > 0 and temperature[i] != 0]
    if by_p:                                           # 5: min_p, after the rest
        at = host_to_device(dev, by_p)
        sub = draw[at]
        floor = host_to_device(dev, [math.log(procs[i].params.min_p) for i in by_p], dtype)
        sub.masked_fill_(sub - sub.max(dim=1, keepdim=True).values < floor[:, None], float("-inf"))
        draw[at] = sub
    return draw


def _settings(procs: list, temperature: list[float], rows: list[int], sizes: list[int],
              like: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per entry, its row's repetition, frequency and presence penalties and 1/T (row
    ``rows[k]``'s repeated ``sizes[k]`` times), in one copy to ``like``'s device and dtype."""
    per = np.array([[procs[i].params.repetition_penalty, procs[i].params.frequency_penalty,
                     procs[i].params.presence_penalty, 1.0 / temperature[i] if temperature[i] else 1.0]
                    for i in rows], dtype=np.float64)
    return host_to_device(like.device, np.repeat(per, sizes, axis=0), like.dtype).unbind(1)


def _penalised(x: torch.Tensor, cnt: torch.Tensor, rep: torch.Tensor, freq: torch.Tensor,
               pres: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """Logits ``x`` of tokens counted ``cnt`` times in the history (0: the prompt's only) under
    the repetition, frequency and presence penalties, then 1/T (elementwise: the same bits for
    a value wherever it is computed)."""
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - freq * cnt
    return (x - pres * (cnt > 0).to(x.dtype)) * inv_t


def _pending(logits: torch.Tensor, draw: torch.Tensor, procs: list, temperature: list[float], ahead: list[int],
             ri: torch.Tensor | None, ci: torch.Tensor | None, cnt: torch.Tensor | None) -> None:
    """Rows ``ahead`` whose last history token is on the device only (``Position.pending``):
    its count is the host's count of it (``ri``, ``ci``, ``cnt``: the penalised entries, each
    row's columns distinct) plus one, and its logit is penalised with that count and written
    over the host's entry for it, if any. Device operations only: nothing waits for the step
    in flight."""
    dev, dtype = logits.device, logits.dtype
    rows = host_to_device(dev, ahead)
    tok = torch.stack([procs[i].pending for i in ahead]).to(torch.long)
    base = torch.zeros(logits.shape[0], dtype=dtype, device=dev)
    if ri is not None:                                 # the host's count of the in-flight token, per row
        owner = torch.full((logits.shape[0],), -1, dtype=torch.long, device=dev)
        owner[rows] = tok
        base.index_add_(0, ri, cnt * (ci == owner[ri]).to(dtype))   # one match at most a row: exact
    draw[rows, tok] = _penalised(logits[rows, tok], base[rows] + 1,
                                 *_settings(procs, temperature, ahead, [1] * len(ahead), logits))
