"""Cost-faithful stand-ins: a bigger checkpoint that computes a small model's exact function.

Everything tailrl measures runs on ``small`` (4.8M parameters, weights in the CPU's cache);
real policies stream 0.5-70B parameters from memory every step. A stand-in has a larger
model's shapes (width, depth, heads, MLP) and therefore its cost per step, but the same
tokens and log-probabilities as its source, so speculation and scheduling can be measured at
that cost without training anything. It is a cost model, not a new model.

Construction (every step exact in real arithmetic; float32 differs only by rounding):

* hidden, MLP and head dimensions are padded with zeros: the source's channels sit first,
  padded channels carry 0 through every layer (zero rows in, zero columns out);
* head_dim is kept (RoPE's frequencies depend on it); added attention heads have zero
  weights and biases, and the source's heads are placed so that each source query head
  still reads its own key/value head under the new grouping (``head_slots``);
* added layers have zero weights, in particular o_proj and down_proj, so the residual
  passes them unchanged;
* every RMSNorm weight is multiplied by sqrt(h0/H) and eps by h0/H (h0, H: source and
  stand-in hidden sizes). Over the padded vector mean(x^2) is (h0/H) times the source's, so
  x / sqrt(mean + eps') * w' = x / sqrt(mean0 + eps) * w exactly;
* embedding and LM head get zero columns (tied or not, as the source).

A learned drafter of the source widens the same way (tailrl/drafter/standin.py): its features are the target's normed hidden states, which a
stand-in's are with zero channels appended, so a drafter whose fc, attention and MLP are
padded with zeros (its heads to the stand-in's KV-head count, its MLP to the stand-in's
width, as ``DrafterConfig.from_target`` sizes a drafter) and whose norms are rescaled drafts
exactly what the source's drafter drafts for the source, at the cost of a drafter sized for
the stand-in.

Matrices keep the source's dtype (bfloat16 for ``small``). The rescaled RMSNorm weights are
stored in float32 (a few KB): rounding w * sqrt(h0/H) to bfloat16 would change the function
that a float32 run of the stand-in computes; a bfloat16 engine rounds them when it loads.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailrl.model.args import ModelArgs
from tailrl.model.loader import read_args, weight_files

log = logging.getLogger(__name__)

# Copied unchanged when present: the stand-in speaks the source's vocabulary.
TOKENIZER_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


@dataclass(frozen=True)
class StandinSpec:
    """The shapes of a stand-in; head_dim, vocabulary and context come from the source."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name != "name" and (not isinstance(getattr(self, f.name), int) or getattr(self, f.name) < 1):
                raise ValueError(f"{f.name} must be an int >= 1, got {getattr(self, f.name)!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads must divide num_heads ({self.num_heads}), got {self.num_kv_heads}")


# Sizes for ``small`` (head_dim 32). "0.5b" has Qwen2.5-0.5B's transformer shapes: its
# 14 query / 2 KV heads of 64 dims are 28 / 4 heads of 32 here, the same projection shapes,
# attention work and KV bytes per token. Its 151,936-token embedding is not reproduced (the
# vocabulary stays the source's), so this is the 0.36B non-embedding part of Qwen2.5-0.5B.
# "0.5b-kv" is "0.5b" with 14 KV heads of 32 dims: 43 KB of bfloat16 K/V per token (0.5b: 12 KB;
# Qwen3-0.6B: 112 KB), the K/V weight of real checkpoints at 0.5b's cost per step.
STANDINS: dict[str, StandinSpec] = {
    "50m": StandinSpec("50m", hidden_size=512, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=2048),
    "0.5b": StandinSpec("0.5b", hidden_size=896, num_layers=24, num_heads=28, num_kv_heads=4,
                        intermediate_size=4864),
    "0.5b-kv": StandinSpec("0.5b-kv", hidden_size=896, num_layers=24, num_heads=28, num_kv_heads=14,
                           intermediate_size=4864),
}


def get_standin(name: str) -> StandinSpec:
    if name not in STANDINS:
        raise ValueError(f"standin must be one of {sorted(STANDINS)}, got {name!r}")
    return STANDINS[name]


