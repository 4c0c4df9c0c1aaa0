"""Model presets for `tailrl make-model`: architecture and training budget, one flat config.

``test`` is for tests and CI (built in about a minute, not expected to solve anything);
``small`` is the workload model of the demo and the benchmarks; ``mini`` the same tasks at a
cheaper step (a cost point below ``small`` for benchmarks, built in about 5 minutes).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class ModelPreset:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024
    vocab_size: int = 320            # BPE target size (bytes + specials + merges)
    tokenizer_examples: int = 20_000  # training examples the tokenizer is fitted on
    steps: int = 1000                # optimizer steps
    batch_tokens: int = 8192         # token budget per batch, padding included
    lr: float = 3e-3                 # peak learning rate
    warmup_steps: int = 100          # linear warmup, then lr * sqrt(warmup / step)
    weight_decay: float = 0.01
    seed: int = 0
    num_threads: int = 2             # torch threads; results are bit-identical only for the same count
    eval_every: int = 200            # validation loss every this many steps (0 = never)
    checkpoint_every: int = 0        # also save a checkpoint every this many steps (0 = never)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or v < 0):
                raise ValueError(f"{f.name} must be a non-negative int, got {v!r}")
        positive = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                    "max_position_embeddings", "steps", "batch_tokens", "num_threads")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"num_heads must divide hidden_size, got {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads, got {self.num_kv_heads}")
        if self.batch_tokens < self.max_position_embeddings:
            raise ValueError(f"batch_tokens must hold one full-length sequence, got {self.batch_tokens}")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")
        if not 0 <= self.weight_decay < 1:
            raise ValueError(f"weight_decay must be in [0, 1), got {self.weight_decay!r}")

    def with_overrides(self, **changes: object) -> "ModelPreset":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


PRESETS: dict[str, ModelPreset] = {
    "test": ModelPreset(name="test", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=192, tokenizer_examples=4000, steps=60,
                        batch_tokens=4096, lr=3e-3, warmup_steps=10, eval_every=0),
    "small": ModelPreset(name="small", hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4,
                         intermediate_size=768, steps=2750, batch_tokens=4096, lr=2e-3,
                         warmup_steps=200, eval_every=250),
    "mini": ModelPreset(name="mini", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        intermediate_size=384, steps=2000, batch_tokens=4096, lr=3e-3,
                        warmup_steps=200, eval_every=250),
}


def get_preset(name: str) -> ModelPreset:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name]
