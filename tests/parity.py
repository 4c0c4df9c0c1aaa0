"""Our module's logits against Hugging Face's, and the check that a ModelArgs field is what makes
them equal."""
from __future__ import annotations

import dataclasses

import torch
import transformers

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
