"""`tailrl serve` under load: 200 concurrent HTTP requests vs the same requests through one `LLM.generate`.

The server runs as its own process (`tailrl serve`, loopback, a free port), as a user would run
it; this process first makes the baseline with `LLM.generate` (one call holding every request)
and then sends the same requests over loopback HTTP (a bare asyncio client), all at once but
bounded by `--concurrency`. Request i has seed i, so the server must return exactly the baseline's tokens:
the benchmark counts requests lost (errors or missing) and requests whose tokens differ.
Reports p50/p99 latency and generated tokens/s of each; ``ratio`` = server tokens/s / baseline
tokens/s (target >= 0.8). The last line is one JSON object with these figures.

Like for like: the server's engine runs in a worker thread, so the baseline does too. On this
shared 2-core machine the same ``generate`` took ~3x longer from the main thread than from a
worker thread (torch intra-op threads fighting other load), which would flatter the server.
``--api sglang`` sends each request as SGLang's native ``POST /generate`` (``sampling_seed`` i,
as slime sends its samples) instead of ``/v1/completions``.
Usage: python benchmarks/serve_load.py [--requests 200] [--max-tokens 128] [--speculative suffix]
                                       [--api openai|sglang]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompts(count: int) -> list[str]:
    from tailrl.tasks import mixture
    return [ex.prompt for ex in mixture.heldout_examples(count)]


def make_llm(a):
    from tailrl import LLM, SamplingParams
    llm = LLM(a.model, speculative=None if a.speculative == "off" else {"method": a.speculative}, seed=0,
              dtype=a.dtype)
    warm = prompts(8)                        # first calls pay one-time costs; the server is warmed too
    llm.generate(warm, SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=10**6), use_tqdm=False)
    return llm


def in_thread(fn, *args):
    """Run ``fn`` in a worker thread, as the server runs its engine loop (see the module docstring)."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(fn(*args)))
    t.start()
    t.join()
    if not box:
        raise RuntimeError("the baseline thread failed (see its traceback above)")
    return box[0]


def baseline(llm, a, texts: list[str]) -> tuple[float, list[list[int]]]:
    """All requests in one generate call; fresh prompt ids so no history from an earlier run helps."""
    from tailrl import SamplingParams
    params = [SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=i) for i in range(len(texts))]
    t0 = time.perf_counter()
    outs = llm.generate(texts, params, prompt_ids=[f"{time.time()}-{i}" for i in range(len(texts))],
                        use_tqdm=False)
    return time.perf_counter() - t0, [o.outputs[0].token_ids for o in outs]


def start_server(a, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tailrl.cli", "serve", "--model", a.model, "--port", str(port),
           "--served-model-name", "small", "--speculative", a.speculative, "--log-level", "warning",
           "--max-tokens-limit", str(a.max_tokens), "--dtype", a.dtype]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not come up in 300 s")


async def post(port: int, body: dict, timeout: float, path: str = "/v1/completions"):
    """One HTTP/1.1 POST on its own loopback connection. A bare asyncio client rather than the
    ``openai`` one: on a shared 2-core machine the client's own parsing competes with the server
    for CPU, and the benchmark should time the server (the tests use the real ``openai`` client)."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n".encode()
                     + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout)
    finally:
        writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {payload[:200]!r}")
    return json.loads(payload)


async def load(a, port: int, texts: list[str]):
    """Every request at once (bounded by --concurrency); returns (wall s, latencies, token ids or None)."""
    gate = asyncio.Semaphore(a.concurrency)

    async def one(i: int):
        async with gate:
            t0 = time.perf_counter()
            try:
                if a.api == "sglang":
                    r = await post(port, {"text": texts[i], "sampling_params": {
                        "max_new_tokens": a.max_tokens, "temperature": 1.0, "sampling_seed": i}}, a.timeout,
                        "/generate")
                    return time.perf_counter() - t0, r["output_ids"]
                r = await post(port, {"model": "small", "prompt": texts[i], "max_tokens": a.max_tokens,
                                      "temperature": 1.0, "seed": i, "prompt_id": f"load-{i}"}, a.timeout)
                return time.perf_counter() - t0, r["choices"][0]["token_ids"]
            except (OSError, RuntimeError, asyncio.TimeoutError, ValueError) as e:
                print(f"request {i} failed: {e}", file=sys.stderr)
                return time.perf_counter() - t0, None

    await post(port, {"model": "small", "prompt": prompts(8), "max_tokens": a.max_tokens, "seed": 10**6},
               a.timeout)                                                    # warm-up, as the baseline's
    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(len(texts))))
    wall = time.perf_counter() - t0
    return wall, [r[0] for r in results], [r[1] for r in results]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "small"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculative", choices=["off", "suffix"], default="off")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="both sides'")
    ap.add_argument("--api", choices=["openai", "sglang"], default="openai",
                    help="/v1/completions, or SGLang's native /generate")
    a = ap.parse_args()
    texts = prompts(a.requests)
    llm = make_llm(a)
    base_s, base_ids = in_thread(baseline, llm, a, texts)
    port = free_port()
    proc = start_server(a, port)               # baseline, server, baseline: drift on a shared CPU averages out
    try:
        wall, lat, ids = asyncio.run(load(a, port, texts))
    finally:
        proc.terminate()
        proc.wait(30)
    base_s2, _ = in_thread(baseline, llm, a, texts)
    base_s = (base_s + base_s2) / 2
    lost = sum(x is None for x in ids)
    differ = sum(x is not None and x != b for x, b in zip(ids, base_ids))
    base_tokens = sum(len(x) for x in base_ids)
    srv_tokens = sum(len(x) for x in ids if x is not None)
    fig = {"requests": a.requests, "concurrency": a.concurrency, "max_tokens": a.max_tokens, "dtype": a.dtype,
           "speculative": a.speculative, "api": a.api, "lost": lost, "tokens_differ": differ,
           "baseline_s": round(base_s, 3), "baseline_tokens_per_s": round(base_tokens / base_s, 1),
           "server_s": round(wall, 3), "server_tokens_per_s": round(srv_tokens / wall, 1),
           "ratio": round((srv_tokens / wall) / (base_tokens / base_s), 3),
           "latency_p50_s": round(float(np.percentile(lat, 50)), 3),
           "latency_p99_s": round(float(np.percentile(lat, 99)), 3)}
    print(f"\nbaseline runs: {base_s:.3f} s mean of two")
    print(f"{'':<26}{'LLM.generate':>14}{'server':>14}")
    print(f"{'wall s':<26}{fig['baseline_s']:>14}{fig['server_s']:>14}")
    print(f"{'generated tokens/s':<26}{fig['baseline_tokens_per_s']:>14}{fig['server_tokens_per_s']:>14}")
    print(f"{'latency p50 / p99 s':<26}{'':>14}{fig['latency_p50_s']:>7}/{fig['latency_p99_s']}")
    print(f"server/baseline throughput: {fig['ratio']}x   lost: {lost}   tokens differ: {differ}\n")
    print(json.dumps(fig))


if __name__ == "__main__":
    main()
