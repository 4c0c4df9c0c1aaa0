"""GLM-4.5 / GLM-4.6 (Glm4MoeForCausalLM; DeepSeek-V3's routing: model/moe.py ``route_groups``):
the published config read as transformers reads it, the route as Hugging Face's router defines
it, the float32 router kept float32 and its product row-invariant in a bfloat16 engine, the
checkpoint's multi-token-prediction layers skipped (and nothing else), and the fields that make
the logits Hugging Face's. Logits and greedy tokens against Hugging Face, speculation lossless
and a trainer's weights are in the architecture-wide tests (test_hf_parity.py, test_moe.py)."""
import json
import os

import pytest
import torch
import transformers
from parity import assert_fields_make_hf_logits
from safetensors.torch import save_file

from tailrl import LLM, SamplingParams
from tailrl.kernels import select
from tailrl.model.args import parse_config
from tailrl.model.loader import load_model, load_state_dict
from tailrl.model.moe import route_groups, sigmoid_rows
from tailrl.model.transformer import Transformer

# zai-org/GLM-4.5-Air's config.json (the fields that matter)
GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "eos_token_id": [151329, 151336, 151338],
    "first_k_dense_replace": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "intermediate_size": 10944, "max_position_embeddings": 131072, "model_type": "glm4_moe",
    "moe_intermediate_size": 1408, "n_group": 1, "n_routed_experts": 128, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 96, "num_experts_per_tok": 8, "num_hidden_layers": 46,
    "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-05,
    "rope_theta": 1000000, "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1,
    "use_qk_norm": False, "vocab_size": 151552}
# zai-org/GLM-4.5's differences (355B: q/k norms, three dense layers, weights times 2.5)
GLM45 = {**GLM45_AIR, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
         "n_routed_experts": 160, "num_hidden_layers": 92, "first_k_dense_replace": 3, "routed_scaling_factor": 2.5,
         "use_qk_norm": True}


@pytest.mark.parametrize("cfg,billions", [(GLM45_AIR, 106), (GLM45, 353)])
def test_the_published_configs_read_as_transformers_reads_them(cfg, billions):
    a = parse_config(cfg)
    hf = transformers.Glm4MoeConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
    assert a.sparse_layers == tuple(range(hf.first_k_dense_replace, hf.num_hidden_layers))
    assert (a.num_experts, a.experts_per_token, a.moe_intermediate_size, a.shared_expert_size) == (
        hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size,
        hf.moe_intermediate_size * hf.n_shared_experts)
    assert (a.expert_groups, a.groups_per_token, a.routed_scaling, a.norm_topk_prob) == (
        hf.n_group, hf.topk_group, hf.routed_scaling_factor, hf.norm_topk_prob)
    assert a.router_sigmoid and a.router_float32 and not a.shared_expert_gate and a.mtp_layers == 1
    assert a.rotary_dim == int(hf.head_dim * hf.rope_parameters["partial_rotary_factor"]) == 64
    assert not a.rope_interleaved and a.qkv_bias and not a.o_bias and a.qk_norm == hf.use_qk_norm
    assert a.num_parameters == pytest.approx(billions * 1e9, rel=0.01)        # the published totals, MTP aside
    few = parse_config({**cfg, "num_hidden_layers": 4})                      # the count is the module's (4 layers)
    assert few.num_parameters == sum(p.numel() for p in Transformer(few, 1, torch.bfloat16, "meta").parameters())
    bare = {k: v for k, v in cfg.items() if k not in ("partial_rotary_factor", "n_group", "topk_group",
                                                      "norm_topk_prob", "num_nextn_predict_layers")}
    b = parse_config(bare)                                                    # transformers' defaults
    assert (b.rotary_dim, b.expert_groups, b.groups_per_token, b.norm_topk_prob, b.mtp_layers) == (64, 1, 1, True, 1)


def test_bad_routing_settings_name_their_field():
    with pytest.raises(ValueError, match="n_group"):
        parse_config({**GLM45_AIR, "n_group": 3})                             # 128 experts in 3 groups
    with pytest.raises(ValueError, match="topk_group"):
        parse_config({**GLM45_AIR, "n_group": 8, "topk_group": 9})
    with pytest.raises(ValueError, match="num_experts_per_tok"):              # 2 groups of 16 hold 32 experts
        parse_config({**GLM45_AIR, "n_group": 8, "topk_group": 2, "num_experts_per_tok": 33})


def test_route_groups_chooses_in_the_best_groups_by_score_plus_bias_and_weighs_by_score():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, -3.0, -3.0, -3.0]])    # groups {0..3}, {4..7}
    scores, zero = sigmoid_rows(logits), torch.zeros(8)
    # group 0's two best (2, 1) outweigh group 1's (3, -3): expert 4, the best alone, is not taken
    ids, w = route_groups(logits, zero, 3, groups=2, chosen=1, normalise=True, scale=2.5)
    top = scores[0, [0, 1, 2]]
    assert ids.tolist() == [[0, 1, 2]] and torch.equal(w[0], top / (top[0] + top[1] + top[2] + 1e-20) * 2.5)
    bias = torch.tensor([0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 0.0])              # the bias chooses, it does not weigh
    ids, w = route_groups(logits, bias, 3, groups=2, chosen=1, normalise=False, scale=1.0)
    assert ids.tolist() == [[0, 1, 3]] and torch.equal(w[0], scores[0, [0, 1, 3]])
    assert route_groups(logits, zero, 3, 2, 2, False, 1.0)[0].tolist() == [[0, 1, 4]]     # every group open
    assert route_groups(torch.zeros(1, 8), zero, 3, 2, 1, False, 1.0)[0].tolist() == [[0, 1, 2]]   # ties: lower ids


