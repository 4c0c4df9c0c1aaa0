"""A trainer's weights sharded by FSDP (2 and 1) or DeepSpeed ZeRO-3 (two gloo processes on this
CPU) reach the engine whole, streamed one tensor at a time (tailrl/integrations/gathered.py):
after a training step on each process's own tokens, an engine loaded from the stream equals,
parameter for parameter and in its samples, one loaded from the same sharded model gathered
whole another way (torch's full state dict; DeepSpeed's gather of every parameter at once), and
differs from the checkpoint's. Both processes take part in every gather, as TRL's do. FSDP1
(accelerate's older FSDP) and ZeRO-3 run with ``-m slow``; ZeRO-3 needs DeepSpeed (not a
dependency: skipped without it; its first run compiles a shared-memory op)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from serve_helpers import free_port

from tailrl.integrations.gathered import clean, gathered_weights


def _shard(hf, version: int, world: int):
    """``hf`` sharded per decoder layer and at the root: FSDP2 in place, FSDP1 wrapped."""
    layer_cls = type(hf.model.layers[0])
    if version == 2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for layer in hf.model.layers:
            fully_shard(layer, mesh=mesh)
        return fully_shard(hf, mesh=mesh)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    return FSDP(hf, device_id=torch.device("cpu"), auto_wrap_policy=ModuleWrapPolicy({layer_cls}),
                use_orig_params=True)


def _zero3_trained(hf, rank: int):
    """``hf`` under DeepSpeed ZeRO-3 after one SGD step on this process's tokens, and its
    weights gathered whole at once (DeepSpeed's other way)."""
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    engine, *_ = deepspeed.initialize(model=hf, model_parameters=hf.parameters(), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True})
    ids = torch.tensor([[3 + rank, 5, 7, 11, 13, 17]])
    engine.backward(engine(ids, labels=ids).loss)
    engine.step()
    params = dict(engine.module.named_parameters())
    assert all(p.numel() < p.ds_numel for p in params.values() if p.ds_numel > 1)    # partitioned
    with deepspeed.zero.GatheredParameters(list(params.values())):
        full = {k: p.data.clone() for k, p in params.items()}
    return engine.module, full


def _worker(rank: int, world: int, path: str, version, port: int) -> None:
    import transformers
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tailrl import LLM, SamplingParams
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if version != "zero3":
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        if version == "zero3":
            root, full = _zero3_trained(hf, rank)
        else:
            root = _shard(hf, version, world)
            assert any(hasattr(p, "full_tensor") or "_fsdp_wrapped_module" in n for n, p in root.named_parameters())
            ids = torch.tensor([[3 + rank, 5, 7, 11, 13, 17]])            # each process its own tokens
            root(ids, labels=ids).loss.backward()
            torch.optim.SGD(root.parameters(), lr=0.5).step()
            full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True))   # torch's own gather
        sp = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True, seed=1)
        run = lambda llm: [[c.token_ids for c in o.outputs] for o in llm.generate([[3, 5, 7]], sp)]   # noqa: E731
        streamed, whole = LLM(path, dtype="float32"), LLM(path, dtype="float32")
        before = run(streamed)
        written = streamed.load_weights(gathered_weights(root, version if version != "zero3" else None,
                                                         zero3=version == "zero3"))
        whole.load_weights({clean(k): v for k, v in full.items()})
        assert written == set(whole.weight_names())
        assert all(torch.equal(a, b) for a, b in zip(streamed.engine.model.parameters(),
                                                     whole.engine.model.parameters(), strict=True))
        assert run(streamed) == run(whole) != before
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("version", [2, pytest.param(1, marks=pytest.mark.slow),
                                     pytest.param("zero3", marks=pytest.mark.slow)])
def test_sharded_weights_stream_into_the_engine_whole(ckpt_dir, version):
    if version == "zero3":
        pytest.importorskip("deepspeed")
    mp.spawn(_worker, args=(2, ckpt_dir("qwen2", init_std=1.0), version, free_port()), nprocs=2)


def test_names_lose_their_wrappers_and_buffers_come_too():
    assert clean("_fsdp_wrapped_module.model.layers.0._fsdp_wrapped_module._checkpoint_wrapped_module.mlp.w") == \
        "model.layers.0.mlp.w"
    m = torch.nn.Linear(2, 2)
    m.register_buffer("kept", torch.ones(2))
    m.register_buffer("dropped", torch.zeros(2), persistent=False)
    assert [n for n, _ in gathered_weights(m)] == ["weight", "bias", "kept"]
