"""A small byte-level BPE tokenizer trained locally on the task solutions.

Digits are always split into single tokens (arithmetic is done digit by digit, and a merged
"47" would hide its digits from the model); frequent words and word pieces ("pass", " vs",
" no") merge, which keeps sequences short. Byte-level means any text encodes (no unknown
token), and decoding reproduces the input exactly. Encoding adds ``<bos>`` in front, so
``tokenizer(prompt)`` gives exactly what the model was trained to see.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

log = logging.getLogger(__name__)

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = [PAD, BOS, EOS]   # ids 0, 1, 2


def train_tokenizer(texts: Iterable[str], vocab_size: int = 320) -> Tokenizer:
    """Train the BPE on ``texts``. Deterministic for the same texts and vocab size."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials), "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    log.info("trained tokenizer: %d tokens", tok.get_vocab_size())
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int) -> None:
    """Write Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json, ...)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, model_max_length=model_max_length,
                                   padding_side="left", clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out_dir))


def special_ids(tok: Tokenizer) -> dict[str, int]:
    return {"pad_token_id": tok.token_to_id(PAD), "bos_token_id": tok.token_to_id(BOS),
            "eos_token_id": tok.token_to_id(EOS)}
