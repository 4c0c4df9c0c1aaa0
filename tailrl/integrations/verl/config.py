"""verl's own trainer config with tailrl as the rollout, composed in Python (hydra).

``compose(model_dir, *overrides)`` is verl's ``ppo_trainer`` config with
``actor_rollout_ref.rollout.name=tailrl`` on one replica of one CPU "device" (no tensor
parallelism, one agent-loop worker), the prompt/response lengths given, and tailrl's engine
options under ``actor_rollout_ref.rollout.engine_kwargs.tailrl``. It is what the tests and
``benchmarks/verl_rollout.py`` hand to verl's ``LLMServerManager`` and ``AgentLoopManager``;
further hydra overrides go on top. ``chat_batch`` is the batch those take: chat prompts, each
repeated ``n`` times in a row (as verl's trainer repeats a batch for ``rollout.n``).
"""
from __future__ import annotations

import os


def compose(model_dir: str, *overrides: str, n: int = 4, prompt_length: int = 64, response_length: int = 48,
            speculative: str | None = None):
    """``speculative``: a hydra value for ``SpeculativeConfig`` (e.g. ``{method:suffix}``), or None."""
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    spec = [f"+actor_rollout_ref.rollout.engine_kwargs.tailrl.speculative={speculative}"] if speculative else []
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.__file__), "trainer", "config"),
                               version_base=None):
        return hydra_compose(config_name="ppo_trainer", overrides=[
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=tailrl",
            f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
            f"actor_rollout_ref.rollout.response_length={response_length}",
            "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.nnodes=1",
            "actor_rollout_ref.rollout.n_gpus_per_node=1", "actor_rollout_ref.rollout.agent.num_workers=1",
            "actor_rollout_ref.rollout.calculate_log_probs=True", *spec,
            f"data.max_prompt_length={prompt_length}", f"data.max_response_length={response_length}", *overrides])


def chat_batch(messages: list[list[dict]], n: int):
    """verl's ``DataProto`` of chat prompts (``raw_prompt``), each repeated ``n`` times in a row."""
    import numpy as np
    from verl import DataProto
    raw = np.empty(len(messages), dtype=object)          # one message list per row, not a 2-D array
    for i, m in enumerate(messages):
        raw[i] = m
    return DataProto.from_dict(non_tensors={"raw_prompt": raw}).repeat(n, interleave=True)
