"""The training run's one flat config, validated in ``__post_init__``, loaded from YAML.

Every invalid value raises ``ValueError`` naming the key; a YAML file with a key this
dataclass does not know is rejected by name (a typo must never silently use a default).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from tailrl.config import SPOT_STREAMS, PoolConfig, SpeculativeConfig, check_device

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean")
REWARDS = ("auto", "task", "math")
FAMILIES = ("add", "sort", "search")
# Keys that may change between a run and its resume: they do not change what is computed.
RESUMABLE_CHANGES = ("total_steps", "checkpoint_every", "log_tensorboard", "progress", "save_rollouts",
                     "instances", "scheduler", "backend", "chunk_tokens",   # the pool never changes outputs
                     # the drafter's training changes drafts, never outputs (drafts are verified)
                     "drafter_init", "drafter_lr", "drafter_buffer", "drafter_batch", "drafter_spot_batch",
                     "drafter_spot_share", "drafter_spot_stream", "drafter_train_steps", "drafter_eval")


def _check(cond: bool, key: str, msg: str, value: Any) -> None:
    if not cond:
        raise ValueError(f"config key {key!r} {msg}, got {value!r}")


@dataclass
class TrainConfig:
    # ---- model and data ----
    model: str = "small"                  # preset name ("test", "small") or a checkpoint directory
    dataset: str = "tasks"                # "tasks" (synthetic task families) or a .jsonl/.json/.parquet file
    task_family: str | None = None        # tasks only: one family ("add", "sort", "search"); None = the mixture
    task_difficulty: int | None = None    # tasks only, with task_family: one difficulty level
    train_size: int = 64                  # tasks only: distinct prompts in the training set (one epoch)
    reward: str = "auto"                  # "auto" (task for tasks, math for files), "task", "math", "module:function"
    shuffle: bool = True                  # reshuffle the prompts every epoch (seeded)
    # ---- GRPO ----
    total_steps: int = 20
    batch_size: int = 8                   # prompts per step
    group_size: int = 8                   # responses per prompt (the GRPO group)
    ppo_minibatches: int = 1              # optimizer steps per rollout batch (1 = fully on-policy)
    micro_batch_tokens: int = 4096        # padded tokens per forward/backward (memory only; same loss)
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0            # 0 = no clipping
    clip_ratio_low: float = 0.2           # ratio clipped to [1 - low, 1 + high]
    clip_ratio_high: float = 0.2          # > low = DAPO's clip-higher
    kl_coef: float = 0.0                  # > 0 keeps a frozen reference model (k3 estimator)
    loss_agg_mode: str = "token-mean"     # DAPO/verl token-level, or GRPO paper's per-sequence mean
    norm_adv_by_std: bool = True          # False = Dr. GRPO (centre only)
    old_logprobs: str = "engine"          # pi_old: the rollout's logprobs, or "recompute" (the trainer's policy, verl)
    exact_logprobs: bool = True           # update log-prob values from the engine's kernels (= the rollout's in bf16)
    # ---- sampling ----
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 512                 # response length cap
    repetition_penalty: float = 1.0       # vLLM's logit processing (engine/logits_process.py): which
    min_p: float = 0.0                    # token is drawn; the log-probabilities stay the policy's
    # ---- engine ----
    speculative: bool | dict | None = True   # True = SpeculativeConfig() defaults; dict = its fields; False/None = off
    dtype: str = "bfloat16"               # engine dtype (spec on/off runs are identical in all three)
    device: str = "cpu"                   # the engine's, the scorer's and the update's: "cpu", "cuda" or "cuda:N"
    gpu_memory_utilization: float = 0.5   # on a GPU: the engine's share (weights, K/V, graphs); the rest trains
    train_dtype: str = "float32"          # policy dtype for the update (weights, gradients, AdamW)
    autocast: bool | str = "auto"         # the update's forward and backward in bfloat16 autocast (float32 policy):
                                          # true, false or "auto" (on a GPU and an AVX512 CPU; off where emulated)
    num_threads: int | None = None        # torch threads (None = as many as other processes leave free)
    # ---- learned drafter (TLT): trained online by the spot trainer, drafts next to suffix drafts ----
    drafter: bool = False                 # on: speculative method becomes hybrid (drafter: stays drafter)
    drafter_init: str | None = None       # warm start (`tailrl train-drafter` directory); None = fresh
    drafter_size: int | None = None       # fresh drafter's MLP width; None = the target's
    drafter_vocab: int | None = None      # fresh drafter's draft vocabulary; None = 32,768; 0 = the whole one
    drafter_lr: float = 1.0e-4           # fine-tuning a warm start (1e-3 measured to undo it at first)
    drafter_buffer: int = 65536           # (hidden state, token) pairs kept, newest first
    drafter_batch: int = 256              # positions (sequence crops) per drafter training step
    drafter_spot_batch: int = 8           # train inside the rollout while fewer requests run (0 = never)
    drafter_spot_share: float = 0.03      # ... and while that training stays below this share of the rollout
    drafter_spot_stream: str = "between"  # "between" the rollout's steps; "side": on a CUDA stream beside them
    drafter_train_steps: int = 16         # drafter steps between rollout and update
    drafter_eval: bool = False            # per step: the drafter's exact acceptance on the step's responses
    # ---- rollout pool (tailrl.rollout.pool; docs/pool.md) ----
    instances: int = 1                    # engine instances; > 1 (or a scheduler) runs a rollout pool
    scheduler: str | None = None          # static | divided | context | history (null: one plain engine)
    backend: str = "local"                # local (worker processes) | ray
    chunk_tokens: int | None = None       # divided rollout: max new tokens per chunk (null: PoolConfig.chunk_for)
    # ---- run ----
    seed: int = 0
    output_dir: str = "runs/demo"
    checkpoint_every: int = 10            # 0 = only at the end
    save_rollouts: bool = True            # rollouts.jsonl: every response's tokens and reward per step
    log_tensorboard: bool = True          # when tensorboard is importable
    progress: bool = True                 # tqdm bars

    def __post_init__(self) -> None:
        self._check_data()
        self._check_optimisation()
        self._check_run()
        self._check_drafter()

    def _check_data(self) -> None:
        """The model, the prompts and the reward."""
        _check(isinstance(self.model, str) and self.model != "", "model", "must be a preset name or a directory",
               self.model)
        _check(isinstance(self.dataset, str) and self.dataset != "", "dataset", "must be 'tasks' or a file",
               self.dataset)
        if self.dataset != "tasks":
            _check(Path(self.dataset).suffix.lower() in (".jsonl", ".json", ".parquet"), "dataset",
                   "must be 'tasks' or a .jsonl/.json/.parquet file", self.dataset)
        _check(self.task_family is None or self.task_family in FAMILIES, "task_family",
               f"must be null or one of {FAMILIES}", self.task_family)
        _check(self.task_difficulty is None or (self.task_family is not None and isinstance(self.task_difficulty, int)),
               "task_difficulty", "needs task_family and must be an int", self.task_difficulty)
        _check(self.reward in REWARDS or (isinstance(self.reward, str) and ":" in self.reward), "reward",
               f"must be one of {REWARDS} or 'module:function'", self.reward)

    def _check_optimisation(self) -> None:
        """Steps, batches and the loss."""
        for key in ("total_steps", "batch_size", "ppo_minibatches", "micro_batch_tokens", "max_tokens"):
            v = getattr(self, key)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, key, "must be an integer >= 1", v)
        _check(isinstance(self.group_size, int) and self.group_size >= 2, "group_size",
               "must be an integer >= 2 (advantages compare responses within a group)", self.group_size)
        _check(isinstance(self.train_size, int) and self.train_size >= self.batch_size, "train_size",
               f"must be an integer >= batch_size ({self.batch_size})", self.train_size)
        _check(self.batch_size % self.ppo_minibatches == 0, "ppo_minibatches", "must divide batch_size",
               self.ppo_minibatches)
        _check(isinstance(self.lr, (int, float)) and 0 < self.lr < 1, "lr", "must be in (0, 1)", self.lr)
        _check(0 <= self.weight_decay < 1, "weight_decay", "must be in [0, 1)", self.weight_decay)
        _check(self.max_grad_norm >= 0, "max_grad_norm", "must be >= 0", self.max_grad_norm)
        _check(0 < self.clip_ratio_low < 1, "clip_ratio_low", "must be in (0, 1)", self.clip_ratio_low)
        _check(self.clip_ratio_high > 0, "clip_ratio_high", "must be > 0", self.clip_ratio_high)
        _check(self.kl_coef >= 0, "kl_coef", "must be >= 0", self.kl_coef)
        _check(self.loss_agg_mode in LOSS_AGG_MODES, "loss_agg_mode", f"must be one of {LOSS_AGG_MODES}",
               self.loss_agg_mode)
        _check(self.old_logprobs in ("recompute", "engine"), "old_logprobs", "must be 'recompute' or 'engine'",
               self.old_logprobs)
        _check(isinstance(self.exact_logprobs, bool), "exact_logprobs", "must be true or false", self.exact_logprobs)
        _check(isinstance(self.autocast, bool) or self.autocast == "auto", "autocast", "must be true, false or 'auto'",
               self.autocast)

    def _check_run(self) -> None:
        """Sampling, the engine, the pool, checkpoints, speculation."""
        _check(self.temperature > 0, "temperature", "must be > 0 (GRPO needs sampled groups)", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (disabled) or >= 1", self.top_k)
        _check(isinstance(self.repetition_penalty, (int, float)) and self.repetition_penalty > 0,
               "repetition_penalty", "must be a number > 0", self.repetition_penalty)
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.dtype in ("bfloat16", "float32", "float64"), "dtype",
               "must be 'bfloat16', 'float32' or 'float64'", self.dtype)
        _check(self.train_dtype in ("float32", "float64"), "train_dtype", "must be 'float32' or 'float64'",
               self.train_dtype)
        check_device(self.device)
        _check(isinstance(self.gpu_memory_utilization, (int, float)) and 0 < self.gpu_memory_utilization <= 1,
               "gpu_memory_utilization", "must be in (0, 1]", self.gpu_memory_utilization)
        _check(self.num_threads is None or (isinstance(self.num_threads, int) and self.num_threads >= 1),
               "num_threads", "must be null or an integer >= 1", self.num_threads)
        _check(isinstance(self.seed, int), "seed", "must be an int", self.seed)
        # oracle needs true lengths from a run with the same seeds: evaluation only, never training
        _check(self.scheduler in (None, "static", "divided", "context", "history"), "scheduler",
               "must be null or one of static, divided, context, history", self.scheduler)
        try:
            self.pool_config()
        except ValueError as e:
            raise ValueError(f"config key {str(e).split()[0]!r}: {e}") from None
        _check(isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0, "checkpoint_every",
               "must be an integer >= 0", self.checkpoint_every)
        _check(isinstance(self.output_dir, str) and self.output_dir != "", "output_dir", "must be a directory",
               self.output_dir)
        try:
            self.speculative_config()
        except ValueError as e:
            raise ValueError(f"config key 'speculative': {e}") from None

    def _check_drafter(self) -> None:
        for key in ("drafter", "drafter_eval"):
            _check(isinstance(getattr(self, key), bool), key, "must be true or false", getattr(self, key))
        for key in ("drafter_buffer", "drafter_batch"):
            v = getattr(self, key)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, key, "must be an integer >= 1", v)
        for key in ("drafter_spot_batch", "drafter_train_steps"):
            v = getattr(self, key)
            _check(isinstance(v, int) and not isinstance(v, bool) and v >= 0, key, "must be an integer >= 0", v)
        _check(isinstance(self.drafter_lr, (int, float)) and 0 < self.drafter_lr < 1, "drafter_lr",
               "must be in (0, 1)", self.drafter_lr)
        _check(isinstance(self.drafter_spot_share, (int, float)) and 0 < self.drafter_spot_share <= 1,
               "drafter_spot_share", "must be in (0, 1]", self.drafter_spot_share)
        _check(self.drafter_spot_stream in SPOT_STREAMS, "drafter_spot_stream", f"must be one of {SPOT_STREAMS}",
               self.drafter_spot_stream)
        _check(self.drafter_spot_stream != "side" or not self.drafter or str(self.device).startswith("cuda"),
               "drafter_spot_stream", "'side' needs device cuda", self.device)
        _check(self.drafter_size is None or (isinstance(self.drafter_size, int) and self.drafter_size >= 1),
               "drafter_size", "must be null or an integer >= 1", self.drafter_size)
        _check(self.drafter_init is None or (isinstance(self.drafter_init, str)
                                             and (Path(self.drafter_init) / "drafter.json").is_file()),
               "drafter_init", "must be null or a drafter directory (with drafter.json)", self.drafter_init)
        _check(self.drafter_init is None or self.drafter_size is None, "drafter_size",
               "must be null with drafter_init (the warm start has its size)", self.drafter_size)
        _check(self.drafter_vocab is None or (isinstance(self.drafter_vocab, int) and self.drafter_vocab >= 0),
               "drafter_vocab", "must be null or an integer >= 0", self.drafter_vocab)
        _check(self.drafter_init is None or self.drafter_vocab is None, "drafter_vocab",
               "must be null with drafter_init (the warm start has its vocabulary)", self.drafter_vocab)
        if not self.drafter:
            return
        _check(self.speculative_config() is not None, "drafter", "needs speculative decoding on (speculative: "
               "false drafts nothing)", self.drafter)
        _check(not (isinstance(self.speculative, dict) and self.speculative.get("drafter") is not None),
               "drafter", "replaces speculative.drafter (use drafter_init for a warm start); set one",
               self.drafter)

    def pool_config(self) -> PoolConfig | None:
        """The rollout pool's config, or None for one plain engine."""
        if self.instances == 1 and self.scheduler is None and self.backend == "local":
            return None
        return PoolConfig(instances=self.instances, scheduler=self.scheduler or "context", backend=self.backend,
                          chunk_tokens=self.chunk_tokens, threads_per_instance=self.num_threads)

    def speculative_config(self, drafter_dir: str | None = None) -> SpeculativeConfig | None:
        """With ``drafter`` on and the online drafter's directory given: method ``hybrid``
        (or ``drafter`` if the mapping asks for it) over that drafter; without the directory
        (validation), the same config with suffix drafts only."""
        if self.speculative is None or self.speculative is False:
            return None
        if self.speculative is not True and not isinstance(self.speculative, dict):
            raise ValueError(f"must be true, false, null or a mapping, got {self.speculative!r}")
        values = {} if self.speculative is True else dict(self.speculative)
        if self.drafter:
            method = "drafter" if values.get("method") == "drafter" else "hybrid"
            values.pop("drafter", None)              # set by the trainer only (checked in _check_drafter)
            values["method"] = method if drafter_dir else "suffix"
            if drafter_dir:
                values["drafter"] = drafter_dir
        return SpeculativeConfig.coerce(values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "TrainConfig":
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a mapping of config keys, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown config key {unknown[0]!r} (known keys: {', '.join(sorted(known))})")
        try:
            return cls(**data)
        except TypeError as e:   # a wrong type that comparisons choke on
            raise ValueError(f"{source}: {e}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` from the command line; the value is parsed as YAML (``10``, ``true``, ``null``)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} must look like key=value")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """A YAML file of TrainConfig keys, then ``key=value`` overrides."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {path}: invalid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path}: expected a mapping of config keys")
    for item in overrides or []:
        key, value = parse_override(item)
        data[key] = value
    return TrainConfig.from_dict(data, source=f"config file {path}")
