"""`tailrl generate --model DIR --prompt TEXT ...`: sample from a checkpoint, print the
responses and the rollout metrics; the last line is the metrics as one JSON object."""
from __future__ import annotations

import argparse
import json


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tailrl generate", description=__doc__)
    ap.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    ap.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    ap.add_argument("--speculative", choices=["off", "suffix"], default="off")
    ap.add_argument("--device", default="cpu", help="where the engine runs: cpu, cuda or cuda:N")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="the model split over this many devices (CUDA: --device and the next ones)")
    a = ap.parse_args(argv)
    from tailrl import LLM, SamplingParams
    try:
        llm = LLM(a.model, speculative=None if a.speculative == "off" else {"method": a.speculative},
                  dtype=a.dtype, seed=a.seed, device=a.device, tensor_parallel_size=a.tensor_parallel_size)
        outs = llm.generate(a.prompt, SamplingParams(n=a.n, temperature=a.temperature, top_p=a.top_p,
                                                     top_k=a.top_k, max_tokens=a.max_tokens))
    except ValueError as e:
        ap.error(str(e))
    for o in outs:
        for c in o.outputs:
            print(f"--- prompt {o.request_id} sample {c.index} ({len(c.token_ids)} tokens, {c.finish_reason})")
            print((o.prompt or "") + c.text)
    print(json.dumps(llm.last_metrics))
    return 0
