"""Two real TRL GRPO steps with tailrl's speculative engine as the rollout engine (CPU, offline)."""
import pytest

pytest.importorskip("trl")

from checkpoints import make_checkpoint  # noqa: E402
from text_tokenizer import save_char_tokenizer  # noqa: E402

from tailrl import LLM  # noqa: E402
from tailrl.integrations.trl import TailRLRollout, collapse_repeats, merged_weights, prompt_key  # noqa: E402

G = 4
# The suffix speculator with the fixed policy: the adaptive one may decide that drafting does not
# pay on a loaded CPU (its cost model is measured), and then the lossless path would go untested.
SPECULATIVE = {"method": "suffix", "policy": "fixed", "max_draft_tokens": 4}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("trl") / "tiny")
    make_checkpoint(path, vocab_size=97, eos_token_id=2, max_pos=1024)   # the speculator calibrates at 512
    save_char_tokenizer(path, chat_template=True)
    return path


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory) -> str:
    """A tiny Qwen3.5 (Gated DeltaNet layers: recurrent states per request) with the same tokenizer."""
    path = str(tmp_path_factory.mktemp("trl") / "qwen3_5")
    make_checkpoint(path, "qwen3_5", num_layers=4, vocab_size=97, eos_token_id=2, max_pos=1024)
    save_char_tokenizer(path, chat_template=True)
    return path


@pytest.fixture(scope="module")
def deepseek_v3_dir(tmp_path_factory) -> str:
    """A tiny DeepSeek-V3 (latent attention, grouped routing): a trainer's module names its experts
    fused and its attention's low-rank projections."""
    path = str(tmp_path_factory.mktemp("trl") / "deepseek_v3")
    make_checkpoint(path, "deepseek_v3", vocab_size=97, eos_token_id=2, max_pos=1024)
    save_char_tokenizer(path, chat_template=True)
    return path


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory) -> str:
    """A tiny gpt-oss (sinks, windows, experts with biases): its module's interleaved expert tensors."""
    path = str(tmp_path_factory.mktemp("trl") / "gpt_oss")
    make_checkpoint(path, "gpt_oss", vocab_size=97, eos_token_id=2, max_pos=1024)
    save_char_tokenizer(path, chat_template=True)
    return path


def length_reward(prompts, completions, **_):
    """Varied rewards, so advantages are non-zero and the update changes the weights."""
    return [float(len(c) % 5) for c in completions]


def test_collapse_repeats():
    assert collapse_repeats(["a", "a", "b", "b"], 2) == ["a", "b"]
    with pytest.raises(ValueError, match="multiple"):
        collapse_repeats(["a", "a", "b"], 2)
    with pytest.raises(ValueError, match="repeated"):
        collapse_repeats(["a", "b", "a", "b"], 2)
    assert prompt_key("x") == prompt_key("x") != prompt_key("y")


@pytest.mark.parametrize("which", ["model_dir", "qwen3_5_dir", "gpt_oss_dir", "deepseek_v3_dir"])
def test_two_grpo_steps_match_engine_output(which, tmp_path, monkeypatch, request):
    model_dir = request.getfixturevalue(which)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    llm = LLM(model_dir, speculative=SPECULATIVE, seed=0)
    rollout = TailRLRollout(llm, seed=123)
    records, verified = [], []

    def rollout_func(prompts, trainer):
        out = rollout(prompts, trainer)
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        records.append((weights, rollout.last_rollout, out))
        verified.append(llm.last_metrics.get("rollout/spec_verify_rows", 0.0))
        return out

    args = GRPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2 * G, num_generations=G,
                      max_completion_length=24, learning_rate=5e-2, beta=0.0, temperature=1.0, report_to="none",
                      use_cpu=True, bf16=False, save_strategy="no", logging_steps=1, seed=0,
                      dataloader_num_workers=0)
    data = Dataset.from_list([{"prompt": p} for p in ["1+2=", "3*4=", "sort 3 1 2:", "max 7 9:"]])
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model_dir),
                          processing_class=AutoTokenizer.from_pretrained(model_dir), reward_funcs=length_reward,
                          args=args, train_dataset=data, rollout_func=rollout_func)
    trainer.train()

    assert len(records) == 2
    changed = any(not records[0][0][k].equal(records[1][0][k]) for k in records[0][0])
    assert changed                                    # the step updated the policy and the engine got it
    assert sum(verified) > 0, verified                # drafts were verified: the speculative path ran
    for weights, roll, out in records:
        assert len(out["completion_ids"]) == 2 * G and len(roll.outputs) == 2
        assert roll.prompt_ids == [prompt_key(llm.tokenizer.decode(p)) for p in roll.prompt_token_ids]
        ref = LLM(model_dir, seed=0)                  # plain engine, same seeds, same weights
        ref.load_weights(weights)
        want = ref.generate(roll.prompt_token_ids, roll.params, prompt_ids=roll.prompt_ids)
        assert out["completion_ids"] == [c.token_ids for o in want for c in o.outputs]
        assert out["prompt_ids"] == [o.prompt_token_ids for o in want for _ in o.outputs]
        got_lp = [lp for seq in out["logprobs"] for lp in seq]
        assert got_lp == pytest.approx([lp for o in want for c in o.outputs for lp in c.logprobs], abs=1e-4)


