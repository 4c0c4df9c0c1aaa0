"""The locally trained tokenizer: exact round trips, single-digit tokens, <bos>, determinism."""
import itertools

from tailrl.tasks import mixture
from tailrl.tasks.tokenizer import BOS, EOS, PAD, save_tokenizer, special_ids, train_tokenizer


def _texts(n=2000):
    return [ex.text for ex in itertools.islice(mixture.training_examples(heldout=16), n)]


def test_round_trip_digits_and_bos():
    tok = train_tokenizer(_texts())
    ids = special_ids(tok)
    assert ids == {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    for text in _texts(50) + ["unseen text: ü, 日本, \t tabs\n"]:
        enc = tok.encode(text)
        assert enc.ids[0] == ids["bos_token_id"]
        assert tok.decode(enc.ids) == text
    digit_tokens = [t for t in tok.encode("reach 12345 with 678").tokens if any(c.isdigit() for c in t)]
    assert all(len(t) == 1 for t in digit_tokens) and len(digit_tokens) == 8
    assert 256 + 3 <= tok.get_vocab_size() <= 320


def test_training_is_deterministic():
    a, b = train_tokenizer(_texts(1000)), train_tokenizer(_texts(1000))
    assert a.to_str() == b.to_str()


def test_saved_files_load_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    tok = train_tokenizer(_texts(500))
    save_tokenizer(tok, tmp_path, model_max_length=1024)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == (BOS, EOS, PAD)
    text = "sort 42 7 19 3\n"
    assert hf.encode(text) == tok.encode(text).ids
    assert hf.decode(hf.encode(text), skip_special_tokens=True) == text
