"""tailrl as ``trl.GRPOTrainer``'s in-process rollout engine: ``GRPOTrainer(..., rollout_func=TailRLRollout(llm))``.

Written against TRL 1.16 (the ``trl`` extra pins ``trl>=1.16,<1.17``), whose trainer calls
``rollout_func(prompts, trainer)`` with the process's prompt slice *as its RepeatSampler drew it*:
each prompt repeated ``num_generations`` times in a row, and expects one completion per entry.
The adapter collapses each run of repeats into one prompt and generates its completions as one
group (``n = num_generations``): the siblings feed group drafts, and a stable prompt id (a digest
of the prompt) lets the history store feed history drafts on the next epoch. Before each
rollout it copies the trainer's current weights into the engine (once per optimizer step; a
PEFT model's adapters merged), so the rollout samples from the policy being trained. It only
uses the public ``LLM`` API.

Seeds: prompt ``i`` of the ``k``-th rollout gets ``SamplingParams.seed = mix(seed, k, i)``;
``last_rollout`` keeps the prompts, params and outputs, so the same tokens can be regenerated
with ``LLM.generate`` (that is what the tests check).
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass

import torch

from tailrl.config import SamplingParams
from tailrl.extras import require
from tailrl.integrations.gathered import gathered_weights
from tailrl.noise import mix

log = logging.getLogger(__name__)


def _require_trl():
    return require("trl", "trl")


def prompt_key(prompt) -> str:
    """A stable id for a TRL prompt (text or chat messages): the history store's key."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return "trl-" + hashlib.sha1(text.encode()).hexdigest()[:16]


def collapse_repeats(prompts: list, num_generations: int) -> list:
    """TRL 1.16 hands each prompt ``num_generations`` times in a row; return each prompt once."""
    if len(prompts) % num_generations:
        raise ValueError(f"rollout_func got {len(prompts)} prompts, not a multiple of num_generations="
                         f"{num_generations}: this adapter expects TRL 1.16's repeated prompts")
    unique = prompts[::num_generations]
    for i, p in enumerate(unique):
        if any(q != p for q in prompts[i * num_generations:(i + 1) * num_generations]):
            raise ValueError("rollout_func: prompts are not repeated num_generations times in a row "
                             "(TRL version other than 1.16?)")
    return unique


def is_peft(model) -> bool:
    """A PEFT model (its adapters are weights of their own beside the base model's)."""
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter")


# PEFT's names for what a checkpoint calls the base model's tensors
_PEFT_WRAPPED = re.compile(r"\.(base_layer|modules_to_save\.[^.]+)(?=\.)")


def _base_name(name: str) -> str:
    return _PEFT_WRAPPED.sub("", name.removeprefix("base_model.model."))


@torch.no_grad()
def merged_weights(model) -> dict:
    """A PEFT model's weights as the base model's checkpoint names them, its active adapters
    merged: each adapted layer's base weight plus its adapters' deltas (``get_delta_weight``:
    LoRA and its kin, scaling and layout as PEFT merges them), computed apart, so the trainer's
    tensors are never modified (merging in place and back would leave them off by rounding);
    a trained copy (``modules_to_save``) in place of its original, the adapters' own tensors
    left out. An adapter PEFT cannot merge as a delta (DoRA) is a ValueError naming it."""
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" in name or ".original_module." in name:
            continue
        out[_base_name(name)] = t.detach()
    for name, module in model.named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
            continue
        if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
            continue                                        # merged into the base already, or off
        if any(getattr(module, "use_dora", {}).get(a) for a in module.active_adapters):
            raise ValueError(f"peft: {name} is a DoRA adapter, whose merge is not a weight delta; "
                             "tailrl takes LoRA-style adapters")
        key = _base_name(name + ".base_layer.weight")
        for adapter in module.active_adapters:
            out[key] = out[key] + module.get_delta_weight(adapter).to(out[key].dtype)
    return out


def sharding(trainer) -> tuple[int | None, bool]:
    """(FSDP's version or None, whether DeepSpeed ZeRO-3 shards the model) of a TRL trainer, as
    TRL itself reads them (``trl.distributed.DistributedBackend``)."""
    from trl.distributed import DistributedBackend
    backend = DistributedBackend(trainer.accelerator)
    return backend.fsdp_version, backend.is_zero3


