"""SGLang's native API (/generate and the RL control routes), as slime drives it, over real HTTP."""
import http.client
import json
import threading
import time

import pytest
from checkpoints import make_checkpoint
from conftest import API_KEY, start_server
from text_tokenizer import save_char_tokenizer

from tailrl import LLM, SamplingParams

LONG = 600


@pytest.fixture(scope="module")
def srv(chat_model):
    with start_server(chat_model, max_tokens_limit=LONG, max_n=8) as s:
        yield s


@pytest.fixture(scope="module")
def ref(chat_model):
    return LLM(chat_model, seed=0, max_num_seqs=64)


def call(port: int, path: str, payload: dict | None = None, method: str = "POST", key: str | None = API_KEY):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    conn.request(method, path, None if payload is None else json.dumps(payload), headers)
    r = conn.getresponse()
    out = r.status, json.loads(r.read() or b"null")
    conn.close()
    return out


def gen(port: int, payload: dict):
    status, body = call(port, "/generate", payload)
    assert status == 200, body
    return body


def wait_running(port: int, count: int = 1, timeout: float = 30.0) -> None:
    """Until ``count`` requests are running in the engine, then a little longer (tokens flow)."""
    deadline = time.monotonic() + timeout
    while call(port, "/v1/loads", method="GET")[1]["loads"][0]["num_running_reqs"] < count:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)


def wait_idle(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while call(port, "/v1/loads", method="GET")[1]["loads"][0]["num_total_reqs"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_seeded_samples_equal_llm_generate_alone_or_in_one_body(srv, ref):
    """slime sends each sample on its own with sampling_seed base + i; one body may ask n."""
    ids = [5, 9, 14, 22, 7]
    sp = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "ignore_eos": True}
    want = ref.generate([ids], SamplingParams(n=4, seed=7, max_tokens=24, top_p=0.9, ignore_eos=True))[0]
    body = gen(srv.port, {"input_ids": ids, "sampling_params": {**sp, "n": 4, "sampling_seed": 7},
                          "return_logprob": True})
    assert [o["output_ids"] for o in body] == [c.token_ids for c in want.outputs]
    assert [[x[0] for x in o["meta_info"]["output_token_logprobs"]] for o in body] == \
        [c.logprobs for c in want.outputs]
    assert all([x[1] for x in o["meta_info"]["output_token_logprobs"]] == o["output_ids"] for o in body)
    results: list = [None] * 4
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, gen(srv.port, {
        "input_ids": ids, "sampling_params": {**sp, "sampling_seed": 100 + i}, "return_logprob": True})))
        for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, r in enumerate(results):
        one = ref.generate([ids], SamplingParams(seed=100 + i, max_tokens=24, top_p=0.9, ignore_eos=True))[0]
        assert r["output_ids"] == one.outputs[0].token_ids
        assert [x[0] for x in r["meta_info"]["output_token_logprobs"]] == one.outputs[0].logprobs
        assert r["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
        assert r["meta_info"]["prompt_tokens"] == 5 and r["meta_info"]["completion_tokens"] == 24
        assert r["meta_info"]["weight_version"] == "default"


def test_text_batch_stop_reasons_and_trim(srv, ref):
    tok = ref.get_tokenizer()
    body = gen(srv.port, {"text": ["ab", "cd"], "sampling_params": {"max_new_tokens": 40, "sampling_seed": 1}})
    assert isinstance(body, list) and len(body) == 2
    for o, prompt in zip(body, ["ab", "cd"]):
        want = ref.generate([prompt], SamplingParams(seed=1, max_tokens=40))[0].outputs[0]
        assert o["output_ids"] == want.token_ids and o["text"] == want.text
        fr = o["meta_info"]["finish_reason"]
        if want.finish_reason == "stop":          # EOS (id 2) matched
            assert fr == {"type": "stop", "matched": 2}
        else:
            assert fr == {"type": "length", "length": 40}
    # a stop string: trimmed by default, kept with no_stop_trim; the tokens up to the one that completed it
    free = gen(srv.port, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 40, "sampling_seed": 3,
                                                                    "ignore_eos": True}})
    stop = tok.decode(free["output_ids"][5:7])
    for keep in (False, True):
        o = gen(srv.port, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 40, "sampling_seed": 3,
                                                                     "ignore_eos": True, "stop": stop,
                                                                     "no_stop_trim": keep}})
        assert o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        full = tok.decode(o["output_ids"])
        assert full.endswith(stop) and o["output_ids"] == free["output_ids"][:len(o["output_ids"])]
        assert o["text"] == (full if keep else full[:-len(stop)])


