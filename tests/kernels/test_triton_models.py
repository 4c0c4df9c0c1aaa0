"""Models end to end through the GPU backend's Triton kernels (the kernels alone:
tests/kernels/test_triton.py), on CPU tensors under Triton's interpreter where there is no GPU
(tests/conftest.py sets TRITON_INTERPRET=1): a tiny model's tokens equal the CPU kernels', other
architectures', Qwen3.5's recurrent layers, rows drafting inside steps launched ahead, and steps
replayed from graphs equal to eager steps."""
import pytest
import torch

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_POOL = dict(kv_cache_gib=0.25)         # a small pool: several engines share one GPU in a test
# slow under the interpreter (a mixture of experts' graph steps: ~2 min), quick on a GPU
SLOW_HERE = pytest.mark.slow if DEVICE == "cpu" else ()
# under the interpreter every program of every launch runs in Python: one layer (a second
# doubles the end-to-end tests' time; ``triton_model`` in tests/conftest.py)
INTERPRETED_LAYERS = dict(num_layers=1) if DEVICE == "cpu" else {}


def test_a_tiny_model_end_to_end_under_the_triton_kernels(triton_model, monkeypatch):
    """float32 greedy tokens and sampled tokens through the Triton kernels equal the native CPU
    kernels' (the matmuls are the same PyTorch ones; attention and norms differ in rounding
    only), with and without speculation; the step runs every tensor on the engine's device
    (without a GPU, each step under ``tests/device_guard.py``: no tensor made on the host by
    default)."""
    from device_guard import guard

    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.engine.engine import LLMEngine
    path = triton_model
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    want = [[c.token_ids for c in o.outputs] for o in LLM(path, dtype="float32").generate(prompts, sp)]
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    if DEVICE == "cpu":                                 # on a GPU the device itself checks
        guard(monkeypatch, LLMEngine, "step")
    for spec, calls in ((None, 1), (SpeculativeConfig(policy="fixed"), 2)):
        llm = LLM(path, dtype="float32", speculative=spec, device=DEVICE, **SMALL_POOL)
        for _ in range(calls):                          # the second call drafts from the first's history
            got = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp)]
            assert got == want
    assert llm.last_metrics["rollout/spec_accepted_tokens"] > 0


def test_qwen3_5s_recurrent_layers_under_the_triton_kernels(ckpt_dir, monkeypatch):
    """Qwen3.5 (a Gated DeltaNet layer, then attention with its output gate; kernels/gpu/delta.py):
    float32 sampled tokens through the Triton kernels equal the native CPU kernels', and with
    speculation (chain nodes on the states' copy in registers, accepted nodes run through
    again) they equal plain decoding's, a group's samples starting from a sibling's snapshot."""
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    path = ckpt_dir("qwen3_5", num_layers=2, init_std=0.5, num_heads=2, num_kv_heads=1)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5, 4, 3]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    want = [[c.token_ids for c in o.outputs] for o in LLM(path, dtype="float32").generate(prompts, sp)]
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    llm = LLM(path, dtype="float32", device=DEVICE, **SMALL_POOL)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp)] == want
    assert llm.last_metrics["rollout/batched_tokens"] == 5 + 1 + 7 + 1 + 4 * 5     # prompts computed once
    spec = LLM(path, dtype="float32", device=DEVICE, speculative=SpeculativeConfig(policy="fixed"), **SMALL_POOL)
    for _ in range(2):                                  # the second call drafts from the first's history
        assert [[c.token_ids for c in o.outputs] for o in spec.generate(prompts, sp)] == want
    assert spec.last_metrics["rollout/spec_accepted_tokens"] > 0


@pytest.mark.parametrize("arch,kw", [("qwen3", {}), ("llama", {}),
                                     ("qwen2", dict(tie=True, num_heads=8, num_kv_heads=2)),
                                     ("qwen3_moe", {}), ("mixtral", {}), ("gemma3", dict(num_heads=2, num_kv_heads=1)),
                                     ("olmo3", dict(num_heads=2, num_kv_heads=1)),
                                     pytest.param("qwen2_moe", {}, marks=SLOW_HERE),
                                     pytest.param("gemma2", {}, marks=SLOW_HERE),
                                     pytest.param("smollm3", {}, marks=SLOW_HERE),
                                     pytest.param("glm4", {}, marks=SLOW_HERE),
                                     pytest.param("glm4_moe", {}, marks=SLOW_HERE),
                                     pytest.param("ministral3", {}, marks=SLOW_HERE),
                                     ("gpt_oss", dict(num_heads=2, num_kv_heads=1)),
                                     ("deepseek_v3", dict(num_heads=2))])
def test_other_architectures_under_the_triton_kernels(ckpt_dir, monkeypatch, arch, kw):
    """Qwen3 (per-head q/k norms, head_dim given apart from hidden / heads), Llama (no biases),
    a tied Qwen2 with 4 queries per K/V head, mixtures of experts (their products grouped by
    expert on the device: kernels/gpu/experts.py) and Gemma 3 (a sliding window of 8 positions
    with its own RoPE base; GeGLU, sandwich norms, scaled scores) and OLMo 3 (a window, no norm
    before attention, q/k norms over all heads); on a GPU or with ``-m slow`` also Gemma 2 (soft
    caps), SmolLM3 (layers without RoPE), GLM-4 (RoPE on half of each head, interleaved) and
    GLM-4.5 (grouped sigmoid routing, a float32 router) and Ministral 3 (queries scaled by position);
    gpt-oss (attention sinks, a window, experts with biases and a clamped SwiGLU) and DeepSeek-V3
    (latent attention): float32 sampled tokens through the Triton kernels equal the native CPU
    kernels', as the Qwen2 checkpoint's above."""
    from tailrl import LLM, SamplingParams
    path = ckpt_dir(arch, init_std=1.0, **kw, **INTERPRETED_LAYERS)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    want = [[c.token_ids for c in o.outputs] for o in LLM(path, dtype="float32").generate(prompts, sp)]
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    llm = LLM(path, dtype="float32", device=DEVICE, **SMALL_POOL)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, sp)] == want


