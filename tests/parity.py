"""Our module's logits against Hugging Face's, and the check that a ModelArgs field is what makes
them equal."""
from __future__ import annotations

import dataclasses
import os

import torch
import transformers
from safetensors.torch import load_file, save_file

from tailrl import SamplingParams
from tailrl.engine.batch import build_batch
from tailrl.engine.kv import KVCache
from tailrl.engine.request import Request
from tailrl.model.loader import load_model


def our_logits(path: str, tokens: list[int]) -> torch.Tensor:
    """Prefill `tokens` as one chunk and return logits at every position."""
    model = load_model(path)
    kv = KVCache(model.args, torch.float32, "cpu", 4096, 4, 512)
    kv.grow(0, len(tokens))
    req = Request("r", tokens, SamplingParams(), 0)
    batch = build_batch([(req, len(tokens))], {}, kv)
    hidden = model(batch.input_ids, batch.positions, kv.layers(), batch.meta)
    return model.logits(hidden)


def assert_fields_make_hf_logits(path: str, monkeypatch, *wrongs: dict) -> None:
    """Our float32 logits of 37 tokens within 1e-4 of Hugging Face's, and more than 1e-2 from them
    with the checkpoint's config read with each of ``wrongs`` (ModelArgs fields replaced): what
    those fields hold is what makes the logits Hugging Face's."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (our_logits(path, tokens) - ref).abs().max().item() < 1e-4
    import tailrl.model.loader as loader
    parse = loader.parse_config
    for wrong in wrongs:
        monkeypatch.setattr(loader, "parse_config",
                            lambda cfg, source="", wrong=wrong: dataclasses.replace(parse(cfg, source), **wrong))
        assert (our_logits(path, tokens) - ref).abs().max().item() > 1e-2, wrong


def noisy_norms(model: torch.nn.Module, std: float = 0.1) -> torch.nn.Module:
    """``model`` with noise added to its norms' weights (a random model's are all ones)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(std * torch.randn_like(p))
    return model


def assert_language_model_equals_hf_under_either_naming(hf, path: str) -> None:
    """An image-text model's language model (``hf``) saved at ``path`` as published (under
    language_model.model., the vision tower and projector beside it, not loaded), then as a
    trainer's module names it (model.language_model.): our float32 logits of 47 tokens within
    1e-4 of Hugging Face's either way."""
    hf.save_pretrained(path)
    tokens = list(range(3, 50))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([tokens])).logits[0]
    assert (our_logits(path, tokens) - ref).abs().max().item() < 1e-4
    file = os.path.join(path, "model.safetensors")
    assert any(k.startswith("language_model.model.layers.") for k in load_file(file))
    state = {k: v.clone() for k, v in hf.state_dict().items()}     # clones: a tied head shares no storage
    assert any(k.startswith("model.language_model.layers.") for k in state)
    assert any(k.startswith("model.vision_tower.") for k in state)
    save_file(state, file)
    assert (our_logits(path, tokens) - ref).abs().max().item() < 1e-4
