"""Training a workload model from scratch (``tailrl make-model --preset``, tailrl/cli/make_model.py).

``build`` makes the tokenizer and a Qwen2 model from scratch on the mixed task solutions
and saves a Hugging Face checkpoint (bf16 safetensors, config.json with eos_token_id,
generation_config.json, tokenizer files, train_info.json). The output is a pure function of
the preset (see tailrl/tasks/train.py for the determinism caveats).
"""
from __future__ import annotations

import itertools
import json
import logging
import random
import time
from pathlib import Path

import torch

from tailrl.tasks import mixture
from tailrl.tasks.presets import ModelPreset
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
