"""Build draft sources and a speculation policy from a ``SpeculativeConfig``.

- ``make_sources``: the suffix sources named in ``config.sources`` (in that order), sharing
  one ``MatchParams``: ``min_match_len``, ``min_token_prob`` and ``max_draft_depth =
  max_draft_tokens`` from the config; ``max_match_len`` (16) is not a config field.
  ``method="drafter"`` is the learned drafter alone (``DrafterSource`` over the engine's
  model); ``"hybrid"`` is the suffix sources followed by the drafter.
- ``make_spec_policy``: ``adaptive`` / ``bandit`` / ``fixed`` (``max_draft_tokens`` for everyone).
  With a history store, the adaptive policy's priority is the request's expected length:
  the longer of its output so far and the prompt's longest previous response (Seer
  estimates a group's length by its longest finished sibling; RhymeRL by history).
"""
from __future__ import annotations

from typing import Any, Callable

from tailrl.config import SpeculativeConfig
from tailrl.speculative.history import HistoryStore
from tailrl.speculative.policies.adaptive import AdaptivePolicy
from tailrl.speculative.policies.bandit import DEFAULT_ARMS, BanditPolicy
from tailrl.speculative.policies.base import FixedPolicy, SpecPolicy
from tailrl.speculative.policies.cost_model import CostModel
from tailrl.speculative.policies.priced import PricedPolicy
from tailrl.speculative.sources.base import DraftSource, MatchParams
from tailrl.speculative.sources.group_source import GroupSource
from tailrl.speculative.sources.history_source import HistorySource
from tailrl.speculative.sources.self_source import SelfSource


def match_params(config: SpeculativeConfig) -> MatchParams:
    return MatchParams(min_match_len=config.min_match_len, max_match_len=max(16, config.min_match_len),
                       min_token_prob=config.min_token_prob, max_draft_depth=config.max_draft_tokens)


def make_sources(config: SpeculativeConfig, history_store: HistoryStore | None = None,
                 params: MatchParams | None = None, target: Any = None) -> list[DraftSource]:
    """``params`` overrides the matching parameters derived from ``config`` (ablations);
    ``target``: the engine's ``Transformer``, whose embedding and LM head the drafter shares
    (required by methods ``drafter`` and ``hybrid``). The drafter comes last: on equal
    scores the speculator prefers the earlier, cheaper suffix drafts."""
    drafter = drafter_source(config, target) if config.method in ("drafter", "hybrid") else None
    if config.method == "drafter":
        return [drafter]
    params = params if params is not None else match_params(config)
    out: list[DraftSource] = []
    for name in config.sources:
        if name == "history":
            out.append(HistorySource(history_store if history_store is not None else HistoryStore(), params))
        elif name == "group":
            out.append(GroupSource(params))
        elif name == "self":
            out.append(SelfSource(params))
        else:                                   # config validation makes this unreachable
            raise ValueError(f"unknown draft source {name!r}")
    return out + ([drafter] if drafter is not None else [])


def drafter_source(config: SpeculativeConfig, target: Any) -> DraftSource:
    """The learned drafter in ``config.drafter`` over ``target``; its paths stop below
    ``min_token_prob`` like the suffix sources'."""
    if target is None:
        raise ValueError(f"speculative.method {config.method!r} needs the target model (build it through LLMEngine)")
    import torch

    from tailrl.drafter.network import Drafter
    from tailrl.speculative.sources.drafter_source import DrafterSource
    fast = torch.bfloat16 if next(target.parameters()).dtype == torch.bfloat16 else None   # batched drafting too
    return DrafterSource(Drafter.load(config.drafter, target), config.min_token_prob, fast_dtype=fast)


def expected_length_fn(history: HistoryStore) -> Callable[[Any], float]:
    def expected_length(req: Any) -> float:
        return float(max(req.priority, len(req.output_token_ids), max(history.lengths(req.prompt_id), default=0)))
    return expected_length


def make_spec_policy(config: SpeculativeConfig, cost_model: CostModel | None = None,
                history_store: HistoryStore | None = None, seed: int = 0) -> SpecPolicy:
    if config.policy == "fixed":
        return FixedPolicy(config.max_draft_tokens, config.max_tree_paths, config.max_spec_batch)
    if config.policy == "priced":
        return PricedPolicy(max_draft_tokens=config.max_draft_tokens, max_tree_paths=config.max_tree_paths,
                            max_spec_batch=config.max_spec_batch,
                            priority_fn=expected_length_fn(history_store) if history_store is not None else None)
    if config.policy == "bandit":
        arms = tuple((min(k, config.max_draft_tokens), min(p, config.max_tree_paths)) for k, p in DEFAULT_ARMS)
        return BanditPolicy(tuple(dict.fromkeys(arms)), seed=seed, max_spec_batch=config.max_spec_batch)
    return AdaptivePolicy(cost_model, max_draft_tokens=config.max_draft_tokens,
                          min_draft_tokens=config.min_draft_tokens, max_tree_paths=config.max_tree_paths,
                          max_spec_batch=config.max_spec_batch,
                          priority_fn=expected_length_fn(history_store) if history_store is not None else None)
