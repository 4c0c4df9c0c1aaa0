"""tailrl engine vs Hugging Face `generate` on the same random-weight Qwen2 and prompts.

64 prompts x 256 new tokens at temperature 1 (top_k disabled, EOS ignored so both do the same
work), for a ~4M and a ~100M parameter model, plus single-request latency. The engines
alternate and each keeps its best of --repeats runs (fair on a shared machine). Prints a table and
ends with one JSON line:
  {"models": {"4m": {"params_m", "tailrl_tok_s", "hf_tok_s", "speedup", "tailrl_single_tok_s",
   "hf_single_tok_s", "single_speedup"}, "100m": {...}}, "num_prompts", "max_tokens"}
Usage: python benchmarks/engine_vs_hf.py [--prompts 64] [--tokens 256] [--models 4m,100m]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from checkpoints import make_checkpoint  # noqa: E402

from tailrl import LLM, SamplingParams  # noqa: E402

MODELS = {
    "4m": dict(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, tie=True),
    "100m": dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, tie=True),
}


def hf_generate(model, prompts: list[list[int]], max_tokens: int) -> int:
    """Batched, left-padded HF generate; returns generated tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    return (out.shape[1] - width) * len(prompts)


def bench(name: str, n_prompts: int, max_tokens: int, tmp: str, repeats: int = 2, dtype: str = "bfloat16") -> dict:
    import transformers
    cfg = MODELS[name]
    path = make_checkpoint(os.path.join(tmp, name), "qwen2", max_pos=2048, init_std=0.02, **cfg)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    params = sum(p.numel() for p in hf.parameters()) / 1e6
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, cfg["vocab_size"], (int(l),), generator=g).tolist()
               for l in torch.randint(16, 64, (n_prompts,), generator=g)]
    sp = SamplingParams(temperature=1.0, top_k=-1, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(path, seed=0, dtype=dtype)                                   # both engines in one dtype
    llm.generate(prompts[:4], sp.clone(max_tokens=8), use_tqdm=False)          # warm-up
    hf_generate(hf, prompts[:4], 8)
    res = {"params_m": round(params, 1)}
    for label, batch in (("", prompts), ("single_", prompts[:1])):
        # alternate the two engines and keep each one's best of `repeats` runs, so a load change
        # on a shared machine does not favour whichever ran first
        ours = theirs = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            outs = llm.generate(batch, sp, use_tqdm=False)
            n = sum(len(c.token_ids) for o in outs for c in o.outputs)
            ours = max(ours, n / (time.perf_counter() - t))
            t = time.perf_counter()
            with torch.inference_mode():
                n = hf_generate(hf, batch, max_tokens)
            theirs = max(theirs, n / (time.perf_counter() - t))
        res[f"tailrl_{label}tok_s"] = round(ours, 1)
        res[f"hf_{label}tok_s"] = round(theirs, 1)
        res[f"{label}speedup"] = round(ours / theirs, 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--models", default="4m,100m")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per engine; the best counts")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="of both engines")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models.split(","):
            results[name] = bench(name, a.prompts, a.tokens, tmp, a.repeats, a.dtype)
            r = results[name]
            print(f"{name:>5} ({r['params_m']}M): batch {a.prompts}x{a.tokens}: tailrl {r['tailrl_tok_s']:.0f} tok/s, "
                  f"HF {r['hf_tok_s']:.0f} tok/s, {r['speedup']:.2f}x | single request: tailrl "
                  f"{r['tailrl_single_tok_s']:.0f} tok/s, HF {r['hf_single_tok_s']:.0f} tok/s, "
                  f"{r['single_speedup']:.2f}x", flush=True)
    print(json.dumps({"models": results, "num_prompts": a.prompts, "max_tokens": a.tokens, "dtype": a.dtype}))


if __name__ == "__main__":
    main()
