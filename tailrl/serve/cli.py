"""`tailrl serve --model DIR`: the OpenAI-compatible server, with SGLang's native ``/generate``
and control routes beside it (needs the ``serve`` extra).

Binds to 127.0.0.1 unless ``--host`` says otherwise; ``--api-key`` (or ``TAILRL_API_KEY``)
makes /v1/* and /metrics require ``Authorization: Bearer <key>``.
"""
from __future__ import annotations

import argparse
import logging
import os

from tailrl.serve import require

log = logging.getLogger(__name__)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="tailrl serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--served-model-name", default=None, help="the name clients send (default: the directory's)")
    ap.add_argument("--speculative", choices=["off", "suffix"], default="off")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("TAILRL_API_KEY"))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float64", "bfloat16"],
                    help="as LLM's (default bfloat16), so a seeded request samples what LLM.generate does")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="where the engine runs: cpu, cuda or cuda:N")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                    help="on a GPU: the engine's share of its memory (weights, K/V cache, CUDA graphs)")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="the model split over this many devices (CUDA: --device and the next ones)")
    ap.add_argument("--max-tokens-limit", type=int, default=4096, help="largest max_tokens a request may ask")
    ap.add_argument("--max-request-bytes", type=int, default=1 << 20)
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    from tailrl.config import check_device, require_device
    try:                                   # before any work: a malformed or absent device, a bad share
        check_device(a.device, "--device")
        require_device(a.device, "--device")
        if not 0 < a.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {a.gpu_memory_utilization}")
        if a.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {a.tensor_parallel_size}")
    except ValueError as e:
        ap.error(str(e))
    return a


def main(argv: list[str]) -> int:
    a = parse_args(argv)
    uvicorn = require("uvicorn")
    from tailrl import LLM
    from tailrl.serve.app import build_app
    from tailrl.serve.config import ServeConfig
    logging.basicConfig(level=a.log_level.upper())
    cfg = ServeConfig(model_name=a.served_model_name or ServeConfig.default_model_name(a.model), host=a.host,
                      port=a.port, api_key=a.api_key, max_tokens_limit=a.max_tokens_limit,
                      max_request_bytes=a.max_request_bytes)
    if a.host not in ("127.0.0.1", "localhost", "::1") and cfg.api_key is None:
        log.warning("serving on %s without --api-key: anyone who can reach it can use it", a.host)
    llm = LLM(a.model, speculative=None if a.speculative == "off" else {"method": a.speculative},
              dtype=a.dtype, seed=a.seed, max_num_seqs=a.max_num_seqs, device=a.device,
              gpu_memory_utilization=a.gpu_memory_utilization, tensor_parallel_size=a.tensor_parallel_size)
    uvicorn.run(build_app(llm, cfg), host=cfg.host, port=cfg.port, log_level=a.log_level)
    return 0
