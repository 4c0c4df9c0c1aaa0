"""Rollouts through verl 0.9.1's own path (LLMServerManager + AgentLoopManager, single-turn agent
loop, rollout.name=tailrl) on the demo's workload: the `small` model (or ``--model``, e.g. a
stand-in at a bigger model's cost: docs/standins.md), 16 task prompts, 4 prompts x
8 samples per step, at most 320 tokens, temperature 1, ``--steps`` steps (two epochs by default:
history drafts from step 5 on).

After one untimed step each, four rollouts of the same prompts, step by step, alternating
their order (ABBA) in one invocation: verl with tailrl's speculation (the demo's: history +
group + self suffix drafts, 6 per step), verl with tailrl plain, and ``LLM.generate`` in this
process with the same speculation and plain (what ``tailrl train`` runs: the cost of verl's
path). Every step's responses through verl are checked equal between speculation and plain
(sorted per prompt). Also printed: verl's own cost of a step (the same 32 samples with 1-token
responses: agent loop, chat template, routing, padding) and the makespan's ratio to the no-tail
bound (the step's generated tokens / the best full-batch decode throughput, measured here with
32 sequences of 64 tokens).
Ends with one line of JSON.

    pip install -e '.[verl]'
    python benchmarks/verl_rollout.py [--steps 8] [--max-tokens 320] [--model DIR] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from itertools import islice

SPEC = "{method:suffix,sources:[history,group,self],policy:fixed,max_draft_tokens:6}"
SPEC_DICT = {"method": "suffix", "sources": ["history", "group", "self"], "policy": "fixed", "max_draft_tokens": 6}


def config(model: str, max_tokens: int, speculative: bool, threads: int | None):
    from tailrl.integrations.verl.config import compose
    from tailrl.integrations.verl.tasks import PLAIN_TEMPLATE
    fixed = [f"+actor_rollout_ref.rollout.engine_kwargs.tailrl.num_threads={threads}"] if threads else []
    return compose(model, f"actor_rollout_ref.model.custom_chat_template='{PLAIN_TEMPLATE}'", *fixed, n=8,
                   response_length=max_tokens, speculative=SPEC if speculative else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--model", default="small",
                    help="a preset or a checkpoint directory (a stand-in: small's tokens at a bigger model's cost)")
    ap.add_argument("--threads", type=int, default=None,
                    help="fixed engine threads in verl's servers (default: tailrl's governor)")
    a = ap.parse_args()
    import ray
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerManager

    from tailrl import LLM, SamplingParams
    from tailrl.integrations.verl.config import chat_batch
    from tailrl.serve.samples import prompt_seed
    from tailrl.tasks.mixture import training_examples
    from tailrl.tasks.models import get_model

    model = a.model if os.path.isdir(a.model) else get_model(a.model)
    prompts = [ex.prompt for ex in islice(training_examples(), 16)]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    loops = {}
    for rank, (name, spec) in enumerate((("verl+tailrl spec", True), ("verl+tailrl plain", False))):
        cfg = config(model, a.max_tokens, spec, a.threads)
        servers = LLMServerManager.create(cfg, start_rank=rank)          # replica ranks name the actors
        loops[name] = AgentLoopManager.create(cfg, servers.get_client())
    direct = {"LLM.generate spec": LLM(model, speculative=SPEC_DICT, seed=42, max_model_len=64 + a.max_tokens),
              "LLM.generate plain": LLM(model, seed=42, max_model_len=64 + a.max_tokens)}
    tok = direct["LLM.generate spec"].tokenizer

    def verl_step(name: str, batch: list[str]):
        out = loops[name].generate_sequences(chat_batch([[{"role": "user", "content": p}] for p in batch], 8))
        resp, mask = out.batch["responses"], out.batch["response_mask"]
        groups: dict[int, list] = {}
        for i in range(len(resp)):
            groups.setdefault(i // 8, []).append(tuple(resp[i, :int(mask[i].sum())].tolist()))
        return [sorted(g) for _, g in sorted(groups.items())], int(mask.sum())

    def direct_step(name: str, batch: list[str], step: int):
        ids = [tok.encode(p, add_special_tokens=False) for p in batch]
        outs = direct[name].generate(ids, [SamplingParams(n=8, temperature=1.0, max_tokens=a.max_tokens,
                                                    seed=prompt_seed(step, i)) for i in ids], use_tqdm=False)
        return None, sum(len(c.token_ids) for o in outs for c in o.outputs)

    names = list(loops) + list(direct)
    warm = [ex.prompt for ex in islice(training_examples(1000), 4)]     # first calls compile and calibrate
    for n in names:
        direct_step(n, warm, -1) if n in direct else verl_step(n, warm)
    times: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {n: [] for n in names}
    identical = True
    for step in range(a.steps):
        batch = prompts[(4 * step) % 16:(4 * step) % 16 + 4]
        order = names if step % 2 == 0 else names[::-1]
        got = {}
        for n in order:
            t = time.perf_counter()
            got[n], count = direct_step(n, batch, step) if n in direct else verl_step(n, batch)
            times[n].append(time.perf_counter() - t)
            tokens[n].append(count)
        identical &= got["verl+tailrl spec"] == got["verl+tailrl plain"]
        print(f"step {step + 1}: " + ", ".join(f"{n} {times[n][-1]:.2f} s" for n in names), flush=True)

    # verl's own cost of a step: the same 32 samples with 1-token responses (no decoding to speak of)
    one = config(model, 1, False, a.threads)
    servers = LLMServerManager.create(one, start_rank=2)
    one_loop = AgentLoopManager.create(one, servers.get_client())
    loops["one token"] = one_loop
    fixed = []
    for step in range(4):
        t = time.perf_counter()
        verl_step("one token", prompts[4 * step:4 * step + 4])
        fixed.append(time.perf_counter() - t)
    fixed_s = statistics.median(fixed[1:])

    # the no-tail bound: the best full-batch decode throughput of this model, this run
    full = []
    for _ in range(3):
        t = time.perf_counter()
        direct["LLM.generate plain"].generate([[5, 6, 7]] * 32, SamplingParams(max_tokens=64, ignore_eos=True), use_tqdm=False)
        full.append(32 * 64 / (time.perf_counter() - t))
    throughput = max(full)
    res = {}
    for n in names:
        total, toks = sum(times[n]), sum(tokens[n])
        res[n] = {"seconds": round(total, 2), "tokens": toks, "vs_no_tail_bound": round(total / (toks / throughput), 2)}
    spec, plain = res["verl+tailrl spec"]["seconds"], res["verl+tailrl plain"]["seconds"]
    per_step = statistics.median(p / q for p, q in zip(times["verl+tailrl plain"], times["verl+tailrl spec"]))
    print(f"verl + tailrl: speculation {spec:.2f} s vs plain {plain:.2f} s over {a.steps} steps: {plain / spec:.2f}x "
          f"(median per-step ratio {per_step:.2f}); responses identical: {identical}")
    print(f"verl's fixed cost of a step (32 samples of 1 token): {fixed_s:.2f} s; without it, speculation "
          f"{(plain - a.steps * fixed_s) / (spec - a.steps * fixed_s):.2f}x")
    dspec, dplain = res["LLM.generate spec"]["seconds"], res["LLM.generate plain"]["seconds"]
    print(f"LLM.generate in this process: speculation {dspec:.2f} s vs plain {dplain:.2f} s: {dplain / dspec:.2f}x; "
          f"verl's path / LLM.generate: {spec / dspec:.2f} with speculation, {plain / dplain:.2f} plain")
    for n in names:
        print(f"{n}: {res[n]['tokens']} tokens, makespan / no-tail bound {res[n]['vs_no_tail_bound']:.2f} "
              f"(full-batch throughput {throughput:.0f} tok/s)")
    print(json.dumps({"steps": a.steps, "results": res, "speedup": round(plain / spec, 3),
                      "median_step_speedup": round(per_step, 3), "verl_fixed_step_s": round(fixed_s, 3),
                      "identical": identical, "full_batch_tok_s": round(throughput, 1)}))
    ray.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
