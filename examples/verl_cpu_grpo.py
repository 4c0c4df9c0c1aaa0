"""GRPO with verl's parts on a CPU, rollouts by tailrl.

verl's PPO trainer needs an accelerator for its FSDP actor (docs/verl.md says where it stops).
Everything around the actor runs here, so this loop uses verl's own pieces: its config
(``compose``), ``RLHFDataset`` over tailrl's task parquet, ``LLMServerManager`` +
``AgentLoopManager`` with ``rollout.name=tailrl`` (speculative rollouts), the task reward
through verl's ``compute_score`` signature, ``core_algos.compute_grpo_outcome_advantage`` and
``compute_policy_loss`` (clip-higher 0.2/0.28), and the trainer-side ``ServerAdapter`` that sends
the new weights to the rollout after each step. In place of the FSDP actor: one Hugging Face
model in float32, one AdamW step per batch (on-policy: one minibatch, so pi_old is the policy).

    pip install -e '.[verl]'
    python examples/verl_cpu_grpo.py [--steps 8] [--model small] [--plain]

Prints, per step, the rollout and update seconds, the mean reward and verl's speculation metrics.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
import uuid

import numpy as np
import torch

SPEC = "{method:suffix,sources:[history,group,self],policy:fixed,max_draft_tokens:6}"


def response_logprobs(model, batch) -> torch.Tensor:
    """log pi(response token) [bs, response_length] from one forward over prompt + response."""
    ids, responses = batch["input_ids"], batch["responses"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    logits = logits[:, ids.shape[1] - responses.shape[1] - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def run(model_dir: str, steps: int, speculative: bool, group: int = 8, prompts: int = 4, max_tokens: int = 320,
        lr: float = 1e-4, seed: int = 0, replica_rank: int = 0) -> list[dict]:
    import ray
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl import DataProto
    from verl.experimental.agent_loop import AgentLoopManager
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_spec_decode_metrics
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.workers.rollout.llm_server import LLMServerManager

    from tailrl.integrations.verl.adapter import ServerAdapter
    from tailrl.integrations.verl.config import compose
    from tailrl.integrations.verl.tasks import PLAIN_TEMPLATE, compute_score, write

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    template = [] if tok.chat_template else [f"actor_rollout_ref.model.custom_chat_template='{PLAIN_TEMPLATE}'"]
    config = compose(model_dir, *template, n=group, response_length=max_tokens,
                     speculative=SPEC if speculative else None)
    train, _ = write(tempfile.mkdtemp(prefix="tailrl-verl-"), train_size=4 * prompts, test_size=1)
    dataset = RLHFDataset(str(train), tok, config.data)
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    servers = LLMServerManager.create(config, start_rank=replica_rank)
    loops = AgentLoopManager.create(config, servers.get_client())
    adapter = ServerAdapter(config.actor_rollout_ref.rollout, config.actor_rollout_ref.model, replica_rank=replica_rank)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    history = []
    for step in range(steps):
        start = (step * prompts) % len(dataset)
        batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(start, start + prompts)]))
        batch.non_tensor_batch["uid"] = np.array([uuid.uuid4().hex for _ in range(prompts)], dtype=object)
        t0 = time.perf_counter()
        gen = loops.generate_sequences(batch.repeat(group, interleave=True))
        t1 = time.perf_counter()
        b, meta = gen.batch, gen.non_tensor_batch
        mask = b["response_mask"].float()
        rewards = torch.zeros_like(mask)
        scores = []
        for i in range(len(mask)):
            n = int(mask[i].sum())
            text = tok.decode(b["responses"][i, :n], skip_special_tokens=True)
            scores.append(compute_score(meta["data_source"][i], text, meta["reward_model"][i]["ground_truth"],
                                        meta["extra_info"][i]))
            rewards[i, max(n - 1, 0)] = scores[-1]
        adv, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, meta["uid"])
        log_prob = response_logprobs(policy, b)
        loss, clipfrac, kl, _ = core_algos.compute_policy_loss(
            log_prob.detach(), log_prob, adv, mask, cliprange_low=0.2, cliprange_high=0.28)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        asyncio.run(adapter.update_weights(iter(policy.state_dict().items()), global_steps=step + 1))
        t2 = time.perf_counter()
        gap = ((b["rollout_log_probs"] - log_prob.detach()).abs() * mask).sum() / mask.sum()
        row = {"step": step + 1, "rollout_s": t1 - t0, "update_s": t2 - t1, "reward": float(np.mean(scores)),
               "loss": loss.item(), "response_tokens": int(mask.sum()), "rollout_probs_diff": float(gap),
               **compute_spec_decode_metrics(meta.get("spec_num_draft_tokens"), meta.get("spec_num_accepted_tokens"),
                                             meta.get("spec_num_verify_steps"))}
        history.append(row)
        print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return history


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--model", default="small", help="a preset name or a checkpoint directory")
    ap.add_argument("--plain", action="store_true", help="rollouts without speculation (the same responses)")
    a = ap.parse_args()
    from tailrl.tasks.models import get_model
    model = a.model if os.path.isdir(a.model) else get_model(a.model)
    run(model, a.steps, not a.plain)


if __name__ == "__main__":
    main()
