"""verl 0.9.1's rollout path with rollout.name=tailrl on this CPU: its LLMServerManager launches
tailrl's replica, its AgentLoopManager runs the single-turn agent loop against it, and the
responses and log-probabilities equal ``LLM.generate``'s for the same seeds (with speculation on,
against plain decoding); new weights sent by the trainer-side ServerAdapter change the outputs
exactly as ``LLM.load_weights`` does."""
import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from checkpoints import make_checkpoint  # noqa: E402
from text_tokenizer import save_char_tokenizer  # noqa: E402

from tailrl import LLM, SamplingParams  # noqa: E402
from tailrl.engine.inputs import default_prompt_id  # noqa: E402
from tailrl.integrations.verl.config import chat_batch, compose  # noqa: E402
from tailrl.serve.samples import prompt_seed  # noqa: E402

N = 4
PROMPT_LEN, RESPONSE_LEN = 64, 48
SPECULATIVE = "{method:suffix,policy:fixed,max_draft_tokens:4}"
MESSAGES = [[{"role": "user", "content": c}] for c in ("add 12 34", "sort 3 1 2", "hello there")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("verl") / "tiny")
    make_checkpoint(path, vocab_size=97, eos_token_id=2, max_pos=1024)
    save_char_tokenizer(path, chat_template=True)
    return path


def verl_config(model_dir: str, *overrides: str):
    return compose(model_dir, *overrides, n=N, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN,
                   speculative=SPECULATIVE)


def rows(out) -> dict[tuple, list[tuple]]:
    """verl's padded output batch -> {prompt tokens: sorted [(response tokens, logprobs)]}."""
    prompts, responses = out.batch["prompts"], out.batch["responses"]
    mask, lps = out.batch["attention_mask"], out.batch["rollout_log_probs"]
    groups: dict[tuple, list[tuple]] = {}
    for i in range(len(prompts)):
        p = tuple(prompts[i][mask[i, :prompts.shape[1]].bool()].tolist())
        n = int(out.batch["response_mask"][i].sum())
        groups.setdefault(p, []).append((tuple(responses[i, :n].tolist()), tuple(lps[i, :n].tolist())))
    return {p: sorted(v) for p, v in groups.items()}


def expected(llm: LLM, groups, epoch: int) -> dict[tuple, list[tuple]]:
    """The same prompts through LLM.generate (no speculation), with the server's seeds."""
    prompts = [list(p) for p in groups]
    params = [SamplingParams(n=N, temperature=1.0, max_tokens=RESPONSE_LEN, seed=prompt_seed(epoch, p))
              for p in prompts]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return {tuple(p): sorted((tuple(c.token_ids), tuple(torch.tensor(c.logprobs, dtype=torch.float32).tolist()))
                             for c in o.outputs) for p, o in zip(prompts, outs)}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_agent_loop_equals_llm_generate_and_weight_updates_apply(model_dir, ray_cluster):
    from transformers import AutoModelForCausalLM
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerManager

    from tailrl.integrations.verl.adapter import ServerAdapter

    config = verl_config(model_dir)
    manager = LLMServerManager.create(config)
    loops = AgentLoopManager.create(config, manager.get_client())
    batch = chat_batch(MESSAGES, N)

    first = rows(loops.generate_sequences(batch))
    assert len(first) == 3 and all(len(v) == N for v in first.values())
    reference = LLM(model_dir, seed=config.actor_rollout_ref.rollout.seed,
                    max_model_len=PROMPT_LEN + RESPONSE_LEN)
    assert first == expected(reference, first, epoch=0)

    # new weights from the trainer side, as verl's actor worker sends them after a step
    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    torch.manual_seed(1)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in hf.state_dict().items()}
    rollout = config.actor_rollout_ref.rollout
    rollout.checkpoint_engine.update_weights_bucket_megabytes = 0      # every tensor in a bucket of its own
    adapter = ServerAdapter(rollout, config.actor_rollout_ref.model)
    asyncio.run(adapter.update_weights(iter(state.items()), global_steps=1))
    out = loops.generate_sequences(batch)
    second = rows(out)
    reference.load_weights(state)
    assert second == expected(reference, second, epoch=1)
    assert second != first
    assert sum(out.non_tensor_batch["spec_num_verify_steps"]) > 0      # history drafts were verified
    with pytest.raises(ValueError, match="lora.merge=True"):           # a LoRA policy's separate adapters
        asyncio.run(adapter.update_weights(iter(state.items()), peft_config={"r": 8}, base_sync_done=True))


