"""Hugging Face checkpoint directory -> our Transformer.

Reads config.json (+ generation_config.json for EOS) and safetensors weights, single file or
sharded with an index (quantized weights, gpt-oss's MXFP4 and block-scaled FP8, dequantized as
they are read: quantized.py). Errors name the missing file or field and the supported
architectures.
"""
from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tailrl.model import quantized
from tailrl.model.args import ModelArgs, parse_config
from tailrl.model.hf_names import check, load_hf
from tailrl.model.parallel import Shard, read_part, shard_args, shard_tensor
from tailrl.model.transformer import Transformer

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def read_config(path: str) -> tuple[dict, str]:
    """(config.json as a dict, its path), or a ValueError naming what is missing."""
    if not os.path.isdir(path):
        raise ValueError(f"model: {path!r} is not a directory")
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"model: {path!r} has no config.json")
    with open(cfg_path) as f:
        return json.load(f), cfg_path


def fp8_block(path: str) -> tuple[int, int] | None:
    """The blocks of a checkpoint's FP8 weight scales (``quantization_config.weight_block_size``;
    None where it names none: parse_config refuses an FP8 checkpoint without them)."""
    block = ((read_config(path)[0].get("quantization_config") or {}).get("weight_block_size"))
    return (int(block[0]), int(block[1])) if block else None


def read_args(path: str) -> ModelArgs:
    cfg, cfg_path = read_config(path)
    args = parse_config(cfg, cfg_path)
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        if eos is not None:
            eos = (eos,) if isinstance(eos, int) else tuple(eos)
            args = ModelArgs(**{**args.__dict__, "eos_token_ids": tuple(dict.fromkeys(args.eos_token_ids + eos))})
    return args


def weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, s) for s in shards]
    else:
        files = [os.path.join(path, "model.safetensors")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"model: {path!r} is missing weight file(s) {[os.path.basename(m) for m in missing]} "
                         "(expected model.safetensors or a sharded index)")
    return files


def tensor_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in a checkpoint's weight files, read from their headers alone (an
    quantized pair's: the tensor it makes)."""
    out = {}
    for f in weight_files(path):
        with safe_open(f, "pt") as g:
            out.update({k: tuple(g.get_slice(k).get_shape()) for k in g.keys()})
    return quantized.shapes(out)


def load_state_dict(path: str, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (quantized pairs dequantized to ``dtype``)."""
    sd: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        sd.update(load_file(f))
    return dict(quantized.dequantized(sd.items(), dtype, block=fp8_block(path)))


def _read(files: list[str], args: ModelArgs, shard: Shard | None):
    """(name, tensor) of every tensor in ``files``, a rank's part where ``shard`` (only those
    bytes read; a quantized half whole: its rank's part is cut once dequantized)."""
    for f in files:
        with safe_open(f, "pt") as g:
            for k in g.keys():
                whole = shard is None or quantized.base_name(k) is not None or \
                    g.get_slice(k).get_dtype().startswith("F8")
                yield k, g.get_tensor(k) if whole else read_part(k, g.get_slice(k), args, shard)


def load_matching_state_dict(path: str, like: str) -> dict[str, torch.Tensor]:
    """The weights at ``path``, checked to fit the model served from ``like`` before any is read:
    the same config (architecture and shapes) and the same tensor names and shapes. A mismatch
    is a ValueError naming it (new weights are copied in place: a partial copy would mix models)."""
    new, old = read_args(path), read_args(like)
    if new != old:
        diff = [f"{k}: {getattr(old, k)!r} -> {getattr(new, k)!r}" for k in old.__dict__
                if getattr(old, k) != getattr(new, k)]
        raise ValueError(f"model_path: {path!r} is not the served model's architecture ({'; '.join(diff)})")

    have, want = tensor_shapes(path), tensor_shapes(like)
    missing = sorted(set(want) - set(have))
    if missing:
        raise ValueError(f"model_path: {path!r} lacks {len(missing)} tensor(s) of the served model, "
                         f"e.g. {missing[0]!r}")
    wrong = [k for k in sorted(want) if have[k] != want[k]]
    if wrong:
        raise ValueError(f"model_path: {path!r} has {wrong[0]!r} of shape {list(have[wrong[0]])}, "
                         f"the served model {list(want[wrong[0]])}")
    return load_state_dict(path)


def load_model(path: str, dtype: str = "float32", device: str = "cpu", max_len: int | None = None,
               shard: Shard | None = None, reduce=None) -> Transformer:
    """Build our module from a checkpoint directory, on ``device``. max_len bounds the RoPE
    table. Every tensor's name and shape is checked (from the files' headers) before the weights
    are allocated; then the tensors are read one at a time and copied into place, so the host
    holds one of them at a time, never the whole checkpoint. ``shard``: one rank's part of the
    model split over devices (parallel.py; ``reduce``: the sum across ranks), reading only the
    bytes of that part; the LM head on rank 0 alone."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    args = read_args(path)
    files, shapes = weight_files(path), tensor_shapes(path)
    with torch.device("meta"):                       # names and shapes, before any allocation
        check(Transformer(args, 1, DTYPES[dtype], "meta"), shapes.items(), complete=True)
    max_len = max_len or args.max_position_embeddings
    if shard is None:
        model = Transformer(args, max_len, DTYPES[dtype], device)
    else:
        model = Transformer(shard_args(args, shard.size), max_len, DTYPES[dtype], device, reduce, shard.rank == 0)
    split = None if shard is None else (lambda name, t: shard_tensor(name, t, args, shard))
    load_hf(model, quantized.dequantized(_read(files, args, shard), DTYPES[dtype], device, split, fp8_block(path)),
            complete=False)
    log.info("loaded %s (%s, %.1fM params%s) from %s", args.architecture, dtype,
             sum(p.numel() for p in model.parameters()) / 1e6,
             "" if shard is None else f", rank {shard.rank} of {shard.size}", path)
    return model.eval()
