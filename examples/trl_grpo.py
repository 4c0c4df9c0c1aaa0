"""A few GRPO steps of TRL on models/small with tailrl as the rollout engine (CPU, offline).

    pip install -e '.[trl]'
    python examples/trl_grpo.py --steps 3

TRL's ``GRPOTrainer`` does the loss and the optimizer; tailrl's ``TailRLRollout`` generates each
prompt's ``num_generations`` completions as one group with the suffix speculator (history drafts
from the previous epoch, group drafts from live siblings), after loading the trainer's weights.
The rewards are the task families' verifiable rewards (``tailrl.rl.data.task_reward``).
Ends with one line of JSON: per-step rewards, rollout seconds and speculation figures.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "..", "models", "small"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="distinct training prompts (they repeat: epochs)")
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--num-generations", type=int, default=4)
    ap.add_argument("--max-completion-length", type=int, default=128)
    ap.add_argument("--speculative", choices=["off", "suffix"], default="suffix")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tailrl import LLM
    from tailrl.integrations.trl import TailRLRollout
    from tailrl.rl.data import task_reward
    from tailrl.tasks import mixture

    examples = list(itertools.islice(mixture.training_examples(), a.prompts))
    data = Dataset.from_list([{"prompt": ex.prompt, "answer": ex.answer, "family": ex.family} for ex in examples])
    llm = LLM(a.model, speculative=None if a.speculative == "off" else {"method": a.speculative}, seed=0)
    rollout = TailRLRollout(llm, seed=0)
    steps: list[dict] = []

    def timed_rollout(prompts, trainer):
        t0 = time.perf_counter()
        out = rollout(prompts, trainer)
        m = llm.last_metrics
        steps.append({"rollout_s": round(time.perf_counter() - t0, 3),
                      "response_length_mean": m.get("response_length/mean"),
                      "spec_accept_length": m.get("rollout/spec_accept_length")})
        return out

    class Log(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs and steps:
                steps[-1]["reward"] = logs["reward"]
                print(f"step {state.global_step}: reward {logs['reward']:.3f}  rollout {steps[-1]['rollout_s']} s  "
                      f"mean length {steps[-1]['response_length_mean']}  "
                      f"accept length {steps[-1]['spec_accept_length']}")

    g = a.num_generations
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=a.prompts_per_step * g,
                          num_generations=g, max_completion_length=a.max_completion_length, learning_rate=1e-5,
                          beta=0.0, temperature=1.0, report_to="none", use_cpu=True, bf16=False,
                          save_strategy="no", logging_steps=1, seed=0, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(a.model, dtype="float32"),
                              processing_class=AutoTokenizer.from_pretrained(a.model), reward_funcs=task_reward,
                              args=args, train_dataset=data, rollout_func=timed_rollout, callbacks=[Log()])
        trainer.train()
    print(json.dumps({"steps": steps, "speculative": a.speculative}))


if __name__ == "__main__":
    main()
