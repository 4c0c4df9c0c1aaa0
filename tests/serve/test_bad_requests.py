"""Every bad request gets an OpenAI-style error with the right status, and the server keeps serving."""
import http.client
import json

import pytest
from conftest import API_KEY, MODEL

GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def body(**changes):
    d = {**GOOD, **changes}
    return {k: v for k, v in d.items() if v is not ...}


# (name, method, path, body (dict, or raw bytes), headers override, expected status)
CASES = [
    ("bad json", "POST", "/v1/completions", b'{"model": "tiny", "prompt": ', None, 400),
    ("not an object", "POST", "/v1/completions", b"[1, 2]", None, 400),
    ("empty body", "POST", "/v1/completions", b"", None, 400),
    ("missing prompt", "POST", "/v1/completions", body(prompt=...), None, 400),
    ("missing model", "POST", "/v1/completions", body(model=...), None, 400),
    ("prompt wrong type", "POST", "/v1/completions", body(prompt=42), None, 400),
    ("prompt mixed list", "POST", "/v1/completions", body(prompt=["a", 3]), None, 400),
    ("empty prompt", "POST", "/v1/completions", body(prompt=""), None, 400),
    ("empty prompt list", "POST", "/v1/completions", body(prompt=[]), None, 400),
    ("token id out of vocab", "POST", "/v1/completions", body(prompt=[5, 100000]), None, 400),
    ("negative token id", "POST", "/v1/completions", body(prompt=[5, -1]), None, 400),
    ("temperature wrong type", "POST", "/v1/completions", body(temperature="hot"), None, 400),
    ("negative temperature", "POST", "/v1/completions", body(temperature=-0.5), None, 400),
    ("top_p zero", "POST", "/v1/completions", body(top_p=0), None, 400),
    ("top_p above one", "POST", "/v1/completions", body(top_p=1.5), None, 400),
    ("top_k zero", "POST", "/v1/completions", body(top_k=0), None, 400),
    ("max_tokens zero", "POST", "/v1/completions", body(max_tokens=0), None, 400),
    ("max_tokens above limit", "POST", "/v1/completions", body(max_tokens=10_000), None, 400),
    ("max_tokens float", "POST", "/v1/completions", body(max_tokens=2.5), None, 400),
    ("n zero", "POST", "/v1/completions", body(n=0), None, 400),
    ("n above limit", "POST", "/v1/completions", body(n=1000), None, 400),
    ("seed wrong type", "POST", "/v1/completions", body(seed="abc"), None, 400),
    ("stop wrong type", "POST", "/v1/completions", body(stop=7), None, 400),
    ("stream wrong type", "POST", "/v1/completions", body(stream="yes"), None, 400),
    ("logprobs too many", "POST", "/v1/completions", body(logprobs=21), None, 400),
    ("logprobs negative", "POST", "/v1/completions", body(logprobs=-1), None, 400),
    ("stop token out of vocab", "POST", "/v1/completions", body(stop_token_ids=[1000]), None, 400),
    ("echo with stream", "POST", "/v1/completions", body(echo=True, stream=True), None, 400),
    ("repetition penalty zero", "POST", "/v1/completions", body(repetition_penalty=0), None, 400),
    ("min_p above one", "POST", "/v1/completions", body(min_p=1.5), None, 400),
    ("include_stop_str_in_output wrong type", "POST", "/v1/completions", body(include_stop_str_in_output="y"),
     None, 400),
    ("min_tokens above max_tokens", "POST", "/v1/completions", body(min_tokens=50, max_tokens=5), None, 400),
    ("prompt ids count", "POST", "/v1/completions", body(prompt=["a", "b"], prompt_id=["x"]), None, 400),
    ("oversized prompt", "POST", "/v1/completions", body(prompt="a" * 1100), None, 400),
    ("unknown model", "POST", "/v1/completions", body(model="gpt-4"), None, 404),
    ("oversized body", "POST", "/v1/completions", body(prompt="a" * 20_000), None, 413),
    ("bad api key", "POST", "/v1/completions", body(), {"Authorization": "Bearer nope"}, 401),
    ("missing api key", "POST", "/v1/completions", body(), {"Authorization": ""}, 401),
    ("chat missing messages", "POST", "/v1/chat/completions", {"model": MODEL}, None, 400),
    ("chat empty messages", "POST", "/v1/chat/completions", {**CHAT, "messages": []}, None, 400),
    ("chat bad role", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "wizard", "content": "x"}]}, None, 400),
    ("chat content wrong type", "POST", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": 5}]}, None, 400),
    ("chat max_tokens zero", "POST", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, None, 400),
    ("chat top_logprobs too many", "POST", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21},
     None, 400),
    ("chat top_logprobs without logprobs", "POST", "/v1/chat/completions", {**CHAT, "top_logprobs": 3}, None, 400),
    ("unknown route", "POST", "/v1/engines", body(), None, 404),
    ("wrong method", "GET", "/v1/completions", None, None, 405),
]


