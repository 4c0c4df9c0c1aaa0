"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral: model/moe.py): the route and the experts'
weighted sum as defined, a token's result its own alone or in a batch, speculation lossless in
bfloat16 and float64, and new weights from a trainer's module (Hugging Face's fused expert
tensors) equal to the same weights read from disk. Equality with Hugging Face's logits and greedy
tokens is in tests/engine/test_hf_parity.py."""
import pytest
import torch
import transformers

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.kernels import select
from tailrl.kernels.backend import combine_experts
from tailrl.model.args import parse_config
from tailrl.model.loader import load_model
from tailrl.model.moe import route

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "gpt_oss", "deepseek_v3", "deepseek_v2")


def test_route_takes_the_top_k_with_ties_to_the_lower_expert_and_lists_them_by_id():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0, 1.0, -1.0],       # a tie at the top and one at the edge
                           [3.0, 1.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    ids, w = route(logits, 3, normalise=False, float32_weights=True)
    assert ids.tolist() == [[1, 2, 3], [0, 1, 2]]
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    assert w.dtype == torch.float32 and torch.equal(w, probs.gather(1, ids))
    ids, w = route(logits, 3, normalise=True, float32_weights=False)
    assert w.dtype == torch.float64
    top = probs.gather(1, ids)
    assert torch.equal(w, (top / (top[:, :1] + top[:, 1:2] + top[:, 2:3])).double())


def test_route_and_experts_give_a_token_the_same_bits_alone_and_in_a_batch():
    """bfloat16 on this machine's kernels: the route, and the experts' outputs (each expert's
    products over whichever tokens it got), of a token alone equal its row among 37 others."""
    torch.manual_seed(0)
    kernels = select("cpu", torch.bfloat16)
    e, h, i, k = 8, 64, 48, 3
    x = torch.randn(37, h).bfloat16()
    router = (0.3 * torch.randn(e, h)).bfloat16()
    gate_up, down = (0.2 * torch.randn(e, 2 * i, h)).bfloat16(), (0.2 * torch.randn(e, h, i)).bfloat16()

    def mixture(rows):
        ids, w = route(kernels.linear(rows, router), k, normalise=True, float32_weights=False)
        return ids, kernels.experts(rows, gate_up, down, ids, w)
    ids, out = mixture(x)
    for t in (0, 5, 36):
        ids1, out1 = mixture(x[t:t + 1])
        assert torch.equal(ids1[0], ids[t]) and torch.equal(out1[0], out[t])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_a_sparse_layer_gives_a_token_the_same_bits_alone_and_in_a_batch(ckpt_dir, arch, dtype):
    """A whole sparse layer (router, route, experts, shared expert and its gate): each of 37
    tokens alone equals its row among the others. Elementwise functions count here: PyTorch's
    CPU sigmoid gave a float64 Qwen2-MoE gate other bits alone than in a batch (moe.sigmoid_rows)."""
    model = load_model(ckpt_dir(arch, init_std=1.0, max_pos=512), {torch.bfloat16: "bfloat16"}.get(dtype, "float64"))
    layer = next(layer for layer in model.layers if layer.moe is not None)
    kernels = select("cpu", dtype)
    h = torch.randn(37, model.args.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        out = layer.moe(h, kernels)
        assert all(torch.equal(layer.moe(h[t:t + 1], kernels)[0], out[t]) for t in range(37))


def test_experts_compute_the_definition():
    """float64 (exact products): each row is its experts' MLPs weighted and added in order."""
    torch.manual_seed(1)
    kernels = select("cpu", torch.float64)
    e, h, i, t, k = 5, 16, 12, 9, 2
    x = torch.randn(t, h, dtype=torch.float64)
    gate_up, down = torch.randn(e, 2 * i, h, dtype=torch.float64), torch.randn(e, h, i, dtype=torch.float64)
    ids = torch.sort(torch.stack([torch.randperm(e)[:k] for _ in range(t)]), dim=1).values
    w = torch.rand(t, k, dtype=torch.float64)
    got = kernels.experts(x, gate_up, down, ids, w)
    for r in range(t):
        want = torch.zeros(h, dtype=torch.float64)
        for j in range(k):
            g, u = (gate_up[ids[r, j]] @ x[r]).chunk(2)
            want = want + w[r, j] * (down[ids[r, j]] @ (torch.nn.functional.silu(g) * u))
        assert torch.allclose(got[r], want, rtol=1e-12, atol=1e-12)
    ys = torch.randn(t, k, h).bfloat16()
    wf = torch.rand(t, k)
    assert torch.equal(combine_experts(ys, wf), ((ys[:, 0] * wf[:, :1]).bfloat16() + (ys[:, 1] * wf[:, 1:]).bfloat16()))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_a_speculative_rollout_equals_plain_decoding_and_a_request_alone(ckpt_dir, arch, dtype):
    path = ckpt_dir(arch, init_std=1.0, max_pos=512)
    prompts = [[5, 17, 30, 8, 9, 5, 17, 30], [40, 41, 42, 40, 41], [3, 3, 3, 3]]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    plain = LLM(path, dtype=dtype)
    spec = LLM(path, dtype=dtype, speculative=SpeculativeConfig(policy="fixed"))
    for _ in range(2):                                              # the second call drafts from the first's history
        a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
        for x, y in zip(a, b, strict=True):
            for cx, cy in zip(x.outputs, y.outputs, strict=True):
                assert (cy.token_ids, cy.logprobs) == (cx.token_ids, cx.logprobs), arch
    assert spec.last_metrics["rollout/spec_accept_length"] > 1.0
    alone = LLM(path, dtype=dtype).generate([prompts[1]], sp)[0]
    assert [(o.token_ids, o.logprobs) for o in alone.outputs] == [(o.token_ids, o.logprobs) for o in a[1].outputs]


