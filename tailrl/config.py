"""Flat dataclass configs, one per component, validated in ``__post_init__``.

Every invalid field raises ``ValueError`` naming the field, before any work is done.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

MAX_LOGPROBS = 20       # vLLM's default max_logprobs: the most alternatives per output token


def _check(cond: bool, name: str, msg: str, value) -> None:
    if not cond:
        raise ValueError(f"{name} {msg}, got {value!r}")


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_device(device, name: str = "device") -> None:
    """``device`` names a CPU or a CUDA device ("cpu", "cuda", "cuda:N"); where it is used, the
    device must exist (``require_device``: a Ray driver may lack the GPUs its actors have)."""
    ok = isinstance(device, str) and (device == "cpu" or device == "cuda" or (
        device.startswith("cuda:") and device[5:].isdigit()))
    _check(ok, name, "must be 'cpu', 'cuda' or 'cuda:N'", device)


def require_device(device: str, name: str = "device") -> None:
    """Where work is about to run on ``device``: a ValueError naming ``name`` if it is absent."""
    if device == "cpu":
        return
    import torch
    index = int(device[5:]) if ":" in device else 0
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    _check(index < count, name, f"needs a CUDA device, and this process sees {count}", device)


def device_scope(device: str):
    """The context a step on ``device`` runs in: CUDA device N made current for ``cuda:N``
    (Triton launches its kernels, and CUDA graphs capture, on the current device, not on
    their tensors'); nothing to do on the CPU."""
    import contextlib

    import torch
    return torch.cuda.device(torch.device(device)) if device.startswith("cuda") else contextlib.nullcontext()


@dataclass
class SamplingParams:
    """How to sample one prompt's ``n`` responses (one GRPO group)."""

    n: int = 1                       # samples per prompt; they form one group
    temperature: float = 1.0         # 0 = greedy
    top_p: float = 1.0               # nucleus mass in (0, 1]
    top_k: int = -1                  # -1 = disabled, else >= 1
    max_tokens: int = 512            # new tokens per response
    seed: int | None = None          # per-prompt seed; None = derived from engine seed + call order
    stop_token_ids: list[int] | None = None  # extra stop tokens (EOS always stops unless ignore_eos)
    ignore_eos: bool = False
    # vLLM's stop strings: a response ends at the token whose text completes one (kept, with its
    # log-probability); its text is cut before the string (engine/stop_strings.py). Needs the
    # model's tokenizer files
    stop: list[str] | None = None
    # vLLM's logit processing (engine/logits_process.py): which token is drawn, never the
    # log-probability reported (that stays log_softmax(logits / T), what a trainer recomputes)
    repetition_penalty: float = 1.0  # > 0: logits of prompt and output tokens / it (x it where negative)
    presence_penalty: float = 0.0    # subtracted from the logits of tokens the output holds
    frequency_penalty: float = 0.0   # subtracted once per occurrence in the output
    min_p: float = 0.0               # in [0, 1]: tokens less probable than min_p x the top token's dropped
    min_tokens: int = 0              # EOS, stop tokens and stop strings cannot end the output before this many
    # vLLM's output settings: the sampled token's log-probability is always returned; ``logprobs``
    # N in 1..20 adds, per output token, its N most probable tokens and the sampled one, ranked
    # (``CompletionOutput.top_logprobs``; engine/top_logprobs.py); the text decoded (``detokenize``)
    # without special tokens (``skip_special_tokens``), cut before a stop string that ended it
    # unless ``include_stop_str_in_output``
    logprobs: int | None = None
    # vLLM's prompt_logprobs = N (0..20): per prompt token after the first, its log-probability and
    # its position's N most probable tokens (``RequestOutput.prompt_logprobs``)
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1", self.n)
        _check(self.temperature >= 0, "temperature", "must be >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1),
               "top_k", "must be -1 (disabled) or >= 1", self.top_k)
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", "must be an integer >= 1", self.max_tokens)
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an int or None", self.seed)
        if self.stop_token_ids is not None:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(self.stop is None or (isinstance(self.stop, (list, tuple)) and all(isinstance(x, str) and x
                                                                                 for x in self.stop)),
               "stop", "must be a non-empty string or a list of them", self.stop)
        if self.stop is not None:
            self.stop = list(self.stop) or None
        _check(_finite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
               "must be a number > 0", self.repetition_penalty)
        _check(_finite(self.presence_penalty), "presence_penalty", "must be a finite number", self.presence_penalty)
        _check(_finite(self.frequency_penalty), "frequency_penalty", "must be a finite number",
               self.frequency_penalty)
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               "must be an integer in [0, max_tokens]", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):      # alternatives per output / prompt token
            v = getattr(self, name)
            _check(v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LOGPROBS), name,
                   f"must be None or an integer in [0, {MAX_LOGPROBS}]", v)
        for name in ("detokenize", "skip_special_tokens", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), name, "must be true or false", getattr(self, name))
        _check(self.detokenize or not self.stop, "stop", "stop strings need detokenize=True", self.stop)

    @property
    def processes(self) -> bool:
        """Whether its logits are processed before a token is drawn (engine/logits_process.py)."""
        return (self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.min_p > 0 or self.min_tokens > 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def clone(self, **changes) -> "SamplingParams":
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        vals.update(changes)
        return SamplingParams(**vals)


SPEC_METHODS = ("suffix", "drafter", "hybrid")
SPEC_SOURCES = ("history", "group", "self")
SPEC_POLICIES = ("priced", "adaptive", "bandit", "fixed")
SPEC_TAILS = ("measured", "speculate")
AHEAD_DRAFTS_GATES = ("measured", "always")
# SpeculativeConfig.ahead_above's default: above this many requests a speculative engine that can
# launch steps ahead does (at 64 rows a verify step of a few tokens a row is still on the flat
# part of an H100's step-time curve, which #34 measured flat to a few hundred tokens; on an H200
# no threshold made speculation beat plain steps launched ahead: docs/speculation.md)
AHEAD_ABOVE = 64
# where the spot trainer's steps run inside a rollout (tailrl/drafter/spot_trainer.py): between
# the rollout's steps, or on a CUDA stream of their own beside them
SPOT_STREAMS = ("between", "side")


@dataclass
class SpeculativeConfig:
    """Speculative decoding: which draft sources, and which policy hands out draft tokens."""

    method: str | None = None                    # "suffix" | "drafter" | "hybrid" (contract); None:
                                                  # "hybrid" with a drafter, else "suffix"
    sources: tuple[str, ...] = SPEC_SOURCES       # suffix draft sources to consult
    drafter: str | None = None                    # learned drafter directory (`tailrl train-drafter`);
                                                  # required by "drafter" and "hybrid", unused by "suffix"
    # "priced" (the default): each step verifies the draft tokens that save the most time, priced
    # by this engine's measured step-time curve and acceptance (tailrl/speculative/policies/priced.py;
    # docs/speculation.md); "fixed": every request drafts up to max_draft_tokens at every batch
    # size up to max_spec_batch; "adaptive" (Seer's budget + RhymeRL's window) and "bandit" (TLT)
    # are the papers' controllers.
    policy: str = "priced"
    max_draft_tokens: int | None = None           # per request per step; None: 16 for "priced" (its
                                                  # cap: it picks the depth), 6 for the others
    min_draft_tokens: int = 2                     # RhymeRL min window (adaptive)
    max_tree_paths: int = 1                       # >1 = multi-path (tree) drafts
    min_match_len: int = 2                        # a shorter suffix match proposes nothing
    min_token_prob: float = 0.1                   # stop a draft when the estimated prob falls below
    # SD off above this batch size (0 = never off). None: 0 for "priced" (its prices switch drafting
    # off), 64 for the others (on a CPU a 7-token verify step at batch 256 costs ~5x a plain step)
    max_spec_batch: int | None = None
    # above max_spec_batch (or wherever the policy turns drafting off) the requests expected to
    # run longest still draft, up to this many per step: the critical path of the rollout
    # (expected lengths come from the scheduler's length-aware policies, `Request.priority`;
    # requests without an estimate never count as critical). 0 = off; 32 measured 1.0-1.14x on
    # the benchmark rollout's makespan, its tail 1.8-4x shorter (docs/pool.md)
    critical_rows: int = 32
    # where plain steps are launched ahead (an engine with CUDA graphs: engine/ahead.py): while
    # more than this many requests are running or waiting, steps are plain, without drafts,
    # launched ahead; from this many down (the tail), speculative steps one at a time. 0 = never
    # (every step speculative). None: AHEAD_ABOVE (steps launched ahead hand their hidden states
    # to a learned drafter and to an online drafter's buffer when they settle). On the
    # H100 a speculative step waited for the one before it (its drafts need the tokens): the
    # default speculation took 2.04 s where plain steps launched ahead took 1.63 s
    ahead_above: int | None = None
    # the tail's steps where plain steps can be launched ahead: "measured", each step the way the
    # rollout measures faster, speculating one step at a time or plain and launched ahead (the
    # rows that gain least, tokens a second: engine/tail_choice.py); "speculate": always the first
    tail: str = "measured"
    # where no step is launched ahead (a CPU's engine: every step one at a time): "measured", each
    # step speculating or plain, the way the rollout measures faster (the rows that gain least,
    # tokens a second: engine/tail_choice.py), for where the model's step is cheap next to the
    # speculator's host work; "speculate": always the first. Off by default, its results mixed on
    # this 2-core CPU: with poor drafts a little better than the default on a model 2.6x cheaper a
    # step than `small` (`mini`), worse on `small`; good drafts varying (docs/speculation.md)
    one_at_a_time: str = "speculate"
    # where steps are launched ahead: this many rows, those expected to run longest, draft inside
    # them anyway, each verifying a chain every other step (it sits out the step after a
    # verification, whose emitted tokens the next step can not know: engine/ahead_drafts.py);
    # 0 = none. Not with a learned drafter. Off by default until measured on a GPU
    ahead_drafts: int = 0
    # whether those rows draft: "measured", where the rollout measures that the rows gaining least
    # (the running rows' lower quartile) gain more tokens a second with them (engine/drafts_gate.py);
    # "always"
    ahead_drafts_gate: str = "measured"
    # the learned drafter's acceptance is measured by shadow drafts (never verified, within 1% of
    # the steps' time) only where a drafter call could pay; true: throughout, to follow an online
    # drafter's acceptance (rollout/spec_drafter_shadow_accept_length) even where it cannot pay
    drafter_tracking: bool = False

    def __post_init__(self) -> None:
        if self.method is None:
            self.method = "hybrid" if self.drafter is not None else "suffix"
        _check(self.method in SPEC_METHODS, "method", f"must be one of {SPEC_METHODS}", self.method)
        if isinstance(self.sources, str):
            self.sources = (self.sources,)
        self.sources = tuple(self.sources)
        _check(len(self.sources) > 0 and all(s in SPEC_SOURCES for s in self.sources),
               "sources", f"must be a non-empty subset of {SPEC_SOURCES}", self.sources)
        needs = self.method in ("drafter", "hybrid")
        _check(not needs or (isinstance(self.drafter, str) and os.path.isdir(self.drafter)), "drafter",
               f"must be a drafter checkpoint directory for method {self.method!r}", self.drafter)
        _check(needs or self.drafter is None, "drafter", "is only used by method 'drafter' or 'hybrid'",
               self.drafter)
        _check(self.policy in SPEC_POLICIES, "policy", f"must be one of {SPEC_POLICIES}", self.policy)
        if self.max_draft_tokens is None:
            self.max_draft_tokens = 16 if self.policy == "priced" else 6
        if self.max_spec_batch is None:
            self.max_spec_batch = 0 if self.policy == "priced" else 64
        _check(isinstance(self.max_draft_tokens, int), "max_draft_tokens", "must be an integer or None",
               self.max_draft_tokens)
        _check(isinstance(self.max_spec_batch, int), "max_spec_batch", "must be an integer or None",
               self.max_spec_batch)
        _check(1 <= self.max_draft_tokens <= 64, "max_draft_tokens", "must be in [1, 64]", self.max_draft_tokens)
        _check(1 <= self.min_draft_tokens <= self.max_draft_tokens, "min_draft_tokens",
               "must be in [1, max_draft_tokens]", self.min_draft_tokens)
        _check(self.max_tree_paths >= 1, "max_tree_paths", "must be >= 1", self.max_tree_paths)
        _check(self.min_match_len >= 1, "min_match_len", "must be >= 1", self.min_match_len)
        _check(0 <= self.min_token_prob < 1, "min_token_prob", "must be in [0, 1)", self.min_token_prob)
        _check(self.max_spec_batch >= 0, "max_spec_batch", "must be >= 0", self.max_spec_batch)
        _check(isinstance(self.critical_rows, int) and self.critical_rows >= 0, "critical_rows",
               "must be an integer >= 0", self.critical_rows)
        _check(isinstance(self.drafter_tracking, bool), "drafter_tracking", "must be true or false",
               self.drafter_tracking)
        _check(self.ahead_above is None or (isinstance(self.ahead_above, int) and self.ahead_above >= 0),
               "ahead_above", "must be an integer >= 0 or None", self.ahead_above)
        _check(self.tail in SPEC_TAILS, "tail", f"must be one of {SPEC_TAILS}", self.tail)
        _check(self.one_at_a_time in SPEC_TAILS, "one_at_a_time", f"must be one of {SPEC_TAILS}", self.one_at_a_time)
        _check(isinstance(self.ahead_drafts, int) and not isinstance(self.ahead_drafts, bool)
               and self.ahead_drafts >= 0, "ahead_drafts", "must be an integer >= 0", self.ahead_drafts)
        _check(self.ahead_drafts_gate in AHEAD_DRAFTS_GATES, "ahead_drafts_gate",
               f"must be one of {AHEAD_DRAFTS_GATES}", self.ahead_drafts_gate)

    @classmethod
    def coerce(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = set(value) - known
            _check(not unknown, "speculative", f"has unknown keys (known: {sorted(known)})", sorted(unknown))
            return cls(**value)
        raise ValueError(f"speculative must be None, a SpeculativeConfig or a dict, got {type(value).__name__}")


DTYPES = ("float32", "float64", "bfloat16")


@dataclass
class EngineConfig:
    """One engine instance."""

    model: str                                    # Hugging Face checkpoint directory
    dtype: str = "bfloat16"                       # exact with and without speculation (batch-invariant kernels)
    device: str = "cpu"
    seed: int = 0
    max_num_seqs: int = 256                       # running requests at once
    max_num_batched_tokens: int = 1024            # tokens per forward (prefill chunks + decodes + drafts)
    max_model_len: int | None = None              # default: the checkpoint's max_position_embeddings
    kv_cache_tokens: int | None = None            # KV budget in token slots; None = from kv_cache_gib
    kv_cache_gib: float | None = None             # None: 4 GiB, raised so one full-context request fits if
                                                  # memory allows, else the context capped (kv/budget.py);
                                                  # on a GPU: from gpu_memory_utilization
    gpu_memory_utilization: float = 0.9           # GPU: this share of its memory for weights, activations and K/V
    cuda_graphs: bool = True                      # GPU: decode and verify steps replayed from CUDA graphs ...
    cuda_graph_max_tokens: int = 512              # ... of at most this many tokens (drafts included) ...
    cuda_graph_gib: float = 1.0                   # ... within this memory (taken from the K/V budget),
    cuda_graph_warmup: bool = True                # ... captured at start-up (each bucket's, as vLLM
                                                  # does), not in the steps that first need them
    cuda_graph_sample_mib: float = 8.0            # a graph runs the LM head and sampler too where its
                                                  # bucket's float32 logits take at most this (MiB; a
                                                  # 152k vocabulary: 8 -> 13 tokens, 64 -> 110)
    enable_prefix_caching: bool = True            # a request takes the K/V blocks of its longest prefix
                                                  # computed before (engine/kv/prefix.py; off with a
                                                  # learned drafter, whose past needs every position)
    async_scheduling: bool | None = None          # launch a plain decoding step before the previous one's
                                                  # tokens are back (engine/ahead.py); None: with CUDA graphs
    num_threads: int | None = None                # torch threads; None = as many cores as other
                                                  # processes leave free (bfloat16, float64; float32:
                                                  # torch's count, tailrl/threads.py says why)
    tensor_parallel_size: int = 1                 # the model split over this many devices (CUDA: this
                                                  # one and the next; a process each: engine/tensor_parallel.py)

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and self.model != "", "model", "must be a checkpoint directory", self.model)
        _check(isinstance(self.tensor_parallel_size, int) and not isinstance(self.tensor_parallel_size, bool)
               and self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be an integer >= 1",
               self.tensor_parallel_size)
        _check(self.dtype in DTYPES, "dtype", f"must be one of {DTYPES}", self.dtype)
        _check(isinstance(self.seed, int), "seed", "must be an int", self.seed)
        check_device(self.device)
        _check(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1", self.max_num_seqs)
        _check(self.max_num_batched_tokens >= 16, "max_num_batched_tokens", "must be >= 16",
               self.max_num_batched_tokens)
        _check(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2",
               self.max_model_len)
        _check(self.kv_cache_tokens is None or self.kv_cache_tokens >= 2, "kv_cache_tokens", "must be >= 2",
               self.kv_cache_tokens)
        _check(self.kv_cache_gib is None or self.kv_cache_gib > 0, "kv_cache_gib", "must be None or > 0",
               self.kv_cache_gib)
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "must be in (0, 1]",
               self.gpu_memory_utilization)
        _check(isinstance(self.cuda_graphs, bool), "cuda_graphs", "must be true or false", self.cuda_graphs)
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "must be true or false",
               self.enable_prefix_caching)
        _check(isinstance(self.cuda_graph_max_tokens, int) and self.cuda_graph_max_tokens >= 1,
               "cuda_graph_max_tokens", "must be an integer >= 1", self.cuda_graph_max_tokens)
        _check(self.cuda_graph_gib >= 0, "cuda_graph_gib", "must be >= 0", self.cuda_graph_gib)
        _check(isinstance(self.cuda_graph_warmup, bool), "cuda_graph_warmup", "must be true or false",
               self.cuda_graph_warmup)
        _check(self.cuda_graph_sample_mib >= 0, "cuda_graph_sample_mib", "must be >= 0", self.cuda_graph_sample_mib)
        _check(self.async_scheduling is None or isinstance(self.async_scheduling, bool), "async_scheduling",
               "must be true, false or null", self.async_scheduling)


