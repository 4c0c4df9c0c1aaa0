"""A learned drafter of a source model widened for one of its stand-ins (tailrl/model/standin.py):
it drafts on the stand-in exactly what it drafts on the source, at the cost of a drafter sized
for the stand-in. Its features are the target's normed hidden states, which a stand-in's are
with zero channels appended, so fc, attention and MLP are padded with zeros (its heads to the
stand-in's KV-head count, its MLP to the stand-in's width, as ``DrafterConfig.from_target``
sizes a drafter) and its norms rescaled as the stand-in's are.
"""
from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailrl.drafter.network import CONFIG_FILE, WEIGHTS_FILE, DrafterConfig, read_config
from tailrl.model.args import ModelArgs
from tailrl.model.loader import read_args
from tailrl.model.standin import StandinSpec, Widener, check_fits, place


def widen_drafter(sd: dict[str, torch.Tensor], cfg: DrafterConfig, src: ModelArgs,
                  spec: StandinSpec) -> tuple[DrafterConfig, dict[str, torch.Tensor]]:
    """A drafter of ``src`` (config ``cfg``, trainable weights ``sd``) for ``spec``'s stand-in:
    heads padded to the stand-in's KV heads (at least the drafter's own), its MLP to the
    stand-in's width scaled as the drafter's is to its target's, eps and norms rescaled."""
    if cfg.hidden_size != src.hidden_size or cfg.vocab_size != src.vocab_size:
        raise ValueError(f"drafter: hidden_size {cfg.hidden_size} / vocab_size {cfg.vocab_size} are not the "
                         f"source's ({src.hidden_size} / {src.vocab_size})")
    check_fits(src, spec)
    h0, H, d = cfg.hidden_size, spec.hidden_size, cfg.head_dim
    heads = max(cfg.num_heads, spec.num_kv_heads)
    inter = max(cfg.intermediate_size, round(cfg.intermediate_size * spec.intermediate_size / src.intermediate_size))
    out_cfg = replace(cfg, hidden_size=H, intermediate_size=inter, num_heads=heads,
                      rms_norm_eps=cfg.rms_norm_eps * h0 / H)
    i0, n0 = cfg.intermediate_size, cfg.num_heads * d
    n = heads * d
    lead = torch.arange(h0)
    scale = Widener(src, spec).norm                    # x sqrt(h0/H), zero-padded to H
    out = {name: scale(t) for name, t in sd.items() if name.endswith("norm")}
    if "vocab" in sd:                                  # the same tokens: the stand-in speaks the source's vocabulary
        out["vocab"] = sd["vocab"]
    out["fc.weight"] = place(sd["fc.weight"], (H, 2 * H), cols=torch.cat([lead, H + lead]))   # [h0, 2h0] -> [H, 2H]
    out["fc.bias"] = place(sd["fc.bias"], (H,))
    rows = torch.cat([j * n + torch.arange(n0) for j in range(3)])                               # q, k, v blocks
    out["qkv.weight"] = place(sd["qkv.weight"], (3 * n, H), rows=rows)
    out["o.weight"] = place(sd["o.weight"], (H, n))
    out["gate_up.weight"] = place(sd["gate_up.weight"], (2 * inter, H),
                                   rows=torch.cat([torch.arange(i0), inter + torch.arange(i0)]))  # gate, up blocks
    out["down.weight"] = place(sd["down.weight"], (H, inter))
    missing = sorted(set(sd) - set(out))
    if missing:
        raise ValueError(f"drafter: no rule to widen {missing}")
    return out_cfg, out


def build_standin_drafter(spec: StandinSpec, source: str | Path, drafter: str | Path, out: str | Path) -> None:
    """Write the widened ``drafter`` (a drafter directory of the ``source`` checkpoint) to
    ``out``, a drafter directory that ``SpeculativeConfig(drafter=out)`` loads on the stand-in."""
    drafter, out = Path(drafter), Path(out)
    cfg = read_config(str(drafter / CONFIG_FILE))
    new_cfg, weights = widen_drafter(load_file(str(drafter / WEIGHTS_FILE)), cfg, read_args(str(source)), spec)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(asdict(new_cfg), indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / WEIGHTS_FILE))
