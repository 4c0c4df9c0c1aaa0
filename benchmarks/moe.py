"""A mixture of experts against a dense model of the same active width: what a step costs as its
tokens grow, and what speculation buys on each.

Two random-weight bfloat16 checkpoints of one shape (Qwen3's attention, ``--hidden`` wide,
``--layers`` deep, a 32k vocabulary): a Qwen3-MoE with ``--experts`` experts of width
``--expert-width``, ``--top-k`` a token (Qwen3-30B-A3B's share: 8 of its 128), and a dense
Qwen3 whose MLP is top-k x expert-width wide (the same products per token). A token of the
mixture reads k of its experts; a step of T tokens reads up to min(E, T k) of them, so where the
weights stream from memory (any model larger than the caches; on a GPU, every decode step) its
cost grows with T until every expert is read, while the dense model's stays flat up to the
machine's ridge. Draft tokens are then dearer on the mixture: the speculation policy, which
prices drafts by the step costs it measures, drafts accordingly.

Measured in one process, the two models alternating (ABBA), medians:

- a step of T tokens (T one-token prompts, greedy, ``max_tokens=1``: one forward and its LM
  head) for T = 1 .. 64, its cost relative to T = 1;
- batch-1 greedy decode (tokens/s), tailrl against Hugging Face ``generate`` on the mixture;
- ``--prompts`` prompts x 1, greedy, ``--max-tokens``, plain against the default speculation
  with the first round as history (the drafts are the very tokens: the best case), the speedup
  on each model and identical outputs.

Usage: python benchmarks/moe.py [--hidden 512 --layers 4 --experts 64 --top-k 4 --expert-width 256]
       [--rounds 3] [--prompts 16 --max-tokens 128]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from tailrl import LLM, SamplingParams, SpeculativeConfig  # noqa: E402

VOCAB = 32000


def make(path: str, a: argparse.Namespace, moe: bool) -> str:
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=16,
                  num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False,
                  initializer_range=0.05, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if moe:
        cfg = transformers.Qwen3MoeConfig(intermediate_size=a.top_k * a.expert_width, num_experts=a.experts,
                                          num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_width,
                                          norm_topk_prob=True, **common)
    else:
        cfg = transformers.Qwen3Config(intermediate_size=a.top_k * a.expert_width, **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def step_costs(llms: dict, sizes: list[int], rounds: int) -> dict:
    """Median seconds of a T-token step per model, the models alternating (ABBA) per round."""
    times: dict = {name: {t: [] for t in sizes} for name in llms}
    greedy = SamplingParams(temperature=0, max_tokens=1)
    names = list(llms)
    for r in range(rounds + 1):                                   # round 0 warms up
        for name in (names if r % 2 == 0 else names[::-1]):
            for t in sizes:
                prompts = [[(17 * i + 5 * r + 1) % VOCAB] for i in range(t)]
                t0 = time.perf_counter()
                llms[name].generate(prompts, greedy)
                if r:
                    times[name][t].append(time.perf_counter() - t0)
    return {name: {t: statistics.median(v) for t, v in per.items()} for name, per in times.items()}


def decode_rates(path: str, llm: LLM, tokens: int, rounds: int) -> tuple[float, float]:
    """Batch-1 greedy tokens/s: tailrl's and Hugging Face generate's (alternating)."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompt = [11, 12, 13, 14]
    ours, theirs = [], []
    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for r in range(rounds + 1):
        t0 = time.perf_counter()
        llm.generate([prompt], sp)
        t1 = time.perf_counter()
        with torch.no_grad():
            hf.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                        pad_token_id=0)
        t2 = time.perf_counter()
        if r:
            ours.append(tokens / (t1 - t0))
            theirs.append(tokens / (t2 - t1))
    return statistics.median(ours), statistics.median(theirs)


def speculation(path: str, a: argparse.Namespace) -> dict:
    """Plain vs the default speculation, round 2 of greedy prompts with round 1 as history."""
    prompts = [[(31 * i + j) % VOCAB for j in range(8)] for i in range(a.prompts)]
    sp = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    plain, spec = LLM(path, enable_prefix_caching=False), LLM(path, speculative=SpeculativeConfig(),
                                                                enable_prefix_caching=False)
    ids = [f"p{i}" for i in range(len(prompts))]
    outs, times = {}, {"plain": [], "default": []}
    for r in range(a.rounds + 1):
        for name, llm in (("plain", plain), ("default", spec)) if r % 2 == 0 else (("default", spec), ("plain", plain)):
            t0 = time.perf_counter()
            out = llm.generate(prompts, sp, prompt_ids=ids)         # each call's history: the last call's responses
            if r:
                times[name].append(time.perf_counter() - t0)
            outs[name] = [o.outputs[0].token_ids for o in out]
    m = spec.last_metrics
    p, d = statistics.median(times["plain"]), statistics.median(times["default"])
    return {"plain_s": round(p, 3), "default_s": round(d, 3), "speedup": round(p / d, 3),
            "accept_length": round(m.get("rollout/spec_accept_length", 0.0), 2),
            "identical": outs["plain"] == outs["default"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--expert-width", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    sizes = [1, 2, 4, 8, 16, 32, 64]
    out: dict = {"machine": f"{os.cpu_count()} CPUs", "threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"moe": make(os.path.join(tmp, "moe"), a, True), "dense": make(os.path.join(tmp, "dense"), a, False)}
        llms = {name: LLM(p, enable_prefix_caching=False) for name, p in paths.items()}
        for name, llm in llms.items():
            args = llm.engine.model.args
            out[f"{name}_parameters_m"] = round(args.num_parameters / 1e6, 1)
        costs = step_costs(llms, sizes, a.rounds)
        for name, per in costs.items():
            out[f"{name}_step_ms"] = {t: round(s * 1e3, 2) for t, s in per.items()}
            out[f"{name}_step_vs_1"] = {t: round(s / per[1], 2) for t, s in per.items()}
            print(name, "step ms by tokens:", out[f"{name}_step_ms"], "relative:", out[f"{name}_step_vs_1"],
                  flush=True)
        ours, hf = decode_rates(paths["moe"], llms["moe"], 64, a.rounds)
        out.update(moe_decode_tokens_per_s=round(ours, 1), hf_moe_decode_tokens_per_s=round(hf, 1),
                   moe_decode_vs_hf=round(ours / hf, 2))
        print(f"batch-1 greedy decode on the mixture: tailrl {ours:.1f} tokens/s, HF generate {hf:.1f} "
              f"({ours / hf:.2f}x)", flush=True)
        del llms
        for name, p in paths.items():
            out[f"{name}_speculation"] = r = speculation(p, a)
            print(f"{name}: plain {r['plain_s']} s, default speculation {r['default_s']} s ({r['speedup']}x, "
                  f"{r['accept_length']} accepted a verify, identical {r['identical']})", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