def test_task_parquet_through_verls_dataset_and_agent_loop(model_dir, ray_cluster, tmp_path):
    """verl's RLHFDataset reads tailrl's task parquet; its batch goes through the agent loop to
    the tailrl replica; the reward function scores every response."""
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.workers.rollout.llm_server import LLMServerManager

    from tailrl.integrations.verl.tasks import compute_score, write

    train, _ = write(tmp_path, train_size=3, test_size=1)
    config = verl_config(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    dataset = RLHFDataset(str(train), tok, config.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(dataset))]))
    manager = LLMServerManager.create(config, start_rank=1)         # rank 0 is the first test's
    out = AgentLoopManager.create(config, manager.get_client()).generate_sequences(batch.repeat(N, interleave=True))
    assert out.batch["responses"].shape[0] == 3 * N
    meta = out.non_tensor_batch
    texts = [tok.decode(out.batch["responses"][i][out.batch["response_mask"][i].bool()]) for i in range(3 * N)]
    scores = [compute_score(meta["data_source"][i], texts[i], meta["reward_model"][i]["ground_truth"],
                            meta["extra_info"][i]) for i in range(3 * N)]
    assert set(scores) <= {0.0, 1.0} and all(meta["data_source"][i].startswith("tailrl/") for i in range(3 * N))


def test_prompt_router_keeps_a_prompts_samples_on_one_replica_across_epochs(model_dir, ray_cluster):
    """Two replicas behind PromptRouter: every prompt's samples, in both calls, ran on one
    replica (its history there holds both calls' 2N responses: no weight update between them,
    so one group); both replicas got work."""
    import ray
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.workers.rollout.llm_server import LLMServerManager

    from tailrl.integrations.verl.router import CONFIG

    config = verl_config(model_dir, "actor_rollout_ref.rollout.n_gpus_per_node=2",
                         f"actor_rollout_ref.rollout.router_config_path={CONFIG}")
    manager = LLMServerManager.create(config, start_rank=3)
    loops = AgentLoopManager.create(config, manager.get_client())
    prompts = [[{"role": "user", "content": f"add {i} {i + 7}"}] for i in range(6)]
    batch = chat_batch(prompts, N)
    loops.generate_sequences(batch)
    out = loops.generate_sequences(batch)
    keys = {tuple(p[m[:p.shape[0]].bool()].tolist()) for p, m in zip(out.batch["prompts"], out.batch["attention_mask"])}
    histories = [ray.get(h.__ray_call__.remote(lambda self, ks: [len(self.llm.history.get(default_prompt_id(list(k))))
                                                                 for k in ks], sorted(keys)))
                 for h in manager.server_handles]
    assert len(histories) == 2
    for counts in zip(*histories):                  # per prompt: 2N responses on one replica, none on the other
        assert sorted(counts) == [0, 2 * N]
    assert all(any(c) for c in histories)


