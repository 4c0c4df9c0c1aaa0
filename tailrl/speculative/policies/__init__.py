"""Speculation policies: how many draft tokens each request gets per step (zero: plain
decoding). ``base`` (the protocol and ``FixedPolicy``), ``priced`` (the default: the engine's
measured step curve against expected accepted tokens), ``adaptive`` (Seer's marginal-benefit
rule over a cost model), ``bandit`` (TLT's bucketed epsilon-greedy), and what they measure
with: ``cost_model``, ``step_curve``, ``acceptance``."""