@pytest.mark.parametrize("arch", ARCHS)
def test_new_weights_from_a_trainers_module_equal_the_same_weights_from_disk(ckpt_dir, tmp_path, arch):
    """A trainer's Hugging Face module holds each layer's experts fused ([E, 2I, H] and [E, H, I]);
    its checkpoint on disk holds one tensor per expert and projection: both load alike."""
    path = ckpt_dir(arch, init_std=1.0, max_pos=512)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert any(name.endswith("experts.gate_up_proj") for name in hf.state_dict())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "experts" in name or name.endswith("gate.weight"):
                p.mul_(1.5)
    hf.save_pretrained(tmp_path)
    prompts = [[5, 17, 30, 8, 9], [40, 41, 42]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=16, ignore_eos=True, seed=7)
    llm = LLM(path, dtype="bfloat16")
    before = llm.generate(prompts, sp)
    llm.load_weights(hf.state_dict())
    got = llm.generate(prompts, sp)
    want = LLM(str(tmp_path), dtype="bfloat16").generate(prompts, sp)
    pairs = lambda outs: [(o.token_ids, o.logprobs) for r in outs for o in r.outputs]   # noqa: E731
    assert pairs(got) == pairs(want) != pairs(before)
    a, b = load_model(str(tmp_path)), load_model(path)
    b.load_hf_state_dict(hf.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_bad_expert_settings_name_their_field():
    cfg = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=97, hidden_size=64, intermediate_size=128,
               num_hidden_layers=2, num_attention_heads=4, num_experts=8, num_experts_per_tok=9,
               moe_intermediate_size=32)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        parse_config(cfg)
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        parse_config(dict(cfg, num_experts_per_tok=2, decoder_sparse_step=0))
    with pytest.raises(ValueError, match="num_experts"):
        parse_config({k: v for k, v in cfg.items() if k != "num_experts"})
    a = parse_config(dict(cfg, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[]))
    assert a.sparse_layers == (1,) and a.num_experts == 8


def test_the_learned_drafter_drafts_for_a_mixture_losslessly(ckpt_dir, tmp_path):
    """TLT's drafter (one dense layer over the target's hidden states, its embedding and head
    shared) on a Qwen3-MoE target: hybrid drafts (drafter trees and suffix chains), every step
    verifying the drafter's, give plain decoding's bfloat16 tokens and log-probabilities."""
    from tailrl.drafter.network import Drafter
    path = ckpt_dir("qwen3_moe", init_std=3.0, max_pos=512)
    Drafter.for_target(load_model(path, "float32"), intermediate_size=64).save(str(tmp_path))
    prompts = [[5, 17, 30, 8, 9], [40, 41, 42]]
    sp = SamplingParams(n=3, temperature=1.0, max_tokens=32, ignore_eos=True, seed=2)
    plain = LLM(path)
    spec = LLM(path, speculative=SpeculativeConfig(policy="fixed", method="hybrid", drafter=str(tmp_path),
                                                    max_tree_paths=2, min_token_prob=0.0))
    spec.engine.speculator.choice.always = True
    for _ in range(2):
        a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
        assert [[(o.token_ids, o.logprobs) for o in r.outputs] for r in b] == \
            [[(o.token_ids, o.logprobs) for o in r.outputs] for r in a]
    m = spec.last_metrics                       # a fresh drafter's drafts are mostly rejected: rejection verified
    assert m["rollout/spec_draft_tokens/drafter"] > 0 and m["rollout/spec_accepted_tokens"] > 0