def test_the_trainers_repetition_penalty_and_min_p_reach_the_engine():
    from types import SimpleNamespace
    trainer = SimpleNamespace(temperature=0.9, top_p=0.95, top_k=0, max_completion_length=64, repetition_penalty=1.1,
                              min_p=0.05)
    p = TailRLRollout.sampling_params(trainer, 4)
    assert (p.n, p.repetition_penalty, p.min_p, p.top_k, p.max_tokens) == (4, 1.1, 0.05, -1, 64)
    p = TailRLRollout.sampling_params(SimpleNamespace(**{**vars(trainer), "repetition_penalty": None,
                                                         "min_p": None}), 4)
    assert (p.repetition_penalty, p.min_p) == (1.0, 0.0) and not p.processes
    with pytest.raises(ValueError, match="repetition_penalty"):
        TailRLRollout.sampling_params(SimpleNamespace(**{**vars(trainer), "repetition_penalty": -1.0}), 4)


def test_a_lora_policys_merged_weights_reach_the_engine_and_the_trainers_stay_unmerged(model_dir):
    """GRPOTrainer(peft_config=LoraConfig(...)): the engine gets the base weights with the
    adapters merged (as PEFT's own merge_and_unload computes them, bit for bit) under the
    checkpoint's names, a trained copy of the LM head included; the trainer's tensors untouched."""
    import copy
    from types import SimpleNamespace

    import torch
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    policy = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                                 peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                                 modules_to_save=["lm_head"]))
    with torch.no_grad():                                   # a trained adapter and head copy
        for name, p in policy.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                p.add_(0.3 * torch.randn_like(p))
    merged = copy.deepcopy(policy).merge_and_unload().state_dict()
    base = {k: v.clone() for k, v in policy.state_dict().items()}
    unsharded = SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None)      # what accelerate says unsharded
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=0), model=policy,
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m, state=unsharded))
    llm = LLM(model_dir, dtype="float32")
    TailRLRollout(llm).sync_weights(trainer)
    assert all(torch.equal(v, base[k]) for k, v in policy.state_dict().items())    # untouched
    mine = merged_weights(policy)
    assert sorted(mine) == sorted(merged) and all(torch.equal(mine[k], merged[k]) for k in merged)
    ref = LLM(model_dir, dtype="float32")
    ref.load_weights(merged)
    from tailrl import SamplingParams
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=5)
    prompts = [[5, 6, 7], [9, 9, 3, 4]]
    got, want = llm.generate(prompts, params), ref.generate(prompts, params)
    assert [c.token_ids for o in got for c in o.outputs] == [c.token_ids for o in want for c in o.outputs]
    plain = LLM(model_dir, dtype="float32").generate(prompts, params)     # the base model's: the adapters count
    assert [c.token_ids for o in got for c in o.outputs] != [c.token_ids for o in plain for c in o.outputs]
