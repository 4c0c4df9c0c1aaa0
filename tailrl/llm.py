"""The public entry point: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

from tailrl.config import EngineConfig, PoolConfig, SamplingParams, SpeculativeConfig
from tailrl.engine.admission import by_history
from tailrl.engine.engine import LLMEngine
from tailrl.engine.heap import held_collections
from tailrl.engine.inputs import InputProcessor, load_tokenizer
from tailrl.engine.metrics import rollout_metrics
from tailrl.engine.outputs import RequestOutput
from tailrl.engine.request import Request
from tailrl.speculative.history import HistoryStore
from tailrl.threads import release_pool

log = logging.getLogger(__name__)


class LLM:
    """One engine in this process, or a rollout pool (``tailrl.rollout.pool``) of several,
    driven by a scheduler policy: ``instances > 1``, a ``scheduler``, ``backend="ray"`` or a
    ``pool`` config (a `PoolConfig` or its fields as a dict) selects the pool. Either way
    ``generate`` returns the same outputs; the pool adds ``pool/...`` metrics."""

    def __init__(self, model: str, speculative: SpeculativeConfig | dict | None = None,
                 max_num_seqs: int = 256, dtype: str = "bfloat16", seed: int = 0, device: str = "cpu",
                 instances: int = 1, scheduler: str | None = None, backend: str = "local",
                 pool: PoolConfig | dict | None = None, **engine_kwargs):
        config = EngineConfig(model=model, dtype=dtype, seed=seed, device=device, max_num_seqs=max_num_seqs,
                              **engine_kwargs)
        self.speculative = SpeculativeConfig.coerce(speculative)
        self.history = HistoryStore()
        self.engine: LLMEngine | None = None
        self.pool = None
        pool_cfg = _pool_config(instances, scheduler, backend, pool)
        if pool_cfg is None:
            self.engine = LLMEngine(config, self.speculative, self.history)
            vocab, max_len = self.engine.args.vocab_size, self.engine.max_model_len
        else:
            from tailrl.rollout.pool import RolloutPool
            self.pool = RolloutPool(config, self.speculative, pool_cfg)
            vocab, max_len = self.pool.info.vocab_size, self.pool.info.max_model_len
        self.tokenizer = load_tokenizer(model)
        self.inputs = InputProcessor(vocab, max_len, self.tokenizer, seed)
        self.seed = seed
        self.last_metrics: dict[str, float] = {}
        self._calls = 0
        release_pool()           # generate may run on another thread: leave no idle OpenMP pool here

    # ---- generate -----------------------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 prompt_ids: list | None = None, use_tqdm: bool | None = None,
                 true_lengths: list[list[int]] | None = None) -> list[RequestOutput]:
        """``true_lengths`` (per prompt, per sample; e.g. from a first run with the same seeds)
        feeds the ``oracle`` scheduler: for evaluation only, never in training."""
        texts, ids, pids, groups = self.inputs.requests(self._calls + 1, prompts, sampling_params, prompt_ids)
        self._calls += 1
        reqs = [r for g in groups for r in g]
        start = time.perf_counter()
        if self.pool is not None:
            counters, spec, extra = self.pool.run(reqs, self.history, _by_request(groups, true_lengths))
        else:
            self.engine.begin_rollout()
            try:
                with held_collections() as heap:   # no full collection walks the heap mid-rollout
                    self._run(reqs, use_tqdm)
            finally:
                release_pool()   # the next call may come from another thread (threads.py says why)
            engine = self.engine
            counters, spec, extra = engine.rollout_counters(), engine.spec_metrics(), engine.graph_metrics()
            extra.update({"timing_s/gc": heap.gc_s, "rollout/gc_full_collections": float(heap.full)})
        end = time.perf_counter()
        outputs = [self.inputs.output(g[0].group_id, texts[i], ids[i], pids[i], g) for i, g in enumerate(groups)]
        self._record_history(outputs)
        self.last_metrics = rollout_metrics(
            [r.num_output_tokens for r in reqs], [r.num_prompt_tokens for r in reqs],
            [r.finish_time for r in reqs], start, end, counters)
        # the engine's stages stand: its timing_s/draft is the whole stage (the speculator's own
        # figure leaves out the engine's share and the steps it decided not to draft)
        self.last_metrics.update({k: v for k, v in spec.items() if k not in self.last_metrics})
        self.last_metrics.update(extra)
        return outputs

    def chat(self, messages: list, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             prompt_ids: list | None = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a
        list of them, each through the tokenizer's chat template with the assistant's turn
        opened, then ``generate`` (one output per conversation). A model without a chat
        template, or a conversation its template rejects, raises ``ValueError`` before any work."""
        convs = [messages] if messages and all(isinstance(m, dict) for m in messages) else messages
        if not isinstance(convs, (list, tuple)) or not convs or not all(isinstance(c, (list, tuple)) for c in convs):
            raise ValueError("messages must be a conversation (a list of dicts) or a list of conversations")
        ids = [self.inputs.chat_tokens(list(c), f"messages[{i}]") for i, c in enumerate(convs)]
        return self.generate(ids, sampling_params, prompt_ids, use_tqdm)

    def get_tokenizer(self):
        """The checkpoint's Hugging Face tokenizer (None where it ships no tokenizer files), as vLLM's."""
        return self.tokenizer

    def _run(self, reqs: list[Request], use_tqdm: bool | None) -> None:
        for r in by_history(reqs, self.history):     # longest expected first (engine/admission.py)
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

    def load_weights(self, weights) -> set[str]:
        """Put new policy weights (Hugging Face names) into the engine, or every instance of the
        pool, without touching disk: a mapping of the whole model (every tensor; names and
        shapes checked before any is copied), or an iterable of (name, tensor) pairs holding any
        part of it (one bucket of a trainer's sync, as vLLM's ``load_weights``). Returns the
        checkpoint names written: a trainer's fused expert tensor writes every expert's."""
        if self.pool is not None:
            return self.pool.load_weights(weights)
        return self.engine.load_weights(weights)

    def weight_names(self) -> list[str]:
        """The Hugging Face names of a complete checkpoint of the model (what ``load_weights``
        must write for a whole update)."""
        if self.pool is not None:
            return self.pool.weight_names()
        return self.engine.model.weight_names()

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes (engine/kv/prefix.py), as vLLM's: the next requests
        compute their prompts afresh. New weights (``load_weights``) forget them anyway."""
        if self.pool is not None:
            self.pool.reset_prefix_cache()
        else:
            self.engine.kv.clear_prefixes()

    def close(self) -> None:
        """Stop the pool's worker processes or actors, or the processes of an engine split over
        devices (``tensor_parallel_size``)."""
        if self.pool is not None:
            self.pool.close()
        else:
            self.engine.close()


def _pool_config(instances: int, scheduler: str | None, backend: str,
                 pool: PoolConfig | dict | None) -> PoolConfig | None:
    """The pool's config, or None for a single engine in this process."""
    if isinstance(pool, PoolConfig):
        return pool
    if pool is not None and not isinstance(pool, dict):
        raise ValueError(f"pool must be None, a PoolConfig or a dict, got {type(pool).__name__}")
    if instances == 1 and scheduler is None and backend == "local" and not pool:
        return None
    fields = {"instances": instances, "backend": backend, **(pool or {})}
    if scheduler is not None:
        fields["scheduler"] = scheduler
    return PoolConfig(**fields)


def _by_request(groups: list[list[Request]], true_lengths: list[list[int]] | None) -> dict[str, int] | None:
    if true_lengths is None:
        return None
    if len(true_lengths) != len(groups) or any(len(t) != len(g) for t, g in zip(true_lengths, groups)):
        raise ValueError("true_lengths must have one list per prompt with one length per sample")
    return {r.request_id: int(n) for g, t in zip(groups, true_lengths) for r, n in zip(g, t)}
