"""``LLM.chat`` and ``LLM.get_tokenizer``, as vLLM's: a conversation goes through the tokenizer's
chat template (the assistant's turn opened) and then ``generate``; bad input raises ValueError
naming the field before any work."""
import pytest
from checkpoints import make_checkpoint
from text_tokenizer import save_char_tokenizer

from tailrl import LLM, SamplingParams

CONV = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "12+34?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for template in (True, False):
        path = str(tmp_path_factory.mktemp(f"chat_{template}"))
        make_checkpoint(path, vocab_size=97, eos_token_id=2, max_pos=256)
        save_char_tokenizer(path, chat_template=template)
        out[template] = path
    return out


def test_a_conversation_is_its_templated_prompt(models):
    llm = LLM(models[True])
    tok = llm.get_tokenizer()
    assert tok is llm.tokenizer and tok.chat_template
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    other = [{"role": "user", "content": "sort 3 1 2"}]
    ids = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
           for c in (CONV, other)]
    assert ids[0][-3:] == tok.encode("<a>", add_special_tokens=False)      # the assistant's turn is open
    want = llm.generate(ids, sp)
    for got in (llm.chat([CONV, other], sp), llm.chat(CONV, sp) + llm.chat(other, sp)):
        assert [o.prompt_token_ids for o in got] == ids
        assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]


def test_bad_conversations_and_a_model_without_a_template_raise_before_any_work(models):
    for template, bad, field in ((False, CONV, "messages\\[0\\].*no chat template"),
                                 (True, "hi", "messages must be"),
                                 (True, [], "messages must be"),
                                 (True, [CONV, "hi"], "messages must be")):
        llm = LLM(models[template])
        before = llm.engine.metrics.num_forward
        with pytest.raises(ValueError, match=field):
            llm.chat(bad, SamplingParams(max_tokens=4))
        assert llm.engine.metrics.num_forward == before
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3                  # still usable