@dataclass
class Rollout:
    """What one call generated (kept for checks and logging)."""

    prompt_token_ids: list[list[int]]
    params: list[SamplingParams]
    prompt_ids: list[str]
    outputs: list                          # list[RequestOutput]


class TailRLRollout:
    """A TRL ``rollout_func`` backed by an ``LLM`` in this process."""

    def __init__(self, llm, seed: int = 0) -> None:
        _require_trl()
        self.llm = llm
        self.seed = seed
        self.calls = 0
        self.last_rollout: Rollout | None = None
        self._loaded_step: int | None = None

    def __call__(self, prompts: list, trainer) -> dict[str, list]:
        self.sync_weights(trainer)
        g = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        unique = collapse_repeats(list(prompts), g)
        token_ids = self.tokenize(unique, trainer)
        base = self.sampling_params(trainer, g)
        params = [base.clone(seed=mix(self.seed, self.calls, i) & (2**62 - 1)) for i in range(len(unique))]
        pids = [prompt_key(p) for p in unique]
        self.calls += 1
        outs = self.llm.generate(token_ids, params, prompt_ids=pids, use_tqdm=False)
        self.last_rollout = Rollout(token_ids, params, pids, outs)
        samples = [(o.prompt_token_ids, c) for o in outs for c in o.outputs]
        return {"prompt_ids": [list(p) for p, _ in samples],
                "completion_ids": [list(c.token_ids) for _, c in samples],
                "logprobs": [list(c.logprobs) for _, c in samples]}

    def sync_weights(self, trainer) -> None:
        """Copy the policy's weights into the engine once per optimizer step (and before the
        first rollout). A PEFT model (``GRPOTrainer(peft_config=...)``, e.g. LoRA) sends its base
        weights with its adapters' deltas added (``merged_weights``), its own left untouched. A
        model sharded by FSDP (1 or 2) or DeepSpeed ZeRO-3 streams its tensors gathered one at a
        time (gathered.py; every process of the trainer takes part, as every one calls this)."""
        step = trainer.state.global_step
        if step == self._loaded_step:
            return
        fsdp_version, zero3 = sharding(trainer)
        model = trainer.accelerator.unwrap_model(trainer.model)
        if (fsdp_version or zero3) and is_peft(model):
            raise ValueError("trl: a PEFT policy sharded by FSDP or DeepSpeed ZeRO-3 is not supported (its adapters "
                             "would be merged into sharded weights); train it unsharded, or without PEFT")
        if fsdp_version or zero3:
            root = trainer.model_wrapped if fsdp_version == 1 else model     # FSDP1: the wrapped root's own too
            self.llm.load_weights(gathered_weights(root, fsdp_version, zero3))
        elif is_peft(model):
            self.llm.load_weights(merged_weights(model))
        else:
            self.llm.load_weights({k: v.detach() for k, v in model.state_dict().items()})
        self._loaded_step = step
        log.debug("loaded the trainer's weights of step %d into the engine", step)

    @staticmethod
    def tokenize(prompts: list, trainer) -> list[list[int]]:
        """Token ids exactly as TRL 1.16 would make them (text as is, chats through the template)."""
        tok = trainer.processing_class
        if prompts and not isinstance(prompts[0], str):
            enc = tok.apply_chat_template(conversation=prompts, add_generation_prompt=True, tokenize=True,
                                          return_dict=True, chat_template=getattr(trainer, "chat_template", None),
                                          **(getattr(trainer, "chat_template_kwargs", None) or {}))
            return [list(ids) for ids in enc["input_ids"]]
        return [list(ids) for ids in tok(text=prompts)["input_ids"]]

    @staticmethod
    def sampling_params(trainer, n: int) -> SamplingParams:
        """The trainer's generation settings (its repetition penalty and min_p too)."""
        return SamplingParams(n=n, temperature=float(trainer.temperature), top_p=float(trainer.top_p),
                              top_k=trainer.top_k if trainer.top_k and trainer.top_k > 0 else -1,
                              max_tokens=trainer.max_completion_length,
                              repetition_penalty=float(getattr(trainer, "repetition_penalty", None) or 1.0),
                              min_p=float(getattr(trainer, "min_p", None) or 0.0))