def test_follow_ups_inside_steps_launched_ahead_under_the_triton_kernels(triton_model, monkeypatch):
    """Rows drafting inside steps launched ahead (engine/ahead_drafts.py) through the Triton
    kernels and the graphs' static inputs: the follow-up queries (their own K/V at scratch
    positions read through ``extra``, moved into place where they hit) and the chains give
    plain decoding's bfloat16 tokens and log-probabilities bit for bit."""
    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.engine.batch import ModelRunner
    from tailrl.engine.graph_pool import GraphPool, cuda_capture, eager_capture
    from tailrl.engine.graphs import StepGraphs
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    path = triton_model
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True, seed=4)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, sp)]   # noqa: E731
    want = run(LLM(path, device=DEVICE, async_scheduling=False, **SMALL_POOL))
    spec = SpeculativeConfig(policy="fixed", ahead_above=1, ahead_drafts=4, ahead_drafts_gate="always")
    llm = LLM(path, speculative=spec, device=DEVICE, async_scheduling=True, **SMALL_POOL)
    e = llm.engine
    capture = cuda_capture if DEVICE == "cuda" else eager_capture
    e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, capture), 64, grouped=True))
    e.tail.plain = lambda: True                     # every step launched ahead
    for _ in range(2):                              # the second call drafts from the first's responses
        assert run(llm) == want
    m = llm.last_metrics
    assert m["rollout/spec_accepted_tokens"] > 0 and m["rollout/ahead_follow_hits"] > 0


@pytest.mark.parametrize("arch", ["qwen2", pytest.param("qwen3_moe", marks=SLOW_HERE),
                                  pytest.param("glm4_moe", marks=SLOW_HERE), pytest.param("gpt_oss", marks=SLOW_HERE)])
def test_graph_steps_under_the_triton_kernels_equal_eager_steps(ckpt_dir, triton_model, monkeypatch, arch):
    """bfloat16 through the Triton kernels (the batch-invariant matmul included; a mixture of
    experts' products grouped on the device): speculation
    gives plain decoding's tokens and logprobs bit for bit, and a rollout whose decode and
    verify steps replay graphs (CUDA graphs on a GPU; on a CPU the same static, padded inputs
    run eagerly) gives the eager rollout's;
    without a GPU, its steps make no tensor on the host by default (``tests/device_guard.py``)."""
    from device_guard import guard

    from tailrl import LLM, SamplingParams, SpeculativeConfig
    from tailrl.engine.batch import ModelRunner
    from tailrl.engine.engine import LLMEngine
    from tailrl.engine.graph_pool import GraphPool, cuda_capture, eager_capture
    from tailrl.engine.graphs import StepGraphs
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    path = triton_model if arch == "qwen2" else ckpt_dir(arch, init_std=3.0)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, sp)]   # noqa: E731
    want = run(LLM(path, speculative=SpeculativeConfig(policy="fixed"), device=DEVICE, cuda_graphs=False, **SMALL_POOL))
    # lossless: plain decoding's steps (one query a row) and the verify steps (chains: query
    # groups in attention) give every token and log-probability the same bits
    assert run(LLM(path, device=DEVICE, cuda_graphs=False, **SMALL_POOL)) == want
    llm = LLM(path, speculative=SpeculativeConfig(policy="fixed"), device=DEVICE, **SMALL_POOL)
    if DEVICE == "cpu":                                 # on a GPU the device itself checks
        guard(monkeypatch, LLMEngine, "step")
    e = llm.engine
    capture = cuda_capture if DEVICE == "cuda" else eager_capture
    e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, capture), 64, grouped=True))
    e.begin_rollout()
    assert run(llm) == want
    assert llm.last_metrics["graphs/replayed_steps"] > 0 and llm.last_metrics["graphs/eager_steps"] == 0


@pytest.mark.parametrize("arch", [pytest.param("qwen3_5", marks=SLOW_HERE)])
def test_a_recurrent_models_plain_graph_steps_under_the_triton_kernels_equal_eager_steps(ckpt_dir, monkeypatch,
                                                                                         arch):
    """Qwen3.5's hybrid in bfloat16 through the Triton kernels: plain steps launched ahead and
    replayed from graphs (CUDA graphs on a GPU; each bucket's rows' runs staged beside its
    tokens, its padding runs of no tokens) give the eager steps' tokens and log-probabilities."""
    from tailrl import LLM, SamplingParams
    from tailrl.engine.batch import ModelRunner
    from tailrl.engine.graph_pool import GraphPool, cuda_capture, eager_capture
    from tailrl.engine.graphs import StepGraphs
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    path = ckpt_dir(arch, num_layers=4)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5], [4, 4]]
    sp = SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    run = lambda llm: [[(c.token_ids, c.logprobs) for c in o.outputs] for o in llm.generate(prompts, sp)]   # noqa: E731
    want = run(LLM(path, device=DEVICE, cuda_graphs=False, **SMALL_POOL))
    llm = LLM(path, device=DEVICE, async_scheduling=True, **SMALL_POOL)
    e = llm.engine
    capture = cuda_capture if DEVICE == "cuda" else eager_capture
    e.runner = ModelRunner(e.model, e.kv, StepGraphs(e.model, e.kv, GraphPool(1 << 30, capture), 64))
    e.begin_rollout()
    assert run(llm) == want
    assert llm.last_metrics["graphs/replayed_steps"] > 0 and llm.last_metrics["graphs/eager_steps"] == 0
