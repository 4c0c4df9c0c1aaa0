"""What DeepSeek-V3's latent attention costs a step in its absorbed form (model/mla.py: the pool
keeps the latent, one K/V head of kv_lora + rope dimensions that every query head reads) against
the expanded form (every head's key and value in the pool, the value zero-padded to the key's
width, as this project computed it first; defined here as the baseline), one attention layer
with its projections, at Moonlight-16B-A3B's shapes (hidden 2,048, 16 heads, a latent of 512,
heads of 128 + 64 key dimensions and 128 value ones), random weights, bfloat16, through this
device's kernels: decode steps of ``--rows`` rows at ``--contexts`` positions (blocks shuffled),
the two forms in alternating rounds (ABBA), medians of ``--rounds`` (each reading its own pool of
random K/V: the arithmetic and bytes of a step, not its values; tests/engine/test_hf_parity.py
checks the values). Also each form's K/V bytes a token and layer.

Usage: python benchmarks/mla.py [--rows 1,16,64] [--contexts 1024,4096] [--rounds 6]
The last line is one JSON object: {"device", "kernels", "kv_bytes", "shapes": {"rows x context":
{"latent_us", "expanded_us", "ratio"}}} (ratio: latent / expanded).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from attention_steps import chain_step, device_names

from tailrl.kernels import RopeTables, select
from tailrl.model.args import parse_config
from tailrl.model.mla import LatentAttention
from tailrl.model.rope import head_order, rope_table

MOONLIGHT = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 2048, "intermediate_size": 11264,
             "num_hidden_layers": 1, "num_attention_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
             "n_routed_experts": 64, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}


def expanded(m: LatentAttention, x, kernels, rope, k_cache, v_cache, meta, dims):
    """The baseline: every head's [key nope | rotary key] and zero-padded value through the pool."""
    a = m.a
    _, kv_lora, nope, rot, v = a.mla
    n, heads = x.shape[0], a.num_heads
    q = kernels.linear(x, m.q.weight).view(n, heads, nope + rot)
    latent = kernels.linear(x, m.kv_a.weight)
    c = kernels.rms_norm(latent[:, :kv_lora].contiguous(), m.kv_a_norm, a.rms_norm_eps)
    kv = kernels.linear(c, m.kv_b.weight).view(n, heads, nope + v)
    k = torch.cat([kv[:, :, :nope], latent[:, None, kv_lora:].expand(n, heads, rot)], dim=2)
    values = torch.cat([kv[:, :, nope:], kv.new_zeros(n, heads, nope + rot - v)], dim=2)
    qkv = torch.cat([q[:, :, dims].reshape(n, -1), k[:, :, dims].reshape(n, -1), values.reshape(n, -1)], dim=1)
    out = kernels.rope_attend(qkv, rope, k_cache, v_cache, meta, heads)
    return kernels.linear(out.view(n, heads, nope + rot)[:, :, :v].reshape(n, heads * v), m.o.weight)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--calls", type=int, default=5, help="calls timed together per round")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = parse_config(MOONLIGHT)
    _, kv_lora, nope, rot, v = a.mla
    heads, wide = a.num_heads, nope + rot
    torch.manual_seed(0)
    m = LatentAttention(a).to(device=device, dtype=torch.bfloat16)
    kernels = select(torch.device(device), torch.bfloat16)
    contexts = [int(c) for c in args.contexts.split(",")]
    ours = [int(i) for i in [*range(nope, wide), *range(nope)]]                  # the baseline's [rope | nope]
    order = head_order(wide, rot, a.rope_interleaved)
    dims = torch.tensor(ours if order is None else [ours[i] for i in order.tolist()], device=device)

    def tables(dim):
        cos, sin = rope_table(dim, max(contexts) + 8, a.rope_theta, torch.float32, rotary_dim=rot)
        return RopeTables(cos.to(device, torch.bfloat16), sin.to(device, torch.bfloat16), cos.to(device),
                          sin.to(device))
    t_latent, t_wide = tables(a.head_dim), tables(wide)
    out = {**device_names(), "kv_bytes": {"latent": 2 * 2 * a.head_dim, "expanded": 2 * 2 * heads * wide},
           "shapes": {}}
    for rows in map(int, args.rows.split(",")):
        for context in contexts:
            _, pos, kl, vl, meta = chain_step(rows, context, 1, device, heads, 1, a.head_dim)
            _, _, kw, vw, _ = chain_step(rows, context, 1, device, heads, heads, wide)
            x = torch.randn(rows, a.hidden_size, device=device).to(torch.bfloat16)
            rl, rw = kernels.rope(t_latent, pos), kernels.rope(t_wide, pos)
            forms = {"latent": lambda: m(x, kernels, rl, kl, vl, meta),
                     "expanded": lambda: expanded(m, x, kernels, rw, kw, vw, meta, dims)}
            with torch.inference_mode():
                med = abba(forms, args.calls, args.rounds, device)
            name = f"{rows}x{context}"
            out["shapes"][name] = {"latent_us": round(med["latent"], 1), "expanded_us": round(med["expanded"], 1),
                                   "ratio": round(med["latent"] / med["expanded"], 3)}
            print(name, out["shapes"][name], flush=True)
    print(json.dumps(out))


def abba(forms: dict, calls: int, rounds: int, device: str) -> dict[str, float]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def timed(f) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        sync()
        return (time.perf_counter() - t0) / calls * 1e6
    times = {k: [] for k in forms}
    for f in forms.values():
        timed(f)
    names = list(forms)
    for i in range(rounds):
        for k in (names if i % 2 == 0 else names[::-1]):
            times[k].append(timed(forms[k]))
    return {k: statistics.median(t) for k, t in times.items()}


if __name__ == "__main__":
    main()
