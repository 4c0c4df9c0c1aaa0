"""The engine's work outside ``step`` on the GPU path makes no tensor on the host by default:
the exact log-probability scorer and a request's migration between engines, through the
Triton kernels (interpreted on the CPU), under ``tests/device_guard.py`` (``step`` itself:
tests/kernels/test_triton_models.py). Results equal the unguarded ones."""
import pytest
import torch
from device_guard import guard, no_default_device

from tailrl import EngineConfig, SamplingParams, SpeculativeConfig
from tailrl.engine.engine import LLMEngine
from tailrl.engine.request import Request
from tailrl.engine.score import Scorer

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the device itself checks")


def test_the_scorer_makes_no_tensor_on_the_host_by_default(monkeypatch, model):
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    scorer = Scorer(model, "bfloat16")
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10]]
    want = scorer.logprobs(prompts, responses, [1.0, 0.7])
    with no_default_device():
        assert scorer.logprobs(prompts, responses, [1.0, 0.7]) == want


def test_a_migrating_request_makes_no_tensor_on_the_host_by_default(monkeypatch, triton_model):
    monkeypatch.setenv("TAILRL_KERNELS", "triton")
    guard(monkeypatch, LLMEngine, "step", "export_request", "import_request", "release")
    engines = [LLMEngine(EngineConfig(model=triton_model, dtype="bfloat16"), SpeculativeConfig(policy="fixed"))
               for _ in range(2)]
    params = SamplingParams(max_tokens=14, ignore_eos=True)
    ref = Request("x", [5, 6, 7, 8], params, seed_key=11)
    engines[0].add_request(ref)
    while engines[0].has_unfinished():
        engines[0].step()
    engines[0].release("x")
    req = Request("x", [5, 6, 7, 8], params, seed_key=11)
    engines[1].add_request(req)
    while req.num_output_tokens < 6:
        engines[1].step()
    moved = engines[0].import_request(engines[1].export_request("x"))
    while engines[0].has_unfinished():
        engines[0].step()
    assert moved.output_token_ids == ref.output_token_ids
