"""The public entry point: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import hashlib
import logging
import os
import time

from tqdm.auto import tqdm

from tailrl.config import EngineConfig, SamplingParams, SpeculativeConfig
from tailrl.engine.engine import LLMEngine
from tailrl.engine.metrics import rollout_metrics
from tailrl.engine.outputs import CompletionOutput, RequestOutput
from tailrl.engine.request import Request
from tailrl.engine.sampler import mix
from tailrl.spec.history import HistoryStore

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str):
    """The checkpoint's Hugging Face tokenizer, or None if it ships none (token-id prompts only)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def default_prompt_id(token_ids: list[int]) -> str:
    return hashlib.sha1(",".join(map(str, token_ids)).encode()).hexdigest()[:16]


class LLM:
    def __init__(self, model: str, speculative: SpeculativeConfig | dict | None = None,
                 max_num_seqs: int = 256, dtype: str = "float32", seed: int = 0, device: str = "cpu",
                 **engine_kwargs):
        config = EngineConfig(model=model, dtype=dtype, seed=seed, device=device, max_num_seqs=max_num_seqs,
                              **engine_kwargs)
        self.speculative = SpeculativeConfig.coerce(speculative)
        self.history = HistoryStore()
        speculator = None
        if self.speculative is not None:
            if self.speculative.method != "suffix":
                raise ValueError(f"speculative.method {self.speculative.method!r} is not available yet "
                                 "(the learned drafter has not landed); use method='suffix'")
            from tailrl.spec.speculator import Speculator
            speculator = Speculator(self.speculative, self.history)
        self.engine = LLMEngine(config, speculator)
        if speculator is not None:                      # measure this machine's step cost up front
            speculator.calibrate(self.engine.runner.synthetic_step, batch_sizes=(1, 8, 64, 256),
                                 extra_per_request=(0, 1, 4), repeats=1, contexts=(128, 512))
        self.tokenizer = load_tokenizer(model)
        self.seed = seed
        self.last_metrics: dict[str, float] = {}
        self._calls = 0

    # ---- input checks: all before any work --------------------------------------------------
    def _prompt_tokens(self, prompts) -> tuple[list[str | None], list[list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a list of str or list[int], got {type(prompts).__name__}")
        vocab, ctx = self.engine.args.vocab_size, self.engine.max_model_len
        texts: list[str | None] = []
        ids: list[list[int]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError(f"prompts[{i}] is a string but the model has no tokenizer files; pass token ids")
                toks = self.tokenizer.encode(p) if p else []      # special tokens (bos) as in HF and vLLM
                texts.append(p)
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                toks = list(p)
                texts.append(None)
            else:
                raise ValueError(f"prompts[{i}] must be a str or a list of int token ids")
            if not toks:
                raise ValueError(f"prompts[{i}] is empty")
            bad = [t for t in toks if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the vocabulary [0, {vocab})")
            if len(toks) >= ctx:
                raise ValueError(f"prompts[{i}] has {len(toks)} tokens: longer than the context "
                                 f"(max_model_len={ctx}, which must leave room for one new token)")
            ids.append(toks)
        return texts, ids

    def _params(self, sampling_params, n_prompts: int) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        plist = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * n_prompts
        if len(plist) != n_prompts:
            raise ValueError(f"sampling_params has {len(plist)} entries for {n_prompts} prompts")
        vocab = self.engine.args.vocab_size
        for p in plist:
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params must be SamplingParams, got {type(p).__name__}")
            p.__post_init__()                            # re-check fields mutated after construction
            bad = [t for t in (p.stop_token_ids or []) if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"stop_token_ids has token id {bad[0]} outside the vocabulary [0, {vocab})")
        return plist

    # ---- generate -----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_ids: list | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        texts, ids = self._prompt_tokens(prompts)
        plist = self._params(sampling_params, len(ids))
        if prompt_ids is not None and len(prompt_ids) != len(ids):
            raise ValueError(f"prompt_ids has {len(prompt_ids)} entries for {len(ids)} prompts")
        pids = [str(prompt_ids[i]) if prompt_ids is not None else default_prompt_id(t) for i, t in enumerate(ids)]
        self._calls += 1
        call = self._calls
        groups: list[list[Request]] = []
        for i, (toks, p) in enumerate(zip(ids, plist)):
            prompt_seed = p.seed if p.seed is not None else mix(call, i)
            groups.append([Request(f"{call}-{i}-{j}", toks, p, mix(self.seed, prompt_seed, j),
                                   group_id=f"{call}-{i}", prompt_id=pids[i], index=j) for j in range(p.n)])
        reqs = [r for g in groups for r in g]
        self.engine.metrics.trace.clear()
        before = self.engine.metrics.snapshot()
        if self.engine.speculator is not None:
            self.engine.speculator.reset_metrics()
        start = time.perf_counter()
        self._run(reqs, use_tqdm)
        end = time.perf_counter()
        outputs = [self._output(call, i, texts[i], ids[i], pids[i], g) for i, g in enumerate(groups)]
        self._record_history(outputs)
        self.last_metrics = rollout_metrics(
            [r.num_output_tokens for r in reqs], [r.num_prompt_tokens for r in reqs],
            [r.finish_time for r in reqs], start, end, self.engine.metrics.since(before))
        if self.engine.speculator is not None:
            self.last_metrics.update(self.engine.speculator.metrics())
        return outputs

    def _run(self, reqs: list[Request], use_tqdm: bool | None) -> None:
        for r in reqs:
            self.engine.add_request(r)
        bar = tqdm(total=len(reqs), desc="generate", unit="req", disable=True if use_tqdm is False else None,
                   leave=False)
        try:
            while self.engine.has_unfinished():
                bar.update(len(self.engine.step()))
        finally:
            bar.close()
            for r in reqs:                                # leave the engine clean even on an error
                if not r.status.finished:
                    self.engine.abort(r.request_id)
                self.engine.requests.pop(r.request_id, None)

    def _output(self, call: int, i: int, text: str | None, ids: list[int], pid: str,
                group: list[Request]) -> RequestOutput:
        out = RequestOutput(f"{call}-{i}", text, ids, pid)
        for r in group:
            decoded = self.tokenizer.decode(r.output_token_ids, skip_special_tokens=True) if self.tokenizer else ""
            out.outputs.append(CompletionOutput(r.index, decoded, list(r.output_token_ids),
                                                list(r.output_logprobs), r.finish_reason))
        return out

    def _record_history(self, outputs: list[RequestOutput]) -> None:
        """The responses of each prompt become its history for the next call (previous epoch)."""
        by_prompt: dict[str, list[list[int]]] = {}
        for o in outputs:
            by_prompt.setdefault(o.prompt_id, []).extend(c.token_ids for c in o.outputs)
        for pid, responses in by_prompt.items():
            self.history.record(pid, responses)

    def load_weights(self, hf_state_dict) -> None:
        """Put new policy weights (Hugging Face names) into the engine without touching disk."""
        self.engine.load_weights(hf_state_dict)
