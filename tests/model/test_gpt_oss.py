"""gpt-oss (GptOssForCausalLM): the published configs read as transformers reads them, the route
as Hugging Face's router defines it, MXFP4 checkpoints dequantized as transformers dequantizes
them (whole and split over ranks), and each rank's part of its weights. Logits and greedy tokens
against Hugging Face are in tests/engine/test_hf_parity.py; speculation lossless, a token's bits
alone and in a batch, and a trainer's weights in tests/model/test_moe.py; the kernels' sinks and
clamped SwiGLU in tests/kernels."""
import json
import os

import pytest
import torch
import transformers
from parity import assert_fields_make_hf_logits, our_logits
from safetensors import safe_open
from safetensors.torch import save_file

from tailrl import LLM, SamplingParams
from tailrl.model import quantized
from tailrl.model.args import parse_config
from tailrl.model.loader import load_model, load_state_dict, read_args, tensor_shapes
from tailrl.model.moe import route_top_logits
from tailrl.model.parallel import Shard, read_part, shard_tensor
from tailrl.model.transformer import Transformer

# openai/gpt-oss-20b's config.json (the fields that matter); gpt-oss-120b's differences
LAYERS_20B = 24
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "eos_token_id": 200002, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * (LAYERS_20B // 2), "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": LAYERS_20B,
    "num_key_value_heads": 8, "num_local_experts": 32, "pad_token_id": 199999,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
    "vocab_size": 201088}
GPT_OSS_120B = {**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18}


@pytest.mark.parametrize("cfg,billions", [(GPT_OSS_20B, 20.9), (GPT_OSS_120B, 116.8)])
def test_the_published_configs_read_as_transformers_reads_them(cfg, billions):
    a = parse_config(cfg)
    hf = transformers.GptOssConfig(**{k: v for k, v in cfg.items() if k not in ("architectures",
                                                                                 "quantization_config")})
    assert a.sparse_layers == tuple(range(hf.num_hidden_layers)) and a.num_experts == hf.num_local_experts
    assert (a.experts_per_token, a.moe_intermediate_size, a.swiglu) == (
        hf.num_experts_per_tok, hf.intermediate_size, (hf.swiglu_alpha, hf.swiglu_limit))
    assert a.layer_windows == tuple(hf.sliding_window if t == "sliding_attention" else 0 for t in hf.layer_types)
    assert a.rope_theta == hf.rope_parameters["rope_theta"] and a.rope_yarn[:2] == (32.0, 4096) and not a.rope_yarn[5]
    assert a.attn_sinks and a.qkv_bias and a.o_bias and a.router_topk_softmax and a.expert_bias
    assert a.num_parameters == pytest.approx(billions * 1e9, rel=0.005)     # OpenAI's model card: 20.9B, 116.8B
    few = parse_config({**cfg, "num_hidden_layers": 4, "layer_types": cfg["layer_types"][:4]})
    assert few.num_parameters == sum(p.numel() for p in Transformer(few, 1, torch.bfloat16, "meta").parameters())
    bare = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_theta", "layer_types", "swiglu_limit",
                                                      "sliding_window")}
    assert parse_config(bare) == parse_config(cfg)                           # transformers' defaults are these


