"""The learned drafter follows its target's device: drafting, its past, the spot trainer's
buffer and training batches, and the exact acceptance measure make no tensor on the host by
default.

Without a GPU, the drafter's path runs on the CPU under ``tests/device_guard.py`` (PyTorch's
default device set to ``meta``, operations mixing ``meta`` and real tensors refused): a tensor
built without naming its device fails as it would on a GPU. The rollouts are those of the CPU
tests: outputs identical to plain decoding.
"""
import pytest
import torch
from device_guard import guard, no_default_device

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl.drafter import evaluate, spot_trainer
from tailrl.drafter.buffer import DrafterBuffer
from tailrl.drafter.network import Drafter
from tailrl.drafter.spot_trainer import SpotConfig, SpotTrainer
from tailrl.engine.graph_pool import GraphPool, eager_capture
from tailrl.model.loader import load_model
from tailrl.speculative.sources.drafter_source import DrafterSource

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5], [(7 * i) % 89 + 1 for i in range(40)], [4, 4]]
PARAMS = [SamplingParams(n=3, max_tokens=40, seed=1), SamplingParams(n=2, temperature=0, max_tokens=30),
          SamplingParams(n=2, top_p=0.8, max_tokens=40, ignore_eos=True), SamplingParams(n=2, max_tokens=24)]


def test_the_guard_catches_a_tensor_made_without_its_device(model):
    drafter = Drafter.for_target(load_model(model, "float32"), intermediate_size=64)
    hidden = torch.randn(3, drafter.cfg.hidden_size)
    with no_default_device():
        drafter.committed_kv(hidden, torch.tensor([1, 2, 3], device="cpu"), torch.arange(3, device="cpu"))
        with pytest.raises(RuntimeError, match="without a device"):
            drafter.committed_kv(hidden, torch.tensor([1, 2, 3]), torch.arange(3, device="cpu"))
        with pytest.raises((RuntimeError, NotImplementedError)):
            torch.tensor([1, 2]).tolist()


def plain_outputs(model, dtype):
    return [(list(c.token_ids), c.finish_reason) for o in LLM(model, dtype=dtype).generate(PROMPTS, PARAMS)
            for c in o.outputs]


@pytest.mark.parametrize("dtype,paths,layout,vocab", [
    ("float32", 1, "cpu", False), ("bfloat16", 1, "cpu", True), ("bfloat16", 3, "gpu", False), ("bfloat16", 1, "gpu", False),
    ("bfloat16", 3, "gpu", True), ("bfloat16", 1, "gpu", True)])
def test_drafting_makes_no_tensor_on_the_host_by_default(monkeypatch, request, model, dtype, paths, layout, vocab):
    """``layout="gpu"``: as on a GPU engine, chain depths run through graphs (captured eagerly
    here) over the padded past; ``"cpu"``: chains on the engine's kernels over the blocks
    (``tailrl.drafter.paged``). ``vocab``: a drafter with a draft vocabulary (its indices
    mapped to token ids on the device)."""
    drafter_dir = request.getfixturevalue("vocab_drafter_dir" if vocab else "drafter_dir")
    want = plain_outputs(model, dtype)
    guard(monkeypatch, DrafterSource, "prepare", "propose", "observe_hidden", "finish", "export", "adopt")
    spec = LLM(model, dtype=dtype, speculative=SpeculativeConfig(policy="fixed", method="drafter",
               drafter=drafter_dir, max_tree_paths=paths, min_token_prob=0.0))
    spec.engine.speculator.choice.always = True
    assert spec.engine.kv.prefix is None           # no prefix caching: the drafter's past needs every position
    src = next(s for s in spec.engine.speculator.sources if s.name == "drafter")
    if layout == "gpu":
        src.use_graphs(GraphPool(1 << 30, eager_capture))
    got = [(list(c.token_ids), c.finish_reason) for o in spec.generate(PROMPTS, PARAMS) for c in o.outputs]
    assert got == want
    assert spec.last_metrics["rollout/spec_draft_tokens/drafter"] > 0
    if layout == "gpu" and paths == 1:                   # chains (trees run eagerly)
        assert src.graphs.replays > 0


def test_spot_training_and_its_buffer_make_no_tensor_on_the_host_by_default(monkeypatch, model, drafter_dir):
    """The optimizer's step runs unguarded (AdamW keeps its step counter on the host by design)."""
    want = plain_outputs(model, "float32")
    guard(monkeypatch, DrafterSource, "prepare", "propose", "observe_hidden", "finish")
    guard(monkeypatch, DrafterBuffer, "add_spans", "finish", "data")
    guard(monkeypatch, spot_trainer, "sample_batch", "drafter_loss")
    llm = LLM(model, dtype="float32", speculative=SpeculativeConfig(policy="fixed", method="drafter",
              drafter=drafter_dir, min_token_prob=0.0))
    src = next(s for s in llm.engine.speculator.sources if s.name == "drafter")
    llm.engine.speculator.choice.always = True
    trainer = SpotTrainer(src.drafter, DrafterBuffer(4096, src.drafter.fc.weight.device),
                          SpotConfig(threshold=1000, min_windows=8, batch=16, unroll=2, max_share=1.0))
    llm.engine.speculator.collector = trainer.buffer
    llm.engine.idle_work = trainer
    got = [(list(c.token_ids), c.finish_reason) for o in llm.generate(PROMPTS, PARAMS) for c in o.outputs]
    assert got == want
    assert trainer.metrics()["drafter/spot_steps"] > 0 and trainer.train(2) == 2


def test_exact_acceptance_makes_no_tensor_on_the_host_by_default(monkeypatch, model, drafter_dir):
    llm = LLM(model, dtype="float32", speculative=SpeculativeConfig(policy="fixed", method="drafter",
              drafter=drafter_dir, min_token_prob=0.0))
    src = next(s for s in llm.engine.speculator.sources if s.name == "drafter")
    buffer = DrafterBuffer(4096)
    llm.engine.speculator.collector = buffer
    llm.generate(PROMPTS, PARAMS)
    data = buffer.data(3)
    want = evaluate.chain_acceptance(src.drafter, data, 4)
    guard(monkeypatch, evaluate, "chain_acceptance", "accepted_per_root")
    assert evaluate.chain_acceptance(src.drafter, data, 4) == want and want[1] > 0
