"""Threads sized to the free cores: the decision, the measurement, and that thread counts and
threads never change what the engine computes."""
import subprocess
import sys
import threading
import time

import pytest
import torch

from tailrl import LLM, SamplingParams, SpeculativeConfig
from tailrl import threads as th
from tailrl.threads import ThreadGovernor


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class FakeClock:
    """Machine CPU seconds and our CPU seconds that a test advances by hand."""

    def __init__(self, monkeypatch):
        self.wall, self.busy, self.ours = 100.0, 1000.0, 10.0
        monkeypatch.setattr(th.time, "monotonic", lambda: self.wall)
        monkeypatch.setattr(th.time, "process_time", lambda: self.ours)
        monkeypatch.setattr(th, "machine_busy_s", lambda: self.busy)
        monkeypatch.setattr(th, "available_cores", lambda: 4)

    def window(self, gov: ThreadGovernor, ours: float, others: float, seconds: float = 0.5) -> int:
        """``seconds`` of wall time where we use ``ours`` cores and other processes ``others``."""
        self.wall += seconds
        self.ours += ours * seconds
        self.busy += (ours + others) * seconds
        return gov.tick()


def test_threads_follow_the_cores_others_leave_free(monkeypatch, restore_threads):
    clock = FakeClock(monkeypatch)
    gov = ThreadGovernor(cap=4)
    assert gov.threads == 4 == torch.get_num_threads()
    assert clock.window(gov, ours=4.0, others=0.1) == 4
    assert clock.window(gov, ours=3.0, others=1.0) == 3             # down at once
    assert gov.others == pytest.approx(1.0)
    assert clock.window(gov, ours=2.0, others=2.5) == 1
    assert torch.get_num_threads() == 1
    assert clock.window(gov, ours=1.0, others=9.0) == 1              # never below one
    assert clock.window(gov, ours=1.0, others=0.0) == 1              # up only when two windows agree
    assert clock.window(gov, ours=1.0, others=0.0) == 4
    assert clock.window(gov, ours=4.0, others=0.3) == 4              # a little load costs no thread
    assert gov.changes == 3
    # between windows a tick only reads the clock
    clock.busy += 100.0
    clock.wall += 0.01
    assert gov.tick() == 4


def test_cap_bounds_the_threads(monkeypatch, restore_threads):
    clock = FakeClock(monkeypatch)
    gov = ThreadGovernor(cap=2)
    assert clock.window(gov, ours=2.0, others=0.0) == 2
    assert gov.want(0.0) == 2 and gov.want(1.5) == 2 and gov.want(2.7) == 1


def test_a_busy_neighbour_is_measured_and_costs_a_thread(restore_threads):
    """A real pure-Python loop in another process shows up as about one core of others' load."""
    gov = ThreadGovernor(cap=2, interval_s=0.3)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            time.sleep(0.01)
            gov.tick()
        assert gov.others > 0.6
        assert gov.threads == gov.want(gov.others)
        if th.available_cores() <= 2:
            assert gov.threads == 1
    finally:
        busy.kill()
        busy.wait()


def test_our_own_work_is_not_counted_as_others(restore_threads):
    gov = ThreadGovernor(cap=2, interval_s=0.3)
    x = torch.randn(256, 256)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        x = torch.tanh(x @ x)
        gov.tick()
    assert gov.others < 0.5 and gov.threads == gov.want(gov.others)


def test_fixed_count_and_float32_are_not_governed(restore_threads):
    fixed = th.use_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(2)                     # e.g. a governed engine in the same process
    assert fixed.tick() == 1 == torch.get_num_threads()
    assert th.use_threads(None, "float32") is None
    assert th.use_threads(None, "bfloat16") is th.governor() is th.use_threads(None, "float64")


def test_release_pool_frees_this_threads_pool(restore_threads):
    torch.set_num_threads(2)
    x = torch.randn(64, 256)
    y = x @ x.T                                                      # a parallel region: a pool exists
    assert th.release_pool() is True
    assert torch.equal(x @ x.T, y)                                   # and the next region makes a new one


def _rollout(llm: LLM, prompts) -> list:
    params = [SamplingParams(n=4, temperature=1.0, max_tokens=48, seed=7 + i) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, prompt_ids=[f"p{i}" for i in range(len(prompts))], use_tqdm=False)
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float64"])
def test_outputs_do_not_depend_on_thread_count_or_calling_thread(model, dtype, restore_threads):
    """Outputs (tokens and log-probabilities) are the same at 1 and 2 threads, with
    speculation, and whether generate runs on the main thread or another one (float32 is not
    governed: MKL's rounding follows the thread count). Fixed-depth drafts: the default policy's
    draft shapes follow measured step times, and float64 log-probabilities follow the batch's
    shape by ~1e-13 (bfloat16 is exact across shapes too, tests/engine/test_default_path.py)."""
    prompts = [[3, 17, 5, 9], [4, 4, 21, 8, 2, 30], [11, 12], [6, 19, 2]]
    runs = {}
    for n in (1, 2):
        llm = LLM(model, dtype=dtype, num_threads=n, speculative=SpeculativeConfig(method="suffix", policy="fixed"))
        runs[n] = _rollout(llm, prompts)
    governed = LLM(model, dtype=dtype, speculative=SpeculativeConfig(method="suffix", policy="fixed"))
    on_worker: list = []
    t = threading.Thread(target=lambda: on_worker.append(_rollout(governed, prompts)))
    t.start()
    t.join()
    assert runs[1] == runs[2] == on_worker[0]


def test_training_update_does_not_depend_on_thread_count(tmp_path, restore_threads):
    from tailrl.rl.config import TrainConfig
    from tailrl.rl.trainer import Trainer
    weights = []
    for n in (1, 2):
        cfg = TrainConfig(model="test", task_family="add", task_difficulty=2, train_size=4, batch_size=2,
                          group_size=4, max_tokens=32, total_steps=2, output_dir=str(tmp_path / f"t{n}"),
                          progress=False, checkpoint_every=0, num_threads=n, lr=3e-3, log_tensorboard=False)
        tr = Trainer(cfg)
        tr.train()
        weights.append({k: v.clone() for k, v in tr.policy.state_dict().items()})
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
