"""Speculative decoding, engine-independent half: draft sources, policies, the Speculator.

The engine holds one ``Speculator`` (see ``speculator.py`` for the per-step protocol).
"""
from tailrl.spec.adaptive_policy import AdaptivePolicy
from tailrl.spec.bandit_policy import BanditPolicy
from tailrl.spec.cost_model import CostModel
from tailrl.spec.draft import Draft
from tailrl.spec.factory import make_spec_policy, make_sources
from tailrl.spec.group_source import GroupSource
from tailrl.spec.history import HistoryStore
from tailrl.spec.history_source import HistorySource
from tailrl.spec.policy import FixedPolicy, SpecPolicy
from tailrl.spec.self_source import SelfSource
from tailrl.spec.source import DraftSource, MatchParams
from tailrl.spec.speculator import Speculator
from tailrl.spec.suffix_index import SuffixIndex

__all__ = ["AdaptivePolicy", "BanditPolicy", "CostModel", "Draft", "DraftSource", "FixedPolicy",
           "GroupSource", "HistorySource", "HistoryStore", "MatchParams", "SelfSource", "SpecPolicy",
           "Speculator", "SuffixIndex", "make_spec_policy", "make_sources"]
