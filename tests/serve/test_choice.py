"""Stop strings and streamed text of one choice, with a real (local) tokenizer."""
import pytest

from tailrl.serve.choice import ChoiceState


@pytest.fixture(scope="module")
def tok(chat_model):
    from tailrl.engine.inputs import load_tokenizer
    return load_tokenizer(chat_model)


def feed_all(c: ChoiceState, tok, text: str, burst: int, finish: str = "length") -> list[bool]:
    ids = tok.encode(text)
    out = []
    for i in range(0, len(ids), burst):
        last = i + burst >= len(ids)
        out.append(c.feed(ids[i:i + burst], [-0.5] * len(ids[i:i + burst]), finish if last else None))
    return out


@pytest.mark.parametrize("burst", [1, 3, 50])
def test_stop_string_cuts_text_and_tokens(tok, burst):
    c = ChoiceState(0, tok, stop=["END", "zz"])
    hits = feed_all(c, tok, "abc ENx END more", burst)
    assert any(hits) and c.text == "abc ENx " and c.finish_reason == "stop"
    assert tok.decode(c.token_ids) == "abc ENx END"        # tokens up to the one that completed the stop
    assert len(c.logprobs) == len(c.token_ids)
    assert c.feed(tok.encode("later"), [0.0] * 5, "abort") is False and c.finish_reason == "stop"


def test_streaming_holds_back_a_possible_stop_prefix(tok):
    c = ChoiceState(0, tok, stop=["END"])
    c.feed(tok.encode("abc EN"), [-1.0] * 6, None)
    delta, toks, lps, _ = c.take_delta()
    assert delta == "abc " and len(toks) == 6 and len(lps) == 6    # "EN" may start "END": held back
    c.feed(tok.encode("x"), [-1.0], "length")
    assert c.take_delta()[0] == "ENx"                         # not a stop after all: released at the end


def test_no_stop_final_only_decodes_at_the_end(tok):
    c = ChoiceState(0, tok, incremental=False)
    c.feed(tok.encode("ab"), [-1.0, -1.0], None)
    assert c.text == "" and c.token_ids == tok.encode("ab")
    c.feed(tok.encode("c"), [-1.0], "stop")
    assert c.text == "abc" and c.finished


def test_a_whole_choice_with_stop_strings_decodes_its_text_only_at_the_end(tok):
    """Without streaming, text is decoded once, when the choice ends (a stop string found or the
    engine's finish), not after every burst: decoding the whole text per token made a long
    response's choice quadratic."""
    c = ChoiceState(0, tok, stop=["END"], incremental=False)
    assert c.feed(tok.encode("ab EN"), [-1.0] * 5, None) is False
    assert c.text == "" and len(c.token_ids) == 5
    assert c.feed(tok.encode("x"), [-1.0], "length") is False and c.text == "ab ENx"
    d = ChoiceState(0, tok, stop=["END"], incremental=False)
    assert d.feed(tok.encode("ab END cd"), [-1.0] * 9, None) is True and d.text == "ab " and d.finished


class ByteTokens:
    """One byte a token: a multi-byte character spans tokens (its first decodes to U+FFFD).
    ``widest``: the most tokens one decode was given."""
    widest = 0

    def decode(self, ids, skip_special_tokens=True):
        self.widest = max(self.widest, len(ids))
        return bytes(ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("seed", range(3))
def test_streamed_text_grows_by_windows_and_equals_the_whole_decode(tok, seed):
    """A streaming choice grows its text from a window of its last tokens; after every update
    it is a prefix of the whole decode, all of it unless that ends in half a character (the
    window's characters wait for the byte that completes it), and what was streamed plus the
    last delta is the final text; with the test model's tokenizer and with byte tokens."""
    import random
    rng = random.Random(seed)
    words = ["ab", "END", " x", "caf\u00e9", "\u00fc\u00df", "\u4e2d\u6587", "\n", "9"]
    text = "".join(rng.choice(words) for _ in range(60))
    for t, ids in ((ByteTokens(), list(text.encode())),
                   (tok, tok.encode("".join(ch for ch in text if ch.isascii())))):
        c = ChoiceState(0, t)
        streamed, i = "", 0
        while i < len(ids):
            k = rng.choice([1, 1, 2, 5])
            last = i + k >= len(ids)
            if isinstance(t, ByteTokens):
                t.widest = 0
            c.feed(ids[i:i + k], [0.0] * len(ids[i:i + k]), "length" if last else None)
            if not last and isinstance(t, ByteTokens):
                assert t.widest <= 20                       # the window, not the whole text
            whole = t.decode(ids[:i + k], skip_special_tokens=True)
            assert whole.startswith(c.text) and (c.text == whole or whole.endswith("\ufffd"))
            streamed += c.take_delta()[0]
            i += k
        assert streamed == c.text == t.decode(ids, skip_special_tokens=True)
