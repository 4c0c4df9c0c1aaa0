"""The drafter's draft vocabulary: what a drafter step costs with it, and what it costs in acceptance.

1. *Step cost.* One drafter step (a chain depth as the engine drafts it: ``paged.paged_step``
   over a 256-position past in the drafter's K/V blocks, then the most likely token) of a drafter for Qwen2.5-0.5B's exact shape (hidden
   896, MLP 4864, 2 heads of 64, its 151,936-token vocabulary; random weights: the cost does not
   depend on them), at 1 and 16 rows, in float32 and bfloat16, with the whole vocabulary and
   with draft vocabularies of ``--sizes`` tokens. The settings run in turn, every other round
   in reverse order (the machine's speed drifts); best of ``--rounds``. On a GPU
   (``--device cuda``) a depth is timed as the engine runs it, replayed from its CUDA graph
   (``DrafterGraphs``), synchronised. Then one spot-trainer step of the same drafters in
   float32 (``drafter_loss`` over 256 positions with its 3-step unroll, and backward), timed alike.
2. *Acceptance* (``--accept``; minutes on a CPU). Drafters of `small` warm-started exactly as
   ``tailrl train-drafter`` does (``--train-prompts`` training prompts x 4, ``--train-steps``),
   one per draft vocabulary in ``--accept-sizes`` (0: the whole vocabulary), the same data and
   seed; each measured exactly (``evaluate.chain_acceptance``: 6-token chains, every position)
   on responses to 64 held-out prompts x 2, with the share of those responses' tokens inside
   its vocabulary. `small` has 292 tokens, so sizes near that say little: the small sizes show
   what a binding vocabulary costs.

Usage: python benchmarks/drafter_vocab.py [--rounds 5] [--sizes 32768,8192] [--device cuda]
       python benchmarks/drafter_vocab.py --accept [--accept-sizes 0,128,64,32]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
REPO = Path(__file__).resolve().parent.parent
QWEN05 = dict(hidden=896, mlp=4864, vocab=151_936, heads=2, head_dim=64)   # Qwen2.5-0.5B's config
PAST = 256


def qwen05_drafters(sizes: list[int], device: str) -> dict:
    """{size (0: whole): a float32 drafter of Qwen2.5-0.5B's shape over that many random tokens},
    random weights, one embedding and head for all."""
    from tailrl.drafter.network import Drafter, DrafterConfig
    torch.manual_seed(0)
    h, v = QWEN05["hidden"], QWEN05["vocab"]
    embed, head = torch.randn(v, h, device=device) * 0.02, torch.randn(v, h, device=device) * 0.02
    out = {}
    for k in [0] + sizes:
        vocab = torch.randperm(v)[:k].sort().values if k else None
        cfg = DrafterConfig(h, QWEN05["mlp"], v, QWEN05["heads"], QWEN05["head_dim"], draft_vocab=k)
        out[k] = Drafter(cfg, embed, head, vocab=vocab)
    return out


def step_costs(sizes: list[int], rounds: int, device: str) -> dict:
    from drafter_step import depth_runner
    drafters = {}
    for k, d in qwen05_drafters(sizes, device).items():
        drafters[(k, "float32")] = d.eval()
        drafters[(k, "bfloat16")] = copy.deepcopy(d).eval().to(torch.bfloat16)
    graphs = None
    if device == "cuda":
        from tailrl.drafter.graphs import DrafterGraphs
        from tailrl.engine.graph_pool import GraphPool, cuda_capture
        graphs = DrafterGraphs(GraphPool(8 << 30, cuda_capture), max_static_bytes=1 << 30)
    runs: dict = {}

    def one(d, rows: int) -> float:
        with torch.inference_mode():
            key = (id(d), rows)
            if key not in runs:
                runs[key] = depth_runner(d, rows, PAST, "graphs" if graphs is not None else "kernels", graphs)
                for _ in range(3):                     # kernels built, graph captured
                    runs[key]()
            run = runs[key]
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                run()
            if device == "cuda":
                torch.cuda.synchronize()
        return (time.perf_counter() - t0) / 10

    keys = [(k, dt, rows) for (k, dt) in drafters for rows in (1, 16)]
    best: dict = {}
    for r in range(rounds):
        for key in (keys if r % 2 == 0 else keys[::-1]):
            s = one(drafters[key[:2]], key[2])
            best[key] = min(best.get(key, s), s)
    out = {}
    for (k, dt, rows), s in best.items():
        whole = best[(0, dt, rows)]
        out[f"{k or 'whole'}/{dt}/{rows}"] = {"ms": round(s * 1e3, 3), "vs_whole": round(whole / s, 2)}
        print(f"draft vocab {k or 'whole':>6}  {dt:8}  {rows:2} rows  {s * 1e3:7.2f} ms  "
              f"{whole / s:5.2f}x faster than the whole vocabulary", flush=True)
    return out


def train_costs(sizes: list[int], rounds: int, device: str) -> dict:
    """One spot-trainer step (``drafter_loss`` with its 3-step unroll over 256 positions, 4
    sequences of 64, then backward) of the same float32 drafters: the loss's soft labels and
    log-probabilities are [positions, head tokens] per unroll step."""
    from tailrl.drafter.network import Drafter
    from tailrl.drafter.train import SequenceBatch, drafter_loss
    drafters = {k: d.train() for k, d in qwen05_drafters(sizes, device).items()}
    h, v = QWEN05["hidden"], QWEN05["vocab"]
    b, t = 4, 64
    batch = SequenceBatch(torch.randn(b, t, h, device=device), torch.randint(0, v, (b, t), device=device),
                          torch.full((b,), t, device=device), torch.zeros(b, dtype=torch.long, device=device))

    def one(d: Drafter) -> float:
        t0 = time.perf_counter()
        loss, _ = drafter_loss(d, batch, 3)
        loss.backward()
        d.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
    for d in drafters.values():                  # kernels built
        one(d)
    best: dict = {}
    keys = list(drafters)
    for r in range(rounds):
        for k in (keys if r % 2 == 0 else keys[::-1]):
            best[k] = min(best.get(k, float("inf")), one(drafters[k]))
    out = {}
    for k, s in best.items():
        out[str(k or "whole")] = {"ms": round(s * 1e3, 1), "vs_whole": round(best[0] / s, 2)}
        print(f"draft vocab {k or 'whole':>6}  a training step (256 positions, unroll 3)  {s * 1e3:7.1f} ms  "
              f"{best[0] / s:5.2f}x faster than the whole vocabulary", flush=True)
    return out


def acceptance(sizes: list[int], train_prompts: int, train_steps: int, seed: int) -> dict:
    from transformers import AutoTokenizer

    from tailrl.cli.train_drafter import sample_responses, task_prompts, warm_start
    from tailrl.drafter.evaluate import chain_acceptance
    from tailrl.drafter.network import Drafter
    from tailrl.drafter.train import teacher_forced
    from tailrl.drafter.vocab import response_tokens
    from tailrl.model.loader import load_model
    from tailrl.tasks import mixture
    model_dir = str(REPO / "models" / "small")
    tok = AutoTokenizer.from_pretrained(model_dir)
    held = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(64)]
    data = teacher_forced(model_dir, sample_responses(model_dir, held, 2, 512, seed + 1))
    target = load_model(model_dir, "float32")
    truth = response_tokens(data)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in sizes:
            d_dir = f"{tmp}/d{k}"
            t0 = time.perf_counter()
            fig = warm_start(model_dir, d_dir, task_prompts(model_dir, train_prompts), n=4, max_tokens=512,
                             steps=train_steps, seed=seed, draft_vocab=k)
            d = Drafter.load(d_dir, target)
            accept, steps = chain_acceptance(d, data, 6)
            cover = float(torch.isin(truth, d.vocab).float().mean()) if d.vocab is not None else 1.0
            out[str(k or "whole")] = {"head_tokens": len(d.head), "coverage": round(cover, 4),
                                      "accept_length": round(accept, 3), "verify_steps": steps,
                                      "train_loss": round(fig["loss"], 4),
                                      "seconds": round(time.perf_counter() - t0, 1)}
            print(f"draft vocab {k or 'whole':>6}: head {len(d.head)} tokens, held-out coverage {cover:.4f}, "
                  f"{accept:.3f} tokens a verify step over {steps}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="32768,8192", help="draft vocabularies timed against the whole one")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--accept", action="store_true", help="also train drafters of small and measure acceptance")
    ap.add_argument("--accept-sizes", default="0,128,64,32")
    ap.add_argument("--train-prompts", type=int, default=128)
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    res = {"device": a.device, "cpus": torch.get_num_threads(), "cost": step_costs(sizes, a.rounds, a.device),
           "train_step": train_costs(sizes, a.rounds, a.device)}
    if a.accept:
        res["acceptance"] = acceptance([int(x) for x in a.accept_sizes.split(",")], a.train_prompts,
                                       a.train_steps, a.seed)
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
