"""Qwen3.5's hybrid (three Gated DeltaNet layers of four, model/deltanet.py) against an all-attention
model of the same width on this CPU (or ``--device cuda``: Qwen3.5's Triton kernels, eager steps,
against the attention model's CUDA graphs): a rollout's decode throughput, and what speculation
gives each.

Two random-weight checkpoints made here (bfloat16, one invocation): Qwen3.5's shape and Qwen3's with
the same hidden size, layers, attention heads and MLP (every layer attention). Per model, ``--prompts``
prompts of ``--context`` tokens, ``--n`` samples each, ``--max-tokens`` new tokens at T=1: plain
decoding, then speculation (the default policy) whose history is the plain round's (seeded alike:
the drafts are the responses themselves, so acceptance is an upper bound, the mechanism's cost and
gain at best). Neither engine caches prefixes (Qwen3.5's can not; the rounds repeat their prompts,
an RL step's prompts are new). Rounds alternate models and modes (ABBA), medians of ``--rounds``; tokens and
log-probabilities of speculation are checked equal to plain's.

Usage: python benchmarks/deltanet.py [--hidden 1024] [--layers 8] [--context 128] [--prompts 4] [--n 2]
                                    [--max-tokens 128]
The last line is one JSON object: {"shape", "models": {"qwen3_5" | "qwen3": {"plain_s", "spec_s",
"speedup", "accept_length" (tokens a verify step emits), "identical", "graph_share" (the share of each
engine's steps replayed from CUDA graphs: {"plain", "spec"})}}, "hybrid_vs_attention_plain"}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch


def make(path: str, kind: str, a) -> str:
    import transformers
    common = dict(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=3 * a.hidden, num_hidden_layers=a.layers,
                  num_attention_heads=a.hidden // 128, num_key_value_heads=2, head_dim=256,
                  max_position_embeddings=4096, tie_word_embeddings=True, initializer_range=0.02,
                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if kind == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(**common, linear_num_key_heads=a.hidden // 128,
                                             linear_num_value_heads=a.hidden // 128, linear_key_head_dim=128,
                                             linear_value_head_dim=128)
    else:
        cfg = transformers.Qwen3Config(**common, attention_bias=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--n", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    a = ap.parse_args()
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    tmp = tempfile.mkdtemp()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, a.vocab, (a.context,), generator=g).tolist() for _ in range(a.prompts)]
    sp = SamplingParams(n=a.n, temperature=1.0, max_tokens=a.max_tokens, ignore_eos=True, seed=7)
    engines, want = {}, {}
    for kind in ("qwen3_5", "qwen3"):
        path = make(os.path.join(tmp, kind), kind, a)
        # no prefix caching (Qwen3.5 has none): the rounds repeat their prompts, an RL step's do not
        kw = dict(enable_prefix_caching=False, device=a.device,
                  **(dict(kv_cache_gib=1.0) if a.device != "cpu" else {}))    # four engines share a GPU
        plain = LLM(path, **kw)
        spec = LLM(path, speculative=SpeculativeConfig(), **kw)
        want[kind] = plain.generate(prompts, sp)
        spec.generate(prompts, sp)                          # its history: the same responses
        engines[kind] = {"plain": plain, "spec": spec}
    times = {k: {"plain": [], "spec": []} for k in engines}
    out = {"shape": vars(a), "models": {}}
    identical = {k: True for k in engines}
    accepted, replayed = {}, {k: {} for k in engines}
    for r in range(a.rounds):
        order = [(k, m) for k in engines for m in ("plain", "spec")]
        for kind, mode in (order if r % 2 == 0 else order[::-1]):
            llm = engines[kind][mode]
            t = time.perf_counter()
            got = llm.generate(prompts, sp)
            times[kind][mode].append(time.perf_counter() - t)
            m = llm.last_metrics                    # the share of steps replayed from CUDA graphs (0 on a CPU)
            replayed[kind][mode] = round(m.get("graphs/replayed_steps", 0) / max(m["rollout/num_forward"], 1), 2)
            if mode == "spec":
                accepted[kind] = llm.last_metrics["rollout/spec_accept_length"]
                identical[kind] &= all((x.token_ids, x.logprobs) == (y.token_ids, y.logprobs)
                                       for o, w in zip(got, want[kind]) for x, y in zip(o.outputs, w.outputs))
    for kind in engines:
        p, s = statistics.median(times[kind]["plain"]), statistics.median(times[kind]["spec"])
        out["models"][kind] = {"plain_s": round(p, 3), "spec_s": round(s, 3), "speedup": round(p / s, 2),
                               "accept_length": round(accepted[kind], 2), "identical": identical[kind],
                               "graph_share": replayed[kind]}
        print(kind, out["models"][kind], flush=True)
    out["hybrid_vs_attention_plain"] = round(out["models"]["qwen3_5"]["plain_s"] / out["models"]["qwen3"]["plain_s"],
                                             2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
