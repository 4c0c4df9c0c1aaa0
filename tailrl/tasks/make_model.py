"""`tailrl make-model --preset {test,small} | --standin {50m,0.5b} --out DIR`: train a workload model, or widen one.

``--preset`` builds the tokenizer and a Qwen2 model from scratch on the mixed task solutions
and saves a Hugging Face checkpoint (bf16 safetensors, config.json with eos_token_id,
generation_config.json, tokenizer files, train_info.json). The output is a pure function of
the preset (see tailrl/tasks/train.py for the determinism caveats).

A stand-in (tailrl/model/standin.py) is computed from a trained checkpoint (``--source``,
default the shipped ``models/small``): the same tokens at a larger model's cost per step.
``--drafter DIR`` widens a learned drafter of the source with it (``OUT/drafter``).
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import random
import time
from pathlib import Path

import torch

from tailrl.model.standin import STANDINS, build_standin, build_standin_drafter, get_standin
from tailrl.tasks import mixture
from tailrl.tasks.models import shipped_model
from tailrl.tasks.presets import PRESETS, ModelPreset, get_preset
from tailrl.tasks.tokenizer import save_tokenizer, special_ids, train_tokenizer
from tailrl.tasks.train import batches, train

log = logging.getLogger(__name__)

VAL_EXAMPLES = 256


def qwen2_config(preset: ModelPreset, ids: dict[str, int], vocab_size: int):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size, hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers, num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads, max_position_embeddings=preset.max_position_embeddings,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, use_cache=True,
        hidden_act="silu", attention_dropout=0.0, **ids)


def save_checkpoint(model: torch.nn.Module, out: Path) -> None:
    """Weights in bf16 (the training model itself stays float32), plus generation config."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    # save_pretrained records the in-memory (float32) dtype; the file holds bf16
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "bfloat16"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    cfg = model.config
    GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                     pad_token_id=cfg.pad_token_id, do_sample=True, temperature=1.0, top_k=0,
                     top_p=1.0, max_length=cfg.max_position_embeddings).save_pretrained(str(out))


def build(preset: ModelPreset, out: str | Path) -> dict[str, float | None]:
    """Train ``preset`` and write the checkpoint to ``out``; returns the training figures."""
    from transformers import Qwen2ForCausalLM

    out = Path(out)
    t0 = time.time()
    torch.set_num_threads(preset.num_threads)
    random.seed(preset.seed)
    torch.manual_seed(preset.seed)
    texts = (ex.text for ex in itertools.islice(mixture.training_examples(), preset.tokenizer_examples))
    tok = train_tokenizer(texts, preset.vocab_size)
    ids = special_ids(tok)
    model = Qwen2ForCausalLM(qwen2_config(preset, ids, tok.get_vocab_size()))
    n_params = sum(p.numel() for p in model.parameters())
    log.info("preset %s: %.2fM parameters", preset.name, n_params / 1e6)

    val_examples = mixture.heldout_examples(VAL_EXAMPLES)
    val = list(itertools.islice(batches(tok, iter(val_examples * 2), preset,
                                        ids["eos_token_id"], ids["pad_token_id"]), 0, 4)) \
        if preset.eval_every else None
    data = batches(tok, mixture.training_examples(), preset, ids["eos_token_id"], ids["pad_token_id"])

    def checkpoint(step: int) -> None:
        save_checkpoint(model, out / "checkpoints" / f"step-{step}")
        save_tokenizer(tok, out / "checkpoints" / f"step-{step}", preset.max_position_embeddings)

    figures = train(model, data, preset, val, checkpoint)
    save_checkpoint(model, out)
    save_tokenizer(tok, out, preset.max_position_embeddings)
    figures.update(params=float(n_params), build_seconds=time.time() - t0)
    info = {"preset": {k: getattr(preset, k) for k in preset.__dataclass_fields__}, "figures": figures}
    (out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    return figures


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tailrl make-model", description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group()
    what.add_argument("--preset", choices=sorted(PRESETS), default=None, help="train this preset (default small)")
    what.add_argument("--standin", metavar="NAME", default=None,
                      help=f"build this stand-in of --source instead of training ({', '.join(STANDINS)})")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--source", default=None, help="stand-in only: the checkpoint to widen (default models/small)")
    p.add_argument("--drafter", default=None,
                   help="stand-in only: also widen this drafter of the source into OUT/drafter")
    p.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    p.add_argument("--checkpoint-every", type=int, default=None, help="also save every N steps")
    p.add_argument("--threads", type=int, default=None, help="torch threads (changes the last bits)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.standin is not None:
        return _standin_main(p, args)
    if args.source is not None or args.drafter is not None:
        p.error("--source and --drafter go with --standin")
    preset = get_preset(args.preset or "small").with_overrides(
        steps=args.steps, checkpoint_every=args.checkpoint_every, num_threads=args.threads)
    figures = build(preset, args.out)
    print(f"saved {args.out}")
    print(json.dumps({"preset": preset.name, "out": str(args.out), **figures}))
    return 0


def _standin_main(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    training = [f"--{k.replace('_', '-')}" for k in ("steps", "checkpoint_every", "threads")
                if getattr(args, k) is not None]
    if training:
        p.error(f"{', '.join(training)} train a preset; a stand-in is not trained")
    source = args.source or shipped_model("small")
    if source is None:     # never fall back to an 80-minute build of small behind the user's back
        p.error("no models/small in this checkout: pass --source DIR (or build it with --preset small)")
    try:
        spec = get_standin(args.standin)
        figures = build_standin(spec, source, args.out)
        if args.drafter is not None:
            build_standin_drafter(spec, source, args.drafter, Path(args.out) / "drafter")
    except ValueError as e:
        p.error(str(e))
    print(f"saved {args.out}")
    drafter = {"drafter": str(Path(args.out) / "drafter")} if args.drafter is not None else {}
    print(json.dumps({"standin": spec.name, "source": str(source), "out": str(args.out), **figures, **drafter}))
    return 0