def check_fits(src: ModelArgs, spec: StandinSpec) -> None:
    """Raise ValueError naming the first field of ``spec`` that cannot hold ``src``."""
    for field, have in (("hidden_size", src.hidden_size), ("num_layers", src.num_layers),
                        ("intermediate_size", src.intermediate_size), ("num_kv_heads", src.num_kv_heads)):
        if getattr(spec, field) < have:
            raise ValueError(f"{field} must be >= the source's {have}, got {getattr(spec, field)}")
    group = src.num_heads // src.num_kv_heads
    if spec.num_heads // spec.num_kv_heads < group:
        raise ValueError(f"num_heads must give each of the {spec.num_kv_heads} KV heads at least the source's "
                         f"{group} query heads, got {spec.num_heads}")


def head_slots(src_heads: int, src_kv: int, heads: int, kv: int) -> tuple[list[int], list[int]]:
    """Where the source's query and KV heads go among ``heads`` / ``kv`` heads.

    Grouped-query attention reads KV head h // (heads / kv) for query head h. Source KV head j
    stays at j; source query head i (the r-th of KV head j's group, r < g0) goes to the r-th
    slot of group j, so it still reads KV head j. Unused slots get zero weights."""
    g0, g = src_heads // src_kv, heads // kv
    kv_slots = list(range(src_kv))
    q_slots = [(i // g0) * g + i % g0 for i in range(src_heads)]
    return q_slots, kv_slots


def _head_rows(slots: list[int], head_dim: int) -> torch.Tensor:
    """Row indices of the heads at ``slots`` in a [heads * head_dim, ...] projection."""
    return (torch.tensor(slots)[:, None] * head_dim + torch.arange(head_dim)[None, :]).flatten()


def place(t: torch.Tensor, shape: tuple[int, ...], rows: torch.Tensor | None = None,
           cols: torch.Tensor | None = None) -> torch.Tensor:
    """Zeros of ``shape`` with ``t`` written at ``rows`` (dim 0) and ``cols`` (dim 1); the
    leading block when an index is None."""
    out = t.new_zeros(shape)
    rows = torch.arange(t.shape[0]) if rows is None else rows
    if t.dim() == 1:
        out[rows] = t
    else:
        cols = torch.arange(t.shape[1]) if cols is None else cols
        out[rows[:, None], cols[None, :]] = t
    return out


class Widener:
    """Maps each source tensor, by its Hugging Face name, to the stand-in's tensor."""

    def __init__(self, src: ModelArgs, spec: StandinSpec):
        self.src, self.spec = src, spec
        d = src.head_dim
        q_slots, kv_slots = head_slots(src.num_heads, src.num_kv_heads, spec.num_heads, spec.num_kv_heads)
        self.q_rows, self.kv_rows = _head_rows(q_slots, d), _head_rows(kv_slots, d)
        self.q_dim, self.kv_dim = spec.num_heads * d, spec.num_kv_heads * d
        self.norm_scale = math.sqrt(src.hidden_size / spec.hidden_size)

    def norm(self, t: torch.Tensor) -> torch.Tensor:
        # float64 product rounded once; float32 at least (see the module docstring)
        out_dtype = torch.promote_types(t.dtype, torch.float32)
        scaled = (t.double() * self.norm_scale).to(out_dtype)
        return place(scaled, (self.spec.hidden_size,))

    def __call__(self, name: str, t: torch.Tensor) -> torch.Tensor:
        H, I = self.spec.hidden_size, self.spec.intermediate_size
        kind = ".".join(name.split(".")[-2:])     # e.g. "model.layers.3.self_attn.q_proj.weight" -> "q_proj.weight"
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            return self.norm(t)
        if kind in ("embed_tokens.weight", "lm_head.weight"):
            return place(t, (t.shape[0], H))                                # [V, h0] -> [V, H]
        if kind in ("q_norm.weight", "k_norm.weight"):
            return t.clone()                                                 # per head_dim: unchanged
        if kind == "q_proj.weight":
            return place(t, (self.q_dim, H), rows=self.q_rows)              # [Hq0*D, h0] -> [Hq*D, H]
        if kind == "q_proj.bias":
            return place(t, (self.q_dim,), rows=self.q_rows)
        if kind in ("k_proj.weight", "v_proj.weight"):
            return place(t, (self.kv_dim, H), rows=self.kv_rows)            # [KV0*D, h0] -> [KV*D, H]
        if kind in ("k_proj.bias", "v_proj.bias"):
            return place(t, (self.kv_dim,), rows=self.kv_rows)
        if kind == "o_proj.weight":
            return place(t, (H, self.q_dim), cols=self.q_rows)              # [h0, Hq0*D] -> [H, Hq*D]
        if kind in ("o_proj.bias", "down_proj.bias"):
            return place(t, (H,))
        if kind in ("gate_proj.weight", "up_proj.weight"):
            return place(t, (I, H))                                         # [i0, h0] -> [I, H]
        if kind in ("gate_proj.bias", "up_proj.bias"):
            return place(t, (I,))
        if kind == "down_proj.weight":
            return place(t, (H, I))                                         # [h0, i0] -> [H, I]
        raise ValueError(f"standin: no rule to widen the tensor {name!r} of shape {tuple(t.shape)}")


def widen_state_dict(sd: dict[str, torch.Tensor], src: ModelArgs, spec: StandinSpec) -> dict[str, torch.Tensor]:
    """The stand-in's weights (Hugging Face names) from the source's."""
    check_fits(src, spec)
    widen = Widener(src, spec)
    out = {name: widen(name, t) for name, t in sd.items()}
    # Added layers: every tensor of a source layer's shape, zero (o_proj and down_proj above
    # all: the residual stream passes through unchanged).
    last = f"model.layers.{src.num_layers - 1}."
    template = {name[len(last):]: t for name, t in out.items() if name.startswith(last)}
    for layer in range(src.num_layers, spec.num_layers):
        for leaf, t in template.items():
            out[f"model.layers.{layer}.{leaf}"] = torch.zeros_like(t)
    return out


def standin_config(cfg: dict, src: ModelArgs, spec: StandinSpec) -> dict:
    """The source's config.json with the stand-in's shapes and eps (other keys unchanged)."""
    out = dict(cfg)
    out.update(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
               num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
               num_key_value_heads=spec.num_kv_heads,
               head_dim=src.head_dim,          # explicit: it no longer follows from hidden / heads in general
               rms_norm_eps=src.rms_norm_eps * src.hidden_size / spec.hidden_size)
    if isinstance(cfg.get("layer_types"), list) and cfg["layer_types"]:
        types = list(cfg["layer_types"])
        out["layer_types"] = types + [types[-1]] * (spec.num_layers - len(types))
    return out


def _count(sd: dict[str, torch.Tensor], tied: bool) -> int:
    """Parameters, a tied LM head (some checkpoints save a copy of the embedding) counted once."""
    return sum(t.numel() for name, t in sd.items() if not (tied and name == "lm_head.weight"))


def build_standin(spec: StandinSpec, source: str | Path, out: str | Path) -> dict[str, float | str]:
    """Write the stand-in of ``source`` with ``spec``'s shapes to ``out``: model.safetensors,
    config.json, the source's tokenizer and generation files, standin_info.json. Returns its
    figures (parameters, bytes of the weight file)."""
    source, out = Path(source), Path(out)
    src = read_args(str(source))
    check_fits(src, spec)                    # before reading any weights
    files = weight_files(str(source))
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(f))
    weights = widen_state_dict(sd, src, spec)
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(standin_config(cfg, src, spec), indent=2, sort_keys=True) + "\n")
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    # save_file leaves a private (0600) file; give it the mode the umask gives config.json
    os.chmod(out / "model.safetensors", (out / "config.json").stat().st_mode & 0o777)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)
    digest = hashlib.sha256()
    for f in files:
        digest.update(Path(f).read_bytes())
    figures: dict[str, float | str] = {
        "params": float(_count(weights, src.tie_word_embeddings)),
        "source_params": float(_count(sd, src.tie_word_embeddings)),
        "bytes": float((out / "model.safetensors").stat().st_size),
        "source_sha256": digest.hexdigest(),
    }
    info = {"spec": asdict(spec), "source": str(source), "figures": figures}
    (out / "standin_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log.info("stand-in %s: %.1fM parameters, %.1f MB, from %s", spec.name, figures["params"] / 1e6,
             figures["bytes"] / 1e6, source)
    return figures
