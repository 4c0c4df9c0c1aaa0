"""Sampling n responses per prompt for the workload report, with our engine or Hugging Face.

Both backends take prompt token ids (``<bos>`` included, as in training) and return, per
prompt, n responses as (token ids without the stop token, finish reason). Sampling is plain
temperature sampling with top-k and top-p disabled.
"""
from __future__ import annotations

import logging

import torch
from tqdm import tqdm

log = logging.getLogger(__name__)

Responses = list[list[tuple[list[int], str]]]   # [prompt][sample] -> (token ids, finish reason)


def sample_tailrl(model_dir: str, prompt_ids: list[list[int]], n: int, temperature: float,
                  max_tokens: int, seed: int) -> Responses:
    from tailrl import LLM, SamplingParams

    llm = LLM(model=model_dir, seed=seed)
    outs = llm.generate(prompt_ids, SamplingParams(n=n, temperature=temperature, top_k=-1, top_p=1.0,
                                                   max_tokens=max_tokens))
    result: Responses = []
    for out in outs:
        group = []
        for o in out.outputs:
            ids = list(o.token_ids)
            if o.finish_reason == "stop" and ids:   # the engine keeps the stop token; we count text tokens
                ids = ids[:-1]
            group.append((ids, o.finish_reason))
        result.append(group)
    return result


@torch.no_grad()
def sample_hf(model_dir: str, prompt_ids: list[list[int]], n: int, temperature: float,
              max_tokens: int, seed: int, prompts_per_batch: int = 16) -> Responses:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    torch.manual_seed(seed)
    result: Responses = []
    for start in tqdm(range(0, len(prompt_ids), prompts_per_batch), desc="hf generate", unit="batch"):
        chunk = prompt_ids[start: start + prompts_per_batch]
        width = max(map(len, chunk))
        x = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])   # left padding
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in chunk])[:, None]).long()
        out = model.generate(input_ids=x, attention_mask=mask, do_sample=True, temperature=temperature,
                             top_k=0, top_p=1.0, max_new_tokens=max_tokens, num_return_sequences=n,
                             eos_token_id=eos, pad_token_id=pad)
        new = out[:, width:].tolist()
        for i in range(len(chunk)):
            group = []
            for row in new[i * n: (i + 1) * n]:
                if eos in row:
                    group.append((row[: row.index(eos)], "stop"))
                else:
                    group.append((row, "length"))
            result.append(group)
    return result


def sample(backend: str, model_dir: str, prompt_ids: list[list[int]], n: int, temperature: float,
           max_tokens: int, seed: int) -> Responses:
    if backend == "tailrl":
        return sample_tailrl(model_dir, prompt_ids, n, temperature, max_tokens, seed)
    if backend == "hf":
        return sample_hf(model_dir, prompt_ids, n, temperature, max_tokens, seed)
    raise ValueError(f"backend must be 'tailrl' or 'hf', got {backend!r}")
