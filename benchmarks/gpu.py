"""tailrl on a GPU, one command, one invocation: the figures of the GPU engine in one JSON line.

Sets up what it needs: the 0.5b stand-in of `small` (`small`'s tokens at Qwen2.5-0.5B's cost,
built into ``--standin-dir`` on first use; ``--model`` takes another stand-in, preset or
checkpoint directory). Then, on ``--device``:

1. The weight-read floor: a device-to-device copy's bandwidth (bytes read + written) and the
   model's weight bytes give the batch-1 decode bound, tokens/s = bandwidth / weight bytes.
2. Batch-1 greedy decode: one prompt, ``--decode-tokens`` new tokens (EOS ignored), after a
   warm-up call: tokens/s, with the decode steps replayed from CUDA graphs (the default on a
   GPU) and without (``cuda_graphs=False``: every kernel launched from Python).
3. The rollout: ``--prompts`` held-out task prompts x ``--n``, T=1, ``--max-tokens``; round 1
   (the history) then the timed round 2, for tailrl plain and tailrl default speculation
   (each its own engine), and Hugging Face ``generate`` on the same model (bf16, sampling at
   T=1 without top-k, the batch padded on the left). Per setting: the makespan; tailrl's
   responses compared with each other (the identical share: 1.0 means speculation changed no
   token).
4. The no-tail bound T* = max(total tokens / saturated tokens/s, longest response x batch-1
   step time): saturated throughput from the plain engine on ``--bound-rows`` rows of
   ``--bound-tokens`` tokens each, EOS ignored; each makespan's ratio to T*.
5. Peak device memory (``torch.cuda.max_memory_allocated``); per timed rollout, the CUDA graph
   pool (the share of steps replayed, captures, the pool's bytes against its budget) and the
   speculator's host time per step (``timing_s/draft`` + ``timing_s/observe``) beside the step.
6. ``tailrl train configs/demo.yaml --set device=...`` for ``--train-steps`` steps (0: skipped):
   seconds per GRPO step (median), its rollout and update shares.
7. On a GPU, the batch-invariant matmul's cost: one forward's matmuls (per layer qkv, o,
   gate/up, down; the LM head) at M = 1, 64 and 512 rows, replayed from a CUDA graph, through
   the Triton kernel and through ``F.linear`` (cuBLAS), bfloat16, best of ``--matmul-reps``;
   the ratio invariant / stock (#34 asks <= 1.15 for the whole step).

The last line is one JSON object: {"device", "model", "weights_gb", "copy_tb_s", "floor_tok_s",
"decode_b1_tok_s", "decode_b1_over_floor", "decode_b1_eager_tok_s", "rollout": {"tokens",
"plain_s", "default_s", "hf_s", "default_speedup", "plain_over_hf", "identical_share",
"accept_length", "bound_s", "plain_over_bound", "default_over_bound", "steps": {"plain",
"default": {"steps", "step_ms", "spec_host_ms", "graph_share", "graph_captures", "graph_mb",
"graph_budget_mb"}}}, "saturated_tok_s", "train": {"steps", "step_s", "rollout_s", "update_s"},
"matmul": {M: {"stock_ms", "invariant_ms", "ratio"}}, "peak_mem_gb", "seconds"}.

Usage (on the GPU machine; ``python3 setup.py build_ext --inplace`` first builds the CPU parts,
which the GPU path does not need):
  python benchmarks/gpu.py [--model 0.5b] [--prompts 64 --n 8 --max-tokens 512]
A smoke test of the script on a CPU: python benchmarks/gpu.py --device cpu --quick
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from regime import model_dir  # noqa: E402

from tailrl import LLM, SamplingParams, SpeculativeConfig  # noqa: E402
from tailrl.model.loader import read_args  # noqa: E402
from tailrl.tasks import mixture  # noqa: E402

HISTORY_SEED, TIMED_SEED = 10_000, 20_000


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str, mb: int = 256, reps: int = 10) -> float:
    """Bytes read + written per second by a device-to-device copy."""
    x = torch.empty(mb << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * reps / (time.perf_counter() - t0)


def rollout(llm: LLM, prompts: list[list[int]], a: argparse.Namespace, seed: int) -> tuple[list, float]:
    params = [SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, seed=seed + i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params, prompt_ids=[f"p{i}" for i in range(len(prompts))])
    return [[list(c.token_ids) for c in o.outputs] for o in outs], llm.last_metrics["timing_s/gen"]


def hf_rollout(mdir: str, prompts: list[list[int]], a: argparse.Namespace, eos: tuple[int, ...]) -> tuple[float, int]:
    """Hugging Face generate on the same device: (seconds, useful tokens) of one rollout."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.bfloat16).to(a.device).eval()
    rows = [p for p in prompts for _ in range(a.n)]
    width = max(map(len, rows))
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=a.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=a.device)
    kw = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
              max_new_tokens=a.max_tokens, pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids[:2], **{**kw, "attention_mask": mask[:2], "max_new_tokens": 8})      # warm-up
        sync(a.device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        sync(a.device)
        seconds = time.perf_counter() - t0
    useful = 0
    for row in out[:, width:].tolist():
        n = len(row)
        for i, t in enumerate(row):
            if t in eos:
                n = i + 1
                break
        useful += n
    del model
    return seconds, useful


def matmul_cost(args, a: argparse.Namespace) -> dict:
    """One forward's matmuls (``args``' shapes, bfloat16, each layer its own weights) at M = 1,
    64, 512, replayed from a CUDA graph as the engine's steps are: milliseconds through
    ``F.linear`` (cuBLAS) and through the batch-invariant Triton kernel, best of ``--matmul-reps``.
    A failed capture is reported, not raised."""
    import torch.nn.functional as F

    from tailrl.engine.graph_pool import cuda_capture
    from tailrl.kernels.gpu import matmul
    h, q, kv = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    shapes = [(q + 2 * kv, h), (h, q), (2 * args.intermediate_size, h), (h, args.intermediate_size)]
    layers = [[torch.randn(n, k, dtype=torch.bfloat16, device=a.device) for n, k in shapes]
              for _ in range(args.num_layers)]
    head = torch.randn(args.vocab_size, h, dtype=torch.bfloat16, device=a.device)
    out: dict = {}
    for m in (1, 64, 512):
        xs = {k: torch.randn(m, k, dtype=torch.bfloat16, device=a.device) for k in {k for _, k in shapes}}

        def forward(linear) -> float:
            def fn() -> torch.Tensor:
                for weights in layers:
                    for w in weights:
                        linear(xs[w.shape[1]], w)
                return linear(xs[h], head)
            replay, _ = cuda_capture(fn)
            best = float("inf")
            for _ in range(a.matmul_reps):
                sync(a.device)
                t = time.perf_counter()
                replay()
                sync(a.device)
                best = min(best, time.perf_counter() - t)
            return best * 1e3
        try:
            stock, inv = forward(F.linear), forward(matmul.linear)
        except Exception as exc:                      # the capture or a kernel failed: say so, go on
            out[m] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        out[m] = {"stock_ms": round(stock, 3), "invariant_ms": round(inv, 3), "ratio": round(inv / stock, 3)}
    return out


def train_steps(a: argparse.Namespace) -> dict:
    """``--train-steps`` GRPO steps of the demo config on ``--device``: median seconds per step,
    per rollout and per update."""
    import statistics
    import tempfile

    from tailrl.rl.config import load_config
    from tailrl.rl.trainer import Trainer
    with tempfile.TemporaryDirectory() as tmp:
        over = [f"device={a.device}", f"total_steps={a.train_steps}", f"output_dir={tmp}", "progress=false",
                "log_tensorboard=false", "checkpoint_every=0"] + (["max_tokens=32"] if a.quick else [])
        rows = Trainer(load_config(HERE.parent / "configs" / "demo.yaml", over)).train(log_fn=lambda line: None)
    med = lambda key: round(statistics.median(r[key] for r in rows), 3)   # noqa: E731
    return {"steps": len(rows), "step_s": med("timing_s/step"), "rollout_s": med("timing_s/gen"),
            "update_s": med("timing_s/update")}


def step_figures(m: dict) -> dict:
    """A rollout's steps: count, wall ms per step, the speculator's host ms per step, and the
    CUDA graphs (share of steps replayed, captures, pool MB, budget MB) where there are any."""
    steps = max(m["rollout/num_forward"], 1)
    out = {"steps": int(steps), "step_ms": round(m["timing_s/gen"] / steps * 1e3, 3),
           "spec_host_ms": round((m["timing_s/draft"] + m["timing_s/observe"]) / steps * 1e3, 3)}
    if "graphs/replayed_steps" in m:
        out.update(graph_share=round(m["graphs/replayed_steps"] / steps, 3), graph_captures=m["graphs/captures"],
                   graph_mb=round(m["graphs/peak_bytes"] / 2**20, 1),
                   graph_budget_mb=round(m["graphs/budget_bytes"] / 2**20, 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="0.5b")
    ap.add_argument("--standin-dir", default="/tmp/tailrl-standins")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--bound-rows", type=int, default=512)
    ap.add_argument("--bound-tokens", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="skip Hugging Face generate")
    ap.add_argument("--train-steps", type=int, default=3, help="GRPO steps of configs/demo.yaml (0: skip)")
    ap.add_argument("--matmul-reps", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="4 prompts x 2, max 32: checks the script in a minute")
    a = ap.parse_args()
    if a.quick:
        a.prompts, a.n, a.max_tokens, a.decode_tokens, a.bound_rows, a.bound_tokens = 4, 2, 32, 16, 8, 16
        a.train_steps = min(a.train_steps, 1)
    t_start = time.perf_counter()
    mdir = model_dir(a.model, Path(a.standin_dir))
    args = read_args(mdir)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(mdir)
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(a.prompts)]
    out: dict = {"device": torch.cuda.get_device_name() if torch.device(a.device).type == "cuda" else a.device,
                 "model": a.model}
    if torch.device(a.device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    # 1-2. the floor and batch-1 decode
    weights = args.num_parameters * 2
    bw = copy_bandwidth(a.device)
    out.update(weights_gb=round(weights / 1e9, 3), copy_tb_s=round(bw / 1e12, 3),
               floor_tok_s=round(bw / weights, 1))    # a decode step reads the weights once (at copy speed)
    plain = LLM(mdir, device=a.device, seed=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=a.decode_tokens, ignore_eos=True)
    plain.generate([prompts[0]], greedy)
    plain.generate([prompts[0]], greedy)
    step_s = plain.last_metrics["timing_s/gen"] / a.decode_tokens
    eager = LLM(mdir, device=a.device, seed=0, cuda_graphs=False)
    eager.generate([prompts[0]], greedy)
    eager.generate([prompts[0]], greedy)
    eager_s = eager.last_metrics["timing_s/gen"] / a.decode_tokens
    del eager
    out.update(decode_b1_tok_s=round(1 / step_s, 1), decode_b1_over_floor=round(1 / step_s / (bw / weights), 3),
               decode_b1_eager_tok_s=round(1 / eager_s, 1))
    print(f"batch-1 decode {1 / step_s:.0f} tokens/s ({1 / eager_s:.0f} without CUDA graphs); weight-read floor "
          f"{bw / weights:.0f} tokens/s ({weights / 1e9:.2f} GB of weights, copy {bw / 1e12:.2f} TB/s)", flush=True)

    # 3. the rollout
    rollout(plain, prompts, a, HISTORY_SEED)
    plain_out, plain_s = rollout(plain, prompts, a, TIMED_SEED)
    steps = {"plain": step_figures(plain.last_metrics)}
    spec = LLM(mdir, device=a.device, seed=0, speculative=SpeculativeConfig())
    rollout(spec, prompts, a, HISTORY_SEED)
    spec_out, spec_s = rollout(spec, prompts, a, TIMED_SEED)
    accept = spec.last_metrics.get("rollout/spec_accept_length", 0.0)
    steps["default"] = step_figures(spec.last_metrics)
    pairs = [(x, y) for xs, ys in zip(plain_out, spec_out) for x, y in zip(xs, ys)]
    lengths = [len(x) for x, _ in pairs]
    roll = {"tokens": sum(lengths), "plain_s": round(plain_s, 3), "default_s": round(spec_s, 3),
            "default_speedup": round(plain_s / spec_s, 3),
            "identical_share": sum(x == y for x, y in pairs) / len(pairs), "accept_length": round(accept, 2),
            "steps": steps}
    print(f"rollout: plain {plain_s:.2f} s, default {spec_s:.2f} s ({plain_s / spec_s:.2f}x), identical "
          f"{roll['identical_share']:.3f}, {sum(lengths)} tokens; steps {json.dumps(steps)}", flush=True)
    del spec

    # 4. the no-tail bound
    rows = max(1, a.bound_rows // a.n)
    fill = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.bound_tokens, ignore_eos=True, seed=1)
    plain.generate([prompts[i % len(prompts)] for i in range(rows)], fill)
    saturated = plain.last_metrics["perf/tokens_per_s"]
    bound = max(sum(lengths) / saturated, max(lengths) * step_s)
    roll.update(bound_s=round(bound, 3), plain_over_bound=round(plain_s / bound, 3),
                default_over_bound=round(spec_s / bound, 3))
    out["saturated_tok_s"] = round(saturated, 1)
    del plain

    if not a.no_hf:
        hf_s, hf_tokens = hf_rollout(mdir, prompts, a, args.eos_token_ids)
        roll.update(hf_s=round(hf_s, 3), hf_tokens=hf_tokens, plain_over_hf=round(plain_s / hf_s, 3))
        print(f"Hugging Face generate: {hf_s:.2f} s ({hf_tokens} useful tokens)", flush=True)
    out["rollout"] = roll
    if torch.device(a.device).type == "cuda":
        out["matmul"] = matmul_cost(args, a)
        print(f"invariant matmul / cuBLAS per forward: {out['matmul']}", flush=True)
    if a.train_steps > 0:
        out["train"] = train_steps(a)
        print(f"tailrl train configs/demo.yaml on {a.device}: {out['train']}", flush=True)
    if torch.device(a.device).type == "cuda":
        out["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    out["seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
