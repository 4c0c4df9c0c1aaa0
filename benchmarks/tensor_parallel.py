"""One engine's model split over two ranks (``tensor_parallel_size=2``) against the whole model
in one process, on the same rollout.

On a CPU the two ranks share the machine's cores and memory bandwidth: what this measures here
is the cost of the split (two sums across ranks per layer, one message per forward), not the
gain a GPU user splits a model for (each GPU holds and reads half of the weights). Both engines
are alive at once and their rollouts alternate (ABBA); reported: median seconds of each, their
ratio, rank 0's host time per forward spent sending the step to the other rank, and the share of
responses identical to the whole model's (bfloat16 sums the two halves of each output projection
in another order, so a response may part from the whole model's once two tokens are near-tied;
speculation on the split engine is exact: tests/engine/test_tensor_parallel.py).

Usage: python benchmarks/tensor_parallel.py --model DIR [--prompts 16] [--n 4] [--max-tokens 64]
       [--rounds 2] [--size 2] [--device cpu | cuda]
(On GPUs: ``--device cuda --size N`` splits over GPUs 0..N-1, the whole model on GPU 0; not run yet.)
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from tailrl import LLM, SamplingParams
from tailrl.tasks import mixture


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--size", type=int, default=2, help="tensor_parallel_size of the split engine")
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    prompts = [ex.prompt for ex in mixture.heldout_examples(a.prompts)]
    params = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=0)
    kw = dict(device=a.device, gpu_memory_utilization=0.4) if a.device != "cpu" else {}
    engines = {"whole": LLM(a.model, **kw), "split": LLM(a.model, tensor_parallel_size=a.size, **kw)}
    seconds: dict[str, list[float]] = {k: [] for k in engines}
    tokens: dict[str, list] = {}
    for r in range(a.rounds):
        for way in (("whole", "split") if r % 2 == 0 else ("split", "whole")):
            t0 = time.perf_counter()
            outs = engines[way].generate(prompts, params, use_tqdm=False)
            seconds[way].append(time.perf_counter() - t0)
            tokens[way] = [c.token_ids for o in outs for c in o.outputs]
    split = engines["split"].engine.model
    med = {k: statistics.median(v) for k, v in seconds.items()}
    new = sum(len(t) for t in tokens["whole"])
    out = {"model": a.model, "device": a.device, "size": a.size,
           "rollout": f"{a.prompts} x {a.n}, T=1, max {a.max_tokens}",
           "whole_s": round(med["whole"], 3), "split_s": round(med["split"], 3),
           "split_over_whole_time": round(med["split"] / med["whole"], 3),
           "whole_tokens_per_s": round(new / med["whole"], 1),
           "message_ms_per_forward": round(1e3 * split.message_s / max(split.forwards, 1), 3),
           "identical_share": round(sum(x == y for x, y in zip(tokens["whole"], tokens["split"]))
                                    / len(tokens["whole"]), 3),
           "rounds": {k: [round(x, 3) for x in v] for k, v in seconds.items()}}
    engines["split"].close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
