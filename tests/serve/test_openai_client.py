"""The real `openai` client against a real server on a loopback port."""
import pytest
from conftest import MODEL

from tailrl import LLM, SamplingParams


@pytest.fixture(scope="module")
def reference(chat_model):
    """The same checkpoint and engine seed, driven through LLM.generate."""
    return LLM(chat_model, seed=0)


def test_models_and_health(server, client):
    import urllib.request
    assert [m.id for m in client.models.list().data] == [MODEL]
    with urllib.request.urlopen(server.base_url + "/health") as r:
        assert r.status == 200


def test_completion_n_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=12, n=3, seed=1, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for c in r.choices:
        ids = c.model_extra["token_ids"]
        assert 1 <= len(ids) <= 12 and c.finish_reason in ("stop", "length")
        assert len(c.logprobs.token_logprobs) == len(ids) and all(lp <= 0 for lp in c.logprobs.token_logprobs)
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)
    assert len({tuple(c.model_extra["token_ids"]) for c in r.choices}) > 1     # samples differ


@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9),
                                dict(temperature=0.0), dict(temperature=1.2, top_k=5),
                                dict(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.4),
                                dict(temperature=0.9, repetition_penalty=1.3, min_p=0.1, min_tokens=10)])
def test_seed_reproduces_llm_generate(client, reference, kw):
    extra = {k: kw.pop(k) for k in ("top_k", "repetition_penalty", "min_p", "min_tokens") if k in kw}
    r = client.completions.create(model=MODEL, prompt=["abc", "x = 1"], max_tokens=20, n=2, seed=7, logprobs=1,
                                  extra_body=extra, **kw)
    outs = reference.generate(["abc", "x = 1"], SamplingParams(n=2, max_tokens=20, seed=7, **extra, **kw))
    want = [c for o in outs for c in o.outputs]
    assert [c.model_extra["token_ids"] for c in r.choices] == [c.token_ids for c in want]
    assert [c.text for c in r.choices] == [c.text for c in want]
    for got, exp in zip(r.choices, want):
        assert got.logprobs.token_logprobs == pytest.approx(exp.logprobs, abs=1e-5)


def test_token_id_prompt_and_prompt_id(client, reference):
    ids = reference.tokenizer.encode("sum 3")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, seed=3, extra_body={"prompt_id": "p-1"})
    out = reference.generate([ids], SamplingParams(max_tokens=10, seed=3))[0].outputs[0]
    assert r.choices[0].model_extra["token_ids"] == out.token_ids


def test_streaming_equals_non_streaming(client):
    kw = dict(model=MODEL, prompt="stream me", max_tokens=24, n=2, seed=11, logprobs=1)
    full = client.completions.create(**kw)
    text, toks, finish = ["", ""], [[], []], [None, None]
    chunks = 0
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            text[c.index] += c.text
            toks[c.index] += c.model_extra["token_ids"]
            assert len(c.logprobs.token_logprobs) == len(c.model_extra["token_ids"])
            finish[c.index] = c.finish_reason or finish[c.index]
        chunks += 1
    assert chunks > 2                       # tokens arrive as they are made, not all at the end
    assert text == [c.text for c in full.choices]
    assert toks == [c.model_extra["token_ids"] for c in full.choices]
    assert finish == [c.finish_reason for c in full.choices]


def test_top_logprobs_are_llm_generates_streamed_or_not(client, reference):
    """Completions ``logprobs`` N: per token a dict of text -> logprob (its N best and the sampled
    token), LLM.generate's ``top_logprobs`` exactly; the stream's equal the body's. Chat
    ``top_logprobs`` N: the N best in rank order."""
    kw = dict(model=MODEL, prompt="abc", max_tokens=16, n=2, seed=4, logprobs=3)
    full = client.completions.create(**kw)
    outs = reference.generate(["abc"], SamplingParams(n=2, max_tokens=16, seed=4, logprobs=3))[0].outputs
    for got, exp in zip(full.choices, outs):
        assert got.model_extra["token_ids"] == exp.token_ids
        want = [{lp.decoded_token: lp.logprob for lp in sorted(e.values(), key=lambda x: x.rank)}
                for e in exp.top_logprobs]
        assert got.logprobs.top_logprobs == want and all(3 <= len(e) <= 4 for e in exp.top_logprobs)
    streamed = [[], []]
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            streamed[c.index] += c.logprobs.top_logprobs
    assert streamed == [c.logprobs.top_logprobs for c in full.choices]
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, seed=5, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert content and all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
                           for t in content)
    assert all(t.logprob in [a.logprob for a in t.top_logprobs] or t.logprob <= t.top_logprobs[1].logprob
               for t in content)
    bare = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, seed=5, logprobs=True)
    assert [t.token for t in bare.choices[0].logprobs.content] == [t.token for t in content]
    assert all(t.top_logprobs == [] for t in bare.choices[0].logprobs.content)


