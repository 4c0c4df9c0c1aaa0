"""Hugging Face names -> our tensors: whole sets, buckets of any part, and what is refused."""
from __future__ import annotations

import random

import pytest
import torch
import transformers

from tailrl.model.hf_names import checkpoint_names, load_hf, slots
from tailrl.model.loader import load_model, load_state_dict

ARCHS = ["qwen2", "qwen3", "llama", "phi3", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss",
         "deepseek_v3_plain"]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_a_checkpoints_names_and_a_trainers_module_names_all_have_slots(ckpt_dir, arch):
    path = ckpt_dir(arch)
    table = slots(load_model(path))
    assert sorted(checkpoint_names(table)) == sorted(load_state_dict(path))
    module = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert set(module) <= set(table)
    for name, tensor in module.items():
        assert tuple(tensor.shape) == table[name].shape, name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", ["disk", "module"])
def test_buckets_in_any_order_load_what_the_whole_set_loads(ckpt_dir, arch, source):
    """A trainer's update sent in shuffled buckets of five tensors (as pairs) writes every
    checkpoint name once all arrived, and leaves the model equal to the new checkpoint."""
    path, new = ckpt_dir(arch), ckpt_dir(arch, seed=1)
    weights = (load_state_dict(new) if source == "disk"
               else transformers.AutoModelForCausalLM.from_pretrained(new).state_dict())
    items = list(weights.items())
    random.Random(0).shuffle(items)
    model, want = load_model(path), load_model(new)
    assert not same(model, want)
    written = set()
    for i in range(0, len(items), 5):
        written |= load_hf(model, items[i:i + 5], complete=False)
    assert written == set(checkpoint_names(slots(model)))
    assert same(model, want)


def test_a_part_writes_its_rows_of_a_fused_projection_and_nothing_else(ckpt_dir):
    path = ckpt_dir("qwen3")
    model, before = load_model(path), load_model(path)
    q = torch.full_like(load_state_dict(path)["model.layers.1.self_attn.q_proj.weight"], 0.5)
    norm = torch.full((16,), 2.0)
    written = load_hf(model, iter([("model.layers.1.self_attn.q_proj.weight", q),
                                   ("model.layers.0.self_attn.k_norm.weight", norm)]), complete=False)
    assert written == {"model.layers.1.self_attn.q_proj.weight", "model.layers.0.self_attn.k_norm.weight"}
    a = model.args
    qkv, old = model.layers[1].qkv.weight, before.layers[1].qkv.weight
    rows = a.num_heads * a.head_dim
    assert torch.equal(qkv[:rows], q) and torch.equal(qkv[rows:], old[rows:])
    assert torch.equal(model.layers[0].qk_norm[a.num_heads:], norm.expand(a.num_kv_heads, -1))
    assert torch.equal(model.layers[0].qk_norm[:a.num_heads], before.layers[0].qk_norm[:a.num_heads])
    changed = [n for (n, x), y in zip(model.named_parameters(), before.parameters()) if not torch.equal(x, y)]
    assert changed == ["layers.0.qk_norm", "layers.1.qkv.weight"]


def test_a_tied_head_and_rotary_tables_are_not_weights(ckpt_dir):
    path = ckpt_dir("qwen2", tie=True)
    model = load_model(path)
    assert "lm_head.weight" not in checkpoint_names(slots(model))
    sd = dict(load_state_dict(path))
    sd["lm_head.weight"] = torch.zeros_like(sd["model.embed_tokens.weight"])
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    load_hf(model, sd, complete=True)
    assert torch.equal(model.embed.weight, sd["model.embed_tokens.weight"])


@pytest.mark.parametrize("bad, field", [
    (("model.layers.9.mlp.up_proj.weight", torch.zeros(1)), "model.layers.9.mlp.up_proj.weight"),
    (("model.norm.weight", torch.zeros(3)), "has shape (3,)"),
    (("model.norm.weight", [1.0]), "must be a torch.Tensor"),
    ((7, torch.zeros(1)), "names must be strings"),
    ("model.norm.weight", "expected (name, tensor) pairs"),
])
def test_what_does_not_fit_is_a_value_error_naming_it_and_a_whole_set_copies_nothing(ckpt_dir, bad, field):
    path = ckpt_dir("qwen2")
    model, before = load_model(path), load_model(path)
    new = load_state_dict(ckpt_dir("qwen2", seed=1))
    with pytest.raises(ValueError, match=field.replace("(", r"\(").replace(")", r"\)")):
        load_hf(model, [bad], complete=False)
    if isinstance(bad, tuple) and isinstance(bad[0], str):
        with pytest.raises(ValueError, match="weights: "):
            load_hf(model, {**new, bad[0]: bad[1]}, complete=True)
    assert same(model, before)
    missing = dict(new)
    del missing["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match="missing the tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_hf(model, missing, complete=True)
    assert same(model, before)


def test_a_checkpoint_is_checked_by_its_headers_then_read_a_tensor_at_a_time(ckpt_dir, tmp_path, monkeypatch):
    """``load_model`` gives every tensor of the checkpoint in the model's dtype; a checkpoint with
    a tensor too many, too few or of another shape is a ValueError naming it before the
    weights are allocated (on the meta device: no memory)."""
    import shutil

    from safetensors.torch import save_file

    from tailrl.model import loader
    path = ckpt_dir("qwen3")
    sd = load_state_dict(path)
    model = load_model(path, dtype="bfloat16")
    table = slots(model)
    assert all(torch.equal(table[n].dest, t.to(torch.bfloat16).expand(table[n].dest.shape)) for n, t in sd.items())
    built = []
    real = loader.Transformer
    monkeypatch.setattr(loader, "Transformer", lambda *a: built.append(a[3]) or real(*a))
    for change, field in [({"model.layers.0.mlp.extra.weight": torch.zeros(2)}, "no tensor named 'model.layers.0.mlp"),
                          ({"model.norm.weight": torch.zeros(3)}, "'model.norm.weight' has shape"),
                          ({"model.norm.weight": None}, "missing the tensor 'model.norm.weight'")]:
        bad = tmp_path / str(len(built))
        shutil.copytree(path, bad)
        save_file({k: v for k, v in {**sd, **change}.items() if v is not None}, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=field):
            load_model(str(bad), dtype="bfloat16")
    assert set(built) == {"meta"}