POOL_BACKENDS = ("local", "ray")
POOL_SCHEDULERS = ("static", "divided", "context", "history", "oracle", "group-oracle")
CHUNK_MIN, CHUNK_MAX = 64, 2048   # bounds of the default chunk (PoolConfig.chunk_for)


@dataclass
class PoolConfig:
    """Many engine instances driven by one scheduler policy (``tailrl.rollout.pool``)."""

    instances: int = 1
    scheduler: str = "context"                    # a policy of tailrl/rollout/policies
    backend: str = "local"                        # "local": this process (1) or worker processes; "ray"
    address: str | None = None                    # ray: cluster to join (None: a local ray.init())
    chunk_tokens: int | None = None               # divided rollout: max new tokens per chunk (None: chunk_for)
    threads_per_instance: int | None = None       # None: the machine's cores split evenly
    steps_per_call: int = 8                       # engine steps per worker message (at most; stops at a chunk end)
    processes: bool | None = None                 # local: worker processes (None: when instances > 1)

    def __post_init__(self) -> None:
        _check(isinstance(self.instances, int) and self.instances >= 1, "instances", "must be an integer >= 1",
               self.instances)
        _check(self.scheduler in POOL_SCHEDULERS, "scheduler", f"must be one of {POOL_SCHEDULERS}", self.scheduler)
        _check(self.backend in POOL_BACKENDS, "backend", f"must be one of {POOL_BACKENDS}", self.backend)
        _check(self.chunk_tokens is None or (isinstance(self.chunk_tokens, int) and not isinstance(
               self.chunk_tokens, bool) and self.chunk_tokens >= 1), "chunk_tokens",
               "must be None (chosen from max_tokens) or an integer >= 1", self.chunk_tokens)
        _check(self.threads_per_instance is None or self.threads_per_instance >= 1, "threads_per_instance",
               "must be >= 1", self.threads_per_instance)
        _check(isinstance(self.steps_per_call, int) and self.steps_per_call >= 1, "steps_per_call",
               "must be an integer >= 1", self.steps_per_call)

    def chunk_for(self, max_tokens: int) -> int:
        """Max new tokens per chunk for a generate call whose responses may run to
        ``max_tokens``: ``chunk_tokens`` if set; else, with several instances, a quarter of
        ``max_tokens`` within [CHUNK_MIN, CHUNK_MAX], and with one instance the whole request.

        Why a quarter: divided rollout gains only if a long request comes back to the buffer
        a few times (to be re-ranked, or to move to an idle instance in the tail); the pool
        ladder on this machine (docs/pool.md) ran max_tokens 960 in chunks of 240. Why at
        most 2,048: in the simulator at max_tokens 40,960, chunks of 2,048 gave 1.28x over
        static, 512 1.29x (moving 3.7x the K/V) and 8,192 only 1.12x (a chunk's K/V growth is
        reserved at admission, so large chunks run fewer requests at once; docs/scheduling.md).
        Why at least 64: every chunk end is a report, a policy decision and, unless the
        instance resumes the request at once, a parked or moved K/V; below 64 tokens that
        would come every few worker messages (``steps_per_call`` steps each) in responses too
        short to leave a tail worth re-placing. Why whole on one instance: a chunk end there
        can only park the request and give its slot to another, which nothing measured here
        shows to pay (the one-engine figures of docs/pool.md ran whole requests)."""
        _check(isinstance(max_tokens, int) and max_tokens >= 1, "max_tokens", "must be an integer >= 1",
               max_tokens)
        if self.chunk_tokens is not None:
            return self.chunk_tokens
        if self.instances == 1:
            return max_tokens
        return min(CHUNK_MAX, max(CHUNK_MIN, max_tokens // 4))
