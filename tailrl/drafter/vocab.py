"""The drafter's draft vocabulary: which target tokens its head covers (EAGLE-3's reduced vocabulary).

A drafter step multiplies its output feature by the head's rows: on a real checkpoint that is
most of the step (Qwen2.5-0.5B: 151,936 rows of 896, 136M of the ~150M parameters a depth
reads). The tokens a model emits in its rollouts are a small, skewed part of its vocabulary, so
the head keeps the rows of ``size`` tokens: those the drafter's training responses use most,
then, where fewer than ``size`` occur, the lowest ids not yet chosen (byte-level BPE
vocabularies number their tokens in merge order, the common ones first). A vocabulary of at
most ``size`` tokens is kept whole. A token outside the set is never drafted; drafts are
verified, so outputs cannot change, only which drafts are made.
"""
from __future__ import annotations

import torch

from tailrl.drafter.network import DrafterData

DRAFT_VOCAB = 32768      # EAGLE-3's size for Llama 3's 128k-token vocabulary


def response_tokens(data: DrafterData) -> torch.Tensor:
    """The tokens a drafter trained on ``data`` is asked to predict: every sequence's tokens
    after its last prompt position (``first``)."""
    index = torch.arange(len(data.tokens))
    seq = torch.bucketize(index, data.offsets[1:], right=True)     # the sequence of each position
    return data.tokens[index > data.first[seq] + data.offsets[seq]]


def frequent_tokens(tokens: torch.Tensor, vocab_size: int, size: int = DRAFT_VOCAB,
                    always: tuple[int, ...] = ()) -> torch.Tensor | None:
    """``size`` token ids, ascending: ``always`` (e.g. the model's end-of-sequence ids) and the
    most frequent of ``tokens`` first, ties (the tokens that never occur among them) to the
    lower id. None where ``size`` is 0 or covers the whole vocabulary: no reduction."""
    if size < 0:
        raise ValueError(f"draft_vocab must be >= 0, got {size}")
    if size == 0 or size >= vocab_size:
        return None
    counts = torch.bincount(tokens.long().cpu(), minlength=vocab_size)
    if len(counts) > vocab_size:
        raise ValueError(f"draft_vocab: token id {len(counts) - 1} is outside the vocabulary of {vocab_size}")
    if always:
        if min(always) < 0 or max(always) >= vocab_size:
            raise ValueError(f"draft_vocab: the ids always kept, {sorted(always)}, must be in the vocabulary "
                             f"of {vocab_size}")
        counts[list(always)] = int(counts.max()) + 1
    order = torch.sort(-counts, stable=True).indices               # most frequent first, ties by id
    return order[:size].sort().values
