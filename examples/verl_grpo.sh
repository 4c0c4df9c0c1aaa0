#!/usr/bin/env bash
# verl GRPO on tailrl's synthetic reasoning tasks with the `small` workload model, rollouts by
# tailrl (actor_rollout_ref.rollout.name=tailrl: history + group + self suffix speculation).
#   pip install -e '.[verl]'
#   bash examples/verl_grpo.sh [more hydra overrides]
# Writes the task data in verl's parquet layout to $DATA (default runs/verl-data). verl's
# trainer needs an accelerator for its FSDP actor (README "With verl" says what runs on CPU).
set -euo pipefail
DATA=${DATA:-runs/verl-data}
MODEL=$(python -c "from tailrl.tasks.models import get_model; print(get_model('small'))")
python -m tailrl.integrations.verl.tasks "$DATA" --train-size 16 --test-size 32
TASKS=$(python -c "import tailrl.integrations.verl.tasks as t; print(t.__file__)")
TEMPLATE=$(python -c "from tailrl.integrations.verl.tasks import PLAIN_TEMPLATE; print(PLAIN_TEMPLATE)")
python -m verl.trainer.main_ppo \
  algorithm.adv_estimator=grpo \
  algorithm.use_kl_in_reward=False \
  data.train_files="$DATA/train.parquet" \
  data.val_files="$DATA/test.parquet" \
  data.train_batch_size=4 \
  data.max_prompt_length=64 \
  data.max_response_length=320 \
  actor_rollout_ref.model.path="$MODEL" \
  "actor_rollout_ref.model.custom_chat_template='$TEMPLATE'" \
  actor_rollout_ref.actor.optim.lr=1e-4 \
  actor_rollout_ref.actor.ppo_mini_batch_size=4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.actor.use_kl_loss=False \
  actor_rollout_ref.actor.clip_ratio_low=0.2 \
  actor_rollout_ref.actor.clip_ratio_high=0.28 \
  actor_rollout_ref.rollout.name=tailrl \
  actor_rollout_ref.rollout.n=8 \
  actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.calculate_log_probs=True \
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
  '+actor_rollout_ref.rollout.engine_kwargs.tailrl.speculative={method:suffix,sources:[history,group,self],policy:fixed,max_draft_tokens:6}' \
  actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
  reward.custom_reward_function.path="$TASKS" \
  reward.custom_reward_function.name=compute_score \
  trainer.n_gpus_per_node=1 \
  trainer.nnodes=1 \
  trainer.logger=console \
  trainer.val_before_train=False \
  trainer.test_freq=-1 \
  trainer.save_freq=-1 \
  trainer.total_training_steps=4 \
  "$@"
