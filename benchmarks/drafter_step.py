"""One depth of the learned drafter's chains: on the engine's kernels over its K/V blocks, against
the padded eager step it replaced.

A depth is what a chain call pays per token it drafts: one drafter position per row over a
committed past of ``--past`` positions, then the most likely token and its probability.
- ``padded``: ``Drafter.step`` over every row's past copied into padded tensors (what chains
  ran before; trees still do), about seventy PyTorch operations (the copy, made once per call,
  is not counted);
- ``kernels``: ``paged.paged_step`` (the engine's kernel set, K/V read in place from the
  blocks through block tables), launched;
- ``graphs`` (``--device cuda`` only): the same depth replayed from its CUDA graph
  (``DrafterGraphs``), as a GPU engine runs it.
Drafters: ``small``'s (random weights over ``models/small``) and one of Qwen2.5-0.5B's exact
shape with a 32,768-token draft vocabulary (random weights: the cost does not depend on
them), in float32 and bfloat16, at 1, 8 and 64 rows. The settings run in turn, every other
round in reverse order (the machine's speed drifts); best of ``--rounds``; on a GPU every
timing is synchronised. Prints per setting the time of a depth and padded / kernels.

Usage: python benchmarks/drafter_step.py [--rounds 5] [--device cuda] [--past 256]
The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
QWEN05 = dict(hidden=896, mlp=4864, vocab=151_936, heads=2, head_dim=64, draft_vocab=32_768)


def drafters(device: str) -> dict:
    """{(name, dtype): drafter}."""
    from tailrl.drafter.network import Drafter, DrafterConfig
    from tailrl.model.loader import load_model
    torch.manual_seed(0)
    small = Drafter.for_target(load_model(str(REPO / "models" / "small"), "float32", device))
    h, v, k = QWEN05["hidden"], QWEN05["vocab"], QWEN05["draft_vocab"]
    embed, head = torch.randn(v, h, device=device) * 0.02, torch.randn(v, h, device=device) * 0.02
    cfg = DrafterConfig(h, QWEN05["mlp"], v, QWEN05["heads"], QWEN05["head_dim"], draft_vocab=k)
    qwen = Drafter(cfg, embed, head, vocab=torch.randperm(v)[:k].sort().values)
    out = {}
    for name, d in (("small", small), ("qwen0.5b/32k", qwen)):
        out[(name, "float32")] = d.eval()
        out[(name, "bfloat16")] = copy.deepcopy(d).eval().to(torch.bfloat16)
    return out


def depth_runner(d, rows: int, past: int, mode: str, graphs=None):
    """A function that runs one chain depth of ``rows`` rows over ``past`` committed positions
    each (random K/V) as ``mode`` says ("padded", "kernels" or "graphs")."""
    from tailrl.drafter.blocks import KVBlocks
    from tailrl.drafter.paged import ChainLayout, kernels_for, paged_step, rope_tables
    c, dt, dev = d.cfg, d.fc.weight.dtype, d.fc.weight.device
    feats = torch.randn(rows, c.hidden_size, dtype=dt, device=dev)
    toks = torch.randint(0, c.vocab_size, (rows,), device=dev)
    if mode == "padded":
        kv = (torch.randn(rows, c.num_heads, c.head_dim, past, dtype=dt, device=dev),
              torch.randn(rows, c.num_heads, past, c.head_dim, dtype=dt, device=dev),
              torch.zeros(rows, past, dtype=dt, device=dev))
        pos = torch.full((rows,), past, device=dev)

        def padded():        # the depth alone: the padded copy was made once per call, not timed here
            _, logits, _, _ = d.step(feats, toks, pos, kv, None, None, 4096)
            return d.token_ids(torch.softmax(logits.float(), -1).max(-1)[1])
        return padded
    blocks = KVBlocks(c.num_heads, c.head_dim, dt, dev)
    lists = []
    for _ in range(rows):
        ids: list[int] = []
        blocks.write(ids, 0, torch.randn(past, c.num_heads, c.head_dim, device=dev),
                     torch.randn(past, c.num_heads, c.head_dim, device=dev))
        blocks.reserve(ids, past + 1)
        lists.append(ids)
    layout = ChainLayout.build(blocks, lists, [past] * rows, [past] * rows, 1)
    kernels, tables = kernels_for(d), rope_tables(d, past + 1, dt)

    def launched():
        out, logits = paged_step(d, kernels, feats, toks, kernels.rope(tables, layout.positions[0]), blocks,
                                 layout.meta(0))
        return d.token_ids(torch.softmax(logits.float(), -1).max(-1)[1])

    def replayed():
        return graphs.depth(d, kernels, tables, blocks, layout, 0, feats, toks)
    return launched if mode == "kernels" else replayed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--past", type=int, default=256)
    a = ap.parse_args()
    graphs = None
    modes = ["padded", "kernels"]
    if a.device == "cuda":
        from tailrl.drafter.graphs import DrafterGraphs
        from tailrl.engine.graph_pool import GraphPool, cuda_capture
        graphs = DrafterGraphs(GraphPool(8 << 30, cuda_capture), max_static_bytes=1 << 30)
        modes.append("graphs")
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    runs = {}
    with torch.inference_mode():
        for (name, dt), d in drafters(a.device).items():
            for rows in (1, 8, 64):
                for mode in modes:
                    fn = runs[(name, dt, rows, mode)] = depth_runner(d, rows, a.past, mode, graphs)
                    for _ in range(3):                     # kernels built, graph captured
                        fn()
        keys = list(runs)
        best: dict = {}
        for r in range(a.rounds):
            for key in (keys if r % 2 == 0 else keys[::-1]):
                sync()
                t0 = time.perf_counter()
                for _ in range(10):
                    runs[key]()
                sync()
                s = (time.perf_counter() - t0) / 10
                best[key] = min(best.get(key, s), s)
    out = {}
    for (name, dt, rows, mode), s in best.items():
        base = best[(name, dt, rows, "padded")]
        out[f"{name}/{dt}/{rows}/{mode}"] = {"ms": round(s * 1e3, 4), "vs_padded": round(base / s, 2)}
        print(f"{name:13s} {dt:8s} {rows:3d} rows  {mode:8s} {s * 1e3:8.3f} ms  padded / this {base / s:5.2f}x",
              flush=True)
    print(json.dumps({"device": a.device, "threads": torch.get_num_threads(), "past": a.past, "depth": out}))


if __name__ == "__main__":
    main()
