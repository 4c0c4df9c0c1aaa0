"""Cluster-scale rollout simulator driven by the scheduler policies of `tailrl.rollout`.

See docs/scheduling.md: `simulator.simulate(trace, policy, SimConfig, step_model)`,
`scenario.Scenario` / `run_policies` for presets, `cli.main` for `tailrl simulate`.
"""
