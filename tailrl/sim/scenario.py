"""A scenario = a workload trace + a deployment (model, accelerator, instance shape).

`build` turns flat settings (what the CLI parses) into the trace, the step model and the
`SimConfig`, and `run_policies` simulates each named policy on the same trace.
Deployments per preset are our assumptions (the papers do not state all of them): one
instance is `gpus` accelerators in tensor parallel, KV capacity from 90% of its memory.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from tailrl.rollout.policies import PolicyConfig, make_policy
from tailrl.sim.hardware import get_accelerator, get_model
from tailrl.sim.metrics import SimResult
from tailrl.sim.simulator import SimConfig, simulate
from tailrl.sim.step_model import CalibratedStepModel, RooflineStepModel, StepModel
from tailrl.sim.workload import PRESETS, Trace, generate, preset, read_jsonl

log = logging.getLogger(__name__)

# preset -> (model, accelerator, gpus per instance, max_num_seqs)
DEPLOYMENTS: dict[str, tuple[str, str, int, int]] = {
    "qwen2vl-72b": ("qwen2-72b", "h800", 8, 256),
    "moonlight": ("moonlight-16b-a3b", "h800", 8, 512),
    "kimi-k2": ("kimi-k2", "h800", 32, 512),
}


@dataclass
class Scenario:
    workload: str = "qwen2vl-72b"   # a preset name or a .jsonl trace
    requests: int | None = None     # override the preset's number of requests
    instances: int = 16
    model: str | None = None        # default: the preset's deployment
    accelerator: str | None = None
    gpus: int | None = None
    max_num_seqs: int | None = None
    kv_capacity: int | None = None  # KV tokens per instance; default from memory
    step_times: str | None = None   # JSON of measured steps: use a calibrated step model
    chunk_tokens: int = 2048
    link_gbps: float = 1600.0       # per instance: 8 NICs x 200 Gb/s
    rho: float | None = None        # workload knobs (None: the preset's)
    rank_corr: float | None = None
    sigma: float | None = None
    epoch: int | None = None        # for a JSONL trace with epochs
    draft_tokens: int = 0
    accept_mean: float = 1.0
    accept_std: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.workload in PRESETS or self.workload.endswith(".jsonl")):
            raise ValueError(f"workload must be one of {sorted(PRESETS)} or a .jsonl path, got {self.workload!r}")
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances!r}")
        if self.link_gbps <= 0:
            raise ValueError(f"link_gbps must be > 0, got {self.link_gbps!r}")

    def trace(self) -> Trace:
        if self.workload.endswith(".jsonl"):
            return read_jsonl(self.workload, self.epoch)
        knobs = {k: v for k, v in dict(requests=self.requests, rho=self.rho, rank_corr=self.rank_corr,
                                       sigma=self.sigma, seed=self.seed).items() if v is not None}
        return generate(preset(self.workload, **knobs))

    def deployment(self) -> tuple[StepModel, SimConfig]:
        model, accel, gpus, seqs = DEPLOYMENTS.get(self.workload, DEPLOYMENTS["qwen2vl-72b"])
        shape = get_model(self.model or model)
        roof = RooflineStepModel(get_accelerator(self.accelerator or accel), shape, gpus=self.gpus or gpus)
        step: StepModel = CalibratedStepModel.from_json(self.step_times) if self.step_times else roof
        cfg = SimConfig(instances=self.instances, max_num_seqs=self.max_num_seqs or seqs,
                        kv_capacity=self.kv_capacity or roof.kv_capacity(),
                        kv_bytes_per_token=shape.kv_bytes_per_token, link_bw=self.link_gbps * 1e9 / 8,
                        draft_tokens=self.draft_tokens, accept_mean=self.accept_mean,
                        accept_std=self.accept_std, seed=self.seed)
        return step, cfg


def run_policies(sc: Scenario, policies: list[str], trace: Trace | None = None) -> list[SimResult]:
    """Simulate each policy on the scenario's trace (the same trace for all)."""
    trace = trace if trace is not None else sc.trace()
    step, cfg = sc.deployment()
    history = trace.history()
    truth = dict(enumerate(trace.length.tolist()))
    out = []
    for name in policies:
        policy = make_policy(name, PolicyConfig(chunk_tokens=sc.chunk_tokens), history=history,
                             true_lengths=truth)
        t0, c0 = time.perf_counter(), time.process_time()
        res = simulate(trace, policy, cfg, step)
        res.wall_s, res.cpu_s = time.perf_counter() - t0, time.process_time() - c0
        log.info("%s: %d requests, %d events in %.1f s (cpu %.1f s)", name, len(trace), res.events,
                 res.wall_s, res.cpu_s)
        out.append(res)
    return out
