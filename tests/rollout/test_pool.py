"""The rollout pool gives a single engine's outputs for every policy, instance count and
speculation setting; chunks, K/V moves and recomputation are counted."""
import os

import pytest
from pool_utils import PARAMS, PROMPTS, assert_same, lengths, pool_ckpt
from safetensors.torch import load_file

from tailrl import LLM
from tailrl.config import PoolConfig

POLICIES = ("static", "divided", "context", "history", "oracle", "group-oracle")


@pytest.fixture(scope="module")
def reference(ckpt_dir):
    path = pool_ckpt(ckpt_dir)
    llm = LLM(path, dtype="float64")
    ref = llm.generate(PROMPTS, PARAMS)
    assert len({n for g in lengths(ref) for n in g}) > 3      # varied lengths: something to schedule
    return path, ref


@pytest.mark.parametrize("instances", [1, 2])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_matches_one_engine(reference, policy, instances):
    path, ref = reference
    llm = LLM(path, dtype="float64", instances=instances, scheduler=policy,
              pool={"chunk_tokens": 7, "processes": False})
    if policy == "history":
        for o in ref:                          # the previous epoch's responses (what history reads)
            llm.history.record(o.prompt_id, [c.token_ids for c in o.outputs])
    outs = llm.generate(PROMPTS, PARAMS, true_lengths=lengths(ref))
    assert_same(outs, ref)
    m = llm.last_metrics
    assert m["pool/instances"] == instances
    assert m["response_length/mean"] == pytest.approx(sum(map(sum, lengths(ref))) / (len(PROMPTS) * PARAMS.n))
    if policy != "static":                     # divided rollout: requests came back between chunks
        assert m["pool/chunks"] > len(PROMPTS) * PARAMS.n
        assert m["pool/local_resumes"] > 0
    assert all(m[f"pool/busy_s/{i}"] > 0 for i in range(instances))


def split_pool(path: str, processes: bool) -> LLM:
    """Two instances, each an engine split over two ranks."""
    return LLM(path, dtype="float64", instances=2, scheduler="context", tensor_parallel_size=2,
               pool={"chunk_tokens": 7, "processes": processes})


def rollout_and_close(llm: LLM) -> tuple[list, dict]:
    try:
        return llm.generate(PROMPTS, PARAMS), llm.last_metrics
    finally:
        llm.close()


