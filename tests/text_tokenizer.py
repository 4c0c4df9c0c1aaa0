"""A character-level tokenizer built locally with `tokenizers` (no hub), saved beside a checkpoint.

Byte-level BPE with no merges: one token per (ASCII) character. Byte-level, because
``AutoTokenizer`` picks the checkpoint's architecture tokenizer (Qwen2's, byte-level) whatever
``tokenizer_config.json`` says, as for models/small."""
from __future__ import annotations

import string

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = string.ascii_lowercase + string.digits + " .,:;!?+-*/=<>()[]{}'\"\n" + string.ascii_uppercase[:20]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'][0] }}>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<a>{% endif %}")


def _byte_char(c: str) -> str:
    """GPT-2's printable stand-in for an ASCII byte (space -> U+0120, newline -> U+010A)."""
    b = ord(c)
    return c if 33 <= b <= 126 else chr(256 + (b if b < 33 else b - 94))


def save_char_tokenizer(path: str, chat_template: bool) -> None:
    """Ids 0..3 are specials (2 = EOS), then one id per character: 4 + len(CHARS) <= 97."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIALS + [_byte_char(c) for c in CHARS])}
    assert len(vocab) <= 97
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
