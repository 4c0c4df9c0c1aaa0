"""The `test` preset trains, saves, and loads in transformers and in our LLM with equal logits;
builds are deterministic and the cache is written atomically."""
import json
import os
from pathlib import Path

import pytest
import torch

from tailrl.tasks import mixture
from tailrl.tasks.make_model import build
from tailrl.tasks.models import SHIPPED_ROOT, build_cached, cached_model_path, get_model, shipped_model
from tailrl.tasks.presets import get_preset


@pytest.fixture(scope="module")
def test_model() -> str:
    return get_model("test")


def test_checkpoint_files_and_stop_token(test_model):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    path = Path(test_model)
    config = json.loads((path / "config.json").read_text())
    gen = json.loads((path / "generation_config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["eos_token_id"] == gen["eos_token_id"] == 2 and config["dtype"] == "bfloat16"
    tok = AutoTokenizer.from_pretrained(test_model)
    assert tok.eos_token_id == 2 and tok.encode("add 1 2\n")[0] == tok.bos_token_id
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    info = json.loads((path / "train_info.json").read_text())
    assert info["figures"]["train_loss"] < 5.0     # it learned something from ln(292) = 5.68


def test_transformers_and_llm_agree(test_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tailrl import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(test_model)
    hf = AutoModelForCausalLM.from_pretrained(test_model, dtype=torch.float32).eval()
    prompts = [tok.encode(ex.prompt) for ex in mixture.heldout_examples(3)]
    llm = LLM(model=test_model, seed=0, dtype="float32")
    sampled = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, sampled):
        for o in out.outputs:
            full = torch.tensor([prompt + o.token_ids])
            with torch.no_grad():
                logp = torch.log_softmax(hf(full).logits[0, len(prompt) - 1: -1].float(), dim=-1)
            ref = logp.gather(1, torch.tensor(o.token_ids)[:, None])[:, 0]
            assert torch.allclose(torch.tensor(o.logprobs), ref, atol=1e-4)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for prompt, out in zip(prompts, greedy):
        ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == ref


def test_build_is_deterministic(tmp_path):
    preset = get_preset("test").with_overrides(steps=3, tokenizer_examples=500)
    build(preset, tmp_path / "a")
    build(preset, tmp_path / "b")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    other = preset.with_overrides(seed=1)
    build(other, tmp_path / "c")
    assert (tmp_path / "a" / "model.safetensors").read_bytes() != (tmp_path / "c" / "model.safetensors").read_bytes()


def test_checkpoint_at_step_k_equals_a_k_step_run(tmp_path):
    """The lr schedule ignores the total step count, so the shipped `small` weights (a
    checkpoint of a longer run) are exactly what `make-model` with that many steps builds."""
    preset = get_preset("test").with_overrides(steps=3, tokenizer_examples=500)
    build(preset.with_overrides(steps=6, checkpoint_every=3), tmp_path / "long")
    build(preset, tmp_path / "short")
    ckpt = tmp_path / "long" / "checkpoints" / "step-3" / "model.safetensors"
    assert ckpt.read_bytes() == (tmp_path / "short" / "model.safetensors").read_bytes()


def test_cache_is_built_once_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("TAILRL_CACHE", str(tmp_path))
    preset = get_preset("test").with_overrides(steps=2, tokenizer_examples=300)
    path = build_cached(preset)
    assert path == cached_model_path(preset) and str(path).startswith(str(tmp_path))
    leftovers = [p.name for p in path.parent.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]
    assert leftovers == []
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    assert build_cached(preset) == path and os.stat(path / "model.safetensors").st_mtime_ns == stamp
    assert cached_model_path(preset.with_overrides(steps=3)) != path   # presets never share a cache entry


def test_small_resolves_to_the_shipped_weights():
    if shipped_model("small") is None:
        pytest.skip("this checkout ships no models/small")
    path = get_model("small")
    assert path == str(SHIPPED_ROOT / "small")
    info = json.loads((Path(path) / "train_info.json").read_text())
    assert info["preset"]["steps"] == get_preset("small").steps   # make-model reproduces what ships


def test_unknown_preset_is_rejected():
    with pytest.raises(ValueError, match="preset"):
        get_model("huge")
