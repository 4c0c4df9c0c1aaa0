"""vLLM's ``stop`` strings (engine/stop_strings.py): a response ends at the token whose text
completes one, keeping it and its log-probability; its text is cut before the string. Checked
against the same rollout without stop strings, cut by hand: one step at a time, with steps
launched ahead, on a pool whose requests move between instances in chunks, and with
speculation (a verify step's accepted run cut inside), in bfloat16."""
import pytest
from checkpoints import make_checkpoint
from text_tokenizer import save_char_tokenizer

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.engine.stop_strings import StopStrings, cut_text

PROMPTS = [[5, 6, 7], [9, 8, 7, 6], [20, 21], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stop"))
    make_checkpoint(path, vocab_size=97, init_std=1.0, max_pos=512)
    save_char_tokenizer(path, chat_template=False)
    return path


def run(llm, stop=None):
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=60, ignore_eos=True, seed=7, stop=stop)
    return [[(c.token_ids, c.logprobs, c.finish_reason, c.text) for c in o.outputs]
            for o in llm.generate(PROMPTS, sp)]


def cut_by_hand(tok, outs, stops):
    """Each response up to the first token whose text (all tokens so far) holds a stop string."""
    want = []
    for group in outs:
        row = []
        for ids, lps, reason, text in group:
            ends = [j for j in range(len(ids)) if any(s in tok.decode(ids[:j + 1], skip_special_tokens=True)
                                                       for s in stops)]
            if ends:
                j = ends[0]
                text = tok.decode(ids[:j + 1], skip_special_tokens=True)
                row.append((ids[:j + 1], lps[:j + 1], "stop", cut_text(text, stops)))
            else:
                row.append((ids, lps, reason, text))
        want.append(row)
    return want


def test_a_response_ends_where_a_stop_string_completes(model):
    plain = LLM(model)
    full = run(plain)
    tok = plain.get_tokenizer()
    texts = [t for g in full for *_, t in g]
    stops = [texts[0][10:12], texts[5][20:23]]                   # strings the rollout does write
    want = cut_by_hand(tok, full, stops)
    assert sum(r == "stop" for g in want for _, _, r, _ in g) >= 2
    pool = LLM(model, instances=2, pool={"processes": False, "chunk_tokens": 16})   # chunks move between instances
    for llm in (plain, LLM(model, async_scheduling=True), pool,
                LLM(model, speculative=SpeculativeConfig(policy="fixed", max_draft_tokens=8))):
        for _ in range(2):                                       # the speculative one drafts from history
            assert run(llm, stops) == want
    assert llm.last_metrics["rollout/spec_accepted_tokens"] > 0
    for group in want:
        for ids, _, reason, text in group:
            assert (reason == "stop") == any(s in tok.decode(ids, skip_special_tokens=True) for s in stops)
            assert not any(s in text for s in stops)


class ByteTokens:
    """A tokenizer of one byte a token: a multi-byte character takes several tokens, the first
    of which decodes alone (and in a window ending there) to U+FFFD."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_a_stop_string_across_a_multi_byte_character_and_bad_stop_settings():
    ids = list("ab\u00e9cd, x".encode())                       # é: two byte tokens, 2 and 3
    check = StopStrings(ByteTokens())
    assert check.first_end(ids, 0, ["\u00e9"]) == 3 and check.first_end(ids, 0, ["b\u00e9c"]) == 4
    assert check.first_end(ids, 0, ["zz", "d,"]) == 6 and check.first_end(ids, 0, [", "]) == 7
    assert check.first_end(ids, 5, ["ab"]) is None and check.first_end(ids, 0, ["zz"]) is None
    assert check.first_end(ids, 6, ["cd"]) is None                # completed before where the search starts
    for bad in ("", [""], [3], ["a", 5]):
        with pytest.raises(ValueError, match="stop"):
            SamplingParams(stop=bad)
    assert SamplingParams(stop="x").stop == ["x"]


def test_stop_strings_need_a_tokenizer(tmp_path):
    path = make_checkpoint(str(tmp_path / "m"), vocab_size=97)
    llm = LLM(path)
    before = llm.engine.metrics.num_forward
    with pytest.raises(ValueError, match="stop"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop=["a"]))
    assert llm.engine.metrics.num_forward == before


def test_vllms_output_settings(model):
    """``include_stop_str_in_output`` keeps the stop string in the text (the tokens as without
    it), ``detokenize=False`` returns the tokens without text, ``logprobs`` 0 or 1 is taken (the
    sampled token's is always returned) and more is refused, as are stop strings without text."""
    llm = LLM(model)
    full = run(llm)
    stops = [[t for g in full for *_, t in g][0][10:12]]
    cut = run(llm, stops)
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=60, ignore_eos=True, seed=7, stop=stops,
                        include_stop_str_in_output=True, logprobs=1)
    kept = [[(c.token_ids, c.text) for c in o.outputs] for o in llm.generate(PROMPTS, sp)]
    assert any(reason == "stop" for g in cut for *_, reason, _ in g)
    for gk, gc in zip(kept, cut):
        for (ids, text), (ids_cut, _, reason, text_cut) in zip(gk, gc):
            assert ids == ids_cut and text == (text_cut + stops[0] if reason == "stop" else text_cut)
    bare = llm.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_tokens=60, ignore_eos=True, seed=7,
                                                detokenize=False, logprobs=0))
    assert [[c.token_ids for c in o.outputs] for o in bare] == [[ids for ids, *_ in g] for g in full]
    assert all(c.text == "" for o in bare for c in o.outputs)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["a"], detokenize=False)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