def test_top_and_prompt_logprobs(srv, ref):
    ids = [5, 9, 14, 22, 7, 30]
    o = gen(srv.port, {"input_ids": ids, "return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 2,
                       "return_text_in_logprobs": True,
                       "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}})
    want = ref.generate([ids], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3,
                                              prompt_logprobs=3))[0]
    meta = o["meta_info"]
    assert o["output_ids"] == want.outputs[0].token_ids
    assert len(meta["output_top_logprobs"]) == 8
    for top, tok, entry in zip(meta["output_top_logprobs"], o["output_ids"], want.outputs[0].top_logprobs):
        assert len(top) == 3 and top[0][1] == tok                 # greedy: the top-1 is the token
        assert [t[1] for t in top] == [t for t, lp in sorted(entry.items(), key=lambda x: x[1].rank)][:3]
        assert top[0][2] == ref.get_tokenizer().decode([tok])
    inp = meta["input_token_logprobs"]
    assert [x[1] for x in inp] == ids[2:]
    assert [x[0] for x in inp] == [want.prompt_logprobs[i][ids[i]].logprob for i in range(2, len(ids))]
    assert len(meta["input_top_logprobs"]) == 4 and all(len(x) == 3 for x in meta["input_top_logprobs"])


def test_abort_returns_the_partial_response_a_prefix_of_the_full_one(srv):
    """slime's partial rollout: abort_all, keep what was generated, go on from there later."""
    sp = {"max_new_tokens": LONG, "ignore_eos": True, "sampling_seed": 11}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(gen(srv.port, {"input_ids": [8, 9], "rid": "r1",
                                                                  "sampling_params": sp, "return_logprob": True})))
    t.start()
    wait_running(srv.port)
    assert call(srv.port, "/abort_request", {"abort_all": True}) == (200, {"success": True, "num_aborted": 1})
    t.join(60)
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(out["output_ids"])
    assert 0 < n < LONG and len(out["meta_info"]["output_token_logprobs"]) == n
    wait_idle(srv.port)
    full = gen(srv.port, {"input_ids": [8, 9], "sampling_params": sp})
    assert full["output_ids"][:n] == out["output_ids"]
    # by rid: only that request ends
    res: dict = {}
    ts = [threading.Thread(target=lambda k=k: res.__setitem__(k, gen(srv.port, {
        "input_ids": [8, 9], "rid": k, "sampling_params": {**sp, "max_new_tokens": 200 if k == "b" else LONG}})))
        for k in ("a", "b")]
    for x in ts:
        x.start()
    wait_running(srv.port, 2)
    assert call(srv.port, "/abort_request", {"rid": "a"})[1]["num_aborted"] == 1
    for x in ts:
        x.join(60)
    assert res["a"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert res["b"]["meta_info"]["finish_reason"] == {"type": "length", "length": 200}


def stream(port: int, payload: dict, stop_after: int | None = None) -> list:
    """The chunks of a streamed /generate (the JSON ones; "[DONE]" as the string), or the first
    ``stop_after`` of them before hanging up."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/generate", json.dumps({**payload, "stream": True}),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type").startswith("text/event-stream")
    chunks = []
    for line in r:
        line = line.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            chunks.append(data if data == "[DONE]" else json.loads(data))
            if stop_after is not None and len(chunks) >= stop_after:
                break
    conn.close()
    return chunks


def test_a_stream_grows_to_the_answer_and_a_client_that_leaves_aborts_it(srv):
    """slime's streaming rollout reads SGLang's cumulative chunks: each the answer so far."""
    body = {"input_ids": [5, 9, 14], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 30, "sampling_seed": 21, "ignore_eos": True}}
    whole = gen(srv.port, body)
    chunks = stream(srv.port, body)
    assert chunks[-1] == "[DONE]" and len(chunks) > 3
    last = chunks[-2]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert last["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]
    assert last["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    for a, b in zip(chunks[:-2], chunks[1:-1]):
        assert a["meta_info"]["finish_reason"] is None
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"] and len(b["output_ids"]) > len(a["output_ids"])
        assert [x[1] for x in a["meta_info"]["output_token_logprobs"]] == a["output_ids"]
    # aborted by id while streaming: the last chunk says so, with the tokens so far
    out: list = []
    t = threading.Thread(target=lambda: out.extend(stream(srv.port, {
        "input_ids": [8, 9], "rid": "s1", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}})))
    t.start()
    wait_running(srv.port)
    assert call(srv.port, "/abort_request", {"rid": "s1"})[1]["num_aborted"] == 1
    t.join(60)
    assert out[-1] == "[DONE]" and out[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(out[-2]["output_ids"]) < LONG
    # a client that hangs up: its request is aborted, nothing keeps running
    assert len(stream(srv.port, {"input_ids": [8, 9], "sampling_params": {"max_new_tokens": LONG,
                                                                          "ignore_eos": True}}, stop_after=3)) == 3
    wait_idle(srv.port)


def test_pause_holds_new_requests_until_continue(srv):
    assert call(srv.port, "/pause_generation", {"mode": "abort"})[0] == 200
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(gen(srv.port, {"input_ids": [4, 5], "sampling_params": {
        "max_new_tokens": 4, "ignore_eos": True}})))
    t.start()
    time.sleep(0.5)
    assert not out                                            # held
    assert call(srv.port, "/continue_generation", {})[0] == 200
    t.join(60)
    assert len(out["output_ids"]) == 4
    assert call(srv.port, "/pause_generation", {"mode": "retract"})[0] == 400


def test_update_weights_from_disk(srv, chat_model, tmp_path):
    other = str(tmp_path / "other")
    make_checkpoint(other, vocab_size=97, eos_token_id=2, max_pos=1024, seed=5)
    save_char_tokenizer(other, chat_template=True)
    wrong = str(tmp_path / "wrong")
    make_checkpoint(wrong, vocab_size=97, eos_token_id=2, max_pos=1024, hidden_size=32)
    greedy = {"input_ids": [5, 9, 14], "sampling_params": {"max_new_tokens": 12, "temperature": 0.0,
                                                            "ignore_eos": True}, "return_logprob": True}
    before = gen(srv.port, greedy)
    status, body = call(srv.port, "/update_weights_from_disk", {"model_path": wrong})
    assert status == 400 and not body["success"] and "hidden_size" in body["message"]
    assert gen(srv.port, greedy)["output_ids"] == before["output_ids"]        # nothing was touched
    try:
        status, body = call(srv.port, "/update_weights_from_disk", {"model_path": other, "weight_version": "v2"})
        assert status == 200 and body["success"], body
        after = gen(srv.port, greedy)
        want = LLM(other, seed=0).generate([[5, 9, 14]], SamplingParams(temperature=0.0, max_tokens=12,
                                                                          ignore_eos=True))[0].outputs[0]
        assert after["output_ids"] == want.token_ids
        assert [x[0] for x in after["meta_info"]["output_token_logprobs"]] == want.logprobs
        assert after["meta_info"]["weight_version"] == "v2"
        assert call(srv.port, "/get_model_info", method="GET")[1]["weight_version"] == "v2"
    finally:
        assert call(srv.port, "/update_weights_from_disk", {"model_path": chat_model,
                                                            "weight_version": "default"})[1]["success"]
    assert gen(srv.port, greedy)["output_ids"] == before["output_ids"]


@pytest.mark.parametrize("payload, field", [
    ({"input_ids": [1, 2], "sampling_params": {"json_schema": "{}"}}, "json_schema"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"n": 99}}, "n"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"bogus": 1}}, "bogus"),
    ({"input_ids": [1, 500]}, "input_ids"),
    ({"input_ids": [1, 2], "text": "a"}, "input_ids"),
    ({"input_ids": [[1, 2], [3]], "stream": True}, "stream"),
    ({"input_ids": [1, 2], "stream": True, "sampling_params": {"n": 2}}, "stream"),
    ({"input_ids": [1, 2], "stream": "yes"}, "stream"),
    ({"input_ids": [1, 2], "lora_path": "x"}, "lora_path"),
    ({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{}]}, "sampling_params"),
    ({"input_ids": [[1, 2], [3]], "rid": "x"}, "rid"),
    ({"input_ids": [[1, 2], [3]], "rid": ["x", "x"]}, "rid"),
])
def test_bad_fields_are_named_and_the_server_stays_usable(srv, payload, field):
    status, body = call(srv.port, "/generate", payload)
    assert status == 400 and body["error"]["param"] == field, body
    assert len(gen(srv.port, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2,
                                                                        "ignore_eos": True}})["output_ids"]) == 2


def test_info_health_loads_flush_and_auth(srv):
    assert call(srv.port, "/health_generate", method="GET") == (200, {"status": "ok"})
    info = call(srv.port, "/server_info", method="GET")[1]
    assert info["tp_size"] == 1 and info["dp_size"] == 1 and info["max_total_num_tokens"] > 0
    assert call(srv.port, "/get_server_info", method="GET")[1] == info
    assert call(srv.port, "/v1/loads", method="GET")[1]["loads"][0]["num_total_reqs"] == 0
    assert call(srv.port, "/flush_cache", {})[0] == 200
    assert call(srv.port, "/get_weight_version", method="GET") == (200, {"weight_version": "default"})
    engine = srv.app.state.server.llm.engine
    assert call(srv.port, "/release_memory_occupation", {}) == (200, {"success": True, "released": ["kv_cache"]})
    assert engine.kv.bytes == 0                                   # given back
    assert call(srv.port, "/release_memory_occupation", {"tags": ["weights"]})[0] == 400
    assert call(srv.port, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert len(gen(srv.port, {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 3,
                                                                        "ignore_eos": True}})["output_ids"]) == 3
    assert call(srv.port, "/generate", {"input_ids": [1, 2]}, key=None)[0] == 401
    assert call(srv.port, "/abort_request", {"abort_all": True}, key="wrong")[0] == 401
