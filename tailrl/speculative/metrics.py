"""What a ``Speculator`` counts between two ``reset_metrics`` calls, and the keys it reports.

``metrics()`` (verl-style keys, totals since ``reset_metrics``):
``rollout/spec_draft_tokens``, ``rollout/spec_accepted_tokens``, ``rollout/spec_verify_steps``,
``rollout/spec_accept_rate`` (accepted / drafted), ``rollout/spec_accept_length`` (mean
tokens per verify step including the bonus token), ``rollout/spec_draft_hit_rate``
(requests given a draft / requests asked), ``rollout/spec_off_steps`` (steps the policy
switched speculation off), ``rollout/spec_probe_steps`` (steps where it had switched it off
but a rate probe's few requests drafted: policies/priced.py, rule 5), per source
``rollout/spec_draft_tokens/<source>``,
``rollout/spec_accepted_tokens/<source>``, ``rollout/spec_accept_length/<source>``,
``rollout/spec_verify_steps/<source>``, and ``timing_s/draft`` (proposing; in ``LLM``'s
metrics the engine's draft stage, which contains it, is reported instead) and
``timing_s/draft_index`` (feeding the indexes); with a learned drafter also
``rollout/spec_drafter_calls`` (batched calls, catch-up of its past included),
``rollout/spec_drafter_explore_calls`` (those made to measure it),
``rollout/spec_drafter_gate_skips`` (calls the prices approved and ``CallGate`` skipped) and
``timing_s/drafter`` (their time, part of ``timing_s/draft``),
``rollout/spec_drafter_shadow_drafts`` and ``rollout/spec_drafter_shadow_accept_length``
(shadow drafts scored, their tokens per verify step had they been verified, bonus included).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecCounters:
    skips0: int = 0                      # the drafter gate's skip count at the reset
    drafted: dict[str, int] = field(default_factory=lambda: defaultdict(int))    # per source
    accepted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    steps: dict[str, int] = field(default_factory=lambda: defaultdict(int))      # verify steps
    asked: int = 0                       # requests asked for a draft
    found: int = 0                       # of them given one
    off_steps: int = 0                   # steps the policy switched speculation off
    probe_steps: int = 0                 # of the others, steps where a rate probe's few rows drafted
    calls: int = 0                       # batched drafter calls
    explore_calls: int = 0               # of them made to measure the drafter
    shadow_n: int = 0                    # shadow drafts scored
    shadow_accepted: int = 0             # their accepted nodes
    draft_s: float = 0.0                 # proposing
    index_s: float = 0.0                 # feeding the indexes
    call_s: float = 0.0                  # the batched drafter calls

    def metrics(self, sources: list[str], choice: Any = None) -> dict[str, float]:
        """The keys above; ``sources``: the speculator's source names (reported even when they
        drafted nothing); ``choice``: its ``SourceChoice`` (None without a learned drafter)."""
        drafted = sum(self.drafted.values())
        accepted = sum(self.accepted.values())
        steps = sum(self.steps.values())
        m = {
            "rollout/spec_draft_tokens": float(drafted),
            "rollout/spec_accepted_tokens": float(accepted),
            "rollout/spec_verify_steps": float(steps),
            "rollout/spec_accept_rate": accepted / drafted if drafted else 0.0,
            "rollout/spec_accept_length": (accepted + steps) / steps if steps else 0.0,
            "rollout/spec_draft_hit_rate": self.found / self.asked if self.asked else 0.0,
            "rollout/spec_off_steps": float(self.off_steps),
            "rollout/spec_probe_steps": float(self.probe_steps),
            "timing_s/draft": self.draft_s,
            "timing_s/draft_index": self.index_s,
        }
        if choice is not None:
            m.update({"rollout/spec_drafter_calls": float(self.calls),
                      "rollout/spec_drafter_explore_calls": float(self.explore_calls),
                      "rollout/spec_drafter_gate_skips": float(choice.gate.skipped - self.skips0),
                      "rollout/spec_drafter_shadow_drafts": float(self.shadow_n),
                      "rollout/spec_drafter_shadow_accept_length":
                          (self.shadow_accepted + self.shadow_n) / self.shadow_n if self.shadow_n else 0.0,
                      "timing_s/drafter": self.call_s})
            d0, d1, d2 = choice.call_prices()            # what the prices weigh a call's gains against
            mean = choice.drafter_mean()
            m.update({"rollout/spec_drafter_price_call_s": float(d0), "rollout/spec_drafter_price_request_s": float(d1),
                      "rollout/spec_drafter_price_position_s": float(d2),
                      "rollout/spec_drafter_mean_accepted": float(mean) if mean is not None else 0.0})
        for name in dict.fromkeys(sources + list(self.steps)):
            st = self.steps.get(name, 0)
            m[f"rollout/spec_draft_tokens/{name}"] = float(self.drafted.get(name, 0))
            m[f"rollout/spec_accepted_tokens/{name}"] = float(self.accepted.get(name, 0))
            m[f"rollout/spec_verify_steps/{name}"] = float(st)
            m[f"rollout/spec_accept_length/{name}"] = (self.accepted.get(name, 0) + st) / st if st else 0.0
        return m