@pytest.mark.parametrize("processes", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_instances_split_over_two_ranks_move_requests_k_v_between_them(reference, processes):
    """Each instance an engine split over two ranks (tensor_parallel_size=2; in this process or
    a worker process of its own, each starting its second rank): a request's K/V gathered from
    both ranks of one instance and scattered over both of another, the single engine's outputs.
    (Instances in processes run at once: whether a chunk moves then depends on their timing.)"""
    path, ref = reference
    outs, m = rollout_and_close(split_pool(path, processes))
    assert_same(outs, ref)
    assert processes or (m["pool/migrations"] > 0 and m["pool/kv_bytes_moved"] > 0)


def test_an_instance_whose_rank_dies_is_lost_and_its_requests_continue_elsewhere(reference):
    """A split instance's second rank killed mid-rollout: the instance is lost as a killed one
    is (RankLost), its requests recomputed on the other, the single engine's outputs."""
    path, ref = reference
    llm = split_pool(path, processes=False)
    rank = llm.pool.instances[1].worker.engine.model.procs[0]
    total = sum(map(sum, lengths(ref)))

    def kill(driver):
        if driver.tokens >= total * 0.3 and rank.poll() is None:
            rank.kill()
            rank.wait()
    llm.pool.on_progress = kill
    outs, m = rollout_and_close(llm)
    assert_same(outs, ref)
    assert m["pool/faults"] == 1 and m["pool/instances_alive"] == 1 and rank.returncode is not None


def test_speculation_in_the_pool_matches_plain_decoding(reference):
    path, ref = reference
    llm = LLM(path, dtype="float64", instances=2, scheduler="context", speculative={"method": "suffix"},
              pool={"chunk_tokens": 9, "processes": False})
    for o in ref:                              # history drafts: the instances' stores get this
        llm.history.record(o.prompt_id, [c.token_ids for c in o.outputs])
    assert_same(llm.generate(PROMPTS, PARAMS), ref)
    m = llm.last_metrics
    assert m["rollout/spec_verify_rows"] > 0 and m["rollout/spec_accept_length"] > 1
    assert m["pool/banked_chunks"] > 0         # speculative steps overshot chunk ends: kept, not lost
    for h in llm.pool.instances:               # each worker's history store is in sync
        assert h.worker.history.get(ref[0].prompt_id) == [c.token_ids for c in ref[0].outputs]


def test_engines_get_each_request_s_known_lengths(reference):
    """The oracle's chunks carry each request's true length to the engine (its critical-path
    estimate, speculative/critical.py) along with the expected length."""
    path, ref = reference
    llm = LLM(path, dtype="float64", instances=2, scheduler="oracle", pool={"chunk_tokens": 7, "processes": False})
    true = {f"{o.request_id}-{c.index}": len(c.token_ids) for o in ref for c in o.outputs}
    seen: dict[str, tuple] = {}

    def look(_driver):
        for h in llm.pool.instances:
            for rid, r in h.worker.engine.requests.items():
                seen[rid] = (r.priority, r.length_prior)
    llm.pool.on_progress = look
    assert_same(llm.generate(PROMPTS, PARAMS, true_lengths=lengths(ref)), ref)
    assert seen and all(prior == (min(true[rid], PARAMS.max_tokens),) and prio == prior[0]
                        for rid, (prio, prior) in seen.items())


def test_oracle_needs_true_lengths(reference):
    path, _ = reference
    llm = LLM(path, dtype="float64", scheduler="oracle")
    with pytest.raises(ValueError, match="true_lengths"):
        llm.generate(PROMPTS, PARAMS)
    with pytest.raises(ValueError, match="true_lengths"):
        llm.generate(PROMPTS, PARAMS, true_lengths=[[1]])


def test_weights_reach_every_instance(reference):
    path, _ = reference
    single = LLM(path, dtype="float64")
    pool = LLM(path, dtype="float64", instances=2, scheduler="divided", pool={"chunk_tokens": 5, "processes": False})
    sd = {k: v.double() * 1.01 for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    single.load_weights(sd)
    pool.load_weights(sd)
    assert_same(pool.generate(PROMPTS, PARAMS), single.generate(PROMPTS, PARAMS))
    # a trainer's buckets: (name, tensor) pairs of a part each; a bucket with a tensor that does
    # not fit is refused (checked by one instance) before any instance copies any of it
    sd = {k: v * 1.01 for k, v in sd.items()}
    items = list(sd.items())
    with pytest.raises(ValueError, match="'model.norm.weight' has shape"):
        pool.load_weights(iter(items[:3] + [("model.norm.weight", sd["model.norm.weight"][:5])]))
    assert_same(pool.generate(PROMPTS, PARAMS), single.generate(PROMPTS, PARAMS))
    written = set()
    for i in range(0, len(items), 4):
        written |= pool.load_weights(iter(items[i:i + 4]))
        single.load_weights(items[i:i + 4])
    assert written == set(pool.weight_names()) and pool.weight_names() == single.weight_names()
    assert_same(pool.generate(PROMPTS, PARAMS), single.generate(PROMPTS, PARAMS))


def test_pool_config_is_validated():
    with pytest.raises(ValueError, match="scheduler"):
        PoolConfig(scheduler="fifo")
    with pytest.raises(ValueError, match="backend"):
        PoolConfig(backend="mpi")
    with pytest.raises(ValueError, match="instances"):
        PoolConfig(instances=0)


def test_local_instances_spread_over_the_gpus_and_split_a_shared_one(monkeypatch):
    """On one machine, ``device="cuda"`` puts instance i on GPU i mod their number; instances
    sharing a GPU split its ``gpu_memory_utilization``; Ray's actors each get their own GPU,
    and CPU instances are left as they are."""
    import torch

    from tailrl.config import EngineConfig
    from tailrl.rollout.pool import instance_configs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    base = EngineConfig(model="m", device="cuda", gpu_memory_utilization=0.9)
    three = instance_configs(base, PoolConfig(instances=3), True)
    got = [(c.device, round(c.gpu_memory_utilization, 3)) for c in three]
    assert got == [("cuda:0", 0.45), ("cuda:1", 0.9), ("cuda:0", 0.45)]
    named = EngineConfig(model="m", device="cuda:1", gpu_memory_utilization=0.8)
    assert [(c.device, c.gpu_memory_utilization) for c in instance_configs(named, PoolConfig(instances=2), True)] == [
        ("cuda:1", 0.4), ("cuda:1", 0.4)]
    ray = instance_configs(base, PoolConfig(instances=2, backend="ray"), True)
    assert [(c.device, c.gpu_memory_utilization) for c in ray] == [("cuda", 0.9), ("cuda", 0.9)]
    cpu = instance_configs(EngineConfig(model="m"), PoolConfig(instances=2), True)
    assert [(c.device, c.gpu_memory_utilization) for c in cpu] == [("cpu", 0.9), ("cpu", 0.9)]
    split = EngineConfig(model="m", device="cuda", gpu_memory_utilization=0.9, tensor_parallel_size=2)
    assert [(c.device, c.gpu_memory_utilization) for c in instance_configs(split, PoolConfig(instances=2), True)] == [
        ("cuda", 0.45), ("cuda", 0.45)]                  # two GPUs: both instances on the same two
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [c.device for c in instance_configs(split, PoolConfig(instances=3), True)] == ["cuda:0", "cuda:2", "cuda:0"]
    from tailrl.rollout.ray_backend import actor_options
    assert actor_options(split)["num_gpus"] == 2
