"""One engine loop for all connections: concurrent requests share steps; leaving clients free KV."""
import http.client
import json
import socket
import threading
import time

import pytest
from conftest import API_KEY, MODEL, start_server

SLOW = {"model": MODEL, "prompt": "long", "max_tokens": 900, "n": 8, "ignore_eos": True}


@pytest.fixture(scope="module")
def big_server(chat_model):
    with start_server(chat_model, max_tokens_limit=1000) as s:
        yield s


def wait_idle(server, timeout=30.0) -> None:
    loop = server.app.state.server.loop
    deadline = time.monotonic() + timeout
    while loop.live_sequences and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loop.live_sequences == 0


def post(port: int, payload: dict) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(payload),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    out = json.loads(conn.getresponse().read())
    conn.close()
    return out


def test_concurrent_requests_share_steps(big_server):
    engine = big_server.app.state.server.llm.engine
    before = engine.metrics.snapshot()
    results: list = [None] * 12
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(
        i, post(big_server.port, {"model": MODEL, "prompt": f"q{i}", "max_tokens": 40, "seed": i,
                                  "ignore_eos": True}))) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None and len(r["choices"][0]["token_ids"]) == 40 for r in results)
    m = engine.metrics.since(before)
    # 12 x 40 tokens in far fewer than 480 forwards: requests joined the running batch
    assert m.sum_batch_size / m.num_forward > 2
    wait_idle(big_server)


def raw_request(port: int, payload: dict) -> socket.socket:
    data = json.dumps(payload).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts_and_frees(big_server, stream):
    srv = big_server.app.state.server
    aborted = srv.loop.aborted_sequences
    s = raw_request(big_server.port, {**SLOW, "stream": stream})
    deadline = time.monotonic() + 30
    while srv.loop.live_sequences < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")        # tokens are flowing
    s.close()
    wait_idle(big_server)
    assert srv.loop.aborted_sequences - aborted == 8     # aborted, not run to max_tokens
    assert not srv.llm.engine.requests                      # released: nothing holds KV
    assert post(big_server.port, {"model": MODEL, "prompt": "still here", "max_tokens": 3})["choices"]


def test_full_server_answers_429_and_recovers(chat_model):
    from test_bad_requests import send
    with start_server(chat_model, max_live_sequences=4) as s:
        status, body = send(s.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 8})
        assert status == 429 and body["error"]["type"] == "rate_limit_error"
        status, body = send(s.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "n": 4,
                                                                 "max_tokens": 3})
        assert status == 200 and len(body["choices"]) == 4


def test_stream_usage_chunk(big_server):
    import openai
    client = openai.OpenAI(base_url=big_server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    chunks = list(client.completions.create(model=MODEL, prompt="u", max_tokens=5, n=2, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_a_server_whose_engine_steps_ahead_answers_as_one_that_does_not(chat_model):
    """Concurrent seeded requests, some ending at EOS: the same tokens and log-probabilities
    from an engine launching each plain step before the last one's tokens are back (a GPU's
    default, forced here) as from one stepping one step at a time."""
    def answers(ahead: bool) -> list:
        with start_server(chat_model, max_tokens_limit=64, engine={"async_scheduling": ahead}) as s:
            assert s.app.state.server.llm.engine.ahead == ahead
            results: list = [None] * 8
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(
                i, post(s.port, {"model": MODEL, "prompt": f"q{i}", "max_tokens": 30 + i, "seed": i,
                                 "logprobs": 1}))) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            wait_idle(s)
            return [(r["choices"][0]["token_ids"], r["choices"][0]["logprobs"]["token_logprobs"],
                     r["choices"][0]["finish_reason"]) for r in results]
    got = answers(True)
    assert got == answers(False)
    assert {r for _, _, r in got} == {"stop", "length"}
