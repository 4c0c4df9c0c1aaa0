"""The trainer's log-probabilities are the rollout's, bit for bit, in bfloat16 (``exact_logprobs``):
``actor/rollout_logprob_diff`` is 0 and the first minibatch's ratio exactly 1, with and without
speculation, on one engine and on a two-instance pool; the gradient is the policy's own, so
one update per batch trains exactly as without exact values."""
import pytest
import torch
from test_train import brevity_reward, tiny_config

from tailrl.rl.policy import with_values
from tailrl.rl.trainer import Trainer


def run(tmp_path, name, **kw) -> tuple[Trainer, list[dict]]:
    cfg = tiny_config(tmp_path, name, total_steps=2, checkpoint_every=0, save_rollouts=False, **kw)
    tr = Trainer(cfg, reward_fn=brevity_reward)
    try:
        return tr, tr.train()
    finally:
        tr.llm.close()


@pytest.mark.parametrize("setting", [{}, {"speculative": {"policy": "fixed"}},
                                     {"instances": 2, "scheduler": "static"}])
def test_trainer_logprobs_equal_the_rollout_bit_for_bit(tmp_path, setting):
    _, rows = run(tmp_path, "exact", ppo_minibatches=2, lr=1e-2, **setting)
    for m in rows:
        assert m["actor/rollout_logprob_diff"] == 0.0 and m["actor/first_ratio_dev"] == 0.0
        assert m["actor/clip_frac"] > 0 and m["actor/grad_norm"] > 0     # the second minibatch moved
    if "speculative" in setting:
        assert sum(m["rollout/spec_accepted_tokens"] for m in rows) > 0
    _, ref = run(tmp_path, "reference", ppo_minibatches=2, lr=1e-2, exact_logprobs=False, **setting)
    assert all(m["actor/rollout_logprob_diff"] > 0 and m["actor/first_ratio_dev"] > 0 for m in ref)


def test_one_update_per_batch_trains_as_without_exact_values(tmp_path):
    """With one optimizer step per batch the ratio is 1 either way and the gradient is the
    policy forward's: the weights after two steps are equal bit for bit."""
    a, _ = run(tmp_path, "exact")
    b, _ = run(tmp_path, "reference", exact_logprobs=False, old_logprobs="recompute")
    sa, sb = a.policy.state_dict(), b.policy.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_with_values_has_the_values_and_the_reference_gradient():
    ref = torch.tensor([0.1, -2.0, 3.0], requires_grad=True)
    values = torch.tensor([0.10000001, -2.5, 2.75])
    out = with_values(ref * 2, values)
    assert torch.equal(out, values)
    (out * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert torch.equal(ref.grad, torch.tensor([2.0, 4.0, 6.0]))


@pytest.mark.parametrize("arch,layers", [("qwen3_5", 4), ("gpt_oss", 2), ("deepseek_v3", 2)])
def test_other_layers_policys_logprobs_are_the_rollouts_bit_for_bit(tmp_path, arch, layers):
    """Qwen3.5 (Gated DeltaNet layers with recurrent states, model/deltanet.py), gpt-oss
    (attention sinks, experts with biases and a clamped SwiGLU) and DeepSeek-V3 (latent
    attention, model/mla.py): the trainer's log-probabilities (the engine's own scorer) equal the
    speculative rollout's in bfloat16."""
    from checkpoints import make_checkpoint
    from text_tokenizer import save_char_tokenizer
    path = make_checkpoint(str(tmp_path / arch), arch, num_layers=layers, vocab_size=97, eos_token_id=2, max_pos=1024)
    save_char_tokenizer(path, chat_template=True)
    _, rows = run(tmp_path, arch, model=path, ppo_minibatches=2, lr=1e-2, speculative={"policy": "fixed"})
    for m in rows:
        assert m["actor/rollout_logprob_diff"] == 0.0 and m["actor/first_ratio_dev"] == 0.0
    assert sum(m["rollout/spec_draft_tokens"] for m in rows) > 0            # drafts verified on the states' copies
