"""Checkpoints with the published configs of Qwen2.5-0.5B, Qwen3-0.6B and Llama-3.2-1B (random
weights, 2 layers; vocabulary, heads, head_dim, norms, tying, rope and context as published)
load with the defaults, equal Hugging Face (greedy tokens and log-probabilities in float32),
and a speculative rollout equals plain decoding in bfloat16. Their full-depth contexts get a
KV budget that fits, or a context capped with a log line, or an error that names the fix."""
import logging

import pytest
import torch
import transformers
from real_configs import REAL_CONFIGS, REAL_MOE_CONFIGS, make_real_checkpoint

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.config import EngineConfig
from tailrl.engine.kv import budget as kv_budget
from tailrl.engine.kv import size_kv
from tailrl.model.args import parse_config
from tailrl.model.rope import inv_frequencies

GiB = 2**30


@pytest.fixture(scope="module")
def real_checkpoints(tmp_path_factory):
    """Factory: each published config's checkpoint, made once for the module."""
    made: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in made:
            made[name] = make_real_checkpoint(str(tmp_path_factory.mktemp(name)), name)
        return made[name]
    return get


# Llama-3.2-1B's 128k-token vocabulary makes its checkpoint and its comparison the slowest here
# (~34 s); its rope scaling is checked against transformers' own below, in the default run
@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n == "llama-3.2-1b" else n
                                        for n in sorted(REAL_CONFIGS)])
def real(request, real_checkpoints):
    return request.param, real_checkpoints(request.param)


def test_loads_with_defaults_and_equals_hugging_face(real):
    name, path = real
    llm = LLM(path)                                                 # the defaults: bfloat16, the checkpoint's context
    assert llm.engine.max_model_len == REAL_CONFIGS[name]["max_position_embeddings"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [[5, 17, 30, 8, 9], [40, 41, 42]]
    outs = LLM(path, dtype="float32").generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs, strict=True):
        got = o.outputs[0]
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0].tolist()
        assert got.token_ids == ref[len(p):], name
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ref[:-1]])).logits[0].double(), -1)
        want = [float(logp[len(p) - 1 + j, t]) for j, t in enumerate(got.token_ids)]
        assert got.logprobs == pytest.approx(want, abs=2e-4), name


# Llama-3.2-1B's rollouts: with -m slow, as its comparison above
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "llama-3.2-1b" else n
                                  for n in sorted(REAL_CONFIGS)])
def test_a_speculative_rollout_equals_plain_decoding(real_checkpoints, name):
    path = real_checkpoints(name)
    prompts = [[5, 17, 30, 8, 9, 5, 17, 30], [40, 41, 42, 40, 41]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=24, ignore_eos=True, seed=3)
    plain, spec = LLM(path), LLM(path, speculative=SpeculativeConfig(policy="fixed"))
    for _ in range(2):                                              # the second call drafts from the first's history
        a, b = plain.generate(prompts, sp), spec.generate(prompts, sp)
        for x, y in zip(a, b, strict=True):
            for cx, cy in zip(x.outputs, y.outputs, strict=True):
                assert (cy.token_ids, cy.logprobs) == (cx.token_ids, cx.logprobs), name
    assert spec.last_metrics["rollout/spec_draft_tokens"] > 0