def test_bad_settings_name_their_field():
    with pytest.raises(ValueError, match="swiglu_limit"):
        parse_config({**GPT_OSS_20B, "swiglu_limit": 0.0})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        parse_config({**GPT_OSS_20B, "num_experts_per_tok": 33})
    with pytest.raises(ValueError, match="quantization_config .*'awq'"):
        parse_config({**GPT_OSS_20B, "quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="quantization_config .*'mxfp4'"):       # only gpt-oss's experts
        parse_config({"architectures": ["Qwen2ForCausalLM"], "quantization_config": {"quant_method": "mxfp4"}})


def test_the_route_is_the_softmax_of_the_top_k_logits_with_ties_to_the_lower_expert():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, -1.0], [3.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    ids, w = route_top_logits(logits, 3)
    assert ids.tolist() == [[1, 2, 3], [0, 1, 2]]
    assert torch.equal(w, torch.softmax(logits.gather(1, ids), dim=-1))
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(0))   # no ties: Hugging Face's router
    ids, w = route_top_logits(logits, 3)
    top, hf_ids = torch.topk(logits, 3)
    order = torch.argsort(hf_ids, dim=1)
    assert torch.equal(ids, hf_ids.gather(1, order))
    assert torch.allclose(w, torch.softmax(top, dim=1).gather(1, order), rtol=0, atol=1e-7)


def test_the_fields_and_sinks_are_what_makes_the_logits_hugging_faces(ckpt_dir, tmp_path, monkeypatch):
    """No clamp, no window, no YaRN, or the route's softmax over every expert: the logits leave
    Hugging Face's; so do they with every sink far below every score (as without sinks)."""
    path = ckpt_dir("gpt_oss")
    assert_fields_make_hf_logits(path, monkeypatch, dict(swiglu=(1.702, 100.0)), dict(layer_windows=()),
                                 dict(rope_yarn=None), dict(router_topk_softmax=False))
    sd = load_state_dict(path, torch.float32)
    sinkless = str(tmp_path / "sinkless")
    os.makedirs(sinkless)
    save_file({k: torch.full_like(v, -80.0) if k.endswith("sinks") else v for k, v in sd.items()},
              os.path.join(sinkless, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f, open(os.path.join(sinkless, "config.json"), "w") as g:
        g.write(f.read())
    monkeypatch.undo()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = list(range(3, 40))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert (our_logits(sinkless, tokens) - ref).abs().max().item() > 1e-2


def _quantize_checkpoint(src: str, dst: str) -> dict[str, torch.Tensor]:
    """A copy of checkpoint ``src`` whose experts are random MXFP4 pairs (config saying so), and
    the tensors transformers' own dequantization makes of them (``convert_moe_packed_tensors``)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(0)
    sd, made = {}, {}
    for name, t in load_state_dict(src).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            sd[name] = t
            continue
        e, cols, rows = t.shape                                             # the module's [E, cols, rows]
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(122, 130, (e, rows, cols // 32), generator=g, dtype=torch.uint8)
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
        made[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    os.makedirs(dst)
    save_file(sd, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, "quantization_config": {"quant_method": "mxfp4"}}, f)
    return made


def test_an_mxfp4_checkpoint_loads_as_transformers_dequantizes_it_whole_and_split(ckpt_dir, tmp_path):
    path = ckpt_dir("gpt_oss")
    made = _quantize_checkpoint(path, str(tmp_path / "mxfp4"))
    mx = str(tmp_path / "mxfp4")
    assert tensor_shapes(mx) == tensor_shapes(path)
    sd = load_state_dict(mx, torch.float32)
    assert all(torch.equal(sd[name], t) for name, t in made.items())
    plain = {**load_state_dict(path), **made}                               # the same weights, dequantized on disk
    os.makedirs(tmp_path / "plain")
    save_file({k: v.contiguous() for k, v in plain.items()}, str(tmp_path / "plain" / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f, open(tmp_path / "plain" / "config.json", "w") as g:
        g.write(f.read())
    for dtype in ("float32", "bfloat16"):
        a, b = load_model(mx, dtype), load_model(str(tmp_path / "plain"), dtype)
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    for rank in range(2):                                                   # a rank's part: cut once dequantized
        a = load_model(mx, "float32", shard=Shard(rank, 2))
        b = load_model(str(tmp_path / "plain"), "float32", shard=Shard(rank, 2))
        assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert LLM(mx).generate([[5, 6, 7]], sp)[0].outputs[0].token_ids == \
        LLM(str(tmp_path / "plain")).generate([[5, 6, 7]], sp)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="no partner"):
        list(quantized.dequantized([("model.layers.0.mlp.experts.down_proj_blocks", made["model.layers.0.mlp.experts."
                                                                                     "down_proj"])], torch.float32))


def test_the_ranks_parts_tile_every_weight(ckpt_dir):
    """Sinks by query heads; the experts' [gate, up] pairs by units (adjacent columns), down by
    rows; the down bias added by rank 0 alone; the router whole."""
    path = ckpt_dir("gpt_oss")
    args = read_args(path)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as g:
        for name in g.keys():
            whole = g.get_tensor(name)
            parts = [read_part(name, g.get_slice(name), args, Shard(r, 2)) for r in range(2)]
            assert all(torch.equal(p, shard_tensor(name, whole, args, Shard(r, 2))) for r, p in enumerate(parts))
            if name.endswith(("o_proj.bias", "down_proj_bias")):
                assert torch.equal(parts[0], whole) and not parts[1].any(), name
                continue
            dim = {"sinks": 0, "gate_up_proj": 2, "gate_up_proj_bias": 1, "down_proj": 1}.get(name.split(".")[-1])
            if dim is not None:
                assert torch.equal(torch.cat(parts, dim), whole) and parts[0].shape[dim] * 2 == whole.shape[dim], name
