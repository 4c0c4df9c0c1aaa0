"""The Ray backend: two actors on this machine give one engine's outputs, with and without a
killed actor. One test (Ray's start-up is slow); the start-up time is logged."""
import logging
import time

import pytest
from pool_utils import PROMPTS, SEEDED, KillAt, assert_same, lengths, pool_ckpt

from tailrl import LLM
from tailrl.model.loader import load_state_dict

ray = pytest.importorskip("ray")
log = logging.getLogger(__name__)


def test_two_ray_actors_match_one_engine_and_survive_a_kill(ckpt_dir):
    path = pool_ckpt(ckpt_dir)
    ref = LLM(path, dtype="float64").generate(PROMPTS, SEEDED)
    t0 = time.perf_counter()
    llm = LLM(path, dtype="float64", instances=2, scheduler="divided", backend="ray",
              pool={"chunk_tokens": 8, "threads_per_instance": 1, "steps_per_call": 2})
    startup = time.perf_counter() - t0
    try:
        log.warning("ray backend start-up: %.1f s (ray.init %.1f s, actors %.1f s)", startup,
                    llm.pool.backend.init_s, llm.pool.backend.start_s)
        assert_same(llm.generate(PROMPTS, SEEDED), ref)
        assert llm.last_metrics["pool/faults"] == 0
        # new weights stored once (ray.put) for both actors: every name written, outputs as before
        assert llm.load_weights(load_state_dict(path)) == set(llm.weight_names())
        kill = KillAt(llm.pool.instances[0], sum(map(sum, lengths(ref))), 0.3)
        llm.pool.on_progress = kill
        assert_same(llm.generate(PROMPTS, SEEDED), ref)
        assert kill.killed_at is not None and llm.last_metrics["pool/faults"] == 1
    finally:
        llm.close()
        ray.shutdown()


def test_an_instance_on_cuda_gets_a_gpu_of_its_own():
    """By construction (no GPU here): a CUDA engine's actor asks Ray for one GPU, a CPU one none."""
    from tailrl.config import EngineConfig
    from tailrl.rollout.ray_backend import actor_options
    assert actor_options(EngineConfig(model="m", device="cuda")) == {"num_cpus": 0, "num_gpus": 1}
    assert actor_options(EngineConfig(model="m", device="cuda:1"))["num_gpus"] == 1
    assert actor_options(EngineConfig(model="m"))["num_gpus"] == 0