def test_llama3_rope_scaling_matches_the_published_rule():
    """Llama 3.1's frequencies: long wavelengths / factor, short ones kept, the band between
    blended; equal to transformers' own computation."""
    cfg = transformers.LlamaConfig(**{k: v for k, v in REAL_CONFIGS["llama-3.2-1b"].items() if k != "architectures"})
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    args = parse_config(REAL_CONFIGS["llama-3.2-1b"])
    got = inv_frequencies(args.head_dim, args.rope_theta, args.rope_llama3)
    assert torch.allclose(got.float(), ref.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_full_depth_contexts_get_a_budget_that_fits(name, monkeypatch, caplog):
    """Defaults: 4 GiB, raised (with one log line) so one full-context request fits when that
    takes at most half the available memory; else the context is capped to what fits (a log
    line naming both settings); an explicit max_model_len that does not fit, or a cap below a
    useful context, is a ValueError naming both."""
    args = parse_config(REAL_CONFIGS[name])
    ctx, per_token = args.max_position_embeddings, args.kv_bytes_per_token * 2          # bfloat16
    cfg = EngineConfig(model="unused")
    monkeypatch.setattr(kv_budget, "available_memory", lambda: 64 * GiB)
    with caplog.at_level(logging.WARNING):
        budget, length = size_kv(args, cfg, 2)
    assert length == ctx and budget >= ctx
    raised = ctx * per_token > 4 * GiB                                # Qwen3-0.6B: 40,960 x 112 KiB = 4.4 GiB
    assert raised == (name == "qwen3-0.6b") and ("raised" in caplog.text) == raised
    caplog.clear()
    monkeypatch.setattr(kv_budget, "available_memory", lambda: 4 * GiB)
    with caplog.at_level(logging.WARNING):
        budget, length = size_kv(args, cfg, 2)
    if raised:
        assert length == 4 * GiB // per_token // 32 * 32 < ctx and "max_model_len" in caplog.text
        assert "kv_cache_gib" in caplog.text
        with pytest.raises(ValueError, match="max_model_len.*kv_cache_gib"):
            size_kv(args, EngineConfig(model="unused", max_model_len=ctx), 2)
    else:
        assert length == ctx and not caplog.text
    with pytest.raises(ValueError, match="max_model_len.*kv_cache_gib"):
        size_kv(args, EngineConfig(model="unused", kv_cache_gib=1000 * per_token / GiB), 2)   # 1,000 tokens
    assert size_kv(args, EngineConfig(model="unused", max_model_len=4096), 2)[1] == 4096


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_a_gpu_budget_is_its_memory_share_less_weights_activations_and_graphs(name, monkeypatch):
    """On a device (memory faked: 80 GiB) the default budget is gpu_memory_utilization of it less
    the weights (counted from the config), a step's activations and the CUDA graphs' budget
    (none when they are off); too small a share, or a share larger than the free memory, is a
    ValueError naming the knob; an explicit kv_cache_gib wins."""
    args = parse_config(REAL_CONFIGS[name])
    per_token = args.kv_bytes_per_token * 2
    free = [80 * GiB]
    monkeypatch.setattr(kv_budget, "device_memory", lambda device: (free[0], 80 * GiB))
    cfg = EngineConfig(model="unused", device="cuda", gpu_memory_utilization=0.5)
    budget, length = size_kv(args, cfg, 2)
    spare = 40 * GiB - args.num_parameters * 2 - kv_budget.step_activation_bytes(args, cfg, 2)
    assert budget == int((spare - cfg.cuda_graph_gib * GiB) // per_token) and length == args.max_position_embeddings
    no_graphs = EngineConfig(model="unused", device="cuda", gpu_memory_utilization=0.5, cuda_graphs=False)
    assert size_kv(args, no_graphs, 2)[0] == spare // per_token
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        size_kv(args, EngineConfig(model="unused", device="cuda", gpu_memory_utilization=0.01), 2)
    assert size_kv(args, EngineConfig(model="unused", device="cuda", kv_cache_gib=1.0), 2)[0] == GiB // per_token
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="unused", gpu_memory_utilization=1.5)
    free[0] = 30 * GiB                  # another engine holds the rest: asking 40 GiB is an error, not an OOM later
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.5 of the device's 80.0 GiB is 40.0 GiB, but 30.0"):
        size_kv(args, cfg, 2)
    assert size_kv(args, EngineConfig(model="unused", device="cuda", gpu_memory_utilization=0.3), 2)[0] > 0


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_parameter_count_is_the_modules(name):
    """ModelArgs.num_parameters (what a GPU budget subtracts) equals our module's own count."""
    from tailrl.model.transformer import Transformer
    args = parse_config(dict(REAL_CONFIGS[name], num_hidden_layers=2, vocab_size=1000))
    model = Transformer(args, 16, dtype=torch.bfloat16)
    assert args.num_parameters == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(REAL_MOE_CONFIGS))
def test_a_mixture_of_experts_counts_its_published_size_and_its_gpu_budget(name, monkeypatch):
    """Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B and Mixtral-8x7B's published configs: the parameter count
    (what a GPU budget subtracts) is our module's (its layers built on the meta device: no memory;
    untied embedding and head, the final norm) and the published total; on an 80 GiB device
    (faked) at gpu_memory_utilization 0.9 the first two leave the KV cache what the weights
    leave, and Mixtral-8x7B (93 GB of bfloat16 weights) is a ValueError naming the knob, not an
    out-of-memory error later."""
    from tailrl.model.transformer import DecoderLayer
    cfg, billions = REAL_MOE_CONFIGS[name]
    args = parse_config(cfg)
    assert args.num_experts > 0 and len(args.sparse_layers) == args.num_layers
    assert args.num_parameters == pytest.approx(billions * 1e9, rel=0.01)
    with torch.device("meta"):
        layer = sum(p.numel() for p in DecoderLayer(args, sparse=True).parameters())
    assert args.num_parameters == args.num_layers * layer + (2 * args.vocab_size + 1) * args.hidden_size
    monkeypatch.setattr(kv_budget, "device_memory", lambda device: (80 * GiB, 80 * GiB))
    cfg_gpu = EngineConfig(model="unused", device="cuda", gpu_memory_utilization=0.9)
    if args.num_parameters * 2 > 72 * GiB:
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            size_kv(args, cfg_gpu, 2)
        return
    spare = 72 * GiB - args.num_parameters * 2 - kv_budget.step_activation_bytes(args, cfg_gpu, 2) \
        - cfg_gpu.cuda_graph_gib * GiB
    assert size_kv(args, cfg_gpu, 2)[0] == int(spare // (args.kv_bytes_per_token * 2)) > 0


def test_phi3s_partial_rotary_is_read_and_long_context_rope_refused_by_name():
    base = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, num_attention_heads=4, intermediate_size=128,
                num_hidden_layers=2, vocab_size=97, max_position_embeddings=4096, sliding_window=2047)
    args = parse_config(base)                                           # Phi-3-mini-4k's window: each layer's
    assert (args.max_position_embeddings, args.layer_windows) == (4096, (2047, 2047))
    partial = parse_config(dict(base, partial_rotary_factor=0.75))     # Phi-4-mini's: 12 of 16 dimensions
    assert (partial.rotary_dim, partial.rope_interleaved) == (12, False)
    with pytest.raises(ValueError, match="rope type 'longrope'"):         # Phi-3's 128k variants, Phi-4-mini
        parse_config(dict(base, rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}))
