"""The trainer on a device: every tensor of the update follows the policy's device, and a
device that is not there is a ValueError naming the key before any work.

Without a GPU, the update's tensors are checked on PyTorch's ``meta`` device: a policy moved
there computes shapes only, and any tensor built on the CPU by mistake meets it in an
operation and fails (``Expected all tensors to be on the same device``), as it would on CUDA.
"""
import pytest
import torch

from tailrl import LLM, EngineConfig
from tailrl.config import require_device
from tailrl.rl.config import TrainConfig
from tailrl.rl.grpo import grpo_loss
from tailrl.rl.policy import frozen_copy, load_policy, resolve_autocast, response_logprobs
from tailrl.rl.trainer import pad_rows

NO_CUDA = not torch.cuda.is_available()


def test_the_update_runs_on_the_policys_device(ckpt_dir):
    policy = load_policy(ckpt_dir("qwen2")).to("meta")
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]]
    logp, mask = response_logprobs(policy, prompts, responses, 1.0, 0, autocast=False)
    assert logp.device.type == mask.device.type == "meta" and logp.shape == (2, 4)
    old = pad_rows([[-1.0, -2.0], [-1.0] * 4], logp)
    ref = response_logprobs(frozen_copy(policy), prompts, responses, 1.0, 0)[0]
    adv = torch.tensor([1.0, -1.0]).to("meta")
    loss, stats = grpo_loss(logp, old, adv[[0, 1]], mask, 0.2, 0.2, 0.1, ref, "token-mean", 6.0, 2.0)
    assert old.device.type == loss.device.type == "meta"
    loss.backward()
    assert all(p.grad is None or p.grad.device.type == "meta" for p in policy.parameters())


@pytest.mark.skipif(not NO_CUDA, reason="checks the error on a machine without CUDA")
def test_an_absent_device_is_a_value_error_naming_the_key(model):
    with pytest.raises(ValueError, match="device needs a CUDA device"):
        require_device("cuda")
    with pytest.raises(ValueError, match="device"):
        LLM(model, device="cuda")                       # not a segmentation fault in the native kernels
    LLM(model, dtype="float32").generate([[1, 2]])      # and the process is fine


def test_device_values_are_checked():
    for bad in ("gpu", "cuda:x", 0):
        with pytest.raises(ValueError, match="device"):
            EngineConfig(model="m", device=bad)
        with pytest.raises(ValueError, match="device"):
            TrainConfig(device=bad)
    assert TrainConfig(device="cuda", drafter=True).drafter      # the learned drafter follows the device


@pytest.mark.parametrize("capability,on", [("AVX512", True), ("AVX512_BF16", True), ("AVX2", False),
                                           ("DEFAULT", False), ("NO AVX", False)])
def test_auto_autocast_is_on_where_bfloat16_is_native(monkeypatch, capability, on):
    """``autocast: auto`` (the default): the update in bfloat16 autocast on a GPU and on an
    AVX512 CPU; off where PyTorch emulates bfloat16 matmuls (AVX2-only: 6-8x slower than
    float32). An explicit true or false is kept on every device."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert resolve_autocast("auto", "cpu") is on
    assert resolve_autocast("auto", "cuda") is True
    assert resolve_autocast(True, "cpu") is True and resolve_autocast(False, "cuda") is False
    assert TrainConfig(autocast="auto").autocast == "auto"
