"""Reasoning task families with verifiable answers, the workload model, dataset loaders.

- families: ``add``, ``sort``, ``search`` (see docs/workload.md); ``mixture`` mixes them
  into a long-tailed workload with a held-out split;
- ``get_model(preset)``: a ready Hugging Face checkpoint directory (``test`` or ``small``);
- ``load_prompts(path)``: JSONL / JSON / parquet prompt files (verl layout included);
- ``math_reward`` / ``extract_answer``: ``\\boxed{}``, ``#### x``, last number.
"""
from tailrl.tasks.datasets import DatasetError, PromptRecord, load_prompts
from tailrl.tasks.math_answer import extract_answer, math_reward
from tailrl.tasks.mixture import FAMILIES, heldout_examples, mixed_example, reward, training_examples
from tailrl.tasks.models import get_model

__all__ = ["FAMILIES", "DatasetError", "PromptRecord", "extract_answer", "get_model", "heldout_examples",
           "load_prompts", "math_reward", "mixed_example", "reward", "training_examples"]