def test_route_groups_is_hugging_faces_router():
    cfg = transformers.Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                     topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    router = Glm4MoeTopkRouter(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.3)
    h = torch.randn(64, 32)
    with torch.no_grad():
        _, hf_w, hf_ids = router(h)
    hf_ids, order = torch.sort(hf_ids, dim=-1)
    ids, w = route_groups(h @ router.weight.T, router.e_score_correction_bias, 4, 4, 2, True, 2.5)
    assert torch.equal(ids, hf_ids) and torch.allclose(w, hf_w.gather(1, order), rtol=1e-6, atol=0)


def test_a_tokens_route_is_its_own_alone_or_in_a_batch():
    """The scores' sigmoid (PyTorch's CPU sigmoid gives a row other bits alone than in a batch)
    and the route: a token's experts and weights alone equal its row among 300."""
    torch.manual_seed(1)
    logits, bias = torch.randn(300, 16), 0.3 * torch.randn(16)
    assert torch.allclose(sigmoid_rows(logits), torch.sigmoid(logits), rtol=2 ** -21, atol=0)   # a few ulps
    ids, w = route_groups(logits, bias, 4, 4, 2, True, 2.5)
    for t in range(0, 300, 7):
        one = route_groups(logits[t:t + 1], bias, 4, 4, 2, True, 2.5)
        assert torch.equal(one[0][0], ids[t]) and torch.equal(one[1][0], w[t]) and torch.equal(
            sigmoid_rows(logits[t:t + 1])[0], sigmoid_rows(logits)[t])


def test_the_float32_router_product_is_row_invariant_and_rounded_from_the_exact_sum():
    torch.manual_seed(0)
    kernels = select("cpu", torch.bfloat16)
    x, w = torch.randn(37, 256).bfloat16(), torch.randn(16, 256)
    out = kernels.linear_float32(x, w)
    assert out.dtype == torch.float32
    for t in (0, 5, 36):
        assert torch.equal(kernels.linear_float32(x[t:t + 1], w)[0], out[t])
    exact = x.double() @ w.double().T
    assert ((out.double() - exact).abs() <= exact.abs() * 2.0 ** -24 * 1.01).all()


def test_a_bfloat16_engine_keeps_the_router_float32_as_hugging_face_does(ckpt_dir):
    path = ckpt_dir("glm4_moe", num_layers=2)
    ours = load_model(path, "bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    gate = hf.model.layers[1].mlp.gate
    moe = ours.layers[1].moe
    assert ours.layers[0].moe is None and ours.layers[1].qkv.weight.dtype == torch.bfloat16
    assert moe.router.dtype == moe.score_bias.dtype == gate.weight.dtype == torch.float32
    assert torch.equal(moe.router, gate.weight) and torch.equal(moe.score_bias, gate.e_score_correction_bias)


def _with_tensors(src: str, dst: str, extra: dict, **config) -> str:
    """``src``'s checkpoint with ``extra`` tensors added (and ``config`` fields replaced), at ``dst``."""
    os.makedirs(dst, exist_ok=True)
    save_file({**load_state_dict(src), **extra}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**cfg, **config}, f)
    return dst


def test_the_multi_token_prediction_layers_are_skipped_and_nothing_else(ckpt_dir, tmp_path):
    """GLM-4.5's checkpoints hold num_nextn_predict_layers more layers after the model's own (its
    MTP module: the engine does not draft with it); they load as the model without them, and a
    layer past them, or with the config saying none, is refused by name."""
    path = ckpt_dir("glm4_moe", num_layers=2)
    mtp = {"model.layers.2.eh_proj.weight": torch.zeros(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
           "model.layers.2.mlp.experts.0.up_proj.weight": torch.zeros(48, 64)}
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = LLM(path).generate([[3, 5, 7]], sp)[0].outputs[0].token_ids
    with_mtp = _with_tensors(path, str(tmp_path / "mtp"), mtp)
    assert LLM(with_mtp).generate([[3, 5, 7]], sp)[0].outputs[0].token_ids == want
    further = _with_tensors(path, str(tmp_path / "further"), {"model.layers.3.eh_proj.weight": torch.zeros(64, 128)})
    with pytest.raises(ValueError, match=r"model\.layers\.3\.eh_proj\.weight"):
        load_model(further)
    none = _with_tensors(path, str(tmp_path / "none"), mtp, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match=r"model\.layers\.2\."):
        load_model(none)


def test_the_routing_fields_are_what_makes_the_logits_hugging_faces(ckpt_dir, monkeypatch):
    """Every group open, no scaling of the weights, or no renormalising: the logits leave Hugging
    Face's (the tiny model's 8 experts in 2 groups, a token's 3 from the better one, weights x 2.5)."""
    assert_fields_make_hf_logits(ckpt_dir("glm4_moe", init_std=0.5), monkeypatch, dict(groups_per_token=2),
                                 dict(routed_scaling=1.0), dict(norm_topk_prob=False))