@pytest.mark.slow
def test_cpu_grpo_example_trains_through_verls_parts(model_dir, ray_cluster):
    """examples/verl_cpu_grpo.py: two GRPO steps with verl's dataset, agent loop, advantages and
    policy loss, tailrl's speculative rollouts and weights sent back through the adapter."""
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "examples" / "verl_cpu_grpo.py"
    spec = importlib.util.spec_from_file_location("verl_cpu_grpo", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    rows = example.run(model_dir, steps=2, speculative=True, group=4, prompts=2, max_tokens=RESPONSE_LEN,
                       replica_rank=7)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(np.isfinite(r["loss"]) and r["response_tokens"] > 0 for r in rows)
    assert all(r["rollout_probs_diff"] < 0.05 for r in rows)       # bf16 engine vs the float32 policy


@pytest.fixture
def server(model_dir):
    from tailrl.integrations.verl.server import TailRLServer
    config = verl_config(model_dir)
    return TailRLServer(config.actor_rollout_ref.rollout, config.actor_rollout_ref.model, http=False)


SAMPLE = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


def test_server_groups_siblings_and_records_their_history(server):
    prompt = [4, 8, 15, 16, 23]

    async def run():
        return await asyncio.gather(*[server.generate(prompt, dict(SAMPLE), f"r{j}") for j in range(2 * N)])

    outs = asyncio.run(run())
    assert all(o.stop_reason == "completed" and len(o.log_probs) == len(o.token_ids) for o in outs)
    history = server.llm.history.get(default_prompt_id(prompt))
    assert sorted(history) == sorted(o.token_ids for o in outs)      # the group's N responses, together
    again = asyncio.run(run())                                       # next samples of the prompt: new noise
    assert sorted(o.token_ids for o in again) != sorted(history)
    assert sum(o.extra_fields["spec_num_verify_steps"] for o in again) > 0    # drafted from the history
    kv = server.llm.engine.kv.bytes                                  # the K/V pool
    asyncio.run(server.sleep())
    assert 0 == server.llm.engine.kv.bytes < kv                      # given back while asleep


@pytest.mark.parametrize("params,field", [({"repetition_penalty": 0.0}, "repetition_penalty"), ({"n": 2}, "'n'"),
                                          ({"best_of": 2}, "best_of"), ({"top_p": 0.0}, "top_p"),
                                          ({"temperature": -1.0}, "temperature")])
def test_server_rejects_what_it_does_not_take_and_stays_usable(server, params, field):
    with pytest.raises(ValueError, match=field):
        asyncio.run(server.generate([5, 6, 7], {**SAMPLE, **params}, "bad"))
    with pytest.raises(ValueError, match="prompt_ids"):
        asyncio.run(server.generate([5, 600], dict(SAMPLE), "bad"))
    out = asyncio.run(server.generate([5, 6, 7], dict(SAMPLE), "good"))
    assert out.stop_reason == "completed" and out.token_ids


def test_abort_ends_running_requests_and_holds_new_ones_until_resume(server):
    long = {**SAMPLE, "max_tokens": RESPONSE_LEN, "ignore_eos": True}

    async def run():
        running = [asyncio.ensure_future(server.generate([9, 9, 9], dict(long), f"a{j}")) for j in range(2)]
        for _ in range(500):                             # a few steps in (bounded: a failed call ends it)
            if server.llm.engine.metrics.num_forward >= 3 or any(r.done() for r in running):
                break
            await asyncio.sleep(0.01)
        await server.abort_all_requests()
        aborted = await asyncio.gather(*running)
        held = asyncio.ensure_future(server.generate([9, 9, 8], dict(SAMPLE), "held"))
        await asyncio.sleep(0.2)
        assert not held.done()
        await server.resume_generation()
        await server.abort_all_requests(reject_request=True)
        rejected = await server.generate([9, 9, 7], dict(SAMPLE), "rejected")
        await server.resume_generation()
        return aborted, await held, rejected

    aborted, held, rejected = asyncio.run(run())
    assert all(o.stop_reason == "aborted" and 0 < len(o.token_ids) < RESPONSE_LEN for o in aborted)
    assert held.stop_reason == "completed" and held.token_ids
    assert rejected.stop_reason == "aborted" and rejected.token_ids == []
    assert server.llm.history.get(default_prompt_id([9, 9, 9])) == []            # cut short: no history


def test_task_parquet_and_reward(tmp_path):
    import pyarrow.parquet as pq

    from tailrl.integrations.verl.tasks import compute_score, write
    from tailrl.tasks.mixture import heldout_examples
    train, test = write(tmp_path, train_size=5, test_size=4)
    got = pq.read_table(train).to_pylist()
    assert len(got) == 5 and got[0]["prompt"][0]["role"] == "user"
    assert got[0]["data_source"].startswith("tailrl/")
    ex = heldout_examples(4)
    rows_ = pq.read_table(test).to_pylist()
    assert [r["prompt"][0]["content"] for r in rows_] == [e.prompt for e in ex]
    for r, e in zip(rows_, ex):
        assert compute_score(r["data_source"], e.solution, r["reward_model"]["ground_truth"], r["extra_info"]) == 1.0
        assert compute_score(r["data_source"], "answer nope", r["reward_model"]["ground_truth"], r["extra_info"]) == 0.0


def test_engine_kwargs_take_verls_memory_share_and_tailrls_own_on_top(model_dir):
    """verl's rollout ``gpu_memory_utilization`` becomes the engine's (used on a GPU, where
    verl's actor shares the device); ``engine_kwargs.tailrl`` wins over verl's keys."""
    from verl.utils.config import omega_conf_to_dataclass

    from tailrl.integrations.verl.server import engine_kwargs
    cfg = omega_conf_to_dataclass(verl_config(model_dir).actor_rollout_ref.rollout)
    assert engine_kwargs(cfg)["gpu_memory_utilization"] == cfg.gpu_memory_utilization == 0.5
    cfg.engine_kwargs = {"tailrl": {"gpu_memory_utilization": 0.3, "device": "cuda"}}
    assert engine_kwargs(cfg)["gpu_memory_utilization"] == 0.3 and engine_kwargs(cfg)["device"] == "cuda"



def test_verls_penalties_min_p_and_min_tokens_reach_the_engine():
    from types import SimpleNamespace

    from tailrl.integrations.verl.server import to_sampling_params
    config = SimpleNamespace(response_length=32, prompt_length=16, ignore_eos=False)
    sp, _ = to_sampling_params({**SAMPLE, "repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 0.1,
                                "min_p": 0.05, "min_tokens": 4}, config, 5, 48)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty, sp.min_p, sp.min_tokens) == (
        1.2, 0.5, 0.1, 0.05, 4)
    assert not to_sampling_params(dict(SAMPLE), config, 5, 48)[0].processes


def test_clear_kv_cache_forgets_the_cached_prefixes(server):
    asyncio.run(server.generate(list(range(3, 43)), dict(SAMPLE), "long"))    # a full block of prompt
    assert server.llm.engine.kv.prefix.by_key
    asyncio.run(server.clear_kv_cache())
    assert server.llm.engine.kv.prefix.by_key == {}
