"""Teacher-forced log-probabilities computed by the engine's own kernels: bit for bit the
log-probabilities a rollout reports for the same tokens.

A rollout reports for response token j the log-softmax, at the sampling temperature, of the
logits the engine computed at that position: in a prefill, a decode step or a verify step,
alone or beside other requests. Every piece of that computation treats each position on its
own (row-invariant bfloat16 matmuls, an attention kernel that reads each query's prefix by
itself, a per-row softmax in the sampler), so the same logits come out when the whole response
is verified at once, as one chain draft after its prompt: one forward per group of sequences,
and ``sampler.token_logprobs`` turns the logits into log-probabilities as ``sampler.sample``
does. In bfloat16 the result equals the rollout's exactly (``tests/engine/test_score.py``);
in float64 to ~1e-13 and in float32 to the BLAS's rounding (their matmuls are not
row-invariant).

``Scorer`` holds its own copy of the model, so a trainer scores its policy's current weights
(``load_weights``, as ``LLM.load_weights``) without touching the rollout engines, one or a pool.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from tailrl.config import SamplingParams, device_scope
from tailrl.engine.batch import build_batch
from tailrl.engine.kv import KVCache
from tailrl.engine.request import Request
from tailrl.engine.sampler import token_logprobs
from tailrl.kernels import blocks
from tailrl.model.hf_names import load_hf
from tailrl.model.loader import DTYPES, load_model, read_args
from tailrl.speculative.draft import Draft


class Scorer:
    """``max_batch_tokens``: prompt and response tokens per forward (bounds the memory of one
    call: the K/V of that many positions and their hidden states)."""

    def __init__(self, model: str, dtype: str = "bfloat16", device: str = "cpu", max_batch_tokens: int = 8192):
        if max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {max_batch_tokens!r}")
        self.args = read_args(model)
        self.max_len = self.args.max_position_embeddings
        self.model = load_model(model, dtype, device, self.max_len)
        self.dtype, self.device = DTYPES[dtype], device
        self.max_batch_tokens = max_batch_tokens

    def load_weights(self, weights) -> set[str]:
        """New weights under Hugging Face names (cast to this scorer's dtype, as the engine's):
        as ``LLMEngine.load_weights``, a mapping of the whole model or pairs of any part."""
        return load_hf(self.model, weights, complete=isinstance(weights, Mapping))

    @torch.inference_mode()
    def logprobs(self, prompts: list[list[int]], responses: list[list[int]],
                 temperature: float | list[float] = 1.0) -> list[list[float]]:
        """Per sequence, log p(response[j] | prompt, response[:j]) at ``temperature`` (per
        sequence or one for all; 0 = greedy, reported at 1 as the engine does)."""
        if len(prompts) != len(responses):
            raise ValueError(f"prompts and responses differ in number ({len(prompts)} vs {len(responses)})")
        temps = [temperature] * len(prompts) if isinstance(temperature, (int, float)) else list(temperature)
        if len(temps) != len(prompts):
            raise ValueError(f"temperature: one per sequence ({len(prompts)}) or one for all, got {len(temps)}")
        for i, (p, r) in enumerate(zip(prompts, responses)):
            if not p or not r:
                raise ValueError(f"sequence {i}: prompt and response must be non-empty")
            if len(p) + len(r) > self.max_len:
                raise ValueError(f"sequence {i}: {len(p) + len(r)} tokens exceed the model's context ({self.max_len})")
            if temps[i] < 0:
                raise ValueError(f"temperature must be >= 0, got {temps[i]!r}")
        out: list[list[float]] = [[] for _ in prompts]
        with device_scope(self.device):
            for group in self._groups([len(p) + len(r) for p, r in zip(prompts, responses)]):
                for i, lp in zip(group, self._forward([prompts[i] for i in group], [responses[i] for i in group],
                                                      [temps[i] for i in group])):
                    out[i] = lp
        return out

    def _groups(self, lengths: list[int]) -> list[list[int]]:
        """Sequences in order, as many per forward as ``max_batch_tokens`` holds (at least one)."""
        groups: list[list[int]] = []
        used = 0
        for i, n in enumerate(lengths):
            if not groups or used + n > self.max_batch_tokens:
                groups.append([])
                used = 0
            groups[-1].append(i)
            used += n
        return groups

    def _forward(self, prompts: list[list[int]], responses: list[list[int]], temps: list[float]) -> list[list[float]]:
        """One forward: each prompt prefilled and its response verified as a chain draft."""
        longest = max(len(p) + len(r) for p, r in zip(prompts, responses))
        kv = KVCache(self.args, self.dtype, self.device, len(prompts) * blocks(longest), len(prompts), longest)
        if not kv.grow_rows([(i, longest) for i in range(len(prompts))]):
            raise RuntimeError(f"scorer: no cache for {len(prompts)} rows of {longest} positions")
        rows, drafts = [], {}
        for i, (p, r, t) in enumerate(zip(prompts, responses, temps)):
            req = Request(f"s{i}", list(p), SamplingParams(temperature=t), 0)
            rows.append((req, len(p)))
            if len(r) > 1:                    # the last response token is only predicted, never read
                drafts[req.request_id] = Draft.chain(r[:-1], source="score")
        batch = build_batch(rows, drafts, kv)
        hidden = self.model(batch.input_ids, batch.positions, kv.layers(), batch.meta)
        logits = self.model.logits(hidden[batch.sample_index])
        if logits.dtype == torch.bfloat16:                 # as ModelRunner.run: sampled in float32
            logits = logits.float()
        targets = [t for r in responses for t in r]        # sampled positions: row by row, root first
        lp = token_logprobs(logits, batch.temperature, targets)
        out, k = [], 0
        for r in responses:
            out.append(lp[k:k + len(r)])
            k += len(r)
        return out
