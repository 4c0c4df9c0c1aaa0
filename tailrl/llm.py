"""The public entry point: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

from tailrl.config import EngineConfig, SamplingParams, SpeculativeConfig
from tailrl.engine.engine import LLMEngine
from tailrl.engine.inputs import InputProcessor, load_tokenizer
from tailrl.engine.metrics import rollout_metrics
from tailrl.engine.outputs import RequestOutput
from tailrl.engine.request import Request
from tailrl.spec.history import HistoryStore

log = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str, speculative: SpeculativeConfig | dict | None = None,
                 max_num_seqs: int = 256, dtype: str = "bfloat16", seed: int = 0, device: str = "cpu",
                 **engine_kwargs):
        config = EngineConfig(model=model, dtype=dtype, seed=seed, device=device, max_num_seqs=max_num_seqs,
                              **engine_kwargs)
        self.speculative = SpeculativeConfig.coerce(speculative)
        self.history = HistoryStore()
        self.engine = LLMEngine(config, self.speculative, self.history)
        self.tokenizer = load_tokenizer(model)
        self.inputs = InputProcessor(self.engine.args.vocab_size, self.engine.max_model_len, self.tokenizer, seed)
        self.seed = seed
        self.last_metrics: dict[str, float] = {}
        self._calls = 0

    # ---- generate -----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_ids: list | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        texts, ids, pids, groups = self.inputs.requests(self._calls + 1, prompts, sampling_params, prompt_ids)
        self._calls += 1
        reqs = [r for g in groups for r in g]
        self.engine.begin_rollout()
        start = time.perf_counter()
        self._run(reqs, use_tqdm)
        end = time.perf_counter()
        outputs = [self.inputs.output(g[0].group_id, texts[i], ids[i], pids[i], g) for i, g in enumerate(groups)]
        self._record_history(outputs)
        self.last_metrics = rollout_metrics(
            [r.num_output_tokens for r in reqs], [r.num_prompt_tokens for r in reqs],
            [r.finish_time for r in reqs], start, end, self.engine.rollout_counters())
        self.last_metrics.update(self.engine.spec_metrics())
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
                self.engine.release(r.request_id)

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