def send(port: int, method: str, path: str, payload, headers=None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = payload if isinstance(payload, bytes) or payload is None else json.dumps(payload).encode()
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}", **(headers or {})}
    conn.request(method, path, body=data, headers=h)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


def test_at_least_fifteen_cases():
    assert len(CASES) >= 15


@pytest.mark.parametrize("name,method,path,payload,headers,status", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, name, method, path, payload, headers, status):
    got, body_ = send(server.port, method, path, payload, headers)
    assert got == status, body_
    err = body_["error"]
    assert isinstance(err["message"], str) and err["message"] and set(err) == {"message", "type", "param", "code"}
    assert "pydantic" not in err["message"] and "loc" not in err      # no FastAPI/pydantic internals
    ok, good = send(server.port, "POST", "/v1/completions", GOOD)  # the server still serves
    assert ok == 200 and len(good["choices"]) == 1


def test_chat_without_template_is_400():
    """models/small ships a tokenizer without a chat template."""
    from conftest import SMALL_MODEL, start_server
    with start_server(SMALL_MODEL, api_key=None) as s:
        status, b = send(s.port, "POST", "/v1/chat/completions", CHAT)
        assert status == 400 and "chat template" in b["error"]["message"]
        assert send(s.port, "POST", "/v1/completions", GOOD)[0] == 200      # no key configured: open


def test_server_binds_loopback_by_default():
    from tailrl.serve.cli import parse_args
    from tailrl.serve.config import ServeConfig
    assert parse_args(["--model", "m"]).host == "127.0.0.1" and ServeConfig().host == "127.0.0.1"


def test_serve_dtype_defaults_to_llms():
    """`tailrl serve` computes in LLM's default dtype, so a seeded request samples what
    `LLM(model).generate` does with that seed."""
    import inspect

    from tailrl import LLM
    from tailrl.serve.cli import parse_args
    assert parse_args(["--model", "m"]).dtype == inspect.signature(LLM).parameters["dtype"].default == "bfloat16"


def test_serve_device_options_are_checked_before_any_work(capsys):
    """`tailrl serve --device cuda` puts the engine on a GPU with `--gpu-memory-utilization` of
    it (split over `--tensor-parallel-size` of them); a malformed device, an absent one, a share
    outside (0, 1] or no rank is an argument error naming the flag, before the model is read."""
    import torch

    from tailrl.serve.cli import parse_args
    a = parse_args(["--model", "m", "--device", "cpu", "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "2"])
    assert (a.device, a.gpu_memory_utilization, a.tensor_parallel_size) == ("cpu", 0.5, 2)
    bad = [["--device", "gpu"], ["--gpu-memory-utilization", "1.5"], ["--gpu-memory-utilization", "0"],
           ["--tensor-parallel-size", "0"]]
    if not torch.cuda.is_available():
        bad.append(["--device", "cuda"])
    for args in bad:
        with pytest.raises(SystemExit):
            parse_args(["--model", "m", *args])
        assert args[0] in capsys.readouterr().err