def test_echo_returns_the_prompt_with_its_logprobs(client, reference):
    """Completions ``echo`` (lm-eval's loglikelihood request): the prompt's text and tokens before
    the completion's, the first prompt token's logprob None, the others LLM.generate's
    ``prompt_logprobs`` (their top 2 too); without logprobs, the text alone."""
    ids = reference.tokenizer.encode("sum 3 and 4")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, logprobs=2, echo=True)
    out = reference.generate([ids], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, logprobs=2))[0]
    c, gen = r.choices[0], out.outputs[0]
    assert c.model_extra["token_ids"] == ids + gen.token_ids
    assert c.text == reference.tokenizer.decode(ids, skip_special_tokens=True) + gen.text
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == [e[t].logprob for e, t in zip(out.prompt_logprobs[1:], ids[1:])]
    assert lp.token_logprobs[len(ids):] == gen.logprobs
    ranked = [sorted(e.values(), key=lambda x: x.rank) for e in out.prompt_logprobs[1:]]
    assert lp.top_logprobs[1:len(ids)] == [{x.decoded_token: x.logprob for x in e} for e in ranked]
    assert len(lp.tokens) == len(lp.text_offset) == len(ids) + len(gen.token_ids)
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == c.text and plain.choices[0].logprobs is None


def test_chat_and_chat_stream(client, reference):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, seed=5, logprobs=True)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason in ("stop", "length")
    assert len(c.logprobs.content) == len(c.model_extra["token_ids"])
    prompt = reference.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = reference.tokenizer.encode(prompt, add_special_tokens=False)
    out = reference.generate([ids], SamplingParams(max_tokens=16, seed=5))[0].outputs[0]
    assert c.model_extra["token_ids"] == out.token_ids and c.message.content == out.text
    streamed = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=16, seed=5, stream=True) if ch.choices)
    assert streamed == out.text


def test_stop_string_truncates(client, reference):
    base = client.completions.create(model=MODEL, prompt="go", max_tokens=40, seed=2, temperature=1.0,
                                     extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) >= 6
    stop = text[3:5]
    cut = text.index(stop)
    for stream in (False, True):
        for keep in (False, True):                        # vLLM's include_stop_str_in_output
            kw = dict(model=MODEL, prompt="go", max_tokens=40, seed=2, stop=[stop],
                      extra_body={"ignore_eos": True, "include_stop_str_in_output": keep})
            if stream:
                got = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw))
            else:
                r = client.completions.create(**kw)
                got = r.choices[0].text
                assert r.choices[0].finish_reason == "stop"
            assert got == text[:cut + len(stop) if keep else cut]


def test_metrics_exposes_engine_keys(server, client):
    import urllib.request
    client.completions.create(model=MODEL, prompt="m", max_tokens=4)
    req = urllib.request.Request(server.base_url + "/metrics", headers={"Authorization": "Bearer test-key"})
    import time
    time.sleep(0.6)                                  # the loop refreshes its snapshot every 0.5 s
    with urllib.request.urlopen(req) as r:
        text = r.read().decode()
    assert "tailrl_rollout_num_forward_total" in text and "tailrl_serve_requests_total" in text
    value = [ln for ln in text.splitlines() if ln.startswith("tailrl_rollout_num_forward_total")][0]
    assert float(value.split()[-1]) > 0


def test_prompt_id_groups_feed_history_and_speculation_is_lossless(chat_model, reference):
    """A speculative server: the n samples of a prompt id become its history, and a second round
    (history + group drafts) still returns exactly the plain engine's tokens."""
    import openai
    from conftest import API_KEY, start_server
    # fixed policy: always draft (the adaptive one may not on a loaded CPU), so the check bites
    with start_server(chat_model, speculative={"method": "suffix", "policy": "fixed", "max_draft_tokens": 4}) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        srv = s.app.state.server
        kw = dict(model=MODEL, prompt="repeat abc abc", n=4, max_tokens=48, temperature=0.3,
                  extra_body={"prompt_id": "task-9"})
        first = client.completions.create(seed=1, **kw)
        import time
        deadline = time.monotonic() + 10
        while "task-9" not in srv.llm.history and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.llm.history.get("task-9") == [c.model_extra["token_ids"] for c in first.choices]
        second = client.completions.create(seed=2, **kw)
        want = reference.generate(["repeat abc abc"], SamplingParams(n=4, max_tokens=48, temperature=0.3, seed=2))
        assert [c.model_extra["token_ids"] for c in second.choices] == [c.token_ids for c in want[0].outputs]
        time.sleep(0.6)
        assert srv.loop.stats().get("rollout/spec_verify_rows", 0) > 0     # drafts were verified


def test_missing_extra_names_the_fix():
    from tailrl.serve import require
    with pytest.raises(ImportError, match=r"pip install 'tailrl\[serve\]'"):
        require("tailrl_no_such_module")


def test_cli_dispatches_serve(capsys):
    from tailrl.cli import main
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "--api-key" in capsys.readouterr().out
