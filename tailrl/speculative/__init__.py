"""Speculative decoding, engine-independent half: draft sources, policies, the Speculator.

The engine holds one ``Speculator`` (see ``speculator.py`` for the per-step protocol).
"""
from tailrl.speculative.draft import Draft
from tailrl.speculative.factory import make_sources, make_spec_policy
from tailrl.speculative.history import HistoryStore
from tailrl.speculative.policies.adaptive import AdaptivePolicy
from tailrl.speculative.policies.bandit import BanditPolicy
from tailrl.speculative.policies.base import FixedPolicy, SpecPolicy
from tailrl.speculative.policies.cost_model import CostModel
from tailrl.speculative.sources.base import DraftSource, MatchParams
from tailrl.speculative.sources.group_source import GroupSource
from tailrl.speculative.sources.history_source import HistorySource
from tailrl.speculative.sources.self_source import SelfSource
from tailrl.speculative.sources.suffix_index import SuffixIndex
from tailrl.speculative.speculator import Speculator

__all__ = ["AdaptivePolicy", "BanditPolicy", "CostModel", "Draft", "DraftSource", "FixedPolicy",
           "GroupSource", "HistorySource", "HistoryStore", "MatchParams", "SelfSource", "SpecPolicy",
           "Speculator", "SuffixIndex", "make_spec_policy", "make_sources"]
